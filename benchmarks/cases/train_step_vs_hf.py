"""One GPT training step: multihead's ``GPT`` vs Hugging Face's ``GPT2LMHeadModel``.

Both models have the same config and the same weights (ours is initialised,
then copied into the Hugging Face model with ``gpt_to_hf_state_dict``),
dropout 0, float32 on CPU, and train on the same batch. One measured step is
what a plain training loop does per batch::

    logits = model(x)                                   # x, y: (B, T) token ids
    loss = F.cross_entropy(logits.view(B * T, V), y.view(B * T))
    loss.backward()
    optimizer.step()                                    # torch.optim.AdamW, same settings
    optimizer.zero_grad(set_to_none=True)

Hugging Face is called as ``model(input_ids=x, use_cache=False).logits``
(a training loop wants no key/value cache) and the loss is computed outside
both models the same way, so the two steps do the same arithmetic. The
Hugging Face attention is ``attn_implementation="eager"`` (its explicit
scores, mask and softmax) in one scenario and ``"sdpa"`` (torch's
``scaled_dot_product_attention``) in the other; multihead always takes its
default path (the sdpa backend with ``is_causal``). GPT-2's configs name
``activation_function="gelu_new"``, which Hugging Face computes as a chain
of elementwise ops in Python (``NewGELUActivation``); one scenario gives it
``"gelu_pytorch_tanh"`` instead, the same function in one torch kernel,
which is what multihead's MLP calls (``F.gelu(approximate="tanh")``).

Scenarios: the byte-level model a 2-core CPU trains (vocab 256, 6 layers,
width 256, 8 heads, context 128, batch 12) and the ``shakespeare-cpu``,
``tiny`` and ``mini`` presets of ``GPT_PRESETS`` (batch 12, their full
context), each against both Hugging Face attention implementations; the
byte-level model also against Hugging Face with sdpa and the fused GELU.
The ``shakespeare-cpu`` preset is the same model with 4 heads (head_dim 64).

Before timing, one forward + backward of each model on the batch is
compared: the losses with ``torch.testing.assert_close`` (float32 defaults)
and every parameter gradient, mapped to Hugging Face names by the same
``gpt_to_hf_state_dict`` (Conv1D weights transposed), with
``atol = grad_atol_rel * max |Hugging Face gradient|`` (float32 sums over
the B*T rows in different orders). Nothing is timed unless they agree.

The runner reports milliseconds per step with ratios multihead / HF (above
1: multihead slower). Tokens per second (B*T / median step time) and the
speed ratio multihead / HF (above 1: multihead faster) come from::

    python -m benchmarks.cases.train_step_vs_hf benchmarks/results/train_step_vs_hf-<stamp>.json
"""

from __future__ import annotations

import copy
import gc
import json
import statistics
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from multihead.convert.hf_gpt2 import gpt_to_hf_state_dict
from multihead.models import GPT, GPTConfig

from ..registry import register

BYTE_LEVEL = {"vocab_size": 256, "context_length": 128, "embed_dim": 256, "num_layers": 6, "num_heads": 8}


def _model_config(config: dict[str, Any]) -> GPTConfig:
    """The GPTConfig of a scenario: a preset by name, or the explicit sizes."""
    if config.get("preset"):
        return GPTConfig.from_preset(str(config["preset"]))
    return GPTConfig(**{k: int(config[k]) for k in BYTE_LEVEL})


def build(config: dict[str, Any]) -> tuple[GPT, nn.Module]:
    """(ours, Hugging Face) in train mode with identical weights and dropout 0.

    Raises:
        ValueError: ``attn_implementation`` other than "eager" or "sdpa".
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    impl = config["attn_implementation"]
    if impl not in ("eager", "sdpa"):
        raise ValueError(f"attn_implementation must be 'eager' or 'sdpa', got {impl!r}")
    cfg = _model_config(config)
    torch.manual_seed(int(config["seed"]))
    ours = GPT(cfg)
    with torch.no_grad():  # non-zero biases and LayerNorm affines, so every parameter is compared
        for name, p in ours.named_parameters():
            if name.endswith("bias") or ".ln_" in name or name.startswith("ln_f"):
                p.add_(0.1 * torch.randn_like(p))
    # bos/eos ids inside the vocabulary (GPT-2's 50256 is not in a byte vocab); unused here.
    act = config["hf_activation"]
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"hf_activation must be 'gelu_new' or 'gelu_pytorch_tanh', got {act!r}")
    hf_kwargs = {**cfg.to_hf_config(), "activation_function": act}
    hf_config = GPT2Config(**hf_kwargs, bos_token_id=0, eos_token_id=0, attn_implementation=impl)
    hf = GPT2LMHeadModel(hf_config)
    hf.load_state_dict(gpt_to_hf_state_dict(ours))
    if hf.config._attn_implementation != impl:
        raise RuntimeError(f"Hugging Face picked attention {hf.config._attn_implementation!r}, asked for {impl!r}")
    return ours.train(), hf.train()


def _grads_by_hf_name(model: GPT) -> dict[str, torch.Tensor]:
    """Our parameter gradients under Hugging Face names (Conv1D ones transposed)."""
    shadow = copy.deepcopy(model)
    with torch.no_grad():
        for p, source in zip(shadow.parameters(), model.parameters()):
            p.copy_(source.grad)
    return gpt_to_hf_state_dict(shadow)


def _close(got: torch.Tensor, want: torch.Tensor, what: str, *, atol: float | None = None) -> None:
    torch.testing.assert_close(
        got,
        want,
        rtol=None if atol is None else 1.3e-6,
        atol=atol,
        msg=lambda m: f"train_step_vs_hf: {what} differ, refusing to time two different computations\n{m}",
    )


@register(
    "train_step_vs_hf",
    description=(
        "one training step (forward, cross-entropy, backward, AdamW step, zero_grad) of multihead's GPT "
        "vs transformers.GPT2LMHeadModel (eager and sdpa attention), same config, weights and batch, "
        "dropout 0, float32, CPU"
    ),
    config={
        **BYTE_LEVEL,
        "preset": None,
        "batch": 12,
        "seq": None,  # None: the model's context length
        "attn_implementation": "eager",
        "hf_activation": "gelu_new",  # GPT-2's; "gelu_pytorch_tanh": the same function, one torch kernel
        "lr": 3e-4,
        "weight_decay": 0.1,
        "seed": 0,
        # Gradients are float32 sums over B*T rows in different orders:
        # compared with atol = grad_atol_rel * max |HF gradient|.
        "grad_atol_rel": 1e-5,
        # 2 cores: the byte-level step is ~0.4 s per contender; all six
        # scenarios take ~4 min at these rounds on an idle machine.
        "warmup": 3,
        "rounds": 30,
        "number": 1,
    },
    # One thread in the smoke run: two OpenMP threads on two shared, busy
    # cores can make a millisecond step take seconds.
    quick={"batch": 2, "seq": 32, "warmup": 1, "rounds": 3, "number": 1, "threads": 1},
    scenarios={
        "byte 6x256 h8, HF eager": {"attn_implementation": "eager"},
        "byte 6x256 h8, HF sdpa": {"attn_implementation": "sdpa"},
        "byte 6x256 h8, HF sdpa + fused gelu": {"attn_implementation": "sdpa", "hf_activation": "gelu_pytorch_tanh"},
        "shakespeare-cpu (6x256 h4), HF eager": {"preset": "shakespeare-cpu", "attn_implementation": "eager"},
        "shakespeare-cpu (6x256 h4), HF sdpa": {"preset": "shakespeare-cpu", "attn_implementation": "sdpa"},
        "tiny, HF eager": {"preset": "tiny", "attn_implementation": "eager"},
        "tiny, HF sdpa": {"preset": "tiny", "attn_implementation": "sdpa"},
        "mini, HF eager": {"preset": "mini", "attn_implementation": "eager"},
        "mini, HF sdpa": {"preset": "mini", "attn_implementation": "sdpa"},
    },
    baseline="hf",
)
def setup(config: dict[str, Any]) -> dict[str, Any]:
    ours, hf = build(config)
    V, context = ours.config.vocab_size, ours.config.context_length
    B = int(config["batch"])
    T = context if config.get("seq") is None else int(config["seq"])
    if not 1 <= T <= context:
        raise ValueError(f"seq must be in [1, context_length={context}], got {T}")
    gen = torch.Generator().manual_seed(int(config["seed"]) + 1)
    tokens = torch.randint(0, V, (B, T + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]  # (B, T) inputs and next-token targets

    def loss_ours() -> torch.Tensor:
        logits = ours(x)  # (B, T, V)
        return F.cross_entropy(logits.reshape(B * T, V), y.reshape(B * T))

    def loss_hf() -> torch.Tensor:
        logits = hf(input_ids=x, use_cache=False).logits  # (B, T, V)
        return F.cross_entropy(logits.reshape(B * T, V), y.reshape(B * T))

    # The same computation? Loss and every gradient, before any timing.
    got, want = loss_ours(), loss_hf()
    _close(got, want, "losses")
    got.backward()
    want.backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    ours_grads = _grads_by_hf_name(ours)
    if not set(hf_grads) <= set(ours_grads):
        raise RuntimeError(f"parameters without a counterpart: {sorted(set(hf_grads) - set(ours_grads))}")
    rel = float(config["grad_atol_rel"])
    for name, g in hf_grads.items():
        _close(ours_grads[name], g, f"gradients of {name}", atol=rel * float(g.abs().max()))

    def make_step(model: nn.Module, loss_fn):
        opt = torch.optim.AdamW(model.parameters(), lr=float(config["lr"]), weight_decay=float(config["weight_decay"]))
        opt.zero_grad(set_to_none=True)

        def step() -> None:
            loss_fn().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    steps = {"multihead": make_step(ours, loss_ours), "hf": make_step(hf, loss_hf)}
    # The runner calls gc.collect() before every measurement; with transformers
    # imported that walks ~365k objects (~0.16 s each time, outside the timed
    # region). Freezing what exists now skips them; nothing timed changes.
    gc.freeze()
    return steps


# ---------------------------------------------------------------- tokens/s
def tokens_table(record: dict[str, Any]) -> str:
    """Markdown: tokens/s of each contender per scenario (B*T / median step
    time) and the speed ratio multihead / HF (above 1: multihead faster),
    from a ``benchmarks.run`` result record of this case."""
    lines = [
        "| scenario | B x T | multihead tok/s | HF tok/s | speed ratio multihead/HF (of medians) "
        "| per-round speed ratio: median [IQR] (min-max) | rounds multihead faster |",
        "|---|---|---|---|---|---|---|",
    ]
    for res in record["results"]:
        cfg = res["config"]
        context = GPTConfig.from_preset(cfg["preset"]).context_length if cfg.get("preset") else cfg["context_length"]
        B, T = int(cfg["batch"]), int(context if cfg.get("seq") is None else cfg["seq"])
        ours, hf = res["samples_s"]["multihead"], res["samples_s"]["hf"]
        speed = sorted(h / o for o, h in zip(ours, hf))  # > 1: multihead faster in that round
        q1, _, q3 = statistics.quantiles(speed, n=4, method="inclusive") if len(speed) > 1 else (speed[0],) * 3
        lines.append(
            f"| {res['scenario']} | {B} x {T} "
            f"| {B * T / statistics.median(ours):,.0f} | {B * T / statistics.median(hf):,.0f} "
            f"| {statistics.median(hf) / statistics.median(ours):.3f} "
            f"| {statistics.median(speed):.3f} [{q1:.3f}-{q3:.3f}] ({speed[0]:.3f}-{speed[-1]:.3f}) "
            f"| {sum(s > 1 for s in speed)} / {len(speed)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m benchmarks.cases.train_step_vs_hf RESULT.json", file=sys.stderr)
        sys.exit(2)
    with open(sys.argv[1], encoding="utf-8") as f:
        print(tokens_table(json.load(f)))
