"""The runs of ``multihead compare``: shared data, one child process per run, kept results.

    OUT/tokenizer/, OUT/data/{train,val}.bin     tokenized once (``prepare_shared_data``);
                                                 every run's data/*.bin are hard links to these
    OUT/compare-state.json                       {"config": what was asked, "steps": steps per run,
                                                  "command", "started": the first call's date}
    OUT/<kind>-seed<s>/                          a ``multihead train`` run directory
    OUT/<kind>-seed<s>/compare-result.json       written (atomically) when the run finished, or
                                                 stopped on a diverged loss (then "val_loss" is
                                                 null and "diverged" says where; strict JSON)
    OUT/<kind>-seed<s>.log                       the run's own output (its progress lines, errors)

A run is a child process (``run_child``) so its peak memory is its own
(``os.wait4``: peak resident set; on CUDA the peak allocation the child
records). While it trains, this process follows its metrics.jsonl and shows
the kind, its step and the ETA (``multihead.progress``). On SIGINT or SIGTERM
the child is stopped and :class:`Interrupted` is raised; the runs that
finished keep their ``compare-result.json``, so the same command continues
with the others (``check_continuation``). The seeds are no part of the
setting: the same command with more seeds grows the comparison, training only
the runs it does not hold yet.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UsageError
from ..io import read_json_file, write_text_atomic
from .compare_json import dumps, loss
from .config import TrainConfig
from .divergence import EXIT_STATUS as EXIT_DIVERGED
from .divergence import read_outcome

__all__ = [
    "Interrupted", "interruptible", "prepare_shared_data", "check_continuation", "save_state", "kept_result",
    "train_run", "run_child", "comparison_started", "RESULT", "STATE",
]  # fmt: skip

RESULT, STATE, PREPARED = "compare-result.json", "compare-state.json", "prepared.json"
POLL_S = 0.25  # how often the child's metrics are read
STOP_S = 30.0  # how long a stopped child may take to exit before it is killed


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived during a comparison (``exit_status``: 128 + the signal's number)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_status = 128 + signum
        self.kept: list[str] = []  # the finished runs, filled in by ``compare``
        super().__init__(f"stopped by {self.name}")


_held: dict[str, Any] = {"holding": False, "signum": None}  # a signal that arrived while a child was being started


def _raise(signum, frame):
    if _held["holding"]:
        _held["signum"] = signum
        return
    raise Interrupted(signum)


@contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Interrupted` inside (main thread only; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _raise_held() -> None:
    """Stop holding signals; raise :class:`Interrupted` for one that arrived meanwhile."""
    signum, _held["holding"], _held["signum"] = _held["signum"], False, None
    if signum is not None:
        raise Interrupted(signum)


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    """The setting a continuation must repeat: everything asked but the folder and the seeds."""
    return json.loads(json.dumps({k: v for k, v in config.items() if k not in ("out", "seeds")}))


def _shown(value: Any) -> str:
    return "unset" if value is None else repr(value)


def check_continuation(out: Path, config: dict[str, Any], run_dirs: list[Path]) -> int | None:
    """The steps per run of the comparison ``out`` already holds when it was asked with the
    same ``config`` but perhaps other seeds (this command continues or grows it), else
    None (a fresh comparison).

    Raises:
        UsageError: ``out`` holds another comparison, or run directories with
            checkpoints but no record of what asked for them.
    """
    state = out / STATE
    if state.is_file():
        saved = read_json_file(state)
        if _comparable(saved.get("config", {})) != _comparable(config):
            given, old = _comparable(config), _comparable(saved.get("config", {}))
            diff = "; ".join(f"{k}: {_shown(old.get(k))} there, {_shown(given.get(k))} here"
                             for k in sorted({*given, *old}) if old.get(k) != given.get(k))  # fmt: skip
            raise UsageError(
                f"--out {out} holds another comparison ({diff}); continue it with "
                f"its own flags ({saved.get('command', 'see ' + str(state))}) or choose another --out"
            )
        return int(saved["steps"])
    taken = [d.name for d in run_dirs if (d / "checkpoints").exists()]
    if taken:
        raise UsageError(f"--out {out} already holds training runs {taken} of no comparison it knows; choose another --out")
    return None


def save_state(out: Path, config: dict[str, Any], steps: int, command: str, started: str) -> None:
    """Record what was asked, the steps per run and when the comparison began (``started``),
    so the same command (or one with other seeds) can continue."""
    out.mkdir(parents=True, exist_ok=True)
    record = {"config": _comparable(config), "seeds": list(config.get("seeds", ())), "steps": steps,
              "command": command, "started": started}  # fmt: skip
    write_text_atomic(out / STATE, json.dumps(record) + "\n")


def comparison_started(out: Path) -> str | None:
    """The date the comparison in ``out`` began (its first call), else None."""
    state = out / STATE
    return read_json_file(state).get("started") if state.is_file() else None


def prepare_shared_data(base: TrainConfig, out: Path) -> Path:
    """Tokenize ``base.data`` once into ``out`` (tokenizer/ and data/{train,val}.bin), unless
    done already; return ``out``. Every run links its token files to these.

    Raises:
        UsageError: a split too short for one batch (the message names the data).
    """
    from .batches import Batches, write_tokens
    from .corpus import load_corpus
    from .tokenizer import train_tokenizer

    if (out / "data" / PREPARED).is_file():
        return out
    corpus = load_corpus(base.data)
    tokenizer = train_tokenizer(base.tokenizer, corpus.train, base.vocab_size)
    for name, text in (("train", corpus.train), ("val", corpus.val)):
        ids = np.asarray(tokenizer.encode(text))
        try:
            Batches(ids, batch_size=base.batch_size, context_length=base.context_length, seed=0)
        except ValueError as e:
            raise UsageError(f"{name} split of data={base.data!r}: {e}") from None
        (out / "data").mkdir(parents=True, exist_ok=True)
        write_tokens(ids, out / "data" / f"{name}.bin")
    tokenizer.save(out / "tokenizer")
    write_text_atomic(out / "data" / PREPARED, json.dumps({"data": base.data, "tokenizer": base.tokenizer}) + "\n")
    return out


def kept_result(run_dir: Path) -> dict[str, Any] | None:
    """The result of a run that finished earlier (its ``compare-result.json``), else None."""
    path = run_dir / RESULT
    if not path.is_file():
        return None
    result = read_json_file(path)
    return {**result, "val_loss": loss(result["val_loss"]),
            "curve": [[step, loss(value)] for step, value in result["curve"]]}  # fmt: skip


def _last_metrics(path: Path) -> dict[str, Any] | None:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue  # a line being written
    return None


def _read_run(run_dir: Path, seed: int, peak: int, diverged: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's result from its metrics.jsonl; a diverged run (``diverged``: its
    ``divergence.read_outcome``) has a NaN loss and the curve up to its last good evaluation."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    rows = [json.loads(line) for line in text.splitlines() if line]
    curve = [[r["step"], r["val_loss"]] for r in rows if r.get("val_loss") is not None]
    if not curve and diverged is None:
        raise RuntimeError(f"{path} has no validation loss")
    speeds = sorted(r["tokens_per_s"] for r in rows if r.get("tokens_per_s"))
    result = {"seed": seed, "val_loss": math.nan if diverged else curve[-1][1], "curve": curve,
              "tokens_per_s": speeds[len(speeds) // 2] if speeds else 0.0, "peak_memory_bytes": peak}  # fmt: skip
    if diverged:
        result["diverged"] = {"step": diverged["step"], "which": diverged["which"], "value": diverged["value"]}
    return result


def _stop(child: subprocess.Popen) -> None:
    """Ask the child to stop (SIGTERM), then kill it if it takes longer than ``STOP_S``."""
    if child.poll() is not None:
        return
    child.terminate()
    try:
        child.wait(STOP_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def train_run(
    train_config: TrainConfig, seed: int, *, data_from: Path, imports: tuple[str, ...] = (),
    show: Callable[[int, dict[str, Any] | None], None] = lambda step, metrics: None,
) -> dict[str, Any]:  # fmt: skip
    """Train one run in a child process and return its result (also written to its
    ``compare-result.json``); ``show(step, last metrics)`` is called as it trains.
    A run whose loss diverged (``multihead.train.divergence``) is a result too:
    its "val_loss" is NaN and its "diverged" holds the step and the value.
    "seconds" is the run's wall-clock time, its process's start included.

    A run directory that holds a checkpoint (a run stopped while saving) is resumed.

    Raises:
        RuntimeError: the child failed (the message has the last line of its log).
        Interrupted: SIGINT/SIGTERM (the child is stopped first).
    """
    from ..models.run_dirs import latest_checkpoint

    run_dir = Path(train_config.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    resume = latest_checkpoint(run_dir) is not None
    spec = write_text_atomic(run_dir / "compare-run.json", json.dumps(
        {"config": train_config.to_dict(), "resume": resume, "data_from": str(data_from)}))  # fmt: skip
    code = "import sys; from multihead.train.compare_runs import run_child; run_child(sys.argv[1], sys.argv[2:])"
    log, began = run_dir.with_suffix(".log"), time.perf_counter()
    with open(log, "a" if resume else "w", encoding="utf-8") as f:
        # a signal while the child starts is held until the child is known to the `try` that stops it
        _held["holding"], _held["signum"] = True, None
        try:
            child = subprocess.Popen([sys.executable, "-c", code, str(spec), *imports], stdout=f,
                                     stderr=subprocess.STDOUT)  # fmt: skip
        except BaseException:
            _held["holding"] = False
            raise
        try:
            _raise_held()
            while True:
                pid, status, usage = os.wait4(child.pid, os.WNOHANG)
                if pid:
                    break
                last = _last_metrics(run_dir / "metrics.jsonl")
                show(int(last["step"]) if last else 0, last)
                time.sleep(POLL_S)
        except BaseException:
            _stop(child)
            raise
    child.returncode = os.waitstatus_to_exitcode(status)
    diverged = read_outcome(run_dir) if child.returncode == EXIT_DIVERGED else None
    if child.returncode != 0 and diverged is None:
        tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
        raise RuntimeError(f"training {run_dir.name} failed (exit {child.returncode}): {' '.join(tail)}; see {log}")
    peak = usage.ru_maxrss * 1024  # Linux reports KiB
    cuda = run_dir / "compare-cuda-peak.json"
    if cuda.exists():
        peak = read_json_file(cuda)["peak_bytes"]
    result = {**_read_run(run_dir, seed, peak, diverged), "seconds": time.perf_counter() - began}
    if diverged is None:
        show(train_config.max_steps, _last_metrics(run_dir / "metrics.jsonl"))
    write_text_atomic(run_dir / RESULT, dumps(result) + "\n")
    return result


def run_child(spec: str, imports: list[str] | tuple[str, ...] = ()) -> None:
    """The child process of one run: import ``imports`` (the parent's ``--import``
    modules; ``python -c`` searches the current folder first, as the parent
    did), train with progress lines into its log, and record the CUDA peak when there is one.

    A Ctrl-C on the terminal reaches the whole process group; the child ignores
    it and ends when the parent stops it (SIGTERM), so one process decides.
    """
    import importlib

    import torch

    from .divergence import LossDiverged
    from .loop import train

    signal.signal(signal.SIGINT, signal.SIG_IGN)

    for name in imports:
        importlib.import_module(name)
    run = read_json_file(spec)
    config = TrainConfig.from_dict(run["config"])
    try:
        train(config, resume=run["resume"], progress=True, data_from=run["data_from"])
    except LossDiverged as e:  # recorded in the run directory by the loop; the parent reads it
        print(f"multihead train: {e}", flush=True)
        sys.exit(e.exit_status)
    if torch.cuda.is_available():
        peak = {"peak_bytes": int(torch.cuda.max_memory_allocated())}
        write_text_atomic(Path(config.out) / "compare-cuda-peak.json", json.dumps(peak))
