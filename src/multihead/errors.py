"""``UsageError``: a mistake in what the user asked for, told apart from a bug.

    raise UsageError(f"--keep {keep}: give the fraction of heads to keep, in (0, 1]")

It is a ``ValueError``, so code that catches ValueError keeps catching it.
The ``multihead`` command prints a UsageError as one line and exits with
status 2; any other exception raised while a command does its work is a bug
in multihead (or torch) and keeps its traceback (``multihead.cli``).
"""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(ValueError):
    """The user's own mistake: a flag's value, a file they named, options that do
    not go together, a model their options cannot build.

    The message names the value (``--out runs/x: exists and is not a folder``)
    and, where there is one, the way out; it is shown on one line.
    """
