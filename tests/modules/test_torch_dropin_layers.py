"""TorchMultiheadAttention inside torch's own transformer layers.

Each test builds a torch model, deep-copies it, replaces every
``nn.MultiheadAttention`` in the copy by ``TorchMultiheadAttention.from_torch(...)``
and compares outputs and every gradient (inputs and parameters, matched by
name: the drop-in keeps torch's parameter names). float64: max abs error
<= 1e-10 scaled by the output magnitude; float32: assert_close defaults.

The inputs of ``test_torch_module_samples`` are torch's own ModuleInfo
samples for the four layer classes (``module_inputs_torch_nn_Transformer*``
in torch/testing/_internal/common_modules.py), rebuilt here because that
module needs torch's test-only dependencies.
"""

from __future__ import annotations

import copy
import itertools
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from support.paths import assert_matches_peer
from torch import nn

from multihead import TorchMultiheadAttention

F64 = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torch's nested-tensor and mask-type notes


def _randomize(model: nn.Module, seed: int) -> nn.Module:
    """Non-trivial values everywhere (torch zero-initialises the attention biases)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return model


def _drop_in(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose attention modules are all drop-ins."""
    model = copy.deepcopy(model)
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.MultiheadAttention):
                setattr(module, name, TorchMultiheadAttention.from_torch(child))
                swapped += 1
    assert swapped and not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    return model


def _run(model: nn.Module, args, kwargs, grad: bool):
    """Output, and {name: gradient} of every floating input and parameter."""
    leaves = [a.detach().clone().requires_grad_(grad) if torch.is_tensor(a) and a.is_floating_point() else a
              for a in args]
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad):
        out = model(*leaves, **kwargs)
    if not grad:
        return out, {}
    weights = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).view_as(out)  # every element matters
    (out * weights).sum().backward()
    grads = {f"input{i}": t.grad for i, t in enumerate(leaves) if torch.is_tensor(t) and t.requires_grad}
    grads.update({n: p.grad for n, p in model.named_parameters()})
    return out, grads


def _compare(torch_model, args, kwargs, mode: str, what: str) -> None:
    """mode: "train", "eval" (gradients on: torch's slow paths) or "no_grad"
    (eval without gradients: the layers' fast paths where they apply)."""
    ours = _drop_in(torch_model)
    training = mode == "train"
    torch_model.train(training)
    ours.train(training)
    grad = mode != "no_grad"
    want_out, want_grads = _run(torch_model, args, kwargs, grad)
    got_out, got_grads = _run(ours, args, kwargs, grad)
    assert_matches_peer(got_out, want_out, f"{what} output")
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        assert_matches_peer(got_grads[name], want_grads[name], f"{what} grad {name}")


# ------------------------------------------------------------ torch's samples
def _bool_masks():
    kpm = (None, torch.tensor([False, False, True]))
    attn = (None, torch.tensor([False, False, True]).expand(3, 3))
    return kpm, attn


def _encoder_layer_samples(g):
    """torch's TransformerEncoderLayer samples: (desc, constructor, args, kwargs)."""
    x = lambda *shape: torch.randn(*shape, generator=g, dtype=F64)  # noqa: E731
    out = [
        ("relu", lambda: nn.TransformerEncoderLayer(4, 2, 16, 0.0, dtype=F64), (x(2, 3, 4),), {}),
        ("gelu", lambda: nn.TransformerEncoderLayer(4, 2, 8, 0.0, F.gelu, dtype=F64), (x(2, 3, 4),), {}),
        ("no_bias", lambda: nn.TransformerEncoderLayer(4, 2, 8, 0.0, bias=False, dtype=F64), (x(2, 3, 4),), {}),
    ]
    kpms, attns = _bool_masks()
    for attn, kpm, norm_first, batch_first, bias in itertools.product(attns, kpms, (True, False), (True, False),
                                                                      (True, False)):
        cfg = {"d_model": 4, "nhead": 2, "dim_feedforward": 8, "dropout": 0.0, "batch_first": batch_first,
               "norm_first": norm_first, "bias": bias, "dtype": F64}
        out.append((f"no_batch_dim {cfg}", lambda cfg=cfg: nn.TransformerEncoderLayer(**cfg), (x(3, 4),),
                    {"src_mask": attn, "src_key_padding_mask": kpm}))
    for norm_first, bias in itertools.product((True, False), (True, False)):
        cfg = {"dropout": 0.0, "batch_first": True, "norm_first": norm_first, "bias": bias, "dtype": F64}
        out.append((f"fastpath {cfg}", lambda cfg=cfg: nn.TransformerEncoderLayer(4, 2, 8, **cfg), (x(2, 3, 4),), {}))
    return out


def _decoder_layer_samples(g):
    x = lambda *shape: torch.randn(*shape, generator=g, dtype=F64)  # noqa: E731
    out = [
        ("relu", lambda: nn.TransformerDecoderLayer(4, 2, 16, 0.0, dtype=F64), (x(2, 3, 4), x(2, 3, 4)), {}),
        ("gelu", lambda: nn.TransformerDecoderLayer(4, 2, 8, 0.0, F.gelu, dtype=F64), (x(2, 3, 4), x(2, 3, 4)), {}),
        ("no_bias", lambda: nn.TransformerDecoderLayer(4, 2, 8, 0.0, bias=False, dtype=F64), (x(2, 3, 4), x(2, 3, 4)),
         {}),
    ]
    kpms, attns = _bool_masks()
    for attn, kpm, norm_first, bias, batch_first in itertools.product(attns, kpms, (True, False), (True, False),
                                                                      (True, False)):
        cfg = {"d_model": 4, "nhead": 2, "dim_feedforward": 8, "dropout": 0.0, "batch_first": batch_first,
               "norm_first": norm_first, "bias": bias, "dtype": F64}
        make = lambda cfg=cfg: nn.TransformerDecoderLayer(**cfg)  # noqa: E731
        masks = {"tgt_mask": attn, "memory_mask": attn, "tgt_key_padding_mask": kpm, "memory_key_padding_mask": kpm}
        out.append((f"no_batch_dim {cfg}", make, (x(3, 4), x(3, 4)), masks))
        tgt, mem = x(2, 3, 4), x(2, 3, 4)
        if not batch_first:
            tgt, mem = tgt.transpose(0, 1), mem.transpose(0, 1)  # (B, L, C) -> (L, B, C), not contiguous
        batched = dict(masks)
        if kpm is not None:
            batched["tgt_key_padding_mask"] = batched["memory_key_padding_mask"] = kpm.expand(2, 3)
        out.append((f"batched {cfg}", make, (tgt, mem), batched))
    return out


def _transformer_samples(g):
    x = lambda *shape: torch.randn(*shape, generator=g, dtype=F64)  # noqa: E731
    out = []
    kpms, attns = _bool_masks()
    for attn, kpm, norm_first, bias, batch_first in itertools.product(attns, kpms, (True, False), (True, False),
                                                                      (True, False)):
        cfg = {"d_model": 4, "nhead": 2, "dim_feedforward": 8, "num_encoder_layers": 1, "num_decoder_layers": 1,
               "dropout": 0.0, "batch_first": batch_first, "norm_first": norm_first, "bias": bias, "dtype": F64}
        make = lambda cfg=cfg: nn.Transformer(**cfg)  # noqa: E731
        masks = {"src_mask": attn, "tgt_mask": attn, "src_key_padding_mask": kpm, "tgt_key_padding_mask": kpm}
        out.append((f"no_batch_dim {cfg}", make, (x(3, 4), x(3, 4)), masks))
        src, tgt = x(2, 3, 4), x(2, 3, 4)
        if not batch_first:
            src, tgt = src.transpose(0, 1), tgt.transpose(0, 1)  # (B, L, C) -> (L, B, C), not contiguous
        batched = dict(masks)
        if kpm is not None:
            batched["src_key_padding_mask"] = batched["tgt_key_padding_mask"] = kpm.expand(2, 3)
        out.append((f"batched {cfg}", make, (src, tgt), batched))
    return out


def _encoder_samples(g):
    """torch builds its TransformerEncoder samples from the layer samples
    (two layers; ``src_mask`` renamed ``mask``)."""
    out = []
    for desc, make_layer, args, kwargs in _encoder_layer_samples(g):
        kwargs = {("mask" if k == "src_mask" else k): v for k, v in kwargs.items()}
        out.append((desc, lambda make_layer=make_layer: nn.TransformerEncoder(make_layer(), 2), args, kwargs))
    return out


SAMPLES = {"TransformerEncoderLayer": _encoder_layer_samples, "TransformerDecoderLayer": _decoder_layer_samples,
           "Transformer": _transformer_samples, "TransformerEncoder": _encoder_samples}


@pytest.mark.parametrize("mode", ["train", "no_grad"])  # eval with gradients is train here (dropout 0)
@pytest.mark.parametrize("kind", list(SAMPLES))
def test_torch_module_samples(kind, mode):
    g = torch.Generator().manual_seed(len(kind))
    samples = SAMPLES[kind](g)
    assert len(samples) >= 19
    for i, (desc, make, args, kwargs) in enumerate(samples):
        _compare(_randomize(make(), i), args, kwargs, mode, f"{kind} {desc}")


# ------------------------------------------------------------ fast paths
def _encoder_layer(batch_first=True, **kwargs):
    layer = nn.TransformerEncoderLayer(8, 2, 16, 0.0, batch_first=batch_first, dtype=F64, **kwargs)
    return _randomize(layer, 1).eval()


def test_encoder_layer_fast_path_runs_torch_kernel_on_the_drop_in_weights():
    """Eval without gradients: torch's layer calls its fused kernel with the
    drop-in's own parameter objects, and merges masks through the drop-in."""
    layer = _encoder_layer()
    ours = _drop_in(layer)
    attn = ours.self_attn
    assert isinstance(attn, TorchMultiheadAttention)
    x = torch.randn(3, 5, 8, dtype=F64)
    kpm = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False, True, False, True, False]])
    causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=F64)
    kernel = torch._transformer_encoder_layer_fwd
    for kwargs in ({}, {"src_key_padding_mask": kpm}, {"src_mask": causal}, {"src_mask": causal, "is_causal": True}):
        with torch.no_grad():
            want = layer(x, **kwargs)
            with mock.patch("torch._transformer_encoder_layer_fwd", wraps=kernel) as fused:
                got = ours(x, **kwargs)
        assert fused.call_count == 1, kwargs
        call = fused.call_args.args
        assert call[3] is attn.in_proj_weight is attn.attention.qkv_proj.weight
        assert call[4] is attn.in_proj_bias and call[5] is attn.out_proj.weight and call[6] is attn.out_proj.bias
        assert_matches_peer(got, want, str(kwargs))


@pytest.mark.parametrize("batch_first", [True, False])
def test_encoder_with_nested_tensor_conversion_and_padding(batch_first):
    """TransformerEncoder(enable_nested_tensor=True) in eval without gradients
    turns a left-aligned padded batch into a nested tensor between its layers
    (batch_first=True): same output as torch's module; with gradients on it
    stays padded and the drop-in's forward runs."""
    encoder = nn.TransformerEncoder(_encoder_layer(batch_first), 2, enable_nested_tensor=True).eval()
    ours = _drop_in(encoder)
    x = torch.randn(3, 6, 8, dtype=F64)
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    kpm[2, 2:] = True  # padding at the end of each row: left-aligned
    if not batch_first:
        x = x.transpose(0, 1)  # (B, L, C) -> (L, B, C)
    nested = torch._nested_tensor_from_mask
    with torch.no_grad():
        with mock.patch("torch._nested_tensor_from_mask", wraps=nested) as converted:
            want = encoder(x, src_key_padding_mask=kpm)
            got = ours(x, src_key_padding_mask=kpm)
    assert converted.call_count == (2 if batch_first else 0)
    assert_matches_peer(got, want)
    for mode in ("eval", "train"):
        _compare(encoder, (x,), {"src_key_padding_mask": kpm}, mode, f"encoder {mode}")


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_causal_and_padding_masks_train_and_eval(batch_first):
    """nn.Transformer with a causal target mask (tgt_is_causal hint), padded
    sources and targets, in float64, with gradients, train and eval."""
    model = _randomize(nn.Transformer(8, 2, 2, 2, 16, 0.0, batch_first=batch_first, dtype=F64), 2)
    B, S, T = 3, 7, 5
    src, tgt = torch.randn(B, S, 8, dtype=F64), torch.randn(B, T, 8, dtype=F64)
    if not batch_first:
        src, tgt = src.transpose(0, 1), tgt.transpose(0, 1)  # (B, L, C) -> (L, B, C)
    src_kpm = torch.zeros(B, S, dtype=torch.bool)
    src_kpm[0, 5:] = True
    tgt_kpm = torch.zeros(B, T, dtype=torch.bool)
    tgt_kpm[2, 3:] = True
    kwargs = {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(T, dtype=F64), "tgt_is_causal": True,
              "src_key_padding_mask": src_kpm, "tgt_key_padding_mask": tgt_kpm,
              "memory_key_padding_mask": src_kpm}
    for mode in ("train", "eval", "no_grad"):
        _compare(model, (src, tgt), kwargs, mode, mode)


def test_float32_transformer_matches_torch_at_default_tolerance():
    torch.manual_seed(3)
    model = nn.Transformer(16, 4, 1, 1, 32, 0.0, batch_first=True)
    src, tgt = torch.randn(2, 9, 16), torch.randn(2, 6, 16)
    kwargs = {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(6), "tgt_is_causal": True}
    for mode in ("train", "no_grad"):
        _compare(model, (src, tgt), kwargs, mode, mode)


def test_dropout_runs_in_training_and_is_off_in_eval():
    torch.manual_seed(4)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.25, batch_first=True), 2)
    ours = _drop_in(model)
    assert ours.layers[0].self_attn.dropout == 0.25
    x = torch.randn(2, 5, 8, requires_grad=True)
    ours.train()
    first, second = ours(x), ours(x)
    assert not torch.equal(first, second)  # different dropout draws
    first.sum().backward()
    assert x.grad.isfinite().all() and all(p.grad.isfinite().all() for p in ours.parameters())
    model.eval()
    ours.eval()
    assert_matches_peer(ours(x), model(x))
