"""What to_gqa and to_mla share (tools.calibration): the refusals name the converter, and a calibration
pass that fails leaves the model as it was (train mode, no hooks)."""

from __future__ import annotations

import pytest
import torch

from multihead.models.gpt import GPT, GPTConfig
from multihead.tools.convert_heads import to_gqa
from multihead.tools.convert_mla import to_mla

CONVERTERS = [
    ("to_gqa", lambda model, calibration=None: to_gqa(model, 2, method="aligned", calibration=calibration)),
    ("to_mla", lambda model, calibration=None: to_mla(model, 8, method="activation", calibration=calibration)),
]


def _gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_preset("tiny", num_layers=2, context_length=16, **overrides))


@pytest.mark.parametrize("caller, convert", CONVERTERS, ids=[c for c, _ in CONVERTERS])
def test_a_layer_of_another_kind_and_another_model_class_are_refused_naming_the_converter(caller, convert):
    with pytest.raises(ValueError) as err:
        convert(_gpt(attention="gated"), [torch.zeros(1, 4, dtype=torch.long)])
    assert str(err.value).startswith("layer 0 is attention kind 'gated' (")
    assert str(err.value).endswith(f"; {caller} converts only ['gqa', 'mha', 'mqa'] layers")
    with pytest.raises(TypeError, match=f"^{caller} takes a GPT, BertEncoder or SentenceEncoder, got Linear$"):
        convert(torch.nn.Linear(2, 2), [torch.zeros(1, 4, dtype=torch.long)])


@pytest.mark.parametrize("caller, convert", CONVERTERS, ids=[c for c, _ in CONVERTERS])
def test_a_bad_calibration_batch_leaves_the_model_in_train_mode_without_hooks(caller, convert):
    model = _gpt().train()
    good = torch.randint(0, model.config.vocab_size, (2, 8))
    with pytest.raises(TypeError, match=r"calibration batch 1 must be a \[B, T\] tensor of token ids; got \(8,\)"):
        convert(model, [good, good[0]])
    assert model.training and all(m.training for m in model.modules())
    assert all(not block.attn._forward_pre_hooks for block in model.blocks)
    new = convert(model, [good])  # the same model converts afterwards, in its train mode
    assert new.training and isinstance(new, GPT)


def test_the_kinds_converted_are_those_that_declare_regrouped_key_values():
    from multihead.modules.kinds.gated import GatedHeadAttention
    from multihead.modules.kinds.mha import MultiHeadAttention
    from multihead.tools.calibration import convertible_kinds

    class OwnKeys(MultiHeadAttention):  # a subclass may form its keys otherwise: not converted unless it says so
        pass

    assert MultiHeadAttention.regroups_key_values and not GatedHeadAttention.regroups_key_values
    assert not OwnKeys.regroups_key_values
    assert sorted(convertible_kinds()) == ["gqa", "mha", "mqa"]
    layer = OwnKeys(32, 4)
    model = _gpt()
    model.blocks[1].attn = layer
    with pytest.raises(ValueError, match=r"^layer 1 is attention kind 'mha' \(OwnKeys\); to_gqa converts only "):
        to_gqa(model, 2, method="mean")


def test_a_kind_that_declares_regrouped_key_values_keeps_its_name_and_class_through_to_gqa():
    """catches: to_gqa naming the new layers by the mha family's rule, which turned an outside kind
    built on MultiHeadAttention into plain "gqa"."""
    from multihead.modules import registry
    from multihead.modules.kinds.mha import MultiHeadAttention

    class Regrouped(MultiHeadAttention):
        kind = "regrouped-for-test"
        regroups_key_values = True

    registry.register_attention(Regrouped.kind)(Regrouped)
    try:
        model = _gpt(attention=Regrouped.kind)
        idx = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
        for G in (4, 2, 1):  # the tiny preset has 4 heads
            new = to_gqa(model, G, method="mean")
            assert new.config.attention == Regrouped.kind and new.config.num_kv_heads == (None if G == 4 else G)
            assert all(type(b.attn) is Regrouped and b.attn.num_kv_heads == G for b in new.blocks)
        torch.testing.assert_close(to_gqa(model, 4, method="mean")(idx), model(idx))  # all heads kept: the same function
    finally:
        registry._KINDS.pop(Regrouped.kind, None)
