"""The tracked heads of a run (``--track-heads``): read, find where they rose, plot.

``read_head_series(run_dir)`` gathers the ``"heads"`` entries of
``metrics.jsonl`` (``multihead.train.head_tracking``) into one array per
role, with the run's loss curves::

    series.steps                  [N]        the evaluation steps that were scored
    series.scores["induction"]    [N, L, H]  NaN where a layer lacks the head
    series.loss_steps, train_loss [M]        every metrics line
    series.val_steps, val_loss    [K]        the evaluation lines

``rises(series)`` names each head whose score of a role reached the role's
threshold (``tools.causal_roles.ROLE_THRESHOLDS``, as the run recorded
them, or one given for all roles) and the first scored step at which it
did (the "induction bump" of Olsson et al. 2022 is the step where induction
heads form); ``plot_heads`` draws the loss beside every role's curves as a
PNG.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["HeadSeries", "Rise", "read_head_series", "rises", "plot_heads", "FALLBACK_THRESHOLD"]

FALLBACK_THRESHOLD = 0.4  # a role the run recorded no threshold for


@dataclass
class HeadSeries:
    """The tracked scores of one run (see the module docstring for the shapes)."""

    run_dir: Path
    steps: np.ndarray
    scores: dict[str, np.ndarray]
    layers: list[str]
    length: int
    batch: int
    chance: dict[str, float] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)
    loss_steps: np.ndarray = field(default_factory=lambda: np.zeros(0))
    train_loss: np.ndarray = field(default_factory=lambda: np.zeros(0))
    val_steps: np.ndarray = field(default_factory=lambda: np.zeros(0))
    val_loss: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def threshold(self, role: str, given: float | None = None) -> float:
        """``given``, else the role's threshold as the run recorded it (else FALLBACK_THRESHOLD)."""
        return given if given is not None else float(self.thresholds.get(role, FALLBACK_THRESHOLD))


@dataclass(frozen=True)
class Rise:
    """Head (layer, head) of ``role`` first scored at least the threshold at ``step``;
    ``before``: its score at the previous scored step (None: ``step`` is the first)."""

    role: str
    threshold: float
    layer: int
    head: int
    step: int
    before: float | None
    at: float
    final: float


def _lines(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def _numbers(values) -> dict[str, float]:
    """role -> float of a recorded dict (anything else: empty)."""
    if not isinstance(values, dict):
        return {}
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _role_series(metrics: Path, role: str, tables: list) -> np.ndarray:
    """[N, L, H] of one role's tables (None where a line lacks the role: a run tracked
    by a version without it, then resumed with one; NaN there)."""
    try:
        known = [np.asarray([[math.nan if v is None else float(v) for v in row] for row in t], dtype=np.float64)
                 for t in tables if t is not None]  # fmt: skip
        shapes = {a.shape for a in known}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"{metrics}: the tracked {role!r} scores are not [layers][heads] tables of one shape") from None
    shape = next(iter(shapes))
    it = iter(known)
    return np.stack([next(it) if t is not None else np.full(shape, math.nan) for t in tables])


def read_head_series(run_dir: str | Path) -> HeadSeries:
    """The tracked heads and loss curves of a ``multihead train`` run directory.

    Raises:
        ValueError: ``run_dir`` is not a run directory (no metrics.jsonl),
            no line holds tracked heads, or the tracked tables change shape.
    """
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: no such folder (expected the run directory of 'multihead train --out DIR')")
    if not metrics.is_file():
        raise ValueError(f"{run_dir} is not a multihead train run directory: it has no metrics.jsonl")
    rows = _lines(metrics)
    tracked = [r for r in rows if isinstance(r.get("heads"), dict) and isinstance(r["heads"].get("scores"), dict)]
    if not tracked:
        raise ValueError(
            f"{run_dir} has no tracked heads (no evaluation line of its metrics.jsonl has \"heads\"): train it with "
            f"--track-heads, or resume it with: multihead train --out {run_dir} --resume --track-heads --max-steps N"
        )
    first = tracked[0]["heads"]
    roles = list(dict.fromkeys(role for r in tracked for role in r["heads"]["scores"]))  # in order of appearance
    scores = {role: _role_series(metrics, role, [r["heads"]["scores"].get(role) for r in tracked]) for role in roles}
    losses = [r for r in rows if isinstance(r.get("train_loss"), (int, float))]
    vals = [r for r in rows if isinstance(r.get("val_loss"), (int, float))]
    return HeadSeries(
        run_dir, np.array([r["step"] for r in tracked]), scores, list(first.get("layers", [])),
        int(first.get("length", 32)), int(first.get("batch", 0)), _numbers(first.get("chance")),
        _numbers(first.get("thresholds")),
        np.array([r["step"] for r in losses]), np.array([r["train_loss"] for r in losses], dtype=np.float64),
        np.array([r["step"] for r in vals]), np.array([r["val_loss"] for r in vals], dtype=np.float64),
    )  # fmt: skip


def rises(series: HeadSeries, given: float | None = None) -> list[Rise]:
    """Every head whose score of a role reached its threshold (``given`` for every role,
    None: each role's own), by role (in the series' order) then step."""
    found = []
    for role, s in series.scores.items():
        threshold = series.threshold(role, given)
        for layer in range(s.shape[1]):
            for head in range(s.shape[2]):
                curve = s[:, layer, head]
                above = np.flatnonzero(curve >= threshold)  # NaN (no such head) is never above
                if above.size:
                    i = int(above[0])
                    before = float(curve[i - 1]) if i > 0 and np.isfinite(curve[i - 1]) else None
                    found.append(Rise(role, threshold, layer, head, int(series.steps[i]), before, float(curve[i]),
                                      float(curve[-1])))  # fmt: skip
    order = {role: k for k, role in enumerate(series.scores)}
    return sorted(found, key=lambda r: (order[r.role], r.step, -r.final))


def plot_heads(series: HeadSeries, found: list[Rise], given: float | None = None) -> bytes:
    """The PNG: the loss curves on top, then one panel per role with every head's
    score over steps (the heads of ``found`` in colour and named, the others
    grey), the role's threshold (``given`` or its own) dashed and its chance
    level dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles = list(series.scores)
    fig, axes = plt.subplots(len(roles) + 1, 1, figsize=(8, 2.2 * (len(roles) + 1) + 0.4), sharex=True)
    loss = axes[0]
    if series.loss_steps.size:
        loss.plot(series.loss_steps, series.train_loss, color="0.6", lw=0.8, label="train (batch)")
    if series.val_steps.size:
        loss.plot(series.val_steps, series.val_loss, color="C3", marker=".", lw=1.4, label="validation")
    loss.set(ylabel="loss (nats/token)", title=f"{series.run_dir}: loss and head roles")
    loss.legend(fontsize=8, loc="upper right")
    risen = {(r.role, r.layer, r.head): r for r in found}
    for ax, role in zip(axes[1:], roles, strict=True):
        s = series.scores[role]
        colour = 0
        for layer in range(s.shape[1]):
            for head in range(s.shape[2]):
                rise = risen.get((role, layer, head))
                if rise is None:
                    ax.plot(series.steps, s[:, layer, head], color="0.75", lw=0.7)
                    continue
                ax.plot(series.steps, s[:, layer, head], color=f"C{colour % 10}", lw=1.6,
                        label=f"L{layer} H{head} (step {rise.step})")  # fmt: skip
                colour += 1
        threshold = series.threshold(role, given)
        ax.axhline(threshold, color="k", ls="--", lw=0.8)
        if role in series.chance:
            ax.axhline(series.chance[role], color="k", ls=":", lw=0.8)
        low = -1.0 if role == "copying" else 0.0  # copying is in [-1, 1]; signed weights may leave [0, 1] too
        finite = s[np.isfinite(s)]
        ax.set(ylabel=f"{role.replace('_', ' ')}\nscore",
               ylim=(min(low, float(finite.min(initial=low))) - 0.02, max(1.0, float(finite.max(initial=1.0))) + 0.02))  # fmt: skip
        if colour:
            ax.legend(fontsize=7, loc="best", ncol=min(4, colour), framealpha=0.6)
        else:
            ax.text(0.01, 0.9, f"no head reached {threshold:g}", transform=ax.transAxes, fontsize=8, va="top")
    axes[-1].set_xlabel(f"step  (scores on {series.batch} x 2·{series.length} repeated random tokens; "
                        "dashed: threshold, dotted: chance)")  # fmt: skip
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
