"""Run under torchrun by test_tensor_parallel.py: every rank shards the same
float64 models and checks them against the one-process model it also holds.

    python -m torch.distributed.run --nproc-per-node N tp_checks.py CHECK OUT_DIR

Writes "ok <what>" per passed check to OUT_DIR/rank<r>.txt; any mismatch
raises (non-zero exit).
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from multihead.models.bert import BertConfig, BertEncoder
from multihead.models.gpt import GPT, GPTConfig
from multihead.parallel import (
    full_optimizer_state,
    full_state_dict,
    load_full_optimizer_state,
    load_full_state_dict,
    tensor_parallel,
)
from multihead.parallel.costs import rank_cost

F64 = torch.float64


def report(line: str) -> None:
    with open(os.path.join(sys.argv[2], f"rank{dist.get_rank()}.txt"), "a", encoding="utf-8") as f:
        f.write(line + "\n")


def close(got, want, what):
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10 * max(1.0, float(want.abs().max())), msg=what)


def after_unit_step(model):
    """SGD with lr 1 turns each parameter p into p - grad: the full state then holds the gradients."""
    torch.optim.SGD(model.parameters(), lr=1.0).step()


def check_gpt(mesh, kind, options, sequence_parallel=False):
    torch.manual_seed(0)
    config = GPTConfig.from_preset("tiny", vocab_size=50, context_length=16, num_layers=2, attention=kind,
                                   attention_options=options)  # fmt: skip
    ref = GPT(config, dtype=F64).eval()
    tp = GPT(config, dtype=F64).eval()
    tp.load_state_dict(ref.state_dict())
    tensor_parallel(tp, mesh, sequence_parallel=sequence_parallel)
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in tp.parameters())
    assert held == rank_cost(config, mesh.size()).parameters, (held, rank_cost(config, mesh.size()))
    idx = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(1))
    want, got = ref(idx), tp(idx)
    close(got, want, f"{kind} forward")
    (want.pow(2).mean() + ref.aux_loss()).backward()
    (got.pow(2).mean() + tp.aux_loss()).backward()
    after_unit_step(ref)
    after_unit_step(tp)
    full, state = full_state_dict(tp), ref.state_dict()
    assert full.keys() == state.keys(), set(full) ^ set(state)
    for name in state:
        close(full[name], state[name], f"{kind} {name} after a step")
    if sequence_parallel:  # decoding one token at a time needs a model split without it
        try:
            tp.generate(idx[:, :4], 2, temperature=0)
        except ValueError as e:
            assert "sequence parallelism over" in str(e), e
        else:
            raise AssertionError("decoding with sequence parallelism was not refused")
        report(f"ok sequence-parallel gpt {kind}")
        return
    prompt = idx[:, :4]
    assert torch.equal(tp.generate(prompt, 6, temperature=0), ref.generate(prompt, 6, temperature=0)), kind
    report(f"ok gpt {kind} {options}")


def check_bert(mesh):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                        max_position_embeddings=16)  # fmt: skip
    ref = BertEncoder(config).double().eval()
    tp = BertEncoder(config).double().eval()
    tp.load_state_dict(ref.state_dict())
    tensor_parallel(tp, mesh)
    ids = torch.randint(1, 40, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    close(tp(ids, attention_mask=mask), ref(ids, attention_mask=mask), "bert forward")
    report("ok bert")


def check_minilm(mesh):
    """The pretrained MiniLM (float32): its sentence embeddings."""
    from multihead.models.minilm import load_minilm

    ref, tp = load_minilm(), tensor_parallel(load_minilm(), mesh)
    sentences = ["Heads are independent until the output projection.", "Hi"]
    torch.testing.assert_close(tp.encode(sentences), ref.encode(sentences))
    report("ok minilm")


def check_state(mesh, kind, options):
    """AdamW steps on the split model equal one process's; weights and optimizer state
    gathered into the one-process layout equal its own, and load back into a fresh split model."""
    torch.manual_seed(0)
    config = GPTConfig.from_preset("tiny", vocab_size=50, context_length=16, num_layers=2, attention=kind,
                                   attention_options=options)  # fmt: skip
    ref = GPT(config, dtype=F64).train()
    tp = GPT(config, dtype=F64).train()
    tp.load_state_dict(ref.state_dict())
    order = [name for name, _ in ref.named_parameters()]
    tensor_parallel(tp, mesh)
    opt_ref, opt_tp = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, tp))
    batches = [torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(s)) for s in range(3)]

    def step(model, optimizer, idx):
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()) + model.aux_loss()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for idx in batches[:2]:
        step(ref, opt_ref, idx)
        step(tp, opt_tp, idx)
    want, got = opt_ref.state_dict(), full_optimizer_state(tp, opt_tp, order)
    assert got["param_groups"] == want["param_groups"], (got["param_groups"], want["param_groups"])
    for i, entries in want["state"].items():
        for key, value in entries.items():
            close(got["state"][i][key].to(value.dtype), value, f"{kind} optimizer {order[i]} {key}")
    state = ref.state_dict()
    for name, value in full_state_dict(tp).items():
        close(value, state[name], f"{kind} {name} after two steps")
    torch.manual_seed(7)  # a fresh split model with other weights, then the one-process state loaded into it
    again = tensor_parallel(GPT(config, dtype=F64).train(), mesh)
    opt_again = torch.optim.AdamW(again.parameters(), lr=1e-2)
    load_full_state_dict(again, state)
    saved = copy.deepcopy(want)  # as read from a file: not ref's live tensors, which its next step changes
    load_full_optimizer_state(again, opt_again, saved, order)
    step(ref, opt_ref, batches[2])
    step(again, opt_again, batches[2])
    state = ref.state_dict()
    for name, value in full_state_dict(again).items():
        close(value, state[name], f"{kind} {name} after a step from the loaded state")
    report(f"ok state {kind}")


def main():
    check = sys.argv[1]
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    if check == "kinds":
        for kind, options in [("mha", {}), ("gqa", {"num_kv_heads": 2}), ("mqa", {}), ("gated", {}),
                              ("collaborative", {"scale": 0.25}), ("moh", {}),
                              ("output_gated", {"gate": "headwise", "qk_norm": True}), ("mla", {"rope": True})]:  # fmt: skip
            check_gpt(mesh, kind, options)
        check_bert(mesh)
        check_minilm(mesh)
        check_state(mesh, "mha", {})
        check_state(mesh, "moh", {})  # training: the balance loss of each rank's part sums to the layer's
        check_gpt(mesh, "gqa", {"num_kv_heads": 2}, sequence_parallel=True)
    elif check == "replicated":
        check_gpt(mesh, "gqa", {"num_kv_heads": 2})
        check_gpt(mesh, "mqa", {})
        check_state(mesh, "gqa", {"num_kv_heads": 2})
    report("done")
    dist.barrier()  # both ranks finished every check before either tears its group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without the interpreter's teardown: gloo's threads can abort a process
    # ("terminate called without an active exception") when static objects are
    # destroyed after the checks are done; every result is already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
