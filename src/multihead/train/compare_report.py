"""The files ``multihead compare`` writes: compare.json, compare.md and compare.png.

Each is written to a temporary name and renamed (``multihead.io``), so a
crash leaves the previous file or the new one; ``compare`` rewrites them as
each kind finishes (the header's ``kinds_finished``). A smoke test's reports
(``header["smoke_test"]``) say so and have no tokens/s. The JSON holds everything the
other two show: per kind its plan (``compare_plan.KindPlan``), the final
validation loss of every seed, the validation curves, training tokens/s and
peak memory, and (not for a smoke test) each kind's difference to the
baseline kind with its 95% interval over seeds (``compare_stats``). A run
whose loss diverged (``multihead.train.divergence``) has a NaN loss: its
kind's row says "diverged" with the seed and step, and lists it under
"diverged"; compare.json is strict JSON, a NaN or infinite number written as
null (``compare_json``).
"""

from __future__ import annotations

import dataclasses
import io
import math
import statistics
from pathlib import Path
from typing import Any

from ..io import write_bytes_atomic, write_text_atomic
from .compare_json import dumps
from .compare_plan import BASELINE
from .compare_stats import MOST_SEEDS, difference

__all__ = ["summarize_kind", "against_baseline", "write_reports", "markdown_table", "SMOKE_NOTE"]

SMOKE_NOTE = (
    "**A smoke test** (`--quick`): {steps} steps show that every kind trains. Losses after so few "
    "steps are no comparison, and no speed is measured; run without --quick for numbers.\n\n"
)


def _spread(losses: list[float]) -> float:
    """The standard deviation over seeds: 0 for one seed, NaN when a run diverged."""
    if len(losses) < 2:
        return 0.0
    return statistics.stdev(losses) if all(map(math.isfinite, losses)) else math.nan


def summarize_kind(plan: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One kind's row: its plan plus the runs' losses, speeds and memory.

    Args:
        plan: ``dataclasses.asdict(KindPlan)``.
        runs: per seed {"seed", "val_loss", "curve" [[step, val_loss], ...],
            "tokens_per_s", "peak_memory_bytes"[, "diverged" {"step", "which", "value"}]}.
    """
    losses = [r["val_loss"] for r in runs]
    diverged = [{"seed": r["seed"], **r["diverged"]} for r in runs if r.get("diverged")]
    return {
        **plan,
        "seeds": [r["seed"] for r in runs],
        "val_loss": losses,
        "val_loss_mean": statistics.fmean(losses),
        "val_loss_std": _spread(losses),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in runs),
        "curves": {str(r["seed"]): r["curve"] for r in runs},
        **({"diverged": diverged} if diverged else {}),
    }


def against_baseline(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows, each with ``vs_baseline``: its difference to the baseline kind
    (``compare_plan.BASELINE`` when compared, else the first) with the 95% interval over
    seeds (``compare_stats``)."""
    kinds = [r["kind"] for r in rows]
    base = rows[kinds.index(BASELINE) if BASELINE in kinds else 0]
    by_seed = {r["kind"]: dict(zip(r["seeds"], r["val_loss"], strict=True)) for r in rows}
    return [{**r, "vs_baseline": {"baseline": base["kind"],
                                  **dataclasses.asdict(difference(by_seed[r["kind"]], by_seed[base["kind"]]))}}
            for r in rows]  # fmt: skip


def _versus(d: dict[str, Any]) -> str:
    if d["low"] is None:
        return f"{d['mean']:+.3f}"
    mark = "" if d["separated"] else " ≈"
    return f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]{mark}"


def _verdict(rows: list[dict[str, Any]]) -> str:
    """The paragraph under the table: which kinds the seeds cannot separate from the baseline."""
    if not rows or "vs_baseline" not in rows[0]:
        return ""
    base = rows[0]["vs_baseline"]["baseline"]
    others = [r for r in rows if r["kind"] != base]
    if any(len(r["val_loss"]) < 2 for r in rows):
        return f"\nWith one seed there is no interval: differences to {base} are not tested (run --seeds 0,1,2).\n"
    untested = [r["kind"] for r in others if r["vs_baseline"]["low"] is None]
    broken = f"\n{', '.join(untested)}: no interval against {base}, a loss is not finite.\n" if untested else ""
    alike = [r for r in others if r["vs_baseline"]["separated"] is False]
    if not alike:
        if len(untested) == len(others):
            return broken
        every = "Every other" if untested else "Every"
        clear = f"{every} kind's 95% interval against {base} leaves out 0: each difference is larger than the seed"
        return f"{broken}\n{clear} spread.\n"
    need = ", ".join(f"{r['kind']} {r['vs_baseline']['seeds_needed'] or f'more than {MOST_SEEDS}'}" for r in alike)
    return broken + (
        f"\n≈: the 95% interval over seeds holds 0, so {len(alike)} of {len(others)} kinds cannot be told apart "
        f"from {base} at this budget; their order in the table is not a ranking. Seeds per kind that would "
        f"separate them if the observed difference and spread held: {need} (or train longer).\n"
    )


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _at_head(context: int | None) -> str:
    """The header of the column of KV-cache bytes at the context (only with local layers)."""
    return "" if context is None else f" KV bytes/sequence at context {context} (local layers: their window) |"


def _at_cell(context: int | None, row: dict[str, Any]) -> str:
    if context is None:
        return ""
    at = row.get("kv_cache_at_context")
    return f" {at['bytes']} |" if at else f" {row['kv_cache_bytes_per_token'] * context} |"  # no window: every position


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The comparison as a markdown table, best validation loss first (the tokens/s
    column only when the rows have a speed: a smoke test's have none)."""
    speed = all("tokens_per_s" in r for r in rows)
    versus = all("vs_baseline" in r for r in rows) and rows
    base = f" vs {rows[0]['vs_baseline']['baseline']} (95% CI) |" if versus else ""
    at = next((r["kv_cache_at_context"]["context"] for r in rows if r.get("kv_cache_at_context")), None)
    head = (
        f"| kind | val loss (nats/token) |{base} params | MLP width |{' tokens/s |' if speed else ''} "
        f"attn FLOPs/token prefill | decode | KV bytes/token |{_at_head(at)} peak memory |\n"
        f"|---|---|{'---|' if versus else ''}---|---|{'---|' if speed else ''}---|---|---|"
        f"{'---|' if at else ''}---|\n"
    )
    lines = []
    for r in sorted(rows, key=lambda r: r["val_loss_mean"] if math.isfinite(r["val_loss_mean"]) else math.inf):
        spread = f" ± {r['val_loss_std']:.3f}" if len(r["val_loss"]) > 1 else ""
        if r.get("diverged"):
            where = ", ".join(f"seed {d['seed']} at step {d['step']}" for d in r["diverged"])
            spread = f" (diverged: {where})"
        tokens_per_s = f" {r['tokens_per_s']:.0f} |" if speed else ""
        baseline = versus and r["kind"] == r["vs_baseline"]["baseline"]
        vs = (" baseline |" if baseline else f" {_versus(r['vs_baseline'])} |") if versus else ""
        lines.append(
            f"| {r['kind']} | {r['val_loss_mean']:.3f}{spread} |{vs} {_si(r['parameters'])} | "
            f"{r['mlp_dim'] or '4C'} |{tokens_per_s} {_si(r['prefill_flops_per_token'])} | "
            f"{_si(r['decode_flops_per_token'])} | {r['kv_cache_bytes_per_token']} |{_at_cell(at, r)} "
            f"{r['peak_memory_bytes'] / 2**20:.0f} MiB |"
        )
    return head + "\n".join(lines) + "\n" + _verdict(rows)


def _plot(rows: list[dict[str, Any]], smoke_test: bool = False) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, kv) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rows:
        steps = sorted({s for curve in r["curves"].values() for s, _ in curve})
        mean = []
        for s in steps:
            vals = [v for curve in r["curves"].values() for t, v in curve if t == s]
            mean.append(statistics.fmean(vals))
        curves.plot(steps, mean, label=r["kind"], marker="." if len(steps) < 20 else None)
        if not math.isfinite(r["val_loss_mean"]):
            continue  # a diverged run: no point on the KV-cache panel
        kv.errorbar(r["kv_cache_bytes_per_token"], r["val_loss_mean"], yerr=r["val_loss_std"] or None, fmt="o")
        kv.annotate(r["kind"], (r["kv_cache_bytes_per_token"], r["val_loss_mean"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)  # fmt: skip
    title = "smoke test: no comparison" if smoke_test else "validation loss, mean over seeds"
    curves.set(xlabel="step", ylabel="validation loss (nats/token)", title=title)
    curves.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True, min_n_ticks=1))  # whole steps
    curves.legend(fontsize=8)
    kv.set(xlabel="KV-cache bytes per token (all layers, float32)", ylabel="final validation loss",
           title="loss against KV-cache size")  # fmt: skip
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_reports(out: Path, rows: list[dict[str, Any]], header: dict[str, Any]) -> dict[str, Path]:
    """Write compare.json, compare.md and compare.png into ``out``; return their paths.

    Args:
        out: the comparison directory.
        rows: ``summarize_kind`` results.
        header: what was run (command, machine, date, preset, steps, tokens per run, ...).
    """
    out.mkdir(parents=True, exist_ok=True)
    smoke = bool(header.get("smoke_test"))
    if smoke:  # a few steps measure no speed
        rows = [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]
    else:
        rows = against_baseline(rows)
    bad = [r["kind"] for r in rows if not math.isfinite(r["val_loss_mean"])]
    data = {**header, "kinds": {r["kind"]: r for r in rows}, "non_finite": bad}
    paths = {
        "json": write_text_atomic(out / "compare.json", dumps(data, indent=2) + "\n"),
        "png": write_bytes_atomic(out / "compare.png", _plot(rows, smoke)),
    }
    described = "\n".join(f"- {k}: {v}" for k, v in header.items())
    note = SMOKE_NOTE.format(steps=header.get("steps_per_run")) if smoke else ""
    md = f"# Attention kinds compared\n\n{note}{described}\n\n{markdown_table(rows)}\n![curves](compare.png)\n"
    paths["md"] = write_text_atomic(out / "compare.md", md)
    return paths
