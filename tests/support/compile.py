"""Helpers for the torch.compile tests."""

from __future__ import annotations

from typing import Any

import torch


def explain_and_run(fn, *args) -> tuple[Any, Any]:
    """``torch._dynamo.explain(fn)(*args)`` and the outputs of that compiled run.

    explain traces ``fn`` with dynamo and runs the captured graphs op by op
    (as ``backend="eager"`` does); the outputs are kept through a list that
    the traced function appends to (dynamo replays the append after the graph).

    Returns:
        (the ExplainOutput, what the compiled ``fn`` returned).
    """
    outputs = []

    def run(*a):
        out = fn(*a)
        outputs.append(out)
        return out

    explained = torch._dynamo.explain(run)(*args)
    assert len(outputs) == 1, f"the compiled function ran {len(outputs)} times"
    return explained, outputs[0]
