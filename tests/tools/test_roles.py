"""Head roles on hand-built attention patterns whose role is known."""

from __future__ import annotations

import math

import pytest
import torch

from multihead import MultiHeadAttention
from multihead.functional.masks import causal_mask
from multihead.tools.capture import AttentionRecord, LayerAttention, capture
from multihead.tools.head_links import strongest_links
from multihead.tools.roles import (
    ROLE_MARGIN,
    ROLE_THRESHOLDS,
    HeadRoles,
    classify_heads,
    format_roles,
    role_table,
)
from multihead.tools.token_kinds import is_punctuation, is_special, rare_tokens

TOKENS = ["[CLS]", "the", "cat", "##s", ",", "[SEP]"]
IDS = [101, 1996, 4937, 2015, 1010, 102]  # BERT-style ids: "cat" has the largest id among the words
T = len(TOKENS)


def make_record(*heads: torch.Tensor, tokens=TOKENS, key_tokens=None) -> AttentionRecord:
    """One recorded call whose heads are the given [T, S] matrices."""
    weights = torch.stack([h.float() for h in heads]).unsqueeze(0)  # (H, T, S) -> (1, H, T, S)
    layer = LayerAttention(layer=0, name="attn", kind="mha", weights=weights)
    return AttentionRecord([layer], query_tokens=tokens, key_tokens=key_tokens)


def one_hot_columns(columns: list[int], S: int = T) -> torch.Tensor:
    """Row i puts all its weight on key columns[i]."""
    return torch.nn.functional.one_hot(torch.tensor(columns), S).double()


PREVIOUS = one_hot_columns([0, 0, 1, 2, 3, 4])
NEXT = one_hot_columns([1, 2, 3, 4, 5, 5])
SELF = torch.eye(T, dtype=torch.float64)
CLS = one_hot_columns([0] * T)
SEP = one_hot_columns([5] * T)
PUNCT = one_hot_columns([4] * T)
RARE = one_hot_columns([2] * T)
UNIFORM = torch.full((T, T), 1.0 / T, dtype=torch.float64)
ALL = {"previous": PREVIOUS, "next": NEXT, "self": SELF, "cls": CLS, "sep": SEP, "punct": PUNCT, "rare": RARE}


@pytest.fixture(scope="module")
def known() -> dict[str, HeadRoles]:
    """Every known pattern as one head of one call, plus a uniform head (which
    also makes every key visible to every query)."""
    names = [*ALL, "uniform"]
    roles = classify_heads(make_record(*ALL.values(), UNIFORM), token_ids=IDS)
    assert [r.head for r in roles] == list(range(len(names)))
    return dict(zip(names, roles))


@pytest.mark.parametrize("name", [*ALL, "uniform"])
def test_each_known_pattern_gets_exactly_its_label(known, name):
    assert known[name].labels == (["broad"] if name == "uniform" else [name])
    assert known[name].layer == 0 and known[name].name == "attn"


def test_positional_scores_are_argmax_fractions_and_neighbour_mass(known):
    prev = known["previous"].scores
    assert prev["previous"] == 1.0 and prev["previous_mass"] == 1.0
    assert prev["next"] == 0.0 and prev["next_mass"] == 0.0
    assert prev["self"] == pytest.approx(1 / 6)  # row 0 attends to itself
    assert known["next"].scores["next"] == 1.0 and known["next"].scores["previous"] == 0.0
    assert known["self"].scores["self"] == 1.0 and known["self"].scores["self_mass"] == 1.0
    assert known["cls"].scores["previous"] == pytest.approx(1 / 5)  # only row 1 has key 0 as its left neighbour


def test_a_uniform_row_is_a_tie_and_wins_no_argmax(known):
    scores = known["uniform"].scores
    assert scores["previous"] == 0.0 and scores["next"] == 0.0 and scores["self"] == 0.0
    assert scores["previous_mass"] == pytest.approx(1 / 6)


def test_token_masses(known):
    assert known["cls"].scores["cls"] == 1.0 and known["cls"].scores["sep"] == 0.0
    assert known["sep"].scores["sep"] == 1.0
    assert known["punct"].scores["punct"] == 1.0
    assert known["rare"].scores["rare"] == 1.0
    uniform = known["uniform"].scores
    for name in ("cls", "sep", "punct", "rare"):
        assert uniform[name] == pytest.approx(1 / 6)


def test_uniform_head_is_broad_with_entropy_log_t(known):
    assert known["uniform"].entropy == pytest.approx(math.log(T))
    assert known["uniform"].scores["broad"] == pytest.approx(1.0)
    assert known["previous"].entropy == 0.0 and known["previous"].scores["broad"] == 0.0


def test_mean_distance_on_known_matrices(known):
    assert known["self"].mean_distance == 0.0
    assert known["previous"].mean_distance == pytest.approx(5 / 6)
    assert known["cls"].mean_distance == pytest.approx(sum(range(T)) / T)
    # sum over all pairs |i - j| for T = 6 is 70
    assert known["uniform"].mean_distance == pytest.approx(70 / 36)


def test_causal_uniform_rows_have_normalised_entropy_one():
    n = 5
    A = causal_mask(n, n).double()
    A = A / A.sum(-1, keepdim=True)
    (roles,) = classify_heads(make_record(A, tokens=[f"w{i}" for i in range(n)]))
    # row 0 sees one key and is skipped; rows 1..4 are uniform over i + 1 keys
    assert roles.scores["broad"] == pytest.approx(1.0)
    assert roles.entropy == pytest.approx(sum(math.log(i + 1) for i in range(1, n)) / (n - 1))
    assert "next" not in roles.scores  # no query can see its right neighbour
    assert roles.scores["previous"] == 0.0
    assert roles.scores["previous_mass"] == pytest.approx(sum(1 / (i + 1) for i in range(1, n)) / (n - 1))
    assert roles.labels == ["broad"]


def test_causal_previous_token_head_with_an_explicit_mask():
    n = 5
    A = one_hot_columns([0, 0, 1, 2, 3], S=n)
    tokens = ["<|endoftext|>", "The", "Ġcat", "Ġsat", "."]
    (roles,) = classify_heads(make_record(A, tokens=tokens), mask=causal_mask(n, n))
    assert roles.scores["previous"] == 1.0 and roles.labels == ["previous"]
    assert "next" not in roles.scores
    # "<|endoftext|>" counts as a separator; only row 1 (its right neighbour) puts weight there
    assert roles.scores["sep"] == pytest.approx(1 / 4)
    # the period is visible only to the last row, which looks at "Ġsat"
    assert roles.scores["punct"] == 0.0


def test_without_a_mask_a_lone_one_hot_head_has_no_usable_rows():
    (roles,) = classify_heads(make_record(PREVIOUS))
    assert roles.scores == {} and roles.labels == [] and roles.entropy is None and roles.mean_distance is None


def test_zero_rows_and_hidden_keys_are_ignored_without_nan():
    A = torch.zeros(T, T, dtype=torch.float64)
    A[:, :4] = 0.25  # the last two keys are padding
    A[2] = 0.0  # a query row with no weights at all
    (roles,) = classify_heads(make_record(A))
    assert roles.entropy == pytest.approx(math.log(4))
    assert roles.scores["broad"] == pytest.approx(1.0)
    assert "sep" not in roles.scores and "punct" not in roles.scores  # both are hidden keys
    assert all(math.isfinite(v) for v in roles.scores.values())
    assert math.isfinite(roles.mean_distance)


def test_thresholds_override_defaults():
    record = make_record(CLS, UNIFORM)
    cls, uniform = classify_heads(record, thresholds={"broad": 1.1, "self": 0.1})
    assert uniform.labels == []
    assert cls.labels == ["cls"]  # self = 1/6 (row 0) reaches 0.1 but does not beat chance (0) by the margin
    cls, uniform = classify_heads(record, thresholds={"broad": 1.1, "self": 0.1}, margin=0.0)
    assert cls.labels == ["self", "cls"]  # without a margin it passes; labels follow ROLE_THRESHOLDS order
    cls, _ = classify_heads(record, thresholds={"cls": math.inf})
    assert cls.labels == []
    assert ROLE_THRESHOLDS["cls"] == 0.5  # the defaults are not modified


def test_threshold_errors_name_the_role():
    with pytest.raises(ValueError, match=r"unknown role 'prev'.*valid roles"):
        classify_heads(make_record(UNIFORM), thresholds={"prev": 0.5})
    with pytest.raises(TypeError, match=r"thresholds\['broad'\] must be a number, got nan"):
        classify_heads(make_record(UNIFORM), thresholds={"broad": math.nan})


def test_rare_tokens_frequencies_ids_and_in_input_counts():
    # in-input counts: "cat" and "dog" appear once; equal length, so the earlier one
    assert rare_tokens(["the", "cat", "the", "dog", ".", "[SEP]"]) == ["cat"]
    assert rare_tokens(["the", "cat", "the", "dog"], k=2) == ["cat", "dog"]
    # longer strings (without the ## marker) break count ties
    assert rare_tokens(["[CLS]", "a", "##zebra", "dog"]) == ["##zebra"]
    # vocabulary ids break ties before length
    assert rare_tokens(TOKENS, token_ids=IDS, k=3) == ["cat", "##s", "the"]  # ids 4937 > 2015 > 1996
    # corpus frequencies come first; a token missing from them is the rarest
    freq = {"the": 1e6, "cat": 5e3, "##s": 1e5}
    assert rare_tokens(TOKENS, token_frequencies=freq, k=2) == ["cat", "##s"]
    assert rare_tokens(["the", "axolotl"], token_frequencies=freq) == ["axolotl"]
    assert rare_tokens(["[CLS]", ",", "[SEP]"]) == []


def test_rare_token_errors():
    with pytest.raises(ValueError, match="token_ids has 2 entries but there are 6 tokens"):
        rare_tokens(TOKENS, token_ids=[1, 2])
    with pytest.raises(ValueError, match="k must be a positive int, got k=0"):
        rare_tokens(TOKENS, k=0)
    with pytest.raises(TypeError, match=r"token_frequencies\['the'\] must be a number"):
        rare_tokens(TOKENS, token_frequencies={"the": "often"})


def test_rare_score_follows_token_frequencies():
    # with corpus frequencies saying "the" is rare, the head looking at "the" is the rare head
    looks_at_the = one_hot_columns([1] * T)
    roles = classify_heads(make_record(looks_at_the, RARE, UNIFORM), token_frequencies={"the": 1, "cat": 10, "##s": 5})
    assert [r.labels for r in roles] == [["rare"], [], ["broad"]]


@pytest.mark.parametrize("token", [",", "##,", "Ġ.", "...", "—", "«", "$", "。", "▁!"])
def test_punctuation(token):
    assert is_punctuation(token)


@pytest.mark.parametrize("token", ["[CLS]", "the", "##s", "Ġ", "", "a.", "<|endoftext|>", "[unused3]"])
def test_not_punctuation(token):
    assert not is_punctuation(token)


def test_special_tokens_by_string():
    for token in ("[CLS]", "[SEP]", "[PAD]", "<s>", "</s>", "<|endoftext|>", "<|im_start|>", "[unused12]"):
        assert is_special(token)
    for token in ("[", "cls", "<", "Ġ<", "s"):
        assert not is_special(token)


def test_strongest_links_sorted_with_specials_skipped():
    w = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.0, 0.6, 0.4]])
    q = ["[CLS]", "a", "b"]
    links = strongest_links(w, q, q, k=3)
    assert [(link.query, link.key, link.query_index, link.key_index) for link in links] == [
        ("a", "b", 1, 2),
        ("b", "a", 2, 1),  # tie at 0.6: the earlier query first
        ("b", "b", 2, 2),
    ]
    assert [link.weight for link in links] == pytest.approx([0.6, 0.6, 0.4])
    first = strongest_links(w, q, q, k=1, skip_special=False)[0]
    assert (first.query, first.key, first.weight) == ("[CLS]", "[CLS]", pytest.approx(0.7))
    # zero weights are never links
    assert len(strongest_links(torch.eye(2), ["x", "y"], ["x", "y"], k=10)) == 2


def test_strongest_links_errors():
    with pytest.raises(ValueError, match=r"need 2 query and 3 key tokens, got len\(query_tokens\)=1"):
        strongest_links(torch.ones(2, 3), ["a"], ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"weights must be \[T, S\], got shape \(1, 2, 3\)"):
        strongest_links(torch.ones(1, 2, 3), ["a"], ["a"])
    with pytest.raises(TypeError, match="weights must be a torch.Tensor, got list"):
        strongest_links([[1.0]], ["a"], ["a"])


def test_links_in_classify_heads(known):
    # all weights are 1: ties in row-major order, rows 0 and 1 point at [CLS] and are skipped
    assert [(link.query, link.key) for link in known["previous"].links] == [
        ("cat", "the"),
        ("##s", "cat"),
        (",", "##s"),
    ]
    # keys that are special tokens are skipped, so the [CLS] head has no links
    assert known["cls"].links == []
    assert [(link.query, link.key) for link in known["self"].links] == [("the", "the"), ("cat", "cat"), ("##s", "##s")]


def test_cross_attention_shapes_skip_positional_scores():
    A = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    B = torch.full((2, 4), 0.25)
    record = make_record(A, B, tokens=["x", "y"], key_tokens=["[CLS]", "a", "b", "[SEP]"])
    first, second = classify_heads(record)
    assert first.mean_distance is None and "previous" not in first.scores and "self" not in first.scores
    assert first.scores["cls"] == pytest.approx(0.75) and first.scores["sep"] == 0.0
    assert second.scores["broad"] == pytest.approx(1.0) and second.labels == ["broad"]
    assert first.labels == ["cls"]


def test_record_without_tokens_has_no_token_scores():
    (roles,) = classify_heads(make_record(UNIFORM, tokens=None))
    assert set(roles.scores) == {"previous", "previous_mass", "self", "self_mass", "next", "next_mass", "broad"}
    assert roles.links[0].query == "0"  # positions stand in for tokens


def test_classify_heads_errors_name_the_values():
    with pytest.raises(TypeError, match="record must be an AttentionRecord, got Tensor"):
        classify_heads(UNIFORM)
    with pytest.raises(ValueError, match="has T=6, S=6 but the record has 5 query tokens and 5 key tokens"):
        classify_heads(make_record(UNIFORM, tokens=TOKENS[:5]))
    with pytest.raises(ValueError, match="batch=1 out of range for layer 0 with B=1"):
        classify_heads(make_record(UNIFORM), batch=1)
    nan = UNIFORM.clone()
    nan[0, 0] = math.nan
    with pytest.raises(ValueError, match=r"roles need finite weights, found 1 that are not, e.g. nan"):
        classify_heads(make_record(nan))
    with pytest.raises(ValueError, match=r"mask must be \[T, S\] = \[6, 6\] for layer 0, got \[5, 5\]"):
        classify_heads(make_record(UNIFORM), mask=causal_mask(5, 5))
    with pytest.raises(ValueError, match="the mask hides keys that get weight"):
        classify_heads(make_record(UNIFORM), mask=causal_mask(T, T))
    with pytest.raises(TypeError, match="mask must be a bool torch.Tensor"):
        classify_heads(make_record(UNIFORM), mask=causal_mask(T, T).float())
    bad = AttentionRecord([LayerAttention(0, "attn", "mha", torch.ones(2, 2, 2))])
    with pytest.raises(ValueError, match=r"weights must be \[B, H, T, S\], got \(2, 2, 2\)"):
        classify_heads(bad)


def test_role_table_and_plain_text():
    roles = classify_heads(make_record(PREVIOUS, UNIFORM, tokens=None))
    rows = role_table(roles)
    assert rows[0][:4] == ["layer", "head", "roles", "previous"] and rows[0][-2:] == ["entropy", "distance"]
    assert rows[1][:4] == ["0", "0", "previous", "1.00"]
    assert rows[2][2] == "broad" and rows[2][rows[0].index("cls")] == "-"
    text = format_roles(roles)
    lines = text.splitlines()
    assert len(lines) == 3 and lines[0].startswith("layer  head  roles")
    assert all(len(row) == len(rows[0]) for row in rows)


@pytest.mark.parametrize("causal", [False, True])
def test_random_multihead_attention_runs_without_nan(causal):
    torch.manual_seed(0)
    model = MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    tokens = ["[CLS]", "the", "law", "##s", "of", "motion", ",", "[SEP]"]
    with capture(model) as record:
        model(torch.randn(2, len(tokens), 16), is_causal=causal)
    record.query_tokens = tokens
    for batch in (0, 1):
        roles = classify_heads(record, batch=batch)
        assert len(roles) == 4
        for r in roles:
            assert all(math.isfinite(v) for v in r.scores.values()), r.scores
            assert math.isfinite(r.entropy) and math.isfinite(r.mean_distance)
            assert set(r.labels) <= set(ROLE_THRESHOLDS)
            assert len(r.links) == 3 and r.links[0].weight >= r.links[-1].weight
            assert {"previous", "self", "cls", "sep", "punct", "rare", "broad"} <= set(r.scores)
            assert ("next" in r.scores) is not causal
    assert format_roles(roles).count("\n") == 4


def test_a_role_needs_its_score_to_beat_chance_by_the_margin():
    """A text that is mostly one word: an even head already puts most of its weight on it."""
    tokens = ["[CLS]", "la", "la", "la", "la", "ole", "la", "[SEP]"]  # "ole" is the rare word
    n = len(tokens)
    on_la = torch.zeros(n, n, dtype=torch.float64)
    on_la[:, [1, 2, 3, 4, 6]] = 0.2  # all weight on "la": punct/rare 0, but a lot on one word
    on_ole = one_hot_columns([5] * n, n)
    even = torch.full((n, n), 1.0 / n, dtype=torch.float64)
    roles = classify_heads(make_record(on_la, on_ole, even, tokens=tokens), thresholds={"rare": 0.1, "broad": 2.0})
    assert roles[2].chance["rare"] == pytest.approx(1 / n) and roles[2].scores["rare"] == pytest.approx(1 / n)
    assert roles[1].labels == ["rare"] and roles[2].labels == []  # 1 - 1/8 beats chance; 1/8 does not
    assert roles[0].chance["previous"] == 0.0 and roles[0].chance["cls"] == pytest.approx(1 / n)
    # "la" rare by a corpus frequency: it fills five of eight keys, so chance is 5/8
    roles = classify_heads(make_record(on_la, even, tokens=tokens), token_frequencies={"la": 1, "ole": 100})
    assert roles[0].scores["rare"] == pytest.approx(1.0) and roles[0].chance["rare"] == pytest.approx(5 / n)
    assert roles[1].scores["rare"] == pytest.approx(5 / n) and "rare" not in roles[1].labels  # 0.625 >= 0.5, at chance
    assert "rare" in roles[0].labels  # beats chance by 0.375 >= ROLE_MARGIN
    assert ROLE_MARGIN == 0.25
    roles = classify_heads(make_record(on_la, tokens=tokens), token_frequencies={"la": 1, "ole": 100}, margin=0.5)
    assert "rare" not in roles[0].labels


def test_a_repeated_word_has_no_rare_score():
    tokens = ["[CLS]", "la", "la", "la", ".", "[SEP]"]
    roles = classify_heads(make_record(one_hot_columns([1] * 6), tokens=tokens))
    assert "rare" not in roles[0].scores and "rare" not in roles[0].labels
    assert role_table(roles)[1][role_table(roles)[0].index("rare")] == "-"  # "-": not measurable
    # with corpus frequencies the one word has a frequency, so the score is measured
    assert "rare" in classify_heads(make_record(UNIFORM, tokens=tokens), token_frequencies={"la": 3})[0].scores


def test_heads_json_keeps_each_roles_chance(tmp_path):
    import json

    from multihead.tools import write_json

    record = make_record(CLS, UNIFORM)
    roles = classify_heads(record)
    data = json.loads(write_json(record, tmp_path / "heads.json", roles=roles).read_text())
    assert [r["chance"] for r in data["roles"]] == [r.chance for r in roles]
    assert data["roles"][0]["chance"]["cls"] == pytest.approx(1 / T) and data["roles"][0]["chance"]["previous"] == 0.0
