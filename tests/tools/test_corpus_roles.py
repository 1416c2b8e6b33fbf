"""``tools.corpus_roles``: each head's scores over many texts, their spread and the evidence a role needs.

References: per-text ``classify_heads`` calls on texts captured one at a time
(no batch, no padding), summarised with Python's ``statistics`` and SciPy's
Student t quantile; hand-built attention weights where the expected roles are
known by construction.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter

import pytest
import torch

from multihead.models.gpt import GPT, GPTConfig
from multihead.tools.capture import AttentionRecord, LayerAttention, capture
from multihead.tools.corpus_roles import corpus_roles, score_records
from multihead.tools.corpus_stats import EvidenceRule
from multihead.tools.corpus_table import corpus_table, format_corpus_roles
from multihead.tools.roles import ROLE_THRESHOLDS, classify_heads

TEXTS = [
    "The law will never be perfect, but its application should be just.",
    "A cat sat on the mat.",
    "It was the best of times, it was the worst of times.",
    "Call me Ishmael.",
    "Some years ago, never mind how long precisely, I thought I would sail about.",
]


def hand_record(tokens: list[str], weights: torch.Tensor) -> AttentionRecord:
    """One text, one layer: weights [H, T, T]."""
    return AttentionRecord([LayerAttention(0, "attn", "mha", weights[None].float())], query_tokens=list(tokens))


def focused(T: int, H: int, key: int | list[int], share: float) -> torch.Tensor:
    """[H, T, T]: every query puts ``share`` on ``key`` (split evenly when a list) and the rest evenly elsewhere."""
    keys = [key] if isinstance(key, int) else key
    w = torch.full((H, T, T), (1 - share) / (T - len(keys)), dtype=torch.float64)
    w[:, :, keys] = share / len(keys)
    return w


def reference(per_text: list[list], name: str, head: int) -> tuple[list[float], int]:
    """The per-text values of one score of one head (texts that measured it) and the rows they used."""
    values, rows = [], 0
    for roles in per_text:
        r = roles[head]
        scores = {**r.scores, "entropy": r.entropy, "distance": r.mean_distance}
        if scores.get(name) is not None:
            values.append(scores[name])
            rows += r.rows.get(name, r.rows["broad"])
    return values, rows


def assert_matches(found, per_text, names) -> None:
    from scipy.stats import t as student_t

    for j, h in enumerate(found.heads):
        for name in names:
            values, rows = reference(per_text, name, j)
            if not values:
                assert name not in h.stats
                continue
            s = h.stats[name]
            assert s.texts == len(values) and s.rows == rows
            assert s.mean == pytest.approx(statistics.fmean(values), abs=1e-5)
            if len(values) > 1:
                sd = statistics.stdev(values)
                assert s.sd == pytest.approx(sd, abs=1e-5)
                half = student_t.ppf(0.975, len(values) - 1) * sd / math.sqrt(len(values))
                assert s.low == pytest.approx(statistics.fmean(values) - half, abs=1e-5)
                assert s.high == pytest.approx(statistics.fmean(values) + half, abs=1e-5)


@pytest.fixture(scope="module")
def minilm():
    from multihead.models import load_minilm

    return load_minilm()


def test_mean_spread_and_evidence_equal_per_text_classify_heads_on_minilm(minilm):
    pytest.importorskip("scipy")
    found = corpus_roles(minilm, TEXTS, batch_size=2, progress=False)  # padded batches
    encoded = [minilm.tokenizer.encode(t) for t in TEXTS]
    freqs = Counter(tok for e in encoded for tok in e.tokens)
    assert found.token_frequencies == dict(freqs) and found.texts == 5
    assert found.tokens == sum(len(e.ids) for e in encoded)
    per_text = []
    for e in encoded:  # one text at a time, no padding
        ids = torch.tensor([e.ids])
        with torch.no_grad(), capture(minilm.encoder) as record:
            minilm.encoder(ids)
        record.query_tokens = list(e.tokens)
        per_text.append(classify_heads(record, token_frequencies=freqs, token_ids=e.ids))
    names = [*ROLE_THRESHOLDS, "previous_mass", "entropy", "distance"]
    assert_matches(found, per_text, names)
    # evidence counted independently: every query row sees [CLS]; row 0 has no previous token
    T = [len(e.ids) for e in encoded]
    for h in found.heads:
        assert h.stats["cls"].rows == sum(T) and h.stats["cls"].keys == 5
        assert h.stats["previous"].rows == sum(t - 1 for t in T) and h.texts == 5
    # labels follow the mean with the thresholds and the margin over the mean chance
    for h in found.heads:
        for role in ("cls", "previous"):
            s = h.stats[role]
            passes = s.mean >= ROLE_THRESHOLDS[role] and s.mean - s.chance >= 0.25
            assert (role in h.labels) == passes, (h.layer, h.head, role)


def test_a_causal_model_scores_only_what_each_query_could_see():
    pytest.importorskip("scipy")
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny")).eval()  # byte-level, 2 layers x 4 heads
    texts = ["to be or not", "that is the question", "ab", "whether tis nobler in the mind"]
    found = corpus_roles(model, texts, batch_size=3, progress=False)
    per_text = []
    for text in texts:
        ids = torch.tensor([list(text.encode())])
        with torch.no_grad(), capture(model) as record:
            model(ids)
        record.query_tokens = [chr(b) for b in ids[0].tolist()]
        T = ids.shape[1]
        per_text.append(classify_heads(record, token_frequencies=found.token_frequencies, token_ids=ids[0].tolist(),
                                       mask=torch.ones(T, T, dtype=torch.bool).tril()))  # fmt: skip
    assert_matches(found, per_text, ["previous", "self", "broad", "punct", "rare", "entropy"])
    for h in found.heads:  # query 0 sees one key: never a row
        assert h.stats["broad"].rows == sum(len(t) - 1 for t in texts)


def test_a_role_is_never_given_from_a_single_token():
    T, H = 6, 2
    plain = ["[CLS]", "a", "b", "c", "d", "[SEP]"]
    comma = ["[CLS]", "a", ",", "c", "d", "[SEP]"]
    records = [hand_record(comma, focused(T, H, 2, 0.9))] + [hand_record(plain, focused(T, H, 1, 0.2))] * 3
    alone = classify_heads(records[0])
    assert all("punct" in r.labels for r in alone)  # one text: its comma gives the role
    found = score_records(records)
    for h in found.heads:
        assert h.stats["punct"].texts == 1 and h.stats["punct"].keys == 1 and h.stats["punct"].rows == T
        assert "punct" not in h.labels and "punct" in h.withheld and h.enough["punct"] is False
    loose = EvidenceRule(min_texts=1, min_rows=1, min_keys=1)
    assert all("punct" in h.labels for h in score_records(records, evidence=loose).heads)
    one_text = EvidenceRule(min_texts=1, min_rows=1)  # a single comma is still one token
    assert all("punct" in h.withheld for h in score_records(records, evidence=one_text).heads)
    two = ["[CLS]", ",", "a", ",", "d", "[SEP]"]
    records[0] = hand_record(two, focused(T, H, [1, 3], 0.9))
    assert all("punct" in h.labels for h in score_records(records, evidence=EvidenceRule(1, T, 2)).heads)
    assert all("punct" in h.withheld for h in score_records(records, evidence=EvidenceRule(1, T + 1, 2)).heads)


def test_corpus_frequencies_pick_each_texts_rare_word():
    """Per-text counts make the one "the" of each text its rare word, and three of four heads that
    look at it rare heads; the corpus holds "the" in every text, so the rare word is the repeated one."""
    words = ["cat", "dog", "sun", "sea", "owl", "fig"]
    records, T = [], 8
    for w in words:
        tokens = ["[CLS]", w, w, w, "the", w, w, "[SEP]"]
        weights = focused(T, 4, 4, 0.7)
        weights[3] = 1 / T  # head 3 spreads evenly
        records.append(hand_record(tokens, weights))
    for record in records:
        labelled = [r.head for r in classify_heads(record) if "rare" in r.labels]
        assert labelled == [0, 1, 2]
    found = score_records(records)
    assert found.token_frequencies["the"] == 6 and found.token_frequencies["cat"] == 5
    assert not any("rare" in h.labels or "rare" in h.withheld for h in found.heads)
    for h in found.heads:
        assert h.stats["rare"].keys == 5 * 6 and h.stats["rare"].chance == pytest.approx(5 / 8)


def test_a_repetitive_corpus_gives_no_rare_heads(minilm):
    texts = [" ".join([w] * 8) for w in "buffalo salmon la yes go red one cat".split()]
    found = corpus_roles(minilm, texts, batch_size=4, progress=False)
    rare = [h.stats["rare"] for h in found.heads]
    # each text's only word is its rarest in the corpus: measured everywhere, with the share of the word as chance
    assert all(s.texts == 8 and s.keys == 64 and s.chance == pytest.approx(0.8) for s in rare)
    assert any(s.mean >= ROLE_THRESHOLDS["rare"] for s in rare)  # heads that read the word...
    assert not any("rare" in h.labels for h in found.heads)  # ...as an even head would: no rare role


def test_the_table_shows_mean_spread_evidence_and_withheld_roles():
    T, H = 6, 2
    comma = ["[CLS]", "a", ",", "c", "d", "[SEP]"]
    records = [hand_record(comma, focused(T, H, 2, 0.9))] + [hand_record(comma, focused(T, H, 1, 0.2))] * 3
    found = score_records(records, evidence=EvidenceRule(min_texts=5))
    rows = corpus_table(found)
    assert rows[0][:4] == ["layer", "head", "roles", "texts"]
    punct = found.heads[0].stats["punct"]
    cell = rows[1][rows[0].index("punct")]
    assert cell == f"{punct.mean:.2f}±{punct.sd:.2f}*" and rows[1][3] == "4"
    broad = found.heads[0].stats["broad"]
    assert broad.mean >= ROLE_THRESHOLDS["broad"] and found.heads[0].withheld == ["broad"]  # 4 texts of 5
    assert rows[1][2] == "none (broad)" and rows[1][rows[0].index("broad")].endswith("*")
    assert format_corpus_roles(found).splitlines()[0].split()[:4] == ["layer", "head", "roles", "texts"]


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m: corpus_roles(m, [], progress=False), ValueError, "texts is empty"),
        (lambda m: corpus_roles(m, "one text", progress=False), TypeError, "texts must be a list"),
        (lambda m: corpus_roles(m, ["ok", "  "], progress=False), ValueError, "texts[1] '  ' is empty"),
        (lambda m: corpus_roles(m, ["x" * 200], progress=False), ValueError, "texts[0] is 200 tokens, more than"),
        (lambda m: corpus_roles(m, ["ok"], batch_size=0, progress=False), ValueError, "batch_size"),
        (lambda m: corpus_roles(m, ["ok"], layers=[5], progress=False), ValueError, "layer 5 out of range"),
        (lambda m: corpus_roles(m, [([1, 2], ["a"])], progress=False), ValueError, "has 2 ids and 1 tokens"),
        (lambda m: corpus_roles(m, [([300, 2], ["a", "b"])], progress=False), ValueError, "has token id 300, but"),
        (lambda m: corpus_roles(GPT(GPTConfig.from_preset("tiny", vocab_size=300)), ["abc"], progress=False),
         ValueError, "texts[0] is a string but there is no tokenizer"),
        (lambda m: score_records([torch.ones(2)]), TypeError, "records[0] must be an AttentionRecord"),
        (lambda m: score_records([]), ValueError, "records is empty"),
        (lambda m: score_records([hand_record(["a", "b"], torch.ones(1, 2, 2) / 2)], evidence=3), TypeError, "EvidenceRule"),
    ],
)
def test_mistakes_are_one_line(call, error, message):
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny")).eval()
    with pytest.raises(error) as exc:
        call(model)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_truncate_keeps_the_first_tokens():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny")).eval()  # context 128
    found = corpus_roles(model, ["x" * 200, "abc"], truncate=True, progress=False)
    assert found.tokens == 128 + 3


def test_an_encoder_with_a_tokenizer_given_scores_as_the_sentence_encoder(minilm):
    whole = corpus_roles(minilm, TEXTS[:3], progress=False)
    bare = corpus_roles(minilm.encoder, TEXTS[:3], tokenizer=minilm.tokenizer, batch_size=3, progress=False)
    assert bare.tokens == whole.tokens and bare.token_frequencies == whole.token_frequencies
    for a, b in zip(whole.heads, bare.heads):
        assert a.labels == b.labels
        for name, s in a.stats.items():
            assert b.stats[name].mean == pytest.approx(s.mean, abs=1e-5) and b.stats[name].rows == s.rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_model_on_the_gpu_scores_as_on_the_cpu():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny")).eval()
    texts = ["to be or not", "that is the question", "whether tis nobler in the mind"]
    on_cpu = corpus_roles(model, texts, batch_size=2, progress=False)
    on_gpu = corpus_roles(model.cuda(), texts, batch_size=2, progress=False)
    for a, b in zip(on_cpu.heads, on_gpu.heads):
        for name, s in a.stats.items():
            assert b.stats[name].mean == pytest.approx(s.mean, abs=1e-4) and b.stats[name].rows == s.rows


@pytest.mark.parametrize("df", [1, 4, 30, 1000, 1001, 20000])
def test_the_interval_uses_students_t(df):
    student_t = pytest.importorskip("scipy.stats").t

    from multihead.tools.corpus_stats import _t

    assert _t(df) == pytest.approx(student_t.ppf(0.975, df), abs=1e-8)


def test_a_padded_batch_record_scores_as_its_items_one_by_one():
    torch.manual_seed(0)
    short, long = ["[CLS]", "a", ",", "[SEP]"], ["[CLS]", "b", "c", "d", ".", "[SEP]"]
    w = torch.rand(2, 3, 6, 6)
    w[0, :, :, 4:] = 0  # item 0: two padded keys
    w = w / w.sum(dim=-1, keepdim=True)
    batch = AttentionRecord([LayerAttention(0, "attn", "mha", w)], query_tokens=[short, long])
    batch.attention_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    together = score_records([batch])
    apart = score_records([hand_record(short, w[0, :, :4, :4]), hand_record(long, w[1])])
    assert together.texts == 2 and together.tokens == 10 and together.token_frequencies == apart.token_frequencies
    for a, b in zip(together.heads, apart.heads):
        assert a.stats.keys() == b.stats.keys()
        for name, s in a.stats.items():
            assert (s.mean, s.sd, s.texts, s.rows, s.keys) == pytest.approx(
                (b.stats[name].mean, b.stats[name].sd, b.stats[name].texts, b.stats[name].rows, b.stats[name].keys))
