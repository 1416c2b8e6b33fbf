"""Weight-only bf16 / int8 GPT: int8 scales, the rounding bound of one layer,
greedy tokens equal to float32, the tied table, and the refusals.

The layer bound is computed in float64 from the rounding the format does
(weights: the actual difference between the stored and the float weights;
activations and outputs: bfloat16's unit roundoff u = 2^-8; float32
accumulation over K terms), not a tolerance picked by hand.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multihead.convert.hf_gpt2 import gpt_to_hf_state_dict
from multihead.models import GPT, GPTConfig, quantize_weights, save_checkpoint, weight_format
from multihead.modules.weight_only import INT8_KERNEL_ROWS, WeightOnlyLinear, dequantize, int8_per_channel

U_BF16 = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits)
U_F32 = 2.0**-24


def tiny(seed=0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_preset("tiny", **{"context_length": 48, **overrides})).eval()


def test_int8_scales_round_trip():
    """catches: rounding past half a step, a scale rounded down (|q| > 127), a zero row
    dividing by zero, or stored values that do not quantize back to themselves."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(9, 33, generator=g) * torch.logspace(-3, 1, 9)[:, None]  # rows of very different sizes
    w[4] = 0.0
    q, s = int8_per_channel(w)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16 and q.shape == w.shape and s.shape == (9,)
    assert int(q.abs().max()) <= 127
    step = s.double()[:, None]
    err = (w.double() - q.double() * step).abs()
    assert bool((err <= step / 2 * (1 + 1e-6)).all())  # half a step (the division is rounded to float32)
    nonzero = torch.arange(9) != 4
    assert bool((q[nonzero].abs().amax(1) >= 126).all())  # the largest weight of a row uses the range
    assert bool((q[4] == 0).all()) and float(s[4]) == 1.0
    back = dequantize(q, s)  # the stored values divide back into q exactly
    assert torch.equal(torch.round(back / s.float()[:, None]).to(torch.int8), q)
    full = q.abs().amax(1) == 127  # rows that use +-127 quantize again to the same q and scale
    assert bool(full.any())
    q2, s2 = int8_per_channel(back)
    assert torch.equal(q2[full], q[full]) and torch.equal(s2[full], s[full])


def _layer_bound(lin: nn.Linear, layer: WeightOnlyLinear, x: torch.Tensor) -> torch.Tensor:
    """|y_stored - y_exact| bound [M, N] in float64: weight rounding + 3 bf16 roundings + float32 sums."""
    w, w_stored = lin.weight.detach().double(), layer.weight.double()
    ax = x.double().abs()
    K = w.shape[1]
    gamma = K * U_F32 / (1 - K * U_F32)
    spread = ax @ w_stored.abs().T  # sum_k |x_k| |W~_nk|
    y = x.double() @ w.T + lin.bias.detach().double()
    u = 0.0 if layer.format == "fp32" else U_BF16  # fp32: only the float32 sums round
    return ax @ (w_stored - w).abs().T + (3 * u + gamma) * (1 + u) * spread + 2 * U_F32 * y.abs()


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("rows", [1, 3, INT8_KERNEL_ROWS + 4])  # one row (mv / int8 kernel), a few, many
@pytest.mark.parametrize("K", [64, 40])  # 40: not a multiple of INT8_KERNEL_K_MULTIPLE, the converted-weight path
def test_layer_error_within_the_rounding_bound(fmt, rows, K):
    """catches: a missing or misplaced scale, a transposed weight, a dropped bias, the wrong rows,
    or a kernel given a width it computes wrongly."""
    torch.manual_seed(1)
    lin = nn.Linear(K, 24)
    layer = WeightOnlyLinear(lin, fmt)
    x = torch.randn(rows, K)
    got = layer(x.view(rows, 1, K)).view(rows, 24)
    assert got.dtype == torch.float32
    want = x.double() @ lin.weight.detach().double().T + lin.bias.detach().double()
    err = (got.double() - want).abs()
    bound = _layer_bound(lin, layer, x)
    assert bool((err <= bound).all()), float((err - bound).max())
    spread = x.double().abs() @ lin.weight.detach().double().abs().T  # sum_k |x_k| |W_nk|
    assert float((bound / spread).max()) < 0.05  # the bound is a few percent of the product's scale, not vacuous


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("overrides", [{}, {"attention": "gqa", "num_kv_heads": 2}, {"attention": "gated"}])
def test_quantized_greedy_tokens_equal_float32(fmt, overrides):
    """catches: a decode path (prefill, cached steps, batch rows) that the quantized layers break.

    Premise, checked: at every step the float model's best token leads the
    second by more than twice the quantized model's largest logit error, so
    no rounding can change a greedy choice."""
    model = tiny(seed=1, **overrides)
    idx = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(2))
    _assert_greedy_equal(model, fmt, idx)


def _assert_greedy_equal(model: GPT, fmt: str, idx: torch.Tensor) -> None:
    q = quantize_weights(model, fmt)
    assert weight_format(q) == fmt and weight_format(model) is None
    with torch.no_grad():
        want, steps = model.generate(idx, 16, temperature=0, return_logits=True)
        top = steps.topk(2, dim=-1).values  # (B, n, 2)
        err = (q(want) - model(want)).abs().max()
    assert float((top[..., 0] - top[..., 1]).min()) > 2 * float(err)
    assert torch.equal(q.generate(idx, 16, temperature=0), want)
    assert torch.equal(q.generate(idx, 16, temperature=0, use_cache=False), want)
    assert q.num_parameters() == model.num_parameters()


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("tied", [True, False])
def test_token_embedding_reads_the_stored_table(fmt, tied):
    """catches: an embedding lookup without the row scales, a second copy of the tied
    table, or an untied LM head reading the embedding table."""
    model = tiny(tie_embeddings=tied)
    q = quantize_weights(model, fmt)
    assert (q.token_embedding.stored is q.lm_head.stored) == tied
    idx = torch.tensor([[0, 5, 255, 5]])
    want = dequantize(q.token_embedding.stored, q.token_embedding.scale)[idx]
    torch.testing.assert_close(q.token_embedding(idx), want)
    table = model.token_embedding.weight.detach()[idx]
    if fmt == "fp32":
        assert torch.equal(q.token_embedding(idx), table)  # the same values, only laid out differently
    elif fmt == "bf16":
        assert bool(((want - table).abs() <= U_BF16 * table.abs()).all())
    else:
        assert bool(((want - table).abs() <= q.token_embedding.scale.float()[idx][..., None] / 2 * (1 + 1e-6)).all())
    head = model.lm_head.weight.detach()
    assert float((q.lm_head.weight - head).abs().max()) <= float(head.abs().max()) / 127  # the head's own rows


def test_the_float_model_is_unchanged_and_shares_no_tensor():
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = quantize_weights(model, "int8")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ours = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
    theirs = {t.data_ptr() for t in [*q.parameters(), *q.buffers()]}
    assert not ours & theirs
    assert not q.training


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda m: quantize_weights(m, "fp16"), ValueError, "weights must be one of fp32, bf16, int8, got weights='fp16'"),
        (lambda m: quantize_weights(m.blocks[0], "int8"), TypeError, "takes a GPT, got Block"),
        (lambda m: quantize_weights(quantize_weights(m, "int8"), "bf16"), ValueError, "already holds int8 weights"),
        (lambda m: quantize_weights(m.double(), "int8"), ValueError, "float32 model, got parameters of dtype torch.float64"),
        (lambda m: quantize_weights(m, "bf16").train(), ValueError, "weight-only bf16 layers, which are for inference"),
        (lambda m: save_checkpoint(quantize_weights(m, "int8"), "/nonexistent/x"), ValueError, "save: the model holds"),
        (lambda m: gpt_to_hf_state_dict(quantize_weights(m, "fp32")), ValueError, "export: the model holds"),
    ],
)
def test_refusals_are_one_line(call, error, words):
    with pytest.raises(error) as info:
        call(tiny())
    assert words in str(info.value) and "\n" not in str(info.value)


def test_other_attention_kinds_are_refused():
    model = tiny(attention="talking_heads")
    with pytest.raises(ValueError, match=r"supports attention \[.*'mha'.*\] \(kinds that declare weight_only_layers\), got attention='talking_heads'"):
        quantize_weights(model, "int8")


def test_train_refusal_changes_no_mode():
    """catches: train() switching some layers to training mode before refusing."""
    q = quantize_weights(tiny(), "int8")
    with pytest.raises(ValueError):
        q.train()
    assert not any(m.training for m in q.modules())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
def test_cuda_quantized_greedy_tokens_equal_float32(fmt):
    model = tiny(seed=1).cuda()
    idx = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(2)).cuda()
    _assert_greedy_equal(model, fmt, idx)
    assert quantize_weights(model, fmt).lm_head.stored.device.type == "cuda"
