"""``tools.causal_head_scores``: previous-token, duplicate-token, induction and copying scores.

The induction model is built by hand from multihead attention modules: one-hot
token and position embeddings, no norm, a large score scale. Layer 0 head 0
copies the previous token into its own slot of the residual stream; layer 1
head 0 matches the current token against that slot (prefix matching) and
writes the attended token back onto its own logit. The expected scores are
worked out by hand below; chance levels by a plain loop over the rows.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from multihead.models.gpt import GPT, GPTConfig
from multihead.modules.kinds.mha import MultiHeadAttention
from multihead.tools import capture, causal_head_scores, repeated_random_tokens, special_token_ids
from multihead.tools.causal_roles import ROLE_THRESHOLDS

V, N, D, BETA = 16, 6, 16, 30.0  # vocabulary, n, head width, score of a match
P = 2 * N  # positions
C = V + P + V  # residual: [token one-hot | position one-hot | previous token one-hot]
TOK, POS, PREV = 0, V, V + P


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.Identity()
        self.attn = MultiHeadAttention(C, 2, head_dim=D, qkv_bias=False, out_bias=False)


class AttentionOnly(nn.Module):
    """Two attention layers of 2 heads, one-hot embeddings, no norm, no MLP (the GPT's attribute names)."""

    def __init__(self) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(V, C)
        self.position_embedding = nn.Embedding(P, C)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.Identity()
        self.lm_head = nn.Linear(C, V, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.token_embedding(idx) + self.position_embedding(torch.arange(T))  # (B, T, C)
        for block in self.blocks:
            x = x + block.attn(block.ln_1(x), is_causal=True)
        return self.lm_head(self.ln_f(x))


def induction_model(previous_head: bool = True) -> AttentionOnly:
    """Weights set by hand; every other parameter is zero (heads 1 attend evenly and write nothing)."""
    m = AttentionOnly()
    for p in m.parameters():
        nn.init.zeros_(p)
    scale = BETA * math.sqrt(D)  # the layer divides scores by sqrt(D)
    q, k, v = 0, 2 * D, 4 * D  # rows of head 0 in qkv_proj: [q heads | k heads | v heads], 2 heads of D
    with torch.no_grad():
        m.token_embedding.weight[:, TOK : TOK + V] = torch.eye(V)
        m.position_embedding.weight[:, POS : POS + P] = torch.eye(P)
        m.lm_head.weight[:, TOK : TOK + V] = torch.eye(V)
        W0, O0 = m.blocks[0].attn.qkv_proj.weight, m.blocks[0].attn.out_proj.weight  # (6D, C), (C, 2D)
        if previous_head:
            for d in range(P - 1):  # q·k = scale·[j == i - 1]
                W0[q + d, POS + d + 1] = scale
                W0[k + d, POS + d] = 1.0
            for d in range(V):  # value: the token; output: into the PREV slot
                W0[v + d, TOK + d] = 1.0
                O0[PREV + d, d] = 1.0
        W1, O1 = m.blocks[1].attn.qkv_proj.weight, m.blocks[1].attn.out_proj.weight
        for d in range(V):  # q·k = scale·[token(i) == previous token(j)]; value: the token, onto its logit
            W1[q + d, TOK + d] = scale
            W1[k + d, PREV + d] = 1.0
            W1[v + d, TOK + d] = 1.0
            O1[TOK + d, d] = 1.0
    return m.eval()


def distinct_tokens(batch: int = 4) -> torch.Tensor:
    """[batch, 2N]: N distinct ids per row (so exactly one earlier occurrence matches), repeated."""
    g = torch.Generator().manual_seed(1)
    first = torch.stack([torch.randperm(V, generator=g)[:N] for _ in range(batch)])
    return torch.cat([first, first], dim=1)


def even_spread(rows) -> float:
    """The score of a head that spreads its weight evenly over the i + 1 keys row i sees."""
    total = 0.0
    for i in rows:
        total += 1.0 / (i + 1)
    return total / len(rows)


def test_hand_built_heads_score_what_they_were_built_for():
    s = causal_head_scores(induction_model(), vocab_size=V, tokens=distinct_tokens())
    # by hand: row i >= 1 of L0 H0 puts ~1 on i - 1 (e^30 against at most 2N e^0). L1 H0 puts ~1 on
    # i - n + 1 for rows n+1..2n-1; row n matches key 1 and key 0 (the first position's own token
    # fills its previous-token slot), 0.5 each.
    want = {
        ("previous_token", 0, 0): 1.0,
        ("induction", 1, 0): (N - 1 + 0.5) / N,
        ("duplicate_token", 1, 0): 0.5 / N,
        ("copying", 1, 0): 1.0,  # its OV circuit is the identity on the tokens
        ("copying", 0, 0): 0.0,  # it writes where the unembedding does not read
    }
    for (role, layer, head), value in want.items():
        assert float(s.scores[role][layer, head]) == pytest.approx(value, abs=1e-4), (role, layer, head)
    chance = {"previous_token": even_spread(range(1, 2 * N)), "duplicate_token": even_spread(range(N, 2 * N)),
              "induction": even_spread(range(N, 2 * N))}  # fmt: skip
    for role, value in chance.items():
        assert s.chance[role] == pytest.approx(value, rel=1e-9)
        for layer in (0, 1):  # the zero heads attend evenly
            assert float(s.scores[role][layer, 1]) == pytest.approx(value, abs=1e-5), (role, layer)
    assert s.scores["copying"][:, 1].tolist() == [0.0, 0.0] and s.chance["copying"] == 0.0
    assert s.heads("induction", ROLE_THRESHOLDS["induction"]) == [(1, 0)]
    assert s.heads("previous_token", ROLE_THRESHOLDS["previous_token"]) == [(0, 0)]
    assert s.heads("duplicate_token", ROLE_THRESHOLDS["duplicate_token"]) == []
    assert s.heads("copying", ROLE_THRESHOLDS["copying"]) == [(1, 0)]
    assert s.to_dict()["scores"]["induction"][1][0] == pytest.approx((N - 0.5) / N, abs=1e-4)


def test_without_the_previous_token_head_there_is_no_induction_head():
    s = causal_head_scores(induction_model(previous_head=False), vocab_size=V, tokens=distinct_tokens())
    assert s.heads("induction", ROLE_THRESHOLDS["induction"]) == []
    assert float(s.scores["induction"][1, 0]) == pytest.approx(even_spread(range(N, 2 * N)), abs=1e-5)


def test_a_random_gpt_has_no_induction_head():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny"))
    s = causal_head_scores(model, vocab_size=256, length=16, batch=4)
    assert s.heads("induction", ROLE_THRESHOLDS["induction"]) == []
    assert set(s.scores) == {"previous_token", "duplicate_token", "induction", "copying"} and s.notes == []


def loop_scores(model, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """[L, H] means of the captured weights at the role's (query, key) pairs, one row at a time."""
    n = tokens.shape[1] // 2
    with torch.no_grad(), capture(model) as record:
        model(tokens)
    out = {}
    pairs = {"previous_token": [(i, i - 1) for i in range(1, 2 * n)],
             "duplicate_token": [(i, i - n) for i in range(n, 2 * n)],
             "induction": [(i, i - n + 1) for i in range(n, 2 * n)]}  # fmt: skip
    for role, rows in pairs.items():
        table = torch.zeros(len(record.layers), record.layers[0].num_heads)
        for li, entry in enumerate(record.layers):
            for h in range(entry.num_heads):
                table[li, h] = sum(float(entry.weights[b, h, i, j]) for b in range(tokens.shape[0]) for i, j in rows)
        out[role] = table / (tokens.shape[0] * len(rows))
    return out


def test_signed_weights_of_dcmha_are_read_as_they_are_and_copying_is_absent():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", attention="dcmha")).eval()
    tokens = repeated_random_tokens(256, 8, 3, seed=2)
    s = causal_head_scores(model, vocab_size=256, tokens=tokens)
    for role, table in loop_scores(model, tokens).items():
        torch.testing.assert_close(s.scores[role], table, rtol=1e-4, atol=1e-6)
    assert "copying" not in s.scores and "copying" not in s.to_dict()["scores"]
    assert len(s.notes) == 2 and all("'dcmha' has no per-head OV circuit" in note for note in s.notes)
    with pytest.raises(ValueError, match="unknown role 'copying'"):
        s.heads("copying", 0.5)


@pytest.mark.parametrize("groups", [1, 2])
def test_grouped_value_heads_score_as_the_mha_that_repeats_them(groups):
    """GQA/MQA: each query head reads its group's key/value head; the same model with every group's
    rows repeated per query head (an MHA) scores the same, copying included."""
    torch.manual_seed(0)
    grouped = GPT(GPTConfig.from_preset("tiny", attention="gqa" if groups > 1 else "mqa", num_kv_heads=groups)).eval()
    H, hd = grouped.config.num_heads, grouped.config.head_dim
    full = GPT(GPTConfig.from_preset("tiny")).eval()
    state = grouped.state_dict()
    for i in range(grouped.config.num_layers):
        name = f"blocks.{i}.attn.qkv_proj"
        for suffix in ("weight", "bias"):
            whole = state[f"{name}.{suffix}"]
            q, k, v = whole.split([H * hd, groups * hd, groups * hd])
            repeat = lambda t: torch.cat([t[(h * groups // H) * hd : (h * groups // H + 1) * hd] for h in range(H)])  # noqa: E731
            state[f"{name}.{suffix}"] = torch.cat([q, repeat(k), repeat(v)])
    full.load_state_dict(state)
    a = causal_head_scores(grouped, vocab_size=256, length=8, batch=3)
    b = causal_head_scores(full, vocab_size=256, length=8, batch=3)
    assert set(a.scores) == set(b.scores) == {"previous_token", "duplicate_token", "induction", "copying"}
    for role in a.scores:
        torch.testing.assert_close(a.scores[role], b.scores[role], rtol=1e-4, atol=1e-5)


def test_special_ids_are_never_drawn():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(["a", "b", "<s>", "c", "</s>", "d"])}, unk_token="a"))
    tok.add_special_tokens(["<s>", "</s>"])
    assert special_token_ids(tok) == [2, 4]
    drawn = repeated_random_tokens(6, 50, 4, exclude=[2, 4])
    assert set(drawn.flatten().tolist()) == {0, 1, 3, 5}
    assert torch.equal(repeated_random_tokens(6, 50, 4, exclude=[]), repeated_random_tokens(6, 50, 4))


@pytest.mark.parametrize(
    "options,message",
    [
        ({"length": 1}, "length must be at least 2 (a previous token and a repeat), got length=1"),
        (
            {"length": 65},
            "T = 2·length = 130 tokens do not fit the model's context of 128 (context_length): give length <= 64",
        ),
        ({"vocab_size": 300}, "ids up to 299 do not fit the model's vocab_size 256: give vocab_size <= 256"),
        ({"tokens": torch.tensor([[1, 2, 3, 1, 2, 4]])}, "each row's second half equal to its first"),
        ({"tokens": torch.tensor([[7, 7]])}, "length must be at least 2"),
        ({"exclude": list(range(255))}, "at least 2 ids must remain to draw from"),
    ],
)
def test_mistakes_are_one_line_value_errors(options, message):
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny"))
    with pytest.raises(ValueError) as err:
        causal_head_scores(model, **{"vocab_size": 256, **options})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_weight_only_gpt_has_no_copying_score_but_the_same_attention_scores():
    from multihead.models.quantize import quantize_weights

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny")).eval()
    fast = quantize_weights(model, "fp32")  # the same values in the decode layout
    a = causal_head_scores(model, vocab_size=256, length=8, batch=2)
    b = causal_head_scores(fast, vocab_size=256, length=8, batch=2)
    assert "copying" in a.scores and "copying" not in b.scores
    assert b.notes == ["copying: the model has no token embedding and unembedding the score knows "
                       "(a multihead GPT, a Hugging Face GPT-2, Llama, Mistral, Qwen2 or Qwen3)"]  # fmt: skip
    for role in b.scores:
        torch.testing.assert_close(b.scores[role], a.scores[role], rtol=1e-4, atol=1e-5)
