"""The lines ``prune`` and ``convert`` print after their before/after table."""

from __future__ import annotations

from collections.abc import Callable

from .recovery_option import describe


def echo_measurements(report: dict, echo: Callable[[str], None]) -> None:
    """Recovery, held-out fidelity, and what the embeddings and validation were measured on."""
    if report["recovery"] is not None:
        echo(describe(report["recovery"]))
    if report["fidelity"] is not None:
        f = report["fidelity"]
        echo(f"  held-out fidelity ({f['lines']} lines): mean cosine {f['mean_cosine']:.4f}, "
             f"top-10 neighbours kept {f['neighbours_top10']:.3f}")  # fmt: skip
    if report["pooling"] is not None:
        echo(f"  (embeddings: {report['pooling']})")
    if report["val_batches"] is not None:
        echo(f"  (validation: {report['val_batches']})")
