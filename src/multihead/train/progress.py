"""Progress of a training run on stderr (``multihead.progress``): a live bar on a terminal, plain lines otherwise.

    terminal (tqdm, else rich):  step 120/1000  12%|█▏   | [00:30<03:40, 4.0step/s, loss 2.3456 | val 2.4012 | 12,345 tok/s]
    not a terminal:              step 120/1000 | loss 2.3456 | val 2.4012 | 12,345 tok/s | eta 5m12s

The bar moves every step; plain lines appear once per logged step.
"""

from __future__ import annotations

from typing import TextIO

from ..progress import ProgressBar, format_duration

__all__ = ["Progress", "format_duration"]


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
        self.enabled = enabled is not False
        self._bar = ProgressBar(total, initial, desc="step", enabled=self.enabled, stream=stream)
        self._val: float | None = None

    def update(
        self, step: int, train_loss: float, tokens_per_s: float, *, val_loss: float | None = None, logged: bool = False
    ) -> None:
        """Step ``step`` is done (``logged``: it is a metrics step, the one a plain line reports)."""
        if val_loss is not None:
            self._val = val_loss
        val = "" if self._val is None else f" | val {self._val:.4f}"
        self._bar.update(step, f"loss {train_loss:.4f}{val} | {tokens_per_s:,.0f} tok/s", line=logged)

    def message(self, text: str) -> None:
        """One line of text (above the bar when there is one)."""
        self._bar.message(text)

    def close(self) -> None:
        """Stop the bar (idempotent)."""
        self._bar.close()
