"""Telling the user's mistakes from bugs: a command checks, then works.

A command first checks everything it was given -- the flags, the files they
name, the model those options build -- inside ``checking()``, and only then
does its work::

    def run(args) -> int:
        with checking():
            job = prepare(args)   # ValueError, TypeError, OSError, ImportError: the user's mistake
        return work(job)          # only UsageError is; anything else is a bug

Inside ``checking()`` those four exception types become ``UsageError``
(the original is chained as its cause, which ``multihead --debug`` shows).
During the work only ``UsageError`` and an ``OSError`` of the disk the
user chose (full, read-only, no permission: ``environment_error``) are the
user's; ``multihead.cli`` prints any other exception with its traceback as
a bug.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import UsageError

__all__ = ["USER_ERRORS", "checking", "environment_error", "one_line"]

# What checking the user's input may raise for the user's own mistake.
USER_ERRORS = (ValueError, TypeError, OSError, ImportError)
# An OSError with one of these numbers during the work is the disk or the
# folder the user chose, not multihead.
_ENVIRONMENT_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EFBIG", "EACCES", "EPERM", "EROFS") if hasattr(errno, name)
)


def one_line(error: BaseException) -> str:
    """The error's message on one line (an error without one names its type)."""
    text = " ".join(str(error).split())
    return text or type(error).__name__


@contextmanager
def checking() -> Iterator[None]:
    """Everything raised inside is the user's mistake: a ValueError, TypeError,
    OSError or ImportError leaves as a ``UsageError`` with the same message."""
    try:
        yield
    except UsageError:
        raise
    except USER_ERRORS as e:
        raise UsageError(one_line(e)) from e


def environment_error(error: BaseException) -> bool:
    """True for an OSError of the machine rather than of multihead: a full disk
    or quota, a file too large, a read-only file system, no permission."""
    return isinstance(error, OSError) and error.errno in _ENVIRONMENT_ERRNOS
