"""Run ``multihead ARGV`` in the test process with its output captured."""

from __future__ import annotations

import contextlib
import io

from multihead.cli import main


def quietly(*argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``multihead ARGV``; a mistake exits through SystemExit(2).

    Unlike pytest's capsys this also serves module-scoped fixtures.
    """
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as exc:
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()
