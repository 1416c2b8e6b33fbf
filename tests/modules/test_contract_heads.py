"""The capabilities every attention kind declares, checked for every registered kind.

Each kind answers, on its class: ``independent_heads`` (a bool),
``head_independence`` (why), ``comparison_skip`` (None or why) and
``comparison_options(kind, num_heads)``. A kind that claims independent
heads is checked here: ``select_heads`` builds a layer whose output, and
whose gradients with respect to the input and to ``out_proj``, equal the
original layer's with the other heads masked (``tools.heads.mask_heads``),
for GQA layers too; a kind that does not is refused with its reason.

Tolerances (docs/testing.md): the selected layer and the masked layer run
different shapes, so they are compared with ``assert_paths_agree``.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from support.kinds import F64, C, H, build
from support.paths import assert_paths_agree

from multihead import AttentionLayer, list_attention_kinds
from multihead.modules.head_selection import head_rows
from multihead.modules.registry import attention_class, kind_options
from multihead.tools.heads import mask_heads

KINDS = list_attention_kinds()
INDEPENDENT = [k for k in KINDS if attention_class(k).independent_heads]
COUPLED = [k for k in KINDS if not attention_class(k).independent_heads]
SELECTIONS = [[1], [0, 2], [2, 3], [0, 1, 2, 3]]  # valid for H = 4 with G = 4, 2 or 1


def _x(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, T, C, dtype=F64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_answers_the_capability_questions(kind):
    cls = attention_class(kind)
    assert issubclass(cls, AttentionLayer)
    assert isinstance(cls.independent_heads, bool)
    assert isinstance(cls.head_independence, str) and len(cls.head_independence) > 20, (
        f"{cls.__name__} must say in head_independence why its heads are or are not independent"
    )
    assert cls.comparison_skip is None or (isinstance(cls.comparison_skip, str) and cls.comparison_skip)
    assert isinstance(cls.weight_only_layers, bool)
    if cls.layer_index_option is not None:  # a constructor option that takes the layer's index
        assert cls.layer_index_option in inspect.signature(cls.__init__).parameters
    accepted = kind_options(kind)  # None: the kind takes any keyword
    assert isinstance(cls.self_attention_options, tuple)
    known = None if accepted is None else {*accepted, *cls.refused_options}  # option names, taken or refused
    assert known is None or set(cls.self_attention_options) <= known, cls.self_attention_options
    options = cls.comparison_options(kind, 8)
    assert isinstance(options, dict)
    m = build(kind, **options) if options else build(kind)
    assert isinstance(m, cls)


@pytest.mark.parametrize("heads", SELECTIONS)
@pytest.mark.parametrize("kind", INDEPENDENT)
def test_selected_heads_equal_the_others_masked(kind, heads):
    m = build(kind, rope=True, qk_norm=True)
    x = _x(2, 5).requires_grad_(True)
    small = m.select_heads(heads)
    assert type(small) is type(m) and small.num_heads == len(heads)
    assert small.head_dim == m.head_dim and small.scale == m.scale
    xs = x.detach().clone().requires_grad_(True)
    masked = [h for h in range(H) if h not in heads]
    with mask_heads(m, {0: masked} if masked else {}):
        want = m(x, is_causal=True)
    got = small(xs, is_causal=True)
    assert_paths_agree(got, want)
    # gradients: through the input, and into out_proj's columns of the kept heads
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    assert_paths_agree(xs.grad, x.grad)
    cols = head_rows(heads, m.out_proj.weight.shape[1] // H, m.out_proj.weight.device)
    assert_paths_agree(small.out_proj.weight.grad, m.out_proj.weight.grad[:, cols])
    # cached decoding of the selected layer equals its full forward
    cache = small.make_kv_cache(2, 5)
    steps = [small(xs[:, :3].detach(), is_causal=True, kv_cache=cache)]
    steps += [small(xs[:, t : t + 1].detach(), is_causal=True, kv_cache=cache) for t in (3, 4)]
    assert_paths_agree(torch.cat(steps, dim=1), got.detach())


@pytest.mark.parametrize("kind", INDEPENDENT)
def test_selection_keeps_dtype_flags_and_mode_and_leaves_the_layer_alone(kind):
    m = build(kind).train()
    m.out_proj.weight.requires_grad_(False)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    small = m.select_heads([0, 2])
    assert small.training and not small.out_proj.weight.requires_grad
    assert all(p.dtype == F64 and p.device.type == "cpu" for p in small.parameters())
    assert not small.observed and not small._head_hooks
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())  # the original is unchanged


def test_a_gqa_selection_takes_whole_groups_and_refuses_uneven_ones():
    m = build("gqa")  # H = 4, G = 2: q0 q1 | q2 q3
    assert (m.select_heads([2, 3]).num_kv_heads, m.select_heads([0, 2]).num_kv_heads) == (1, 2)
    with pytest.raises(ValueError, match=r"different numbers of query heads \{0: 1, 1: 2\}"):
        m.select_heads([0, 2, 3])
    with pytest.raises(ValueError, match=r"kv_heads=\[0\] must be the key/value heads that heads=\[2, 3\] read: \[1\]"):
        m.select_heads([2, 3], kv_heads=[0])
    assert m.select_heads([2, 3], kv_heads=[1]).num_kv_heads == 1


@pytest.mark.parametrize(
    "heads,error,match",
    [
        ([], ValueError, "heads is empty; a layer keeps at least one head"),
        ([4], ValueError, r"heads must be ints in \[0, 4\); \[4\] are not"),
        ([1, 1], ValueError, r"lists head\(s\) \[1\] more than once"),
        ("01", TypeError, "must be a list of head indices"),
        ([True], ValueError, r"\[True\] are not"),
    ],
)
def test_bad_selections_are_refused_with_their_values(heads, error, match):
    with pytest.raises(error, match=match):
        build("mha").select_heads(heads)


@pytest.mark.parametrize("kind", COUPLED)
def test_kinds_whose_heads_mix_refuse_with_their_reason(kind):
    m = build(kind)
    with pytest.raises(ValueError, match="cannot keep a subset of its heads: ") as err:
        m.select_heads([0])
    assert type(m).head_independence in str(err.value)


@pytest.mark.parametrize("kind", KINDS)
def test_shared_options_are_taken_once_and_refused_ones_are_named(kind):
    """Every kind takes the shared options through AttentionLayer; those it declares
    in refused_options are a TypeError naming them."""
    cls = attention_class(kind)
    m = build(kind, qkv_bias=False, out_bias=False, dropout=0.25)
    assert (m.qkv_bias, m.out_bias, m.dropout) == (False, False, 0.25)
    assert m.out_proj.bias is None and m.init_options["dropout"] == 0.25
    for name in cls.refused_options:
        with pytest.raises(TypeError, match=rf"{cls.__name__} does not take {name} \(got \{{'{name}': 8\}}\)"):
            cls(C, H, **{name: 8})


def test_a_class_claiming_independent_heads_without_subset_heads_is_refused_when_defined():
    with pytest.raises(TypeError, match="Claims declares independent_heads = True but defines no subset_heads"):

        class Claims(AttentionLayer):
            independent_heads = True
