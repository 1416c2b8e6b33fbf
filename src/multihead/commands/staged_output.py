"""Output folders written whole or not at all, and Ctrl-C / SIGTERM during the work.

``multihead prune`` and ``multihead convert`` write their folder into a
staging folder (beside it, or inside an existing one) and move it into
place at the end::

    parent/.OUT.<pid>.<32 hex>.tmp/    config.json, model.safetensors, ... written here
    parent/OUT/                        <- os.rename(staging, OUT) when OUT does not exist

    OUT/.output.<pid>.<32 hex>.tmp/    an existing OUT is staged inside it; then each file
    OUT/config.json, ...               <- os.replace'd, and an output file of an earlier run
                                          that this run does not write (a tokenizer.json) is
                                          removed; the user's other files stay

SIGINT and SIGTERM during the moves are held back until they are done, so
OUT is the old folder or the new one. ``interruptible`` runs a command's
body with handlers for both signals: an interrupt raises ``Interrupted``
where the work is, the staging folder is removed on the way out, and the
command prints one line and exits with 128 + the signal number (130 for
SIGINT, 143 for SIGTERM). A staging folder left by a ``kill -9`` is removed
by the next write to the same OUT (``multihead.io.remove_stale_temps``).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..io import remove_stale_temps

__all__ = ["Interrupted", "interruptible", "write_folder"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_INSIDE = "output"  # an existing folder is staged in OUT/.output.<pid>.<hex>.tmp/


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived during the work (a BaseException: no ``except Exception`` stops it).

    Attributes:
        signum: the signal's number.
        written: whether the output folder had been moved into place already.
    """

    def __init__(self, signum: int, written: bool = False) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.written = signum, written


class _State:
    holding = False  # True while the staged files move into place
    pending: int | None = None


def _handler(signum, frame) -> None:
    if _State.holding:
        _State.pending = signum
        return
    raise Interrupted(signum)


@contextmanager
def _held_signals() -> Iterator[None]:
    _State.holding, _State.pending = True, None
    try:
        yield
    finally:
        _State.holding = False
    if _State.pending is not None:
        raise Interrupted(_State.pending, written=True)


def interruptible(command: str, out: str, body: Callable[[], int]) -> int:
    """``body()``, or 128 + the signal's number after one line on stderr when SIGINT or SIGTERM arrives.

    Handlers are installed only in the main thread (elsewhere ``body`` runs
    as it is); the previous handlers are put back afterwards.
    """
    if threading.current_thread() is not threading.main_thread():
        return body()
    previous = {s: signal.signal(s, _handler) for s in _SIGNALS}
    try:
        return body()
    except Interrupted as e:
        name = signal.Signals(e.signum).name
        if e.written:
            print(f"{command}: interrupted by {name} after {out} was written in full", file=sys.stderr)
        else:
            print(f"{command}: interrupted by {name}; {out} was not written (nothing was left behind)",
                  file=sys.stderr)  # fmt: skip
        return 128 + e.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def write_folder(folder: str | os.PathLike, write: Callable[[Path], object], names: Iterable[str]) -> Path:
    """Write a folder whole: ``write(staging)`` fills a staging folder, then it moves in (module docstring).

    Args:
        folder: the output folder (made with its parents when missing).
        write: fills the empty staging folder it is given.
        names: the file names this output owns: in an existing ``folder``
            each is replaced by the staged one, or removed when this run
            wrote none; other files there are left alone.

    Returns:
        ``folder`` as a Path. On any exception (``Interrupted`` included) the
        staging folder is removed and ``folder`` is as it was.
    """
    folder = Path(folder)
    parent = Path(os.path.abspath(folder)).parent
    made = []  # the parents this call creates, deepest first: removed again if it fails
    up = parent
    while not os.path.lexists(up):
        made.append(up)
        up = up.parent
    parent.mkdir(parents=True, exist_ok=True)
    exists = os.path.lexists(folder)
    # a new folder is staged beside it and renamed; an existing one inside it (its own file
    # system and permissions: the user may write there but not beside it)
    target = folder / _INSIDE if exists else folder
    remove_stale_temps(target)
    staging = target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    os.mkdir(staging)
    try:
        try:
            write(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            for d in made:
                try:
                    os.rmdir(d)
                except OSError:
                    break
            raise
        with _held_signals():
            if not exists:
                os.rename(staging, folder)
            else:
                for name in names:
                    if (staging / name).is_file():
                        os.replace(staging / name, folder / name)
                    elif (folder / name).is_file():
                        (folder / name).unlink()
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
