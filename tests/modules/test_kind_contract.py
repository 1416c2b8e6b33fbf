"""The contract every attention kind keeps: ``kind`` is a plain attribute naming
the kind, and ``aux_loss()`` is a method returning a finite 0-d tensor."""

from __future__ import annotations

import inspect

import pytest
import torch

from multihead import build_attention, list_attention_kinds

OPTIONS = {"gqa": {"num_kv_heads": 2}, "overlapping": {"overlap": 1}}
LOSS_KINDS = {"moh", "gated"}  # kinds whose training forward asks for a loss term


def _build(kind: str, dtype=torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_attention(kind, embed_dim=16, num_heads=4, dtype=dtype, **OPTIONS.get(kind, {}))


def _class_kind(cls: type) -> object:
    """``kind`` as the class defines it (inspect.getattr_static: no descriptor runs)."""
    return inspect.getattr_static(cls, "kind")


@pytest.mark.parametrize("kind", list_attention_kinds())
def test_kind_is_a_plain_attribute_equal_to_the_built_name_and_the_events(kind):
    m = _build(kind)
    static = _class_kind(type(m))
    assert isinstance(static, str), f"{type(m).__name__}.kind is {type(static).__name__}, not a class attribute"
    if "kind" in vars(m):  # a per-instance name set in __init__ over the class's family name
        assert isinstance(vars(m)["kind"], str)
    else:
        assert static == kind
    assert m.kind == kind
    events = []
    m.register_attention_observer(lambda mod, event: events.append(event))
    m(torch.randn(1, 3, 16, dtype=torch.float64), is_causal=True)
    assert [e.kind for e in events] == [kind]


@pytest.mark.parametrize(
    "name,options,want",
    [("mha", {}, "mha"), ("gqa", {"num_kv_heads": 2}, "gqa"), ("mqa", {}, "mqa"),
     ("gqa", {"num_kv_heads": 1}, "mqa"), ("gqa", {"num_kv_heads": 4}, "mha")],
)
def test_mha_family_names_each_instance_by_its_key_value_heads(name, options, want):
    m = build_attention(name, embed_dim=16, num_heads=4, **options)
    assert type(m).kind == "mha" and m.kind == want and vars(m)["kind"] == want


@pytest.mark.parametrize("kind", list_attention_kinds())
def test_aux_loss_is_a_finite_0d_method_and_zero_in_eval(kind):
    m = _build(kind)
    assert inspect.ismethod(m.aux_loss)
    before = m.aux_loss()  # before any forward: a zero
    assert before.shape == () and before.dtype == torch.float64 and float(before) == 0
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    m.train()(x, is_causal=True)
    train_loss = m.aux_loss()
    assert train_loss.shape == () and torch.isfinite(train_loss)
    if kind in LOSS_KINDS:
        assert float(train_loss.detach()) > 0 and train_loss.requires_grad
    else:
        assert float(train_loss) == 0
    m.eval()(x, is_causal=True)
    eval_loss = m.aux_loss()
    assert eval_loss.shape == () and float(eval_loss) == 0 and not eval_loss.requires_grad
    assert eval_loss.dtype == torch.float64 and eval_loss.device == x.device


@pytest.mark.parametrize("kind", list_attention_kinds())
def test_aux_loss_zero_takes_the_module_dtype(kind):
    m = _build(kind, dtype=torch.float32).eval()
    m(torch.randn(1, 3, 16))
    assert m.aux_loss().dtype == torch.float32 and m.aux_loss().shape == ()
