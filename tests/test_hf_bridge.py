"""multihead.hf: multihead as transformers' attention implementation.

Each tiny model is built three times from one set of random weights, with
attn_implementation "eager", "sdpa" and "multihead"; transformers' own
eager and SDPA paths are the references. They run different operations, so
results are compared with float32 tolerances (support.paths), never bitwise.
Outputs at padded query positions are not compared: there eager averages
every value (a row of finfo.min scores) while multihead returns zeros.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from support.paths import assert_paths_agree  # noqa: E402
from transformers import (  # noqa: E402
    AttentionInterface,
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402

import multihead.hf as mhf  # noqa: E402

IMPLS = ("eager", "sdpa", "multihead")
V = 61  # vocabulary


def _bert():
    cfg = BertConfig(vocab_size=V, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=40, max_position_embeddings=32)
    return BertModel, cfg


def _gpt2():
    cfg = GPT2Config(vocab_size=V, n_embd=24, n_layer=2, n_head=4, n_positions=32)
    return GPT2LMHeadModel, cfg


def _llama():
    cfg = LlamaConfig(vocab_size=V, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM, cfg


BUILDERS = {"bert": _bert, "gpt2": _gpt2, "llama": _llama}


def _build(arch: str) -> dict:
    cls, cfg = BUILDERS[arch]()
    torch.manual_seed(0)
    # one config each: _from_config writes the implementation into the config it is given
    models = {impl: cls._from_config(copy.deepcopy(cfg), attn_implementation=impl).eval() for impl in IMPLS}
    assert [m.config._attn_implementation for m in models.values()] == list(IMPLS)
    state = models["eager"].state_dict()
    for m in models.values():
        m.load_state_dict(state)
    return models


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def trio(request):
    return request.param, _build(request.param)


def _batch(arch: str, B: int = 3, T: int = 7):
    """Token ids [B, T] and a padding mask with padded rows: right padding for
    the encoder, left padding for the decoders."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, T), generator=g)
    keep = torch.ones(B, T, dtype=torch.long)
    lengths = [T - 3, T, T - 1][:B]
    for b, n in enumerate(lengths):
        if arch == "bert":
            keep[b, n:] = 0
        else:
            keep[b, : T - n] = 0
    return ids, keep


def _out(arch, model, **kw):
    out = model(**kw)
    return out.last_hidden_state if arch == "bert" else out.logits


def test_register_is_idempotent_and_installs_both_interfaces():
    mhf.register()
    mhf.register()
    assert AttentionInterface._global_mapping[mhf.NAME] is mhf.attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[mhf.NAME] is ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]


def test_outputs_equal_eager_and_sdpa_with_padding(trio):
    arch, models = trio
    ids, keep = _batch(arch)
    got = _out(arch, models["multihead"], input_ids=ids, attention_mask=keep)
    valid = keep.bool()
    for impl in ("eager", "sdpa"):
        want = _out(arch, models[impl], input_ids=ids, attention_mask=keep)
        assert_paths_agree(got[valid], want[valid], msg=f"{arch} vs {impl}")


def test_outputs_equal_without_mask(trio):
    # no padding: decoders get mask None and rely on is_causal, BERT on no mask
    arch, models = trio
    ids, _ = _batch(arch)
    got = _out(arch, models["multihead"], input_ids=ids)
    for impl in ("eager", "sdpa"):
        assert_paths_agree(got, _out(arch, models[impl], input_ids=ids), msg=f"{arch} vs {impl}")


def test_output_attentions_equal_eager_on_valid_rows(trio):
    arch, models = trio
    ids, keep = _batch(arch)
    got = models["multihead"](input_ids=ids, attention_mask=keep, output_attentions=True).attentions
    want = models["eager"](input_ids=ids, attention_mask=keep, output_attentions=True).attentions
    assert len(got) == len(want) == 2
    rows = keep.bool()  # (B, T) query rows that are real tokens
    for w_got, w_want in zip(got, want):
        assert w_got.shape == w_want.shape
        for b in range(ids.shape[0]):
            assert_paths_agree(w_got[b][:, rows[b]], w_want[b][:, rows[b]])
    if arch != "bert":
        # a left-padded query sees no key: zero weights (exact, not uniform)
        assert torch.equal(got[0][0, :, 0], torch.zeros_like(got[0][0, :, 0]))


def test_gqa_reaches_functional_without_repeat(monkeypatch):
    models = _build("llama")
    seen = []
    real = mhf.bridge.attention

    def spy(q, k, v, **kw):
        seen.append((q.shape[1], k.shape[1], v.shape[1]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(mhf.bridge, "attention", spy)
    ids, keep = _batch("llama")
    models["multihead"](input_ids=ids, attention_mask=keep)
    assert seen == [(6, 2, 2), (6, 2, 2)]


def test_cached_decoding_equals_full_forward():
    models = _build("llama")
    model = models["multihead"]
    ids, keep = _batch("llama")
    full = model(input_ids=ids, attention_mask=keep).logits[:, -1]
    past = model(input_ids=ids[:, :-1], attention_mask=keep[:, :-1], use_cache=True).past_key_values
    step = model(input_ids=ids[:, -1:], attention_mask=keep, past_key_values=past, use_cache=True).logits[:, -1]
    assert_paths_agree(step, full)
    nopad = model(input_ids=ids, use_cache=True).logits[:, -1]  # mask None, T = 1 step below
    past = model(input_ids=ids[:, :-1], use_cache=True).past_key_values
    assert_paths_agree(model(input_ids=ids[:, -1:], past_key_values=past).logits[:, -1], nopad)


def test_capture_records_every_layer_with_eager_weights(trio):
    arch, models = trio
    ids, keep = _batch(arch)
    model = models["multihead"]
    want = model(input_ids=ids, attention_mask=keep, output_attentions=True).attentions
    with mhf.capture(model) as record:
        out = _out(arch, model, input_ids=ids, attention_mask=keep)
    assert [e.layer for e in record.layers] == [0, 1]
    assert all(e.name.endswith(("self", "attn", "self_attn")) for e in record.layers), [e.name for e in record.layers]
    kinds = {"llama": "gqa"}.get(arch, "mha")
    assert [e.kind for e in record.layers] == [kinds, kinds]
    for entry, w in zip(record.layers, want):
        # output_attentions with gradients runs the math path; a capture's detached weights
        # come from the fused kernel's log-sum-exp: two paths, within tolerance
        assert_paths_agree(entry.weights, w.float().detach())
    assert record.head(layer=1, head=2).shape == (ids.shape[1], ids.shape[1])
    # capturing does not change the outputs (the math backend then serves the
    # call instead of the SDPA kernel: tolerance), and records nothing outside the block
    valid = keep.bool()
    assert_paths_agree(out[valid], _out(arch, model, input_ids=ids, attention_mask=keep)[valid])
    assert len(record.layers) == 2


def test_capture_of_some_heads_and_rows_is_that_part_of_every_weight(trio):
    arch, models = trio
    ids, keep = _batch(arch)
    model = models["multihead"]
    with torch.no_grad(), mhf.capture(model) as full:
        _out(arch, model, input_ids=ids, attention_mask=keep)
    with torch.no_grad(), mhf.capture(model, heads=[1, 3], rows=slice(-2, None)) as alone:
        _out(arch, model, input_ids=ids, attention_mask=keep)  # only these weights are formed
    with torch.no_grad(), mhf.capture(model, heads=[1, 3], rows=slice(-2, None)) as part, mhf.capture(model) as both:
        _out(arch, model, input_ids=ids, attention_mask=keep)  # every weight, each capture its part
    T = ids.shape[1]
    for one, entry, whole, again in zip(alone.layers, part.layers, full.layers, both.layers):
        assert (entry.heads, entry.rows) == (one.heads, one.rows) == ((1, 3), (T - 2, T - 1))
        assert (again.heads, again.rows) == (None, None)
        assert_paths_agree(one.weights, whole.weights[:, [1, 3], T - 2 :])
        assert_paths_agree(entry.weights, whole.weights[:, [1, 3], T - 2 :])
        assert_paths_agree(again.weights, whole.weights)


def test_capture_and_gates_are_scoped_to_their_model():
    a, b = _build("gpt2")["multihead"], _build("gpt2")["multihead"]
    ids, _ = _batch("gpt2")
    with mhf.capture(a) as record, mhf.head_mask(a, {0: [0, 1, 2, 3]}):
        ref = b(input_ids=ids).logits
    assert record.layers == []
    assert torch.equal(ref, b(input_ids=ids).logits)  # same model, same inputs: bitwise


def _zero_head_columns(arch: str, model, layer: int, head: int, D: int) -> None:
    """Zero head ``head``'s input columns of layer ``layer``'s output projection."""
    cols = slice(head * D, (head + 1) * D)
    with torch.no_grad():
        if arch == "llama":
            model.model.layers[layer].self_attn.o_proj.weight[:, cols] = 0
        elif arch == "gpt2":
            model.transformer.h[layer].attn.c_proj.weight[cols, :] = 0  # Conv1D: (in, out)
        else:
            model.encoder.layer[layer].attention.output.dense.weight[:, cols] = 0


def test_head_mask_equals_zeroing_output_projection_columns(trio):
    arch, models = trio
    ids, keep = _batch(arch)
    cfg = models["eager"].config
    D = cfg.hidden_size // cfg.num_attention_heads
    with mhf.head_mask(models["multihead"], {1: [2], 0: [0, 3]}) as gates:
        got = _out(arch, models["multihead"], input_ids=ids, attention_mask=keep)
    assert gates.shape == (2, cfg.num_attention_heads) and int((gates == 0).sum()) == 3
    edited = _build(arch)["eager"]
    for layer, head in ((1, 2), (0, 0), (0, 3)):
        _zero_head_columns(arch, edited, layer, head, D)
    want = _out(arch, edited, input_ids=ids, attention_mask=keep)
    valid = keep.bool()
    assert_paths_agree(got[valid], want[valid])
    assert not torch.allclose(got[valid], _out(arch, models["eager"], input_ids=ids, attention_mask=keep)[valid])


def _out_proj_weight(arch, model, layer):
    if arch == "llama":
        return model.model.layers[layer].self_attn.o_proj.weight, 1
    if arch == "gpt2":
        return model.transformer.h[layer].attn.c_proj.weight, 0
    return model.encoder.layer[layer].attention.output.dense.weight, 1


def test_gate_gradients_equal_output_projection_column_scaling(trio):
    # d loss / d gate[l, h] at gates = 1 is d loss / d s for head h's columns
    # of the output projection scaled by s, i.e. sum(grad W * W) over them.
    # The loss reads real tokens only (padded rows differ from eager's by design).
    arch, models = trio
    ids, keep = _batch(arch)
    valid = keep.bool()
    cfg = models["eager"].config
    H = cfg.num_attention_heads
    D = cfg.hidden_size // H
    gates = torch.ones(2, H, requires_grad=True)
    with mhf.head_gates(models["multihead"], gates):
        _out(arch, models["multihead"], input_ids=ids, attention_mask=keep)[valid].square().mean().backward()
    eager = _build(arch)["eager"]
    _out(arch, eager, input_ids=ids, attention_mask=keep)[valid].square().mean().backward()
    want = torch.empty(2, H)
    for layer in range(2):
        w, dim = _out_proj_weight(arch, eager, layer)
        per_head = (w.grad * w).detach().unflatten(dim, (H, D))  # (C, H*D) -> (C, H, D) or (H*D, C) -> (H, D, C)
        want[layer] = per_head.sum(dim=(0, 2) if dim == 1 else (1, 2))
    assert_paths_agree(gates.grad, want)
    models["multihead"].zero_grad(set_to_none=True)


def test_refusals_name_the_values(tmp_path):
    models = _build("llama")
    ids, _ = _batch("llama")
    with pytest.raises(ValueError, match="attn_implementation='eager'.*set_attn_implementation"):
        with mhf.capture(models["eager"]):
            pass
    with pytest.raises(ValueError, match=r"shape \(6,\)"):
        with mhf.head_gates(models["multihead"], torch.ones(6)):
            pass
    with pytest.raises(TypeError, match="torch.int64"):
        with mhf.head_gates(models["multihead"], torch.ones(2, 6, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match=r"gates have shape \(1, 6\).*layer 1 with 6 heads"):
        with mhf.head_gates(models["multihead"], torch.ones(1, 6)):
            models["multihead"](input_ids=ids)
    with pytest.raises(ValueError, match=r"head 6 of layer 0 out of range \[0, 6\)"):
        with mhf.head_mask(models["multihead"], {0: [6]}):
            pass
    with pytest.raises(ValueError, match=r"layer 2 out of range \[0, 2\)"):
        with mhf.head_mask(models["multihead"], {2: [0]}):
            pass
    attn = models["multihead"].model.layers[0].self_attn
    q = torch.randn(1, 6, 3, 4)
    k = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="soft-capping: softcap=30.0"):
        mhf.attention_forward(attn, q, k, k, None, softcap=30.0)
    with pytest.raises(ValueError, match="no config.json"):
        mhf.load_hf(tmp_path)


def test_pretrained_minilm_loads_with_multihead_and_equals_sdpa():
    from multihead.models.minilm import MissingWeightsPackageError, minilm_model_dir

    try:
        folder = minilm_model_dir()
    except MissingWeightsPackageError as err:
        pytest.skip(str(err))
    model = mhf.load_hf(folder)
    assert model.config._attn_implementation == "multihead"
    ref = transformers.AutoModel.from_pretrained(folder, attn_implementation="sdpa", local_files_only=True).eval()
    ids, keep = _batch("bert", T=9)
    ids = ids + 1000  # ordinary word pieces
    got = model(input_ids=ids, attention_mask=keep).last_hidden_state
    want = ref(input_ids=ids, attention_mask=keep).last_hidden_state
    valid = keep.bool()
    assert_paths_agree(got[valid], want[valid])


def test_attention_forward_position_bias_gqa_and_dropout():
    # direct calls, as a T5-style layer makes them: scores + position_bias, hidden keys exactly hidden
    g = torch.Generator().manual_seed(2)
    B, H, G, T, S, D = 2, 4, 2, 5, 6, 3
    q, k, v = (torch.randn(B, n, L, D, generator=g, dtype=torch.float64) for n, L in ((H, T), (G, S), (G, S)))
    bias = torch.randn(1, H, T, S, generator=g, dtype=torch.float64)
    allowed = torch.rand(B, 1, T, S, generator=g) > 0.3
    allowed[:, :, :, 0] = True
    layer = torch.nn.Module().eval()
    out, weights = mhf.attention_forward(layer, q, k, v, allowed, scaling=0.7, position_bias=bias, output_attentions=True)
    kk, vv = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)  # (B, G, S, D) -> (B, H, S, D)
    ref_w = (q @ kk.transpose(-1, -2) * 0.7 + bias).masked_fill(~allowed, float("-inf")).softmax(-1)
    torch.testing.assert_close(weights, ref_w, rtol=0, atol=1e-12)
    torch.testing.assert_close(out, (ref_w @ vv).transpose(1, 2), rtol=0, atol=1e-12)  # (B, H, T, D) -> (B, T, H, D)
    # dropout only in training mode; in eval the same call (same operations) is bitwise the no-dropout one
    assert torch.equal(mhf.attention_forward(layer, q, k, v, allowed, dropout=0.5)[0],
                       mhf.attention_forward(layer, q, k, v, allowed)[0])
    layer.train()
    dropped = mhf.attention_forward(layer, q, k, v, allowed, dropout=0.5)[0]
    assert not torch.allclose(dropped, mhf.attention_forward(layer, q, k, v, allowed)[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_cuda_multihead_models_equal_the_cpu_and_the_cuda_sdpa_ones(arch):
    """float32 on the GPU: outputs and captured weights (some heads and rows) of the valid rows
    equal transformers' eager model on the CPU; bfloat16 on the GPU: outputs within bfloat16's
    rounding (3e-2 of their magnitude) of transformers' own SDPA model on the GPU."""
    models = _build(arch)
    ids, keep = _batch(arch)
    valid = keep.bool()
    with torch.no_grad():
        want = _out(arch, models["eager"], input_ids=ids, attention_mask=keep)
        want_w = models["eager"](input_ids=ids, attention_mask=keep, output_attentions=True).attentions
        gpu = copy.deepcopy(models["multihead"]).to("cuda")
        with mhf.capture(gpu, heads=[1, 3], rows=slice(-2, None)) as record:
            got = _out(arch, gpu, input_ids=ids.cuda(), attention_mask=keep.cuda())
    assert_paths_agree(got.cpu()[valid], want[valid])
    for entry, w in zip(record.layers, want_w):
        part = w[:, [1, 3], -2:]  # (B, 2, 2, S): the last two query rows, each seeing a real key
        assert_paths_agree(entry.weights.cpu(), part.float())
    with torch.no_grad():
        half = {impl: copy.deepcopy(models[impl]).to("cuda", torch.bfloat16) for impl in ("sdpa", "multihead")}
        outs = {impl: _out(arch, m, input_ids=ids.cuda(), attention_mask=keep.cuda()).float().cpu()[valid]
                for impl, m in half.items()}  # fmt: skip
    scale = max(1.0, float(want[valid].abs().max()))
    torch.testing.assert_close(outs["multihead"], outs["sdpa"], rtol=0, atol=3e-2 * scale)
    torch.testing.assert_close(outs["multihead"], want[valid], rtol=0, atol=3e-2 * scale)
