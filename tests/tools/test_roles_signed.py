"""Head roles on signed weights (heads mixed after the softmax, as in DCMHA).

The rule under test: every score reads each used row as |w| / sum(|w|).
Expected values are computed here with plain Python loops over that rule.
"""

from __future__ import annotations

import math

import pytest
import torch

from multihead.modules.kinds.dcmha import DCMHA
from multihead.tools.capture import AttentionRecord, LayerAttention, capture
from multihead.tools.head_links import strongest_links
from multihead.tools.roles import classify_heads

TOKENS = ["[CLS]", "dog", ",", "[SEP]"]
FREQ = {"dog": 1}  # one word: rare is measured only with a corpus frequency for it

# Causal rows that sum to 1 (as DCMHA's composed rows may) with negative entries.
SIGNED = [
    [1.0, 0.0, 0.0, 0.0],
    [1.5, -0.5, 0.0, 0.0],
    [-0.25, 1.0, 0.25, 0.0],
    [0.5, -0.5, 0.75, 0.25],
]


def record_of(*heads) -> AttentionRecord:
    weights = torch.tensor(heads, dtype=torch.float64).unsqueeze(0)  # (H, T, S) -> (1, H, T, S)
    return AttentionRecord([LayerAttention(0, "attn", "dcmha", weights)], query_tokens=TOKENS)


def expected_scores(rows_of_w: list[list[float]], visible: list[list[bool]]) -> dict[str, float]:
    """The documented rule, by hand: rows with >= 2 visible keys and some
    |w| > 0, each as |w| / sum(|w|)."""
    used = [i for i, r in enumerate(rows_of_w) if sum(map(abs, r)) > 0 and sum(visible[i]) >= 2]
    P = {i: [abs(x) / sum(map(abs, rows_of_w[i])) for x in rows_of_w[i]] for i in used}
    out: dict[str, float] = {}
    S = len(rows_of_w[0])
    for name, off in (("previous", -1), ("self", 0), ("next", 1)):
        cand = [i for i in used if 0 <= i + off < S and visible[i][i + off]]
        if cand:
            wins = [P[i][i + off] > max(x for j, x in enumerate(P[i]) if j != i + off) for i in cand]
            out[name] = sum(wins) / len(cand)
            out[f"{name}_mass"] = sum(P[i][i + off] for i in cand) / len(cand)
    for name, key in (("cls", 0), ("sep", 3), ("punct", 2), ("rare", 1)):
        cand = [i for i in used if visible[i][key]]
        if cand:
            out[name] = sum(P[i][key] for i in cand) / len(cand)
    ents = [-sum(x * math.log(x) for x in P[i] if x > 0) for i in used]
    out["entropy"] = sum(ents) / len(used)
    out["broad"] = sum(e / math.log(sum(visible[i])) for e, i in zip(ents, used)) / len(used)
    out["distance"] = sum(sum(x * abs(i - j) for j, x in enumerate(P[i])) for i in used) / len(used)
    return out


def test_signed_rows_are_scored_by_magnitude_and_stay_in_range():
    (roles,) = classify_heads(record_of(SIGNED), token_frequencies=FREQ)
    visible = [[x != 0 for x in row] for row in SIGNED]  # no mask: non-zero entries of the only head
    want = expected_scores(SIGNED, visible)
    got = dict(roles.scores, entropy=roles.entropy, distance=roles.mean_distance)
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-12, abs=1e-12), name
    for name in ("previous", "self", "cls", "sep", "punct", "rare", "broad", "previous_mass", "self_mass"):
        assert 0.0 <= got[name] <= 1.0, (name, got[name])
    assert 0.0 <= roles.entropy <= math.log(len(TOKENS))
    assert 0.0 <= roles.mean_distance <= len(TOKENS) - 1
    # Row 1 holds -0.5 on itself: by magnitude 0.25 of the row, not -0.5.
    assert want["self_mass"] != pytest.approx(sum(SIGNED[i][i] for i in (1, 2, 3)) / 3)


def test_a_sign_flip_changes_no_score():
    flipped = [[-x if (i + j) % 2 else x for j, x in enumerate(row)] for i, row in enumerate(SIGNED)]
    (a,) = classify_heads(record_of(SIGNED), token_frequencies=FREQ)
    (b,) = classify_heads(record_of(flipped), token_frequencies=FREQ)
    assert b.scores.keys() == a.scores.keys()
    for name in a.scores:
        assert b.scores[name] == pytest.approx(a.scores[name], rel=1e-12, abs=1e-12), name


def test_links_rank_by_magnitude_and_keep_the_sign():
    w = torch.tensor([[0.25, -0.75], [0.0, 0.5]])
    links = strongest_links(w, ["a", "b"], ["c", "d"], k=3, skip_special=False)
    assert [(link.query_index, link.key_index, link.weight) for link in links] == [
        (0, 1, -0.75),
        (1, 1, 0.5),
        (0, 0, 0.25),
    ]


def test_mask_refuses_negative_weight_on_hidden_keys():
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    bad = [row[:] for row in SIGNED]
    bad[0][3] = -0.125
    with pytest.raises(ValueError, match=r"the mask hides keys that get weight \(\|w\| up to 0.125\)"):
        classify_heads(record_of(bad), mask=causal)


def test_dcmha_with_negative_composed_weights_gets_finite_scores_in_range():
    torch.manual_seed(0)
    model = DCMHA(16, 4, dynamic=False).eval()
    with torch.no_grad():
        model.post_static.copy_(torch.randn(4, 4))  # cross-head mixing after the softmax
    with torch.no_grad(), capture(model) as record:
        model(torch.randn(1, len(TOKENS), 16), is_causal=True)
    assert (record.layers[0].weights < 0).any()  # the case under test
    record.query_tokens = TOKENS
    roles = classify_heads(record, mask=torch.ones(4, 4, dtype=torch.bool).tril())
    assert len(roles) == 4
    for r in roles:
        for name, value in r.scores.items():
            assert math.isfinite(value) and 0.0 <= value <= 1.0, (r.head, name, value)
        assert 0.0 <= r.entropy <= math.log(len(TOKENS))
        assert 0.0 <= r.mean_distance <= len(TOKENS) - 1
        assert r.links and all(math.isfinite(link.weight) for link in r.links)
