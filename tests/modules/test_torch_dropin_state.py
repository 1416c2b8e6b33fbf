"""TorchMultiheadAttention's parameters and state against torch.nn.MultiheadAttention.

Attributes, parameter identity with the inner MultiHeadAttention, state
dicts both ways, from_torch for every bias layout, initialisation,
conversions, optimizers, dropout = 1 and TorchScript. Numbers are compared
in float64 to 1e-10 scaled by the output magnitude, against torch's own
module with the same weights.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from multihead import TorchMultiheadAttention

F64 = torch.float64
E, H = 8, 2
CONFIGS = {
    "fused": {},
    "split": {"kdim": 3, "vdim": 5},
    "no_bias": {"bias": False},
    "bias_kv_zero_attn": {"add_bias_kv": True, "add_zero_attn": True},
    "split_no_bias_kv": {"kdim": 6, "vdim": 6, "bias": False, "add_bias_kv": True},
}


def _torch_mha(seed=0, **kwargs) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(E, H, dtype=F64, batch_first=True, **kwargs)
    with torch.no_grad():
        for p in mha.parameters():  # non-trivial biases too
            p.normal_(0.0, 0.5)
    return mha


def _inputs(mha, seed=1, B=3, T=4, S=5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, E, generator=g, dtype=F64), torch.randn(B, S, mha.kdim, generator=g, dtype=F64),
            torch.randn(B, S, mha.vdim, generator=g, dtype=F64))


def _close(actual, expected, what=""):
    if expected is None:
        assert actual is None, what
        return
    assert actual is not None and actual.shape == expected.shape, what
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-10 * scale, msg=lambda m: f"{what}: {m}")


def _outputs_and_grads(module, q, k, v):
    """Output, weights and {name: grad} of q, k, v and every parameter."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    module.zero_grad(set_to_none=True)
    out, w = module(*leaves, average_attn_weights=False)
    (out.pow(2).sum() + w.pow(2).sum()).backward()
    grads = dict(zip("qkv", (t.grad for t in leaves)))
    grads.update({n: p.grad for n, p in module.named_parameters()})
    return out, w, grads


def _same_results(ours, mha, seed=1):
    q, k, v = _inputs(mha, seed)
    want_out, want_w, want_g = _outputs_and_grads(mha, q, k, v)
    got_out, got_w, got_g = _outputs_and_grads(ours, q, k, v)
    _close(got_out, want_out, "output")
    _close(got_w, want_w, "weights")
    assert got_g.keys() == want_g.keys()
    for name in want_g:
        _close(got_g[name], want_g[name], f"grad {name}")


# ------------------------------------------------------------ attributes, identity
@pytest.mark.parametrize("name", list(CONFIGS))
def test_attributes_and_parameter_names_are_torchs(name):
    mha = _torch_mha(**CONFIGS[name])
    ours = TorchMultiheadAttention.from_torch(mha)
    for attr in ("embed_dim", "kdim", "vdim", "num_heads", "head_dim", "dropout", "batch_first",
                 "_qkv_same_embed_dim", "add_zero_attn"):
        assert getattr(ours, attr) == getattr(mha, attr), attr
    for attr in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias", "bias_k",
                 "bias_v", "out_proj.weight", "out_proj.bias"):
        obj_t, obj_o = mha, ours
        for part in attr.split("."):
            obj_t, obj_o = getattr(obj_t, part), getattr(obj_o, part)
        assert (obj_o is None) == (obj_t is None), attr
        if obj_t is not None:
            assert isinstance(obj_o, nn.Parameter) and obj_o.shape == obj_t.shape, attr
    assert type(ours.out_proj) is NonDynamicallyQuantizableLinear
    # same names in the same order: optimizer state dicts and name-based parameter groups carry over
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in mha.named_parameters()]
    assert list(ours.state_dict()) == list(mha.state_dict())


@pytest.mark.parametrize("name", ["fused", "split"])
def test_torch_named_parameters_are_the_inner_modules_parameters(name):
    ours = TorchMultiheadAttention(E, H, **CONFIGS[name])
    inner = ours.attention
    assert inner.out_proj is ours.out_proj
    if name == "fused":
        assert inner.qkv_proj.weight is ours.in_proj_weight and inner.qkv_proj.bias is ours.in_proj_bias
    else:
        for n in "qkv":
            proj = getattr(inner, f"{n}_proj")
            assert proj.weight is getattr(ours, f"{n}_proj_weight") and proj.in_proj_bias is ours.in_proj_bias
        # each projection's bias is a view of its rows of the shared bias
        assert torch.equal(torch.cat([inner.k_proj.bias, inner.v_proj.bias]), ours.in_proj_bias[E:])
    ids = {id(p) for p in ours.parameters()}
    assert ids == {id(p) for p in inner.parameters()} and len(ids) == len(list(ours.parameters()))


@pytest.mark.parametrize("name", ["fused", "split"])
def test_in_place_edits_and_optimizer_steps_act_on_the_computation(name):
    mha = _torch_mha(**CONFIGS[name])
    ours = TorchMultiheadAttention.from_torch(mha)
    for module in (mha, ours):  # what torch's own _reset_parameters does, in place
        nn.init.zeros_(module.in_proj_bias)
        with torch.no_grad():
            module.out_proj.weight.mul_(2.0)
    _same_results(ours, mha)
    q, k, v = _inputs(mha, 2)
    for module in (mha, ours):
        opt = torch.optim.SGD(module.parameters(), lr=0.005, momentum=0.9)
        for _ in range(2):
            opt.zero_grad()
            module(q, k, v)[0].pow(2).sum().backward()
            opt.step()
    for (n, p), (_, want) in zip(ours.named_parameters(), mha.named_parameters()):
        _close(p, want, n)
    _same_results(ours, mha, seed=3)


def test_assigning_parameters_repoints_the_inner_module():
    """torch code assigns parameters (torch's own tests: mha.in_proj_weight =
    qkv.weight); the drop-in computes with what was assigned."""
    for kwargs in ({}, CONFIGS["split"]):
        mha = _torch_mha(**kwargs)
        ours = TorchMultiheadAttention.from_torch(mha)
        g = torch.Generator().manual_seed(7)
        new = {}
        for n, p in mha.named_parameters():
            new[n] = torch.randn(p.shape, generator=g, dtype=F64)
        for module in (mha, ours):
            for n, value in new.items():
                if "." not in n:
                    setattr(module, n, nn.Parameter(value.clone()))
            module.out_proj = nn.Linear(E, E, dtype=F64)
            with torch.no_grad():
                module.out_proj.weight.copy_(new["out_proj.weight"])
                module.out_proj.bias.copy_(new["out_proj.bias"])
        assert ours.attention.out_proj is ours.out_proj
        _same_results(ours, mha)
        mha.in_proj_bias = ours.in_proj_bias = None
        _same_results(ours, mha)


# ------------------------------------------------------------ state dicts
@pytest.mark.parametrize("name", list(CONFIGS))
def test_state_dicts_load_both_ways_strictly(name):
    source = _torch_mha(seed=5, **CONFIGS[name])
    ours = TorchMultiheadAttention(E, H, batch_first=True, dtype=F64, **CONFIGS[name])
    ours.load_state_dict(source.state_dict())  # strict
    _same_results(ours, source)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.25)
    back = _torch_mha(seed=6, **CONFIGS[name])
    back.load_state_dict(ours.state_dict())  # strict
    _same_results(ours, back)
    assert list(ours.state_dict()._metadata) == list(back.state_dict()._metadata)


def test_load_with_assign_keeps_the_parameters_shared():
    source = _torch_mha(seed=5, **CONFIGS["split"])
    ours = TorchMultiheadAttention(E, H, batch_first=True, dtype=F64, **CONFIGS["split"])
    ours.load_state_dict(source.state_dict(), assign=True)
    assert ours.attention.k_proj.weight is ours.k_proj_weight and ours.attention.q_proj.in_proj_bias is ours.in_proj_bias
    _same_results(ours, source)


def test_strict_loading_still_reports_unknown_and_missing_keys():
    ours = TorchMultiheadAttention(E, H)
    state = nn.MultiheadAttention(E, H).state_dict()
    state["extra.weight"] = torch.zeros(1)
    del state["in_proj_bias"]
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "extra.weight"') as err:
        ours.load_state_dict(state)
    assert 'Missing key(s) in state_dict: "in_proj_bias"' in str(err.value)
    result = ours.load_state_dict(state, strict=False)
    assert result.missing_keys == ["in_proj_bias"] and result.unexpected_keys == ["extra.weight"]
    # inside a model the keys carry the model's prefix
    layer = nn.TransformerEncoderLayer(E, H, 16, batch_first=True)
    mine = copy.deepcopy(layer)
    mine.self_attn = TorchMultiheadAttention.from_torch(layer.self_attn)
    state = layer.state_dict()
    mine.load_state_dict(state)
    del state["self_attn.in_proj_weight"]
    result = mine.load_state_dict(state, strict=False)
    assert result.missing_keys == ["self_attn.in_proj_weight"] and result.unexpected_keys == []
    assert list(mine.state_dict()) == list(layer.state_dict())


# ------------------------------------------------------------ from_torch
BIAS_LAYOUTS = [(True, True), (False, True), (True, False), (False, False)]  # (in_proj_bias, out_proj.bias)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("layout", BIAS_LAYOUTS, ids=lambda b: f"in{int(b[0])}-out{int(b[1])}")
@pytest.mark.parametrize("start_with_bias", [True, False])
def test_from_torch_every_bias_combination(layout, split, start_with_bias):
    """torch lets users set in_proj_bias / out_proj.bias to None or to a new
    Parameter after construction; the drop-in follows the module as it is."""
    kw = CONFIGS["split"] if split else {}
    mha = _torch_mha(bias=start_with_bias, **kw)
    g = torch.Generator().manual_seed(11)
    want_in, want_out = layout
    mha.in_proj_bias = nn.Parameter(torch.randn(3 * E, generator=g, dtype=F64)) if want_in else None
    mha.out_proj.bias = nn.Parameter(torch.randn(E, generator=g, dtype=F64)) if want_out else None
    ours = TorchMultiheadAttention.from_torch(mha)
    assert (ours.in_proj_bias is None) != want_in and (ours.out_proj.bias is None) != want_out
    _same_results(ours, mha)
    back = nn.MultiheadAttention(E, H, dtype=F64, batch_first=True, **kw)
    back.in_proj_bias = nn.Parameter(torch.zeros(3 * E, dtype=F64)) if want_in else None
    back.out_proj.bias = nn.Parameter(torch.zeros(E, dtype=F64)) if want_out else None
    back.load_state_dict(ours.state_dict())
    _same_results(ours, back)


def test_from_torch_keeps_frozen_parameters_dtype_device_and_draws_no_random_numbers():
    mha = _torch_mha(add_bias_kv=True)
    mha.in_proj_weight.requires_grad_(False)
    mha.bias_v.requires_grad_(False)
    state = torch.random.get_rng_state()
    ours = TorchMultiheadAttention.from_torch(mha)
    assert torch.equal(state, torch.random.get_rng_state())
    for (n, p), (_, want) in zip(ours.named_parameters(), mha.named_parameters()):
        assert p.requires_grad == want.requires_grad and p.dtype == want.dtype == F64 and p.device == want.device, n
        assert p.data_ptr() != want.data_ptr(), n  # copies, not shared storage
    _same_results(ours, mha)
    assert ours.in_proj_weight.grad is None and ours.bias_v.grad is None
    on_meta = TorchMultiheadAttention.from_torch(nn.MultiheadAttention(E, H, kdim=3, vdim=5, device="meta",
                                                                  dtype=torch.float16))
    assert all(p.device.type == "meta" and p.dtype == torch.float16 for p in on_meta.parameters())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_seed_initialises_like_torch(name):
    """torch's init (Xavier in-projection, zero biases, Xavier-normal bias_k/v)
    with the same random draws: the same operations on the same shapes, so
    the values are compared bitwise."""
    torch.manual_seed(123)
    mha = nn.MultiheadAttention(E, H, **CONFIGS[name])
    after_torch = torch.rand(3)
    torch.manual_seed(123)
    ours = TorchMultiheadAttention(E, H, **CONFIGS[name])
    assert torch.equal(torch.rand(3), after_torch)  # as many draws as torch
    for (n, p), (_, want) in zip(ours.named_parameters(), mha.named_parameters(), strict=True):
        assert torch.equal(p, want), n


@pytest.mark.parametrize("name", ["fused", "split"])
def test_conversions_copies_and_pickles_keep_parameters_shared(name):
    mha = _torch_mha(**CONFIGS[name])
    ours = TorchMultiheadAttention.from_torch(mha)

    def shared(m):
        inner = m.attention
        if m._qkv_same_embed_dim:
            return inner.qkv_proj.weight is m.in_proj_weight and inner.qkv_proj.bias is m.in_proj_bias
        return inner.v_proj.weight is m.v_proj_weight and inner.v_proj.in_proj_bias is m.in_proj_bias

    ours.float()
    assert shared(ours) and ours.in_proj_bias.dtype == torch.float32 and ours.attention.out_proj.weight.dtype == torch.float32
    ours.to(F64)
    mha.float().to(F64)  # the same rounding
    assert shared(ours)
    _same_results(ours, mha)
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)  # new Parameter objects on conversion
    try:
        ours.float().double()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
    assert shared(ours)
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    for copy_ in (copy.deepcopy(ours), torch.load(buffer, weights_only=False)):
        assert shared(copy_) and copy_.attention.out_proj is copy_.out_proj
        _same_results(copy_, mha)


def test_optimizer_state_from_a_torch_model_carries_over():
    mha = _torch_mha(add_bias_kv=True)
    q, k, v = _inputs(mha)
    opt = torch.optim.SGD(mha.parameters(), lr=0.005, momentum=0.9)  # state: a buffer per parameter
    for _ in range(2):
        opt.zero_grad()
        mha(q, k, v)[0].pow(2).sum().backward()
        opt.step()
    ours = TorchMultiheadAttention.from_torch(mha)
    ours_opt = torch.optim.SGD(ours.parameters(), lr=0.005, momentum=0.9)
    ours_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch shares same-dtype state tensors
    for module, o in ((mha, opt), (ours, ours_opt)):
        o.zero_grad()
        module(q, k, v)[0].pow(2).sum().backward()
        o.step()
    for (n, p), (_, want) in zip(ours.named_parameters(), mha.named_parameters()):
        _close(p, want, n)


# ------------------------------------------------------------ dropout, TorchScript
@pytest.mark.parametrize("need_weights", [True, False])
def test_dropout_one_is_accepted_and_matches_torch(need_weights):
    """p = 1 in training zeroes every attention weight: the output is
    out_proj.bias, the input gradients are zero, no random numbers drawn.
    (The returned weights are those before dropout, as for any p.)"""
    mha = _torch_mha(dropout=1.0)
    ours = TorchMultiheadAttention.from_torch(mha)
    assert ours.dropout == 1.0 and ours.training
    q, k, v = _inputs(mha)
    state = torch.random.get_rng_state()
    results = []
    for module in (mha, ours):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = module(*leaves, need_weights=need_weights)
        out.pow(2).sum().backward()
        results.append((out, [t.grad for t in leaves]))
    assert torch.equal(state, torch.random.get_rng_state())
    (want, want_grads), (got, got_grads) = results
    _close(got, want)
    _close(got, ours.out_proj.bias.expand_as(got))
    for a, b in zip(got_grads, want_grads):
        _close(a, b)
    mha.eval()
    ours.eval()
    _close(ours(q, k, v)[0], mha(q, k, v)[0])


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), True, "0.1"])
def test_dropout_outside_zero_one_is_refused(bad):
    with pytest.raises(ValueError, match=r"dropout must be a float in \[0, 1\], got dropout="):
        TorchMultiheadAttention(E, H, dropout=bad)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torchscript_is_refused_with_a_clear_message():
    ours = TorchMultiheadAttention(E, H)
    with pytest.raises(TypeError, match="torch.jit.script is not supported by multihead's TorchMultiheadAttention"):
        torch.jit.script(ours)
    layer = nn.TransformerEncoderLayer(E, H, 16)
    layer.self_attn = TorchMultiheadAttention.from_torch(layer.self_attn)
    with pytest.raises(TypeError, match="torch.jit.script is not supported"):
        torch.jit.script(layer)
