"""Annotated Transformer converter against the textbook reproduction of the
official ``MultiHeadedAttention`` (float64, 1e-10), with every mask the model
uses, cross-attention, fully masked rows, and the round trip."""

from __future__ import annotations

import pytest
import torch

from multihead import MultiHeadAttention
from multihead.convert import from_official, official_kinds
from multihead.convert.official.annotated_transformer import AnnotatedTransformerAttention, to_official
from multihead.textbook import MultiHeadedAttention, subsequent_mask

F64 = torch.float64
TOL = 1e-10


def _official(h=4, d_model=12, seed=0, dtype=F64) -> MultiHeadedAttention:
    torch.manual_seed(seed)
    official = MultiHeadedAttention(h, d_model, dropout=0.1).to(dtype)
    with torch.no_grad():  # distinct weights and biases, so a swapped projection shows
        for p in official.parameters():
            p.normal_(0.0, 0.5)
    return official.eval()


def _pair(**kw):
    official = _official(**kw)
    ours = from_official("annotated_transformer", official.state_dict(), h=official.h, d_model=official.d_model)
    return official, ours


def _check(official, ours, query, key, value, mask):
    inputs = [t.detach().clone().requires_grad_() for t in (query, key, value)]
    mine = [t.detach().clone().requires_grad_() for t in (query, key, value)]
    want = official(*inputs, mask)
    got = ours(*mine, mask)
    assert got.shape == want.shape and torch.isfinite(got).all()
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= TOL * scale
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    for a, b in zip(inputs, mine):
        assert (a.grad - b.grad).abs().max().item() <= TOL * max(1.0, a.grad.abs().max().item())


def _padding(B, S, lengths):
    keep = torch.zeros(B, 1, S, dtype=torch.bool)
    for b, n in enumerate(lengths):
        keep[b, :, :n] = True
    return keep


def test_registered():
    assert "annotated_transformer" in official_kinds()


def test_no_mask_and_separate_self_attention_tensors():
    official, ours = _pair()
    x = torch.randn(2, 7, 12, dtype=F64)
    _check(official, ours, x, x, x, None)
    _check(official, ours, x, x.clone(), x.clone(), None)


def test_encoder_padding_mask():
    official, ours = _pair(h=3, d_model=15)  # d_k = 5
    x = torch.randn(3, 7, 15, dtype=F64)
    _check(official, ours, x, x, x, _padding(3, 7, [7, 4, 1]))


def test_decoder_causal_and_padding_masks():
    official, ours = _pair()
    x = torch.randn(3, 7, 12, dtype=F64)
    _check(official, ours, x, x, x, subsequent_mask(7))  # [1, T, T]
    tgt_mask = _padding(3, 7, [7, 5, 2]) & subsequent_mask(7)  # Batch.make_std_mask: [B, T, T]
    _check(official, ours, x, x, x, tgt_mask)


def test_cross_attention_to_memory_of_another_length():
    official, ours = _pair()
    x, memory = torch.randn(3, 7, 12, dtype=F64), torch.randn(3, 5, 12, dtype=F64)
    _check(official, ours, x, memory, memory, _padding(3, 5, [5, 3, 1]))
    _check(official, ours, x, memory, memory, None)


def test_fully_masked_rows_attend_uniformly():
    official, ours = _pair()
    x, memory = torch.randn(3, 7, 12, dtype=F64), torch.randn(3, 5, 12, dtype=F64)
    src_mask = _padding(3, 5, [5, 0, 2])  # sequence 1 has no real key at all
    _check(official, ours, x, memory, memory, src_mask)
    # the result is the mean value through the output projection, not zeros
    v = official.linears[2](memory[1]).mean(0)
    torch.testing.assert_close(ours(x, memory, memory, src_mask)[1], official.linears[3](v).expand(7, 12),
                               rtol=0, atol=1e-12)
    tgt_mask = _padding(3, 7, [7, 5, 2]) & subsequent_mask(7)
    tgt_mask[0, 3] = False  # one fully masked query row inside a causal mask
    _check(official, ours, x, x, x, tgt_mask)


def test_head_dependent_dead_rows_of_a_two_dimensional_mask():
    """A 2-D [Tq, Tk] mask becomes [Tq, 1, Tk]: with Tq == h it varies by head."""
    official, ours = _pair()
    x = torch.randn(2, 4, 12, dtype=F64)
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[1] = False  # head 1 sees no key in any row
    mask[2, :2] = False
    _check(official, ours, x, x, x, mask)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64, F64])
def test_non_boolean_masks_compare_with_zero(dtype):
    official, ours = _pair()
    x = torch.randn(2, 6, 12, dtype=F64)
    mask = _padding(2, 6, [6, 3]).to(dtype)
    _check(official, ours, x, x, x, mask)


def test_float32():
    official, ours = _pair(dtype=torch.float32)
    x, memory = torch.randn(2, 6, 12), torch.randn(2, 4, 12)
    mask = _padding(2, 4, [4, 0])
    torch.testing.assert_close(ours(x, memory, memory, mask), official(x, memory, memory, mask))


def test_round_trip():
    official = _official()
    ours = from_official("annotated_transformer", official.state_dict(), h=4, d_model=12)
    assert isinstance(ours, AnnotatedTransformerAttention) and not ours.training
    assert ours.attention.dropout == 0.1 and ours.attention.qkv_proj.weight.dtype == F64
    back = to_official(ours)
    assert list(back) == list(official.state_dict())
    for name, t in official.state_dict().items():
        assert torch.equal(back[name], t), name
    again = MultiHeadedAttention(4, 12).to(F64)
    again.load_state_dict(to_official(ours.attention))  # also from the bare MultiHeadAttention
    x = torch.randn(2, 5, 12, dtype=F64)
    assert torch.equal(again.eval()(x, x, x), official(x, x, x))


def test_to_official_refuses_other_layouts():
    for m, match in [
        (MultiHeadAttention(12, 4, num_kv_heads=2), "num_kv_heads=2"),
        (MultiHeadAttention(12, 4, head_dim=2), "embed_dim=12"),
        (MultiHeadAttention(12, 4, qkv_bias=False), "bias"),
        (MultiHeadAttention(12, 3, rope=True), "rope"),
        (MultiHeadAttention(12, 4, kdim=6), "kdim=6"),
    ]:
        with pytest.raises(ValueError, match=match):
            to_official(m)
    with pytest.raises(TypeError, match="Linear"):
        to_official(torch.nn.Linear(2, 2))


def test_from_official_errors():
    sd = _official().state_dict()
    with pytest.raises(ValueError, match=r"missing \['linears.3.bias'\]"):
        from_official("annotated_transformer", {k: v for k, v in sd.items() if k != "linears.3.bias"},
                      h=4, d_model=12)
    with pytest.raises(ValueError, match="unexpected.*extra"):
        from_official("annotated_transformer", {**sd, "extra": sd["linears.0.bias"]}, h=4, d_model=12)
    with pytest.raises(ValueError, match=r"\(16, 16\) for d_model=16"):
        from_official("annotated_transformer", sd, h=4, d_model=16)
    with pytest.raises(ValueError, match="d_model=12 must be divisible by h=5"):
        from_official("annotated_transformer", sd, h=5, d_model=12)
    with pytest.raises(ValueError, match="dropout"):
        from_official("annotated_transformer", sd, h=4, d_model=12, dropout=1.0)
    mixed = {**sd, "linears.2.bias": sd["linears.2.bias"].float()}
    with pytest.raises(ValueError, match="dtype/device"):
        from_official("annotated_transformer", mixed, h=4, d_model=12)


def test_call_errors():
    _, ours = _pair()
    x = torch.randn(2, 5, 12, dtype=F64)
    with pytest.raises(ValueError, match="does not broadcast"):
        ours(x, x, x, torch.ones(3, 1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[B, 1, Tk\]"):
        ours(x, x, x, torch.ones(2, 1, 1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="d_model=12"):
        ours(x, x[..., :6], x)
    with pytest.raises(ValueError, match="share"):
        ours(x, x, x[:, :4])
    with pytest.raises(TypeError, match="mask"):
        ours(x, x, x, [[1, 1, 1, 1, 1]])
