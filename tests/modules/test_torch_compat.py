"""TorchMultiheadAttention (``TorchMultiheadAttention.from_torch``) against
``torch.nn.MultiheadAttention`` in float64, across torch's options."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch
from torch import nn

from multihead import TorchMultiheadAttention

F64 = torch.float64
TOL = 1e-10
E, H, T, S, B = 8, 2, 5, 6, 3

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torch's mask-type deprecation notes




def _torch_mha(seed=0, **kwargs) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(E, H, dtype=F64, **kwargs)
    with torch.no_grad():
        for p in mha.parameters():  # non-trivial biases, bias_k and bias_v too
            nn.init.normal_(p, 0.0, 0.5)
    return mha.eval()


def _close(actual, expected, tol=TOL):
    if expected is None:
        assert actual is None
        return
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=0, atol=tol * max(1.0, expected.abs().max().item()))


def _masks(kind: str, batch: int, T: int, S: int, g: torch.Generator):
    """torch-polarity masks (bool True = may NOT attend), no fully hidden row."""
    kpm = attn = None
    if "kpm_bool" in kind:
        kpm = torch.rand(batch, S, generator=g) < 0.3
        kpm[:, 0] = False
    if "kpm_float" in kind:
        kpm = torch.randn(batch, S, generator=g, dtype=F64)
    for dims in ("2d", "3d"):
        shape = (T, S) if dims == "2d" else (batch * H, T, S)
        if f"attn{dims}_bool" in kind:
            attn = torch.rand(*shape, generator=g) < 0.3
            attn[..., 0] = False
        if f"attn{dims}_float" in kind:
            attn = torch.randn(*shape, generator=g, dtype=F64)
    if "causal" in kind:
        attn = torch.ones(T, S, dtype=torch.bool).triu(1)  # top-left, torch polarity
    return kpm, attn


MASK_KINDS = ["none", "kpm_bool", "kpm_float", "attn2d_bool", "attn2d_float", "attn3d_bool", "attn3d_float",
              "kpm_bool+attn2d_bool", "kpm_bool+attn3d_float", "kpm_float+attn2d_float", "causal",
              "causal+kpm_bool"]
OPTIONS = {"batch_first": [True, False], "bias": [True, False], "add_bias_kv": [False, True],
               "add_zero_attn": [False, True], "kv": [None, (7, 9), (E, E)], "self_attn": [True, False]}


def _pairwise() -> list[dict]:
    """Structures covering every pair of option values (greedy covering array);
    self-attention with kdim/vdim != embed_dim is impossible and left out."""
    names = list(OPTIONS)
    full = [dict(zip(names, vals)) for vals in itertools.product(*OPTIONS.values())]
    full = [c for c in full if not (c["self_attn"] and c["kv"] == (7, 9))]

    def pairs(c):
        return {(a, repr(c[a]), b, repr(c[b])) for a, b in itertools.combinations(names, 2)}

    todo, chosen = set().union(*(pairs(c) for c in full)), []
    while todo:
        best = max(full, key=lambda c: len(pairs(c) & todo))
        chosen.append(best)
        todo -= pairs(best)
    return chosen


STRUCTURE = _pairwise()
WEIGHTS = [(False, True), (True, True), (True, False)]  # (need_weights, average_attn_weights)


def _structure_id(s):
    return "-".join(f"{k}={v}" for k, v in s.items()).replace(" ", "")


def _inputs(cfg, batch, g, unbatched=False):
    kdim, vdim = cfg["kv"] or (E, E)
    lead = () if unbatched else (batch,)

    def make(n, c):
        t = torch.randn(*lead, n, c, generator=g, dtype=F64)
        return t if cfg["batch_first"] or unbatched else t.transpose(0, 1).contiguous()  # (B, L, C) -> (L, B, C)

    q = make(T, E)
    if cfg["self_attn"]:
        return q, q, q, T
    return q, make(S, kdim), make(S, vdim), S


def _pair(cfg):
    kdim, vdim = cfg["kv"] or (None, None)
    mha = _torch_mha(batch_first=cfg["batch_first"], bias=cfg["bias"], add_bias_kv=cfg["add_bias_kv"],
                     add_zero_attn=cfg["add_zero_attn"], kdim=kdim, vdim=vdim)
    ours = TorchMultiheadAttention.from_torch(mha)
    assert isinstance(ours, TorchMultiheadAttention) and not ours.training
    return mha, ours


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("cfg", STRUCTURE, ids=_structure_id)
def test_parity_with_torch(cfg, mask_kind):
    mha, ours = _pair(cfg)
    g = torch.Generator().manual_seed(zlib.crc32(f"{_structure_id(cfg)}/{mask_kind}".encode()))
    q, k, v, S_ = _inputs(cfg, B, g)
    kpm, attn = _masks(mask_kind, B, T, S_, g)
    for need, avg in WEIGHTS:
        kw = {"key_padding_mask": kpm, "attn_mask": attn, "need_weights": need, "average_attn_weights": avg,
                  "is_causal": "causal" in mask_kind}
        got_out, got_w = ours(q, k, v, **kw)
        if _torch_hint_drops_extra_keys(cfg, kw):
            kw["is_causal"] = False  # what the mask says; see the test below
        want_out, want_w = mha(q, k, v, **kw)
        _close(got_out, want_out)
        _close(got_w, want_w)


def _torch_hint_drops_extra_keys(cfg, kw):
    """torch's is_causal hint replaces the mask by the kernel's top-left
    triangle over S + 1 keys when need_weights=False and there is no padding
    mask, which hides the bias_k / zero key that the padded mask shows."""
    return (kw["is_causal"] and not kw["need_weights"] and kw["key_padding_mask"] is None
            and (cfg["add_bias_kv"] or cfg["add_zero_attn"]))


@pytest.mark.parametrize("extra", ["add_bias_kv", "add_zero_attn"])
def test_is_causal_follows_the_mask_with_extra_keys_unlike_torch_hint(extra):
    """Documented difference: with add_bias_kv / add_zero_attn, torch's
    need_weights=False path hides the appended key (its hint disagrees with its
    own need_weights=True result); the drop-in follows the mask either way."""
    cfg = {"batch_first": True, "bias": True, "add_bias_kv": False, "add_zero_attn": False, "kv": None, "self_attn": True}
    cfg[extra] = True
    mha, ours = _pair(cfg)
    x = torch.randn(B, T, E, dtype=F64)
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    by_mask = mha(x, x, x, attn_mask=causal, need_weights=True)[0]
    assert not torch.allclose(mha(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0], by_mask)
    for need in (True, False):
        _close(ours(x, x, x, attn_mask=causal, is_causal=True, need_weights=need)[0], by_mask)


@pytest.mark.parametrize("mask_kind", ["none", "kpm_bool", "kpm_float", "attn2d_bool", "attn3d_float", "causal"])
@pytest.mark.parametrize("cfg", STRUCTURE, ids=_structure_id)
def test_parity_with_torch_unbatched(cfg, mask_kind):
    mha, ours = _pair(cfg)
    g = torch.Generator().manual_seed(zlib.crc32(f"u/{_structure_id(cfg)}/{mask_kind}".encode()))
    q, k, v, S_ = _inputs(cfg, 1, g, unbatched=True)
    kpm, attn = _masks(mask_kind, 1, T, S_, g)
    kpm = None if kpm is None else kpm[0]  # (S,)
    for need, avg in WEIGHTS:
        kw = {"key_padding_mask": kpm, "attn_mask": attn, "need_weights": need, "average_attn_weights": avg,
                  "is_causal": mask_kind == "causal"}
        got_out, got_w = ours(q, k, v, **kw)
        if _torch_hint_drops_extra_keys(cfg, kw):
            kw["is_causal"] = False
        want_out, want_w = mha(q, k, v, **kw)
        assert got_out.shape == (T, E)
        _close(got_out, want_out)
        _close(got_w, want_w)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
def test_parity_with_torch_fast_path_under_no_grad(batch_first, need_weights):
    """Self-attention in eval mode without grad is torch's fused fast path."""
    cfg = {"batch_first": batch_first, "bias": True, "add_bias_kv": False, "add_zero_attn": False, "kv": None, "self_attn": True}
    mha, ours = _pair(cfg)
    q, k, v, _ = _inputs(cfg, B, torch.Generator().manual_seed(4))
    kpm = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0], [0, 1, 0, 1, 0]], dtype=torch.bool)
    with torch.no_grad():
        want = mha(q, k, v, key_padding_mask=kpm, need_weights=need_weights)
        got = ours(q, k, v, key_padding_mask=kpm, need_weights=need_weights)
    _close(got[0], want[0])
    _close(got[1], want[1])


def test_input_gradients_match_torch():
    mha, ours = _pair({"batch_first": True, "bias": True, "add_bias_kv": True, "add_zero_attn": True, "kv": (7, 9),
                           "self_attn": False})
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, n, c, generator=g, dtype=F64) for n, c in ((T, E), (S, 7), (S, 9)))
    kpm = torch.rand(B, S, generator=g) < 0.3
    kpm[:, 0] = False
    grads = []
    for mod in (mha, ours):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, w = mod(*leaves, key_padding_mask=kpm, average_attn_weights=False)
        (out.pow(2).sum() + w.sum(-1).pow(2).sum()).backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        _close(b, a)


def test_is_causal_without_mask_raises_value_error():
    _, ours = _pair({"batch_first": True, "bias": True, "add_bias_kv": False, "add_zero_attn": False, "kv": None,
                         "self_attn": True})
    x = torch.randn(2, T, E, dtype=F64)
    with pytest.raises(ValueError, match="is_causal=True needs attn_mask"):
        ours(x, x, x, is_causal=True)


@pytest.mark.parametrize("need_weights", [True, False])
def test_fully_masked_row_gives_bias_where_torch_gives_nan(need_weights):
    """Documented difference (pytorch#41508): a query that may attend to nothing
    gets zeros before out_proj here (so the output is out_proj.bias, weights 0);
    torch returns NaN with need_weights=True."""
    mha, ours = _pair({"batch_first": True, "bias": True, "add_bias_kv": False, "add_zero_attn": False, "kv": None,
                           "self_attn": True})
    x = torch.randn(B, T, E, dtype=F64)
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1] = True  # every key of batch row 1 ignored (torch polarity)
    want_out, want_w = mha(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
    got_out, got_w = ours(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
    assert not got_out.isnan().any()
    _close(got_out[1], ours.attention.out_proj.bias.expand(T, E))
    _close(got_out[[0, 2]], want_out[[0, 2]])
    if need_weights:
        assert want_out[1].isnan().all() and want_w[1].isnan().all()  # torch's behaviour
        assert not got_w[1].any() and not got_w.isnan().any()
        _close(got_w[[0, 2]], want_w[[0, 2]])


def test_from_torch_copies_training_mode_and_dropout_and_refuses_other_modules():
    mha = _torch_mha(dropout=0.25).train()
    ours = TorchMultiheadAttention.from_torch(mha)
    assert ours.training and ours.attention.dropout == 0.25 and ours.batch_first is False
    with pytest.raises(TypeError, match="expected torch.nn.MultiheadAttention, got Linear"):
        TorchMultiheadAttention.from_torch(nn.Linear(2, 2))


def test_non_contiguous_3d_mask_and_inputs():
    cfg = {"batch_first": False, "bias": True, "add_bias_kv": True, "add_zero_attn": False, "kv": None, "self_attn": False}
    mha, ours = _pair(cfg)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(B, T, E, generator=g, dtype=F64).transpose(0, 1)  # (T, B, E), not contiguous
    k = torch.randn(B, S, E, generator=g, dtype=F64).transpose(0, 1)
    attn = torch.randn(B * H, S, T, generator=g, dtype=F64).transpose(1, 2)  # (B*H, T, S), not contiguous
    kpm = (torch.rand(S, B, generator=g) < 0.3).t()
    kpm[:, 0] = False
    want = mha(q, k, k, attn_mask=attn, key_padding_mask=kpm, average_attn_weights=False)
    got = ours(q, k, k, attn_mask=attn, key_padding_mask=kpm, average_attn_weights=False)
    _close(got[0], want[0])
    _close(got[1], want[1])


def test_bad_shapes_raise_value_error():
    _, ours = _pair({"batch_first": True, "bias": True, "add_bias_kv": False, "add_zero_attn": False, "kv": None,
                         "self_attn": True})
    x = torch.randn(2, T, E, dtype=F64)
    with pytest.raises(ValueError, match=r"3-D attn_mask must be \(B\*H, T, S\) = \(4, 5, 5\), got \(2, 5, 5\)"):
        ours(x, x, x, attn_mask=torch.zeros(2, T, T, dtype=F64))
    with pytest.raises(ValueError, match=r"query must be .* got \(2, 5, 7\)"):
        y = torch.randn(2, T, 7, dtype=F64)
        ours(y, y, y)
