"""The KV-cache rows of the before/after table ``prune`` and ``convert`` print,
and the lines they print after it.

A model with local layers (a layer with ``window``, whose decoding cache holds
its window: ``modules.window_cache``) also gets the bytes of one sequence's
caches at its context (``config.context_length``): report.json's
``kv_cache_at_context`` = {"context": n, "bytes": [before, after]}
(``tools.flops.kv_cache_size(model, context=n).bytes``), None otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .recovery_option import describe


def kv_cache_entries(before: nn.Module, after: nn.Module) -> dict:
    """The report's KV-cache entries of the model before and after: ``kv_cache_bytes_per_token``
    [before, after], ``kv_cache_dtype`` (the model's after) and ``kv_cache_at_context``
    (see the module docstring)."""
    from ..tools.flops import kv_cache_size

    context = getattr(getattr(after, "config", None), "context_length", None)
    local = any(getattr(m, "sliding_window", None) for model in (before, after) for m in model.modules())
    context = context if local and isinstance(context, int) else None
    sizes = [kv_cache_size(model, context=context) for model in (before, after)]
    at = None if context is None else {"context": context, "bytes": [s.bytes for s in sizes]}
    return {"kv_cache_bytes_per_token": [s.bytes_per_token for s in sizes], "kv_cache_dtype": sizes[1].dtype,
            "kv_cache_at_context": at}  # fmt: skip


def kv_cache_rows(report: dict) -> list[tuple]:
    """(label, before, after) rows of the report's KV-cache entries."""
    rows = [(f"KV cache (bytes/token, {report['kv_cache_dtype']})", *report["kv_cache_bytes_per_token"])]
    at = report.get("kv_cache_at_context")
    if at is not None:
        rows.append((f"KV cache (bytes/sequence at context {at['context']})", *at["bytes"]))
    return rows


def echo_measurements(report: dict, echo: Callable[[str], None]) -> None:
    """Recovery, held-out fidelity, and what the embeddings and validation were measured on."""
    if report.get("kv_cache_at_context") is not None:
        echo("  (KV cache at context: one sequence's caches, a local layer's holding its window, a global's "
             "every position)")  # fmt: skip
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
