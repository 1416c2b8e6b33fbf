"""``multihead heads RUN_DIR``: how the heads of a ``--track-heads`` run took their roles.

    multihead train --preset tiny --track-heads --out runs/tiny
    multihead heads runs/tiny                      # runs/tiny/heads.png and the table
    multihead heads runs/tiny --threshold 0.5 --out induction.png

Reads the ``"heads"`` entries of RUN_DIR/metrics.jsonl
(``multihead.train.head_series``), draws the loss curves above one panel
per tracked role (every head's score over the steps) into RUN_DIR/heads.png
(written to a temporary name and renamed), and prints each head whose score
reached ``--threshold`` with the step where it first did, its score at the
scored step before and at the end: the induction bump is the step where the
induction heads' rows appear.

Checked before anything is written: RUN_DIR is a run directory (it has
metrics.jsonl), the run tracked its heads, the threshold is in (0, 1], and
the PNG's folder can be written. Ctrl-C or SIGTERM while the figure is
drawn leaves the previous PNG (or none) and one line.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..paths import output_folder
from .checking import checking
from .staged_output import interruptible

__all__ = ["DEFAULT_THRESHOLD", "add_arguments", "run", "format_rises"]

DEFAULT_THRESHOLD = 0.3  # well above an even spread over the 2n keys (ln 64 / 64 = 0.065 at n = 32)
DESCRIPTION = (
    "Plot how every head's causal-role scores (previous-token, duplicate-token, induction, ...) changed over the "
    "steps of a run trained with --track-heads, beside its loss curves, to RUN_DIR/heads.png, and print the heads "
    "whose score reached --threshold with the step where it first did. See docs/heads.md."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The description and flags of ``multihead heads``."""
    parser.description = DESCRIPTION
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of 'multihead train --track-heads --out DIR'")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, metavar="S",
                        help=f"a head has taken a role once its score reaches S, in (0, 1] (default {DEFAULT_THRESHOLD})")  # fmt: skip
    parser.add_argument("--out", metavar="PNG", help="where to write the figure (default RUN_DIR/heads.png)")


def format_rises(series, found, threshold: float) -> list[str]:
    """The lines printed: what was tracked, then one row per head that reached ``threshold``
    (``found``: ``head_series.rises``), and a line for each role where none did."""
    steps = series.steps
    lines = [
        f"{series.run_dir}: heads scored at {len(steps)} evaluation(s), steps {int(steps[0])}..{int(steps[-1])}, "
        f"on {series.batch} x 2·{series.length} repeated random tokens (an even spread scores {series.uniform:.3f})"
    ]
    if found:
        lines.append(f"{'role':<16} {'layer':>5} {'head':>4} {'reached ' + format(threshold, 'g') + ' at step':>20} "
                     f"{'score before -> then':>21} {'final':>6}")  # fmt: skip
    for r in found:
        before = "   -" if r.before is None else f"{r.before:.3f}"
        lines.append(f"{r.role:<16} {r.layer:>5} {r.head:>4} {r.step:>20} {before:>12} -> {r.at:.3f} {r.final:>6.3f}")
    quiet = [role for role in series.scores if not any(r.role == role for r in found)]
    for role in quiet:
        best = series.scores[role][-1]
        top = float(best[best == best].max()) if (best == best).any() else math.nan
        lines.append(f"{role}: no head reached {threshold:g} (best at step {int(steps[-1])}: {top:.3f})")
    return lines


def run(args: argparse.Namespace) -> int:
    """``multihead heads``: check, read the run, write the PNG, print the table. Returns 0."""
    from ..train.head_series import plot_heads, read_head_series, rises

    with checking():
        threshold = args.threshold
        if not (math.isfinite(threshold) and 0 < threshold <= 1):
            raise ValueError(f"--threshold must be in (0, 1], got {threshold!r}")
        series = read_head_series(args.run_dir)
        png = Path(args.out) if args.out else Path(args.run_dir) / "heads.png"
        if png.is_dir():
            raise ValueError(f"--out {png}: is a folder (give the PNG's file name)")
        output_folder("--out" if args.out else "RUN_DIR", png.parent, [png.name])

    def work() -> int:
        from ..io import write_bytes_atomic

        found = rises(series, threshold)
        png.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(png, plot_heads(series, threshold, found))
        for line in format_rises(series, found, threshold):
            print(line)
        print(f"wrote {png}")
        return 0

    return interruptible("multihead heads", str(png), work)
