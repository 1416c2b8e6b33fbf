"""TorchMultiheadAttention on torch's own test inputs for nn.MultiheadAttention.

The inputs come from torch's tests: the ModuleInfo samples
(``module_inputs_torch_nn_MultiheadAttention`` in
torch/testing/_internal/common_modules.py, rebuilt here because that module
needs torch's test-only dependencies), test/nn/test_multihead_attention.py
and test/test_native_mha.py. Each runs through torch's module and through
``TorchMultiheadAttention.from_torch`` of it; outputs, weights and every gradient
(inputs and parameters, matched by name) are compared: float64 to 1e-10
scaled by the output magnitude, float32 with assert_close defaults. Where
torch raises AssertionError for a bad input, the drop-in raises
ValueError/TypeError naming the input.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from support.paths import assert_matches_peer
from torch import nn

from multihead import TorchMultiheadAttention

F64 = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torch's mask-type deprecation notes


def _randomize(mha: nn.MultiheadAttention, seed: int) -> nn.MultiheadAttention:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mha.parameters():  # torch zero-initialises the biases
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return mha


def _run(module, args, kwargs, grad=True):
    """(output, weights, {name: grad}) for q, k, v and every parameter."""
    leaves = [t.detach().clone().requires_grad_(grad) for t in args]
    module.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad):
        out, w = module(*leaves, **kwargs)
    if not grad:
        return out, w, {}
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()
    if w is not None:
        loss = loss + w.pow(2).sum()
    loss.backward()
    grads = dict(zip("qkv", (t.grad for t in leaves)))
    grads.update({n: p.grad for n, p in module.named_parameters()})
    return out, w, grads


def _compare(mha, args, kwargs, what="", grad=True):
    ours = TorchMultiheadAttention.from_torch(mha)
    want = _run(mha, args, kwargs, grad)
    got = _run(ours, args, kwargs, grad)
    assert_matches_peer(got[0], want[0], f"{what} output")
    assert_matches_peer(got[1], want[1], f"{what} weights")
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        assert_matches_peer(got[2][name], want[2][name], f"{what} grad {name}")


# ------------------------------------------------------------ ModuleInfo samples
def _module_info_samples():
    """torch's nn.MultiheadAttention samples: unbatched (3, 3) inputs, embed 3,
    3 heads, every bias / bias_kv / zero_attn / batch_first combination, with
    and without a padding mask [F, F, T] and a 3-D (H, T, S) attention mask."""
    kpms = (None, torch.tensor([False, False, True]))
    attns = (None, torch.tensor([False, False, True]).expand(3, 3, 3))
    for bias, add_bias_kv, add_zero_attn, kpm, attn, batch_first in itertools.product(
            (True, False), (True, False), (True, False), kpms, attns, (True, False)):
        cfg = {"bias": bias, "add_bias_kv": add_bias_kv, "add_zero_attn": add_zero_attn, "batch_first": batch_first}
        yield cfg, {"key_padding_mask": kpm, "attn_mask": attn}


@pytest.mark.parametrize("training", [True, False])
def test_module_info_samples(training):
    g = torch.Generator().manual_seed(0)
    samples = list(_module_info_samples())
    assert len(samples) == 64
    for i, (cfg, masks) in enumerate(samples):
        mha = _randomize(nn.MultiheadAttention(3, 3, dtype=F64, **cfg), i).train(training)
        args = [torch.randn(3, 3, generator=g, dtype=F64) for _ in range(3)]
        for need, avg in ((True, True), (True, False), (False, True)):
            _compare(mha, args, {**masks, "need_weights": need, "average_attn_weights": avg}, f"{cfg} {masks}")


# ------------------------------------------------------------ test_multihead_attention.py
HELPER_CASES = [  # torch's _multihead_attn_test_helper flag sets (static_k/v is functional-only)
    {},
    {"add_bias_kv": True},
    {"add_zero_attn": True},
    {"key_padding_mask": True},
    {"key_padding_mask": True, "add_bias_kv": True, "add_zero_attn": True},
    {"key_padding_mask": True, "add_zero_attn": True, "same_embed_dim": True},
]


@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("case", HELPER_CASES, ids=lambda c: "-".join(c) or "plain")
def test_torch_random_decoder_step_cases(case, average):
    """torch's helper: one decoder query (T = 1, (1, B, C)) over a (S, B, kdim)
    source, random sizes (batch and length 2-10, head dim 3-10, an even head
    count 4-10, kdim 5-20 or C), a random (1, S) float mask of 0 / -inf and a
    padding mask shared by the batch; here key 0 is always visible, since a
    query with no visible key is a documented difference (zeros, not NaN)."""
    rng = random.Random(hash(tuple(case)) % 1000 + average)
    for trial in range(6):
        B, S = rng.randint(2, 10), rng.randint(2, 10)
        d_head, heads = rng.randint(3, 10), rng.randint(2, 5) * 2
        C = d_head * heads
        kv = C if case.get("same_embed_dim") else rng.randint(5, 20)
        torch.manual_seed(trial)
        mha = nn.MultiheadAttention(C, heads, add_bias_kv=case.get("add_bias_kv", False),
                                    add_zero_attn=case.get("add_zero_attn", False), kdim=kv, vdim=kv, dtype=F64)
        _randomize(mha, trial)
        q, source = torch.rand(1, B, C, dtype=F64), torch.rand(S, B, kv, dtype=F64)
        hidden = torch.rand(1, S) < 0.5
        hidden[0, 0] = False
        attn = torch.zeros(1, S, dtype=F64).masked_fill(hidden, float("-inf"))
        kwargs = {"attn_mask": attn, "average_attn_weights": average}
        if case.get("key_padding_mask"):
            pad = torch.rand(1, S) < 0.5
            pad[0, 0] = False
            kwargs["key_padding_mask"] = pad.expand(B, S)
        _compare(mha, [q, source, source], kwargs, f"trial {trial}")


def test_3d_attn_mask_equals_per_sample_2d_masks():
    """torch's test_multihead_attn_3d_attn_mask: a (B*H, T, S) mask repeated
    per head gives, for each batch row, the output of that row's 2-D mask."""
    B, H, T, S, C = 8, 4, 2, 3, 8
    g = torch.Generator().manual_seed(1)
    q, k = torch.rand(B, T, C, generator=g, dtype=F64), torch.rand(B, S, C, generator=g, dtype=F64)
    masks = torch.zeros(B, T, S, dtype=F64).masked_fill(torch.rand(B, T, S, generator=g) < 0.5, float("-inf"))
    masks[:, :, 0] = 0.0  # a visible key for every query
    mha = _randomize(nn.MultiheadAttention(C, H, dtype=F64), 2)
    ours = TorchMultiheadAttention.from_torch(mha)
    mask3d = masks.repeat_interleave(H, dim=0)  # (B, T, S) -> (B*H, T, S)
    qt, kt = q.transpose(0, 1), k.transpose(0, 1)  # (B, L, C) -> (L, B, C)
    _compare(mha, [qt, kt, kt], {"attn_mask": mask3d})
    out3d = ours(qt, kt, kt, attn_mask=mask3d)[0]
    for i in range(B):
        one = ours(qt[:, i:i + 1], kt[:, i:i + 1], kt[:, i:i + 1], attn_mask=masks[i])[0]
        assert_matches_peer(one, out3d[:, i:i + 1], f"row {i}")


# ------------------------------------------------------------ test_native_mha.py
@pytest.mark.parametrize("mode", ["self", "encdec", "generic"])
@pytest.mark.parametrize("padding", ["none", "first_row", "every_row"])
def test_torch_native_mha_cases_in_float32(mode, padding):
    """torch's native-MHA cases: embed 64, 4 heads, batch 16, length 8,
    batch_first, eval without gradients (torch's fused kernel for
    self-attention), inputs uniform in [-3, 3); the last key of the first
    (or of every) row padded. float32: assert_close defaults."""
    g = torch.Generator().manual_seed(len(mode) + len(padding))
    x = lambda: 6 * torch.rand(16, 8, 64, generator=g) - 3  # noqa: E731
    q = x()
    k, v = {"self": (q, q), "encdec": (x(),) * 2, "generic": (x(), x())}[mode]
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(64, 4, batch_first=True)
    with torch.no_grad():
        mha.in_proj_bias.uniform_(-0.1, 0.1)
        mha.out_proj.bias.uniform_(-0.1, 0.1)
    mha.eval()
    kpm = None
    if padding != "none":
        kpm = torch.zeros(16, 8, dtype=torch.bool)
        kpm[0 if padding == "first_row" else slice(None), -1] = True
    ours = TorchMultiheadAttention.from_torch(mha)
    for need, avg in ((False, False), (True, True), (True, False)):
        kwargs = {"key_padding_mask": kpm, "need_weights": need, "average_attn_weights": avg}
        with torch.no_grad():
            want, got = mha(q, k, v, **kwargs), ours(q, k, v, **kwargs)
        assert_matches_peer(got[0], want[0], f"output {kwargs}")
        assert_matches_peer(got[1], want[1], f"weights {kwargs}")


def test_batch_first_changed_after_construction():
    """torch's test_multihead_attention_fastpath_for_all_batchfirst flips
    ``batch_first`` on a live module; the drop-in reads it at every call."""
    mha = _randomize(nn.MultiheadAttention(100, 2, batch_first=True, dtype=F64), 3).eval()
    ours = TorchMultiheadAttention.from_torch(mha)
    x = torch.randn(5, 2, 100, dtype=F64)
    with torch.no_grad():
        first = ours(x, x, x)[0]
        assert_matches_peer(first, mha(x, x, x)[0])
        mha.batch_first = ours.batch_first = False
        y = x.transpose(0, 1)  # (B, L, C) -> (L, B, C)
        assert_matches_peer(ours(y, y, y)[0], mha(y, y, y)[0])
        assert_matches_peer(ours(y, y, y)[0].transpose(0, 1), first)


def test_in_proj_bias_of_another_dtype_as_torch_allows():
    """torch's test_multihead_attn_fast_path_query_and_bias_have_different_dtypes:
    a float16 in_proj_bias on a float64 module still runs (promoted)."""
    mha = _randomize(nn.MultiheadAttention(4, 4, batch_first=True, dtype=F64), 4).eval()
    mha.in_proj_bias = nn.Parameter(mha.in_proj_bias.to(torch.half))
    ours = TorchMultiheadAttention.from_torch(mha)
    assert ours.in_proj_bias.dtype == torch.half
    q = torch.randn(4, 4, 4, dtype=F64)
    with torch.no_grad():
        want, got = mha(q, q, q), ours(q, q, q)
    assert_matches_peer(got[0], want[0])
    assert_matches_peer(got[1], want[1])


# ------------------------------------------------------------ bad inputs
def _bad_input_cases():
    """torch's test_multihead_attn_invalid_shape inputs (AssertionError there),
    plus wrong lengths and dtypes: (args, kwargs, error, message)."""
    q3, q2 = torch.randn(4, 4, 4), torch.randn(4, 4)
    flags = torch.tensor([False, False, True, True])
    return [
        ((q3, torch.randn(4, 4), q3), {}, ValueError, r"key must be 3-D like query, .* key \(4, 4\)"),
        ((q3, q3, torch.randn(4, 4)), {}, ValueError, r"value must be 3-D like query, .* value \(4, 4\)"),
        ((q3, q3, q3), {"key_padding_mask": flags}, ValueError,
         r"key_padding_mask must be \(B, S\) for batched input = \(4, 4\), got \(4,\)"),
        ((q3, q3, q3), {"key_padding_mask": torch.zeros(4, 5, dtype=torch.bool)}, ValueError,
         r"key_padding_mask must be \(B, S\) for batched input = \(4, 4\), got \(4, 5\)"),
        ((q3, q3, q3), {"attn_mask": flags}, ValueError, r"attn_mask must be 2-D \(T, S\) or 3-D .* got shape \(4,\)"),
        ((q3, q3, q3), {"attn_mask": torch.zeros(4, 5, dtype=torch.bool)}, ValueError,
         r"2-D attn_mask must be \(T, S\) = \(4, 4\), got \(4, 5\)"),
        ((q2, torch.randn(4, 4, 4), q2), {}, ValueError, r"key must be 2-D like query"),
        ((q2, q2, torch.randn(4, 4, 4)), {}, ValueError, r"value must be 2-D like query"),
        ((q2, q2, q2), {"key_padding_mask": flags.repeat(1, 2)}, ValueError,
         r"key_padding_mask must be \(S,\) for unbatched input = \(4,\), got \(1, 8\)"),
        ((q2, q2, q2), {"attn_mask": flags}, ValueError, r"attn_mask must be 2-D"),
        ((q2, q2, q2), {"attn_mask": torch.rand(5, 4, 4) < 0.5}, ValueError,
         r"3-D attn_mask must be \(H, T, S\) = \(4, 4, 4\), got \(5, 4, 4\)"),
        ((torch.randn(4), torch.randn(4), torch.randn(4)), {}, ValueError, r"query must be unbatched 2-D .* \(4,\)"),
        ((q3, q3, q3), {"key_padding_mask": torch.zeros(4, 4, dtype=torch.long)}, TypeError,
         r"key_padding_mask must be bool or floating, got dtype torch.int64"),
        ((q3, torch.randn(4, 5, 4), torch.randn(4, 6, 4)), {}, ValueError,
         r"query, key and value must share the batch size, key and value the length, .* key \(4, 5, 4\), value \(4, 6, 4\)"),
    ]


@pytest.mark.parametrize("batch_first", [True, False])
def test_bad_inputs_raise_errors_naming_the_input(batch_first):
    mha = nn.MultiheadAttention(4, 4, batch_first=batch_first)
    ours = TorchMultiheadAttention.from_torch(mha)
    for args, kwargs, error, message in _bad_input_cases():
        with pytest.raises(error, match=message):
            ours(*args, **kwargs)
        with pytest.raises((AssertionError, RuntimeError, ValueError)):  # torch refuses each one too
            mha(*args, **kwargs)


def test_nested_tensors_are_refused_with_a_message():
    ours = TorchMultiheadAttention.from_torch(nn.MultiheadAttention(10, 5, batch_first=True).eval())
    nt = torch.nested.nested_tensor([torch.randn(4, 10), torch.randn(6, 10)], layout=torch.jagged)
    message = r"nested tensors are not supported by TorchMultiheadAttention \(query is nested\); pass padded tensors"
    for context in (torch.enable_grad(), torch.no_grad()):
        with context, pytest.raises(TypeError, match=message):
            ours(nt, nt, nt)
    padded = torch.randn(2, 6, 10)
    with pytest.raises(TypeError, match=r"\(value is nested\)"):
        ours(padded, padded, nt)
