"""Progress of a training run on stderr: a live bar on a terminal, plain lines otherwise.

    terminal (rich, else tqdm):  step 120/1000 ━━━━━━━━╸━━━━━━━  loss 2.3456 | val 2.4012 | 12,345 tok/s | eta 0:05:12
    not a terminal:              step 120/1000 | loss 2.3456 | val 2.4012 | 12,345 tok/s | eta 5m12s

The bar moves every step; plain lines appear once per logged step.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["Progress", "format_duration"]


def format_duration(seconds: float) -> str:
    """``"1h02m03s"``, ``"5m12s"`` or ``"7s"``."""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    return f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    """Reports steps ``initial + 1 .. total`` of a run.

    Args:
        total: the last step.
        initial: steps already done (a resumed run starts its bar there).
        enabled: False silences everything; None or True reports.
        stream: where to write (stderr by default); a bar only when it is a TTY.
    """

    def __init__(self, total: int, initial: int = 0, *, enabled: bool | None = None, stream: TextIO | None = None):
        self.total, self.initial = total, initial
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled is not False
        self._start = time.perf_counter()
        self._bar: Any = None
        self._rich: Any = None
        self._val: float | None = None
        if self.enabled and getattr(self.stream, "isatty", lambda: False)():
            self._open_bar()

    def _open_bar(self) -> None:
        try:
            from rich.console import Console
            from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
            )
            self._bar = self._rich.add_task("train", total=self.total, completed=self.initial, info="")
            self._rich.start()
            return
        except ImportError:
            pass
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, initial=self.initial, file=self.stream, unit="step", dynamic_ncols=True)
        except ImportError:
            self._bar = None  # plain lines then

    def _info(self, train_loss: float, tokens_per_s: float) -> str:
        val = "" if self._val is None else f" | val {self._val:.4f}"
        return f"loss {train_loss:.4f}{val} | {tokens_per_s:,.0f} tok/s"

    def update(
        self, step: int, train_loss: float, tokens_per_s: float, *, val_loss: float | None = None, logged: bool = False
    ) -> None:
        """Step ``step`` is done (``logged``: it is a metrics step, the one a plain line reports)."""
        if not self.enabled:
            return
        if val_loss is not None:
            self._val = val_loss
        info = self._info(train_loss, tokens_per_s)
        if self._rich is not None:
            self._rich.update(self._bar, completed=step, info=info)
        elif self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix_str(info, refresh=False)
            self._bar.refresh()
        elif logged:
            done = step - self.initial
            elapsed = time.perf_counter() - self._start
            eta = elapsed / done * (self.total - step) if done > 0 else 0.0
            print(f"step {step}/{self.total} | {info} | eta {format_duration(eta)}", file=self.stream, flush=True)

    def message(self, text: str) -> None:
        """One line of text (above the bar when there is one)."""
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.console.print(text, markup=False, highlight=False)
        elif self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        """Stop the bar (idempotent)."""
        if self._rich is not None:
            self._rich.stop()
        elif self._bar is not None:
            self._bar.close()
        self._rich = self._bar = None
