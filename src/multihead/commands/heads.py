"""``multihead heads RUN_DIR``: how the heads of a ``--track-heads`` run took their roles.

    multihead train --preset tiny --track-heads --out runs/tiny
    multihead heads runs/tiny                      # runs/tiny/heads.png and the table
    multihead heads runs/tiny --threshold 0.5 --out induction.png   # one threshold for every role

Reads the ``"heads"`` entries of RUN_DIR/metrics.jsonl
(``multihead.train.head_series``), draws the loss curves above one panel
per tracked role (every head's score over the steps) into RUN_DIR/heads.png
(written to a temporary name and renamed), and prints each head whose score
reached its role's threshold (``tools.causal_roles.ROLE_THRESHOLDS``, which
the run recorded, or ``--threshold`` for every role) with the step where it
first did, its score at the scored step before and at the end: the
induction bump is the step where the induction heads' rows appear.

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

__all__ = ["add_arguments", "run", "format_rises"]

DESCRIPTION = (
    "Plot how every head's causal-role scores (previous-token, duplicate-token, induction, copying) changed over "
    "the steps of a run trained with --track-heads, beside its loss curves, to RUN_DIR/heads.png, and print the "
    "heads whose score reached the role's threshold with the step where it first did. See docs/heads.md."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The description and flags of ``multihead heads``."""
    parser.description = DESCRIPTION
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of 'multihead train --track-heads --out DIR'")
    parser.add_argument("--threshold", type=float, metavar="S",
                        help="a head has taken a role once its score reaches S, in (0, 1], for every role "
                             "(default: each role's own, 0.4 for the attention roles and 0.5 for copying)")  # fmt: skip
    parser.add_argument("--out", metavar="PNG", help="where to write the figure (default RUN_DIR/heads.png)")


def format_rises(series, found, given: float | None = None) -> list[str]:
    """The lines printed: what was tracked, then one row per head that reached its role's
    threshold (``found``: ``head_series.rises``; "held" when its final score is still at
    least the threshold, "fell" when it is not), and a line for each role where none did."""
    import numpy as np

    steps = series.steps
    chance = ", ".join(f"{role} {value:.3f}" for role, value in series.chance.items() if role in series.scores)
    lines = [
        f"{series.run_dir}: heads scored at {len(steps)} evaluation(s), steps {int(steps[0])}..{int(steps[-1])}, "
        f"on {series.batch} x 2·{series.length} repeated random tokens" + (f" (chance: {chance})" if chance else "")
    ]
    if found:
        lines.append(f"{'role':<16} {'layer':>5} {'head':>4} {'threshold':>9} {'reached at step':>15} "
                     f"{'score before -> then':>21} {'final':>6} {'at the end':>10}")  # fmt: skip
    for r in found:
        before = "   -" if r.before is None else f"{r.before:.3f}"
        end = "held" if r.final >= r.threshold else "fell"  # a score that crossed once and fell back is no formed head
        lines.append(f"{r.role:<16} {r.layer:>5} {r.head:>4} {r.threshold:>9g} {r.step:>15} {before:>12} -> "
                     f"{r.at:.3f} {r.final:>6.3f} {end:>10}")  # fmt: skip
    for role in series.scores:
        if any(r.role == role for r in found):
            continue
        last = series.scores[role][-1]
        top = float(np.nanmax(last)) if np.isfinite(last).any() else math.nan
        lines.append(f"{role}: no head reached {series.threshold(role, given):g} "
                     f"(best at step {int(steps[-1])}: {top:.3f})")  # fmt: skip
    return lines


def run(args: argparse.Namespace) -> int:
    """``multihead heads``: check, read the run, write the PNG, print the table. Returns 0."""
    from ..train.head_series import plot_heads, read_head_series, rises

    with checking():
        threshold = args.threshold
        if threshold is not None and not (math.isfinite(threshold) and 0 < threshold <= 1):
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
        write_bytes_atomic(png, plot_heads(series, found, threshold))
        for line in format_rises(series, found, threshold):
            print(line)
        print(f"wrote {png}")
        return 0

    return interruptible("multihead heads", str(png), work)
