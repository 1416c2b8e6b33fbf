"""The one progress display of every long loop (train, compare, prune, convert, inspect --importance).

    on a terminal (tqdm, else rich):  recovery 8/20  40%|████      | [00:04<00:06, 2.0step/s, loss 0.12]
    not a terminal (a log, a pipe):    recovery 8/20 | loss 0.12 | eta 6s

A bar is drawn only when the stream is a terminal; anywhere else the display
writes plain lines, each complete with its newline, so a log never holds one
long line of carriage returns. Plain lines come at intervals: when another
tenth of the total is done or ``LINE_SECONDS`` have passed since the last line,
and once at the last unit (a caller that knows better passes ``line=True/False``).
The ETA is (time since the start) / (units done) x (units left).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = ["ProgressBar", "progress_bar", "format_duration", "LINE_SECONDS"]

LINE_SECONDS = 30.0
BAR_FORMAT = "{desc} {n_fmt}/{total_fmt} {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def format_duration(seconds: float) -> str:
    """``"1h02m03s"``, ``"5m12s"`` or ``"7s"``."""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    return f"{m}m{s:02d}s" if m else f"{s}s"


class ProgressBar:
    """Units ``initial + 1 .. total`` of one loop.

    Args:
        total: the last unit.
        initial: units already done (a resumed run starts there).
        desc: what is counted ("recovery", "step", "mha seed 0").
        unit: the unit's name, for the bar's rate.
        enabled: False writes nothing at all.
        stream: where to write (stderr by default); a bar only when it is a terminal.
    """

    def __init__(self, total: int, initial: int = 0, *, desc: str = "", unit: str = "step", enabled: bool = True,
                 stream: TextIO | None = None) -> None:  # fmt: skip
        self.total, self.initial, self.desc = total, initial, desc
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.done = initial
        self._start = self._last_line = time.perf_counter()
        self._next_tenth = initial + max(1, total // 10)
        self._lined = initial  # the last unit that got a plain line
        self._tqdm: Any = None
        self._rich: Any = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            self._open_bar(unit)

    @property
    def is_bar(self) -> bool:
        """Whether a live bar is drawn (a terminal with tqdm or rich installed)."""
        return self._tqdm is not None or self._rich is not None

    def _open_bar(self, unit: str) -> None:
        try:
            from tqdm import tqdm

            self._tqdm = tqdm(total=self.total, initial=self.initial, desc=self.desc, unit=unit, file=self.stream,
                              dynamic_ncols=True, bar_format=BAR_FORMAT)  # fmt: skip
            return
        except ImportError:
            pass
        try:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._rich = Progress(TextColumn("{task.description} {task.completed}/{task.total}"), BarColumn(),
                                  TextColumn("{task.fields[note]}"), TextColumn("eta"), TimeRemainingColumn(),
                                  console=Console(file=self.stream))  # fmt: skip
            self._task = self._rich.add_task(self.desc, total=self.total, completed=self.initial, note="")
            self._rich.start()
        except ImportError:
            self._rich = None  # neither installed: plain lines

    def eta_seconds(self) -> float:
        """Seconds left at the pace of this loop so far (0 before the first unit)."""
        done = self.done - self.initial
        return (time.perf_counter() - self._start) / done * (self.total - self.done) if done > 0 else 0.0

    def update(self, n: int | None = None, note: str | None = None, *, line: bool | None = None) -> None:
        """Unit ``n`` is done (None: the next one), with a short ``note`` (e.g. the loss).

        ``line`` decides whether this unit gets a plain line when there is no bar
        (None: the interval rule of the module docstring).
        """
        if not self.enabled:
            return
        self.done = self.done + 1 if n is None else n
        if self._tqdm is not None:
            self._tqdm.n = self.done
            if note is not None:
                self._tqdm.set_postfix_str(note, refresh=False)
            self._tqdm.refresh()
            return
        if self._rich is not None:
            self._rich.update(self._task, completed=self.done, note=note or "")
            return
        now = time.perf_counter()
        if line is None:
            moved = self.done != self._lined and (self.done >= self.total or self.done >= self._next_tenth)
            line = moved or now - self._last_line >= LINE_SECONDS
        if line:
            self._lined = self.done
            while self._next_tenth <= self.done:
                self._next_tenth += max(1, self.total // 10)
            self._last_line = now
            parts = [f"{self.desc} {self.done}/{self.total}".strip(), note, f"eta {format_duration(self.eta_seconds())}"]
            print(" | ".join(p for p in parts if p), file=self.stream, flush=True)

    def message(self, text: str) -> None:
        """One line of text (above the bar when there is one)."""
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.write(text, file=self.stream)
        elif self._rich is not None:
            self._rich.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        """Stop the bar (idempotent)."""
        if self._tqdm is not None:
            self._tqdm.close()
        elif self._rich is not None:
            self._rich.stop()
        self._tqdm = self._rich = None


@contextmanager
def progress_bar(total: int, enabled: bool, desc: str, unit: str = "step") -> Iterator[Callable[..., None]]:
    """Yields ``step(note=None)``: one unit done, with an optional short note (e.g. the loss).

    A :class:`ProgressBar` on stderr when ``enabled``; ``step`` does nothing when not.
    """
    bar = ProgressBar(total, desc=desc, unit=unit, enabled=enabled)
    try:
        yield lambda note=None: bar.update(note=note)
    finally:
        bar.close()
