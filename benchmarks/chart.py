"""A bar chart of a run's ratios, one bar per (case, scenario, pair).

    ratio_chart([record, ...], Path("out/suite.png"))

Each bar is the median of the per-round ratios (numerator / denominator,
as in the report's table) with its interquartile range as an error bar; a
line marks 1 (equal time). Below 1 the numerator is faster. The figure's
title and footer carry the command, machine, date and load average of
each record, so the PNG says where its numbers come from on its own.
The PNG is written by ``multihead.io.write_atomic`` (staged beside
``path``, then renamed over it, with the mode a plain open() gives).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from multihead.io import write_atomic

__all__ = ["ratio_bars", "ratio_chart"]


def ratio_bars(records: list[dict[str, Any]]) -> list[tuple[str, float, float, float]]:
    """(label, per-round median, q1, q3) for every ratio of every record."""
    bars = []
    prefix = len(records) > 1
    for record in records:
        for res in record["results"]:
            for name, ratio in res.get("ratios", {}).items():
                num, den = ratio.get("numerator", name), ratio.get("denominator", res["baseline"])
                pr = ratio["per_round"]
                label = f"{record['case']}: " * prefix + f"{res['scenario']}: {num} / {den}"
                bars.append((label, pr["median"], pr["q1"], pr["q3"]))
    return bars


def _footer(record: dict[str, Any]) -> str:
    m = record["machine"]
    loads = [x for res in record["results"] for x in (res.get("load_average_before"), res.get("load_average_after")) if x]
    load = f"load {loads[0][0]}-{loads[-1][0]}" if loads else "load ?"
    command = textwrap.fill(record["command"], 150, subsequent_indent="    ")
    return (f"{command}\n{m['cpu_model']}, {m['cpus_usable']} CPUs, torch {m['torch']}"
            f"{', CUDA' if m.get('cuda') else ''} | {record.get('started', '?')} to {m['date']} | {load}")  # fmt: skip


def ratio_chart(records: list[dict[str, Any]], path: Path) -> Path:
    """Draw every ratio of ``records`` as a horizontal bar; write ``path`` (PNG).

    Raises:
        ValueError: the records hold no ratio (a dry run, or nothing timed).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = ratio_bars(records)
    if not bars:
        raise ValueError("no ratios to draw: the records hold no timed comparison")
    labels = [b[0] for b in bars]
    medians = [b[1] for b in bars]
    err = [[b[1] - b[2] for b in bars], [b[3] - b[1] for b in bars]]
    footer = "\n".join(_footer(r) for r in records)
    lines = footer.count("\n") + 1
    height = 1.4 + 0.28 * len(bars) + 0.12 * lines
    fig, ax = plt.subplots(figsize=(11, height))
    colours = ["tab:green" if m < 1 else "tab:red" for m in medians]
    y = list(range(len(bars)))[::-1]
    ax.barh(y, medians, xerr=err, color=colours, alpha=0.8, error_kw={"elinewidth": 1, "capsize": 2})
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_xlabel("time ratio, per-round median with IQR (below 1: the first named is faster)")
    for yi, (_, m, _, q3) in zip(y, bars):
        ax.text(max(m, q3), yi, f" {m:.2f}", va="center", fontsize=6)
    ax.set_title(", ".join(sorted({r["case"] for r in records})), fontsize=9)
    fig.text(0.01, 0.005, footer, fontsize=6, va="bottom", family="monospace")
    fig.tight_layout(rect=(0, min(0.5, 0.12 * lines / height + 0.01), 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_atomic(path, lambda staged: fig.savefig(staged, format="png", dpi=110))
    finally:
        plt.close(fig)
    return path
