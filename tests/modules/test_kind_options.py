"""A kind's options come from its classes: listed by ``kind_options``, and a
misspelt one is refused with the list and the nearest name."""

from __future__ import annotations

import inspect

import pytest

from multihead import build_attention
from multihead.modules.base import AttentionLayer
from multihead.modules.registry import attention_class, check_kind_options, kind_options, list_attention_kinds


def shared_options() -> set[str]:
    """AttentionLayer's keyword options, read here from its signature."""
    params = inspect.signature(AttentionLayer.__init__).parameters.values()
    return {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


@pytest.mark.parametrize("kind", list_attention_kinds())
def test_every_kind_lists_the_shared_options_it_takes_and_its_own(kind):
    cls = attention_class(kind)
    options = kind_options(kind)
    assert options == sorted(options)
    assert set(options) >= shared_options() - set(cls.refused_options)
    assert not set(options) & set(cls.refused_options)
    own = {p.name for p in inspect.signature(cls.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY}
    assert own - set(cls.refused_options) <= set(options)


def test_a_kind_adds_its_own_options_to_the_shared_ones():
    assert {"shared_heads", "routed_heads", "router"} <= set(kind_options("moh"))
    assert "shared_heads" not in kind_options("mha")
    # talking heads is DCMHA with the dynamic and static switches set: those are not its options
    assert "chunk_size" in kind_options("talking_heads") and "rank" not in kind_options("talking_heads")
    assert "rank" in kind_options("dcmha")


def test_a_misspelt_option_names_the_nearest_and_lists_the_kind_options():
    with pytest.raises(TypeError) as err:
        build_attention("gqa", embed_dim=16, num_heads=4, num_kv_head=2)
    message = str(err.value)
    assert "attention kind 'gqa' has no option 'num_kv_head' (did you mean 'num_kv_heads'?)" in message
    assert message.endswith("its options: " + ", ".join(kind_options("gqa")))
    with pytest.raises(TypeError, match=r"'mha' has no option 'foo'; its options: alibi, device, dropout"):
        build_attention("mha", embed_dim=16, num_heads=4, foo=1)
    with pytest.raises(TypeError, match=r"no options 'shared_head' \(did you mean 'shared_heads'\?\), 'zzz'"):
        check_kind_options("moh", ["shared_head", "zzz", "router"])


def test_a_refused_option_is_left_to_the_kind_which_says_why():
    with pytest.raises(ValueError, match="'collaborative' shares one key projection"):
        build_attention("collaborative", embed_dim=16, num_heads=4, num_kv_heads=2)
    with pytest.raises(TypeError, match="TalkingHeadsAttention does not take rank"):
        build_attention("talking_heads", embed_dim=16, num_heads=4, rank=1)


def test_a_new_kind_on_the_layer_is_checked_and_one_whose_options_leave_its_classes_is_not():
    from torch import nn

    from multihead.modules import registry
    from multihead.modules.kinds.mha import MultiHeadAttention

    class Widened(MultiHeadAttention):
        def __init__(self, embed_dim, num_heads, *, width=1, **options):
            super().__init__(embed_dim, num_heads, **options)

    class Open(nn.Module):  # takes anything and keeps it
        def __init__(self, embed_dim, num_heads, **options):
            super().__init__()
            self.options = options

    try:
        registry._KINDS["test-widened"] = (Widened, Widened)
        assert set(kind_options("test-widened")) == set(kind_options("mha")) | {"width"}
        with pytest.raises(TypeError, match="'test-widened' has no option 'widht' \\(did you mean 'width'\\?\\)"):
            build_attention("test-widened", embed_dim=4, num_heads=1, widht=2)
        registry._KINDS["test-open"] = (Open, Open)
        assert kind_options("test-open") is None
        assert build_attention("test-open", embed_dim=4, num_heads=1, anything=2).options == {"anything": 2}
    finally:
        registry._KINDS.pop("test-widened", None)
        registry._KINDS.pop("test-open", None)
