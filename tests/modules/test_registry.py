"""Attention kinds by name."""

from __future__ import annotations

import sys

import pytest

from multihead import MultiHeadAttention, build_attention, list_attention_kinds


def test_known_kinds():
    assert {"mha", "gqa", "mqa"} <= set(list_attention_kinds())


def test_build_each_kind():
    mha = build_attention("mha", embed_dim=16, num_heads=4)
    gqa = build_attention("gqa", embed_dim=16, num_heads=4, num_kv_heads=2)
    mqa = build_attention("mqa", embed_dim=16, num_heads=4, qkv_bias=False)
    assert isinstance(mha, MultiHeadAttention) and mha.num_kv_heads == 4
    assert gqa.num_kv_heads == 2 and mqa.num_kv_heads == 1
    assert mqa.qkv_proj.bias is None


def test_unknown_kind_lists_known_ones_and_says_how_to_register_ones_own():
    with pytest.raises(ValueError, match=r"unknown attention kind 'flash'; known: \[.*'gqa'.*\]") as err:
        build_attention("flash", embed_dim=8, num_heads=2)
    assert "--import MODULE" in str(err.value) and "'multihead.attention_kinds'" in str(err.value)


@pytest.mark.parametrize(
    "name,kv,match",
    [("mha", 2, "use 'gqa'"), ("gqa", None, "needs num_kv_heads"), ("mqa", 2, "one key/value head")],
)
def test_inconsistent_head_counts(name, kv, match):
    with pytest.raises(ValueError, match=match):
        build_attention(name, embed_dim=16, num_heads=4, num_kv_heads=kv)


def test_every_kind_is_registered_by_its_decorator_on_import():
    assert set(list_attention_kinds()) >= {
        "mha", "gqa", "mqa", "moh", "dcmha", "talking_heads", "overlapping", "collaborative", "gated",
    }  # fmt: skip


def test_every_kind_class_in_the_kinds_package_is_registered():
    """Importing multihead imports every file of modules/kinds/, so a new kind needs no import line."""
    import pkgutil

    from multihead.modules import kinds
    from multihead.modules.base import AttentionLayer
    from multihead.modules.registry import attention_class

    names = [m.name for m in pkgutil.iter_modules(kinds.__path__)]
    assert all(f"multihead.modules.kinds.{n}" in sys.modules for n in names)
    classes = {
        obj for n in names for obj in vars(sys.modules[f"multihead.modules.kinds.{n}"]).values()
        if isinstance(obj, type) and issubclass(obj, AttentionLayer) and obj.__module__.endswith(n)
    }  # fmt: skip
    assert classes and classes <= {attention_class(k) for k in list_attention_kinds()}


def test_a_new_kind_registers_with_the_decorator_and_a_second_claim_is_refused():
    from multihead.modules import registry

    @registry.register_attention("scaled_mha_for_test", MultiHeadAttention)
    def _build(*, embed_dim, num_heads, **options):
        return MultiHeadAttention(embed_dim, num_heads, **options)

    try:
        assert "scaled_mha_for_test" in list_attention_kinds()
        assert isinstance(build_attention("scaled_mha_for_test", embed_dim=8, num_heads=2), MultiHeadAttention)
        assert registry.register_attention("scaled_mha_for_test", MultiHeadAttention)(_build) is _build  # the same builder again: fine
        with pytest.raises(ValueError, match="'scaled_mha_for_test' is already registered by"):
            registry.register_attention("scaled_mha_for_test", MultiHeadAttention)(lambda **kw: None)
        with pytest.raises(TypeError, match="non-empty str"):
            registry.register_attention("")
        assert registry.attention_class("scaled_mha_for_test") is MultiHeadAttention
    finally:
        registry._KINDS.pop("scaled_mha_for_test", None)


def test_a_builder_function_without_its_class_is_refused():
    from multihead.modules import registry

    with pytest.raises(TypeError, match=r"needs the class it builds: @register_attention\('nameless', TheKindClass\)"):
        registry.register_attention("nameless")(lambda **kw: None)
    assert "nameless" not in list_attention_kinds()


def test_a_class_registers_itself_and_is_built_with_keywords():
    from multihead.modules import registry

    @registry.register_attention("class_registered_for_test")
    class Scaled(MultiHeadAttention):
        pass

    try:
        m = build_attention("class_registered_for_test", embed_dim=8, num_heads=2, qkv_bias=False)
        assert type(m) is Scaled and m.qkv_proj.bias is None
        assert registry.attention_class("class_registered_for_test") is Scaled
    finally:
        registry._KINDS.pop("class_registered_for_test", None)
