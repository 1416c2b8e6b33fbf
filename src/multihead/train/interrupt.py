"""Stopping a training run cleanly on Ctrl-C (SIGINT) or SIGTERM.

While the loop runs, :class:`StopSignals` holds handlers for both signals
(the previous ones come back when it ends). The first signal only sets a
flag; after each optimizer step the processes agree on it::

    step s done -> stop = max over ranks of (the signal this rank got, or 0)
                   (one all-reduce of a 1-element tensor; nothing with one process)
    stop != 0   -> checkpoint after step s (unless one was just written),
                   then raise TrainingInterrupted(signal, step)

so every rank of a torchrun launch stops after the same step, and the
checkpoint resumes to the very numbers of an uninterrupted run. A second
signal ``REPEAT_WINDOW_S`` seconds or more after the first stops at once:
``TrainingInterrupted`` with ``checkpointed=False`` is raised from the
handler (the last checkpoint stays, as after a kill). One sooner is the same
stop delivered twice and changes nothing: a Ctrl-C under torchrun reaches
each worker from the terminal and again from torchrun, which forwards it
(and kills the workers if they are not done within its shutdown timeout,
30 s by default). ``multihead train`` turns the exception into one
line that gives the command resuming the run, and exits with 128 + the
signal's number (130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["TrainingInterrupted", "StopSignals", "SIGNALS", "REPEAT_WINDOW_S"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_WINDOW_S = 2.0  # a second signal this soon after the first is the same stop


class TrainingInterrupted(Exception):
    """The run stopped on a signal.

    Attributes:
        signum: the signal's number (the largest one when ranks got different ones).
        step: optimizer steps completed and checkpointed; None when a second
            signal stopped the run at once (then the last checkpoint is
            whatever was written before).
        run_dir: the run directory.
        exit_status: 128 + signum, the shell's convention.
    """

    def __init__(self, signum: int, step: int | None, run_dir: Path) -> None:
        self.signum, self.step, self.run_dir = signum, step, Path(run_dir)
        name = signal.Signals(signum).name
        if step is None:
            text = f"{name} again: stopped at once in {run_dir}, without a checkpoint of the current step"
        else:
            text = f"{name}: stopped after step {step} with a checkpoint in {run_dir}"
        super().__init__(text)

    @property
    def checkpointed(self) -> bool:
        return self.step is not None

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class StopSignals:
    """A context that holds SIGINT and SIGTERM handlers for one run.

    Outside the main thread (where Python cannot install handlers) it does
    nothing and :meth:`agreed` only reports the other ranks' signals.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.signum = 0
        self._first = 0.0  # time.monotonic() of the first signal
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        """Put the previous handlers back (idempotent)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first = signum, now
        elif now - self._first >= REPEAT_WINDOW_S:  # a second stop: now
            self.restore()
            raise TrainingInterrupted(signum, None, self.run_dir)

    def agreed(self, world, device: torch.device) -> int:
        """The signal some rank got (0: none), the same on every rank (collective)."""
        if world.size == 1:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
