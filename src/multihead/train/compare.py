"""``multihead compare``: train one GPT per attention kind on the same data and budget.

    for kind in kinds:                      (compare_plan: options, size-matched MLP, costs)
        for seed in seeds:
            a child process runs train(TrainConfig(attention=kind, seed=seed, ...))
            into OUT/<kind>-seed<seed>/    (its own metrics.jsonl, checkpoints, train.log)
            peak memory = the child's peak resident set (CPU) or peak CUDA allocation
    OUT/compare.json, compare.md, compare.png        (compare_report)

Every run sees the same tokens: the same preset, data, tokenizer, batch
size, context and number of steps. ``--budget-minutes`` turns a wall-clock
budget into that number of steps: each kind's training step is timed here
for a few steps first, and the steps are those that fit the budget for all
runs together (with 25 % headroom for evaluation, data preparation and the
processes' start-up). Each run is a child process so its peak memory is its
own (``os.wait4`` resource usage).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import UsageError
from ..io import read_json_file, write_text_atomic
from ..models.gpt import GPT, GPTConfig
from .compare_plan import KindPlan, default_kinds, plan_kind
from .compare_report import summarize_kind, write_reports
from .config import TrainConfig

__all__ = ["CompareConfig", "compare", "plan_comparison", "steps_for_budget"]

HEADROOM = 0.75  # share of the budget the timed training steps may take
# The shared setting by default: a model that learns in a few hundred steps
# on a 2-core CPU, so nine kinds and two seeds fit the default budget.
DEFAULT_TRAIN: dict[str, Any] = {"preset": "mini", "context_length": 128, "batch_size": 16, "warmup": 20, "lr": 1e-3}
EVAL_POINTS = 8  # validation losses per curve when eval_every is not given


@dataclass
class CompareConfig:
    """What ``multihead compare`` runs.

    Args:
        kinds: attention kinds (registered names; default ``compare_plan.default_kinds()``,
            every registered kind that does not opt out).
        seeds: one run per kind and seed; the spread of the final
            validation loss is over these.
        max_steps: training steps of every run; None: from ``budget_minutes``.
        budget_minutes: wall-clock budget of the whole comparison (used when
            ``max_steps`` is None).
        out: the comparison directory.
        train: ``TrainConfig`` fields shared by every run (preset, data,
            tokenizer, batch_size, context_length, eval_every, ...), over
            ``DEFAULT_TRAIN``. Unless given, ``eval_every`` gives
            ``EVAL_POINTS`` points per curve, ``checkpoint_every`` keeps only
            the final checkpoint, and ``warmup`` is at most a tenth of the steps.
        imports: modules each run's process imports before it trains: those
            that register kinds of ``kinds`` (``multihead compare --import``;
            this process must have imported them too).
    """

    kinds: tuple[str, ...] = dataclasses.field(default_factory=default_kinds)
    seeds: tuple[int, ...] = (0, 1)
    max_steps: int | None = None
    budget_minutes: float = 18.0
    out: str = "runs/compare"
    train: dict[str, Any] = dataclasses.field(default_factory=dict)
    imports: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.kinds or not self.seeds:
            raise ValueError(f"compare needs kinds and seeds, got kinds={self.kinds}, seeds={self.seeds}")
        if self.max_steps is None and not (isinstance(self.budget_minutes, (int, float)) and self.budget_minutes > 0):
            raise ValueError(f"budget_minutes must be > 0, got budget_minutes={self.budget_minutes!r}")


def _train_config(config: CompareConfig, plan: KindPlan, seed: int, steps: int, out: Path) -> TrainConfig:
    fields = {
        "eval_every": max(1, steps // EVAL_POINTS),
        "checkpoint_every": steps,
        **DEFAULT_TRAIN,
        **config.train,
        "attention": plan.kind,
        "attention_options": plan.attention_options,
        "mlp_dim": plan.mlp_dim,
        "seed": seed,
        "max_steps": steps,
        "out": str(out),
    }
    if "warmup" not in config.train:
        fields["warmup"] = min(fields["warmup"], steps // 10)
    return TrainConfig.from_dict(fields)


def _base_model_config(train: TrainConfig) -> GPTConfig:
    """The MHA model of the comparison. The vocabulary size only shifts every kind's
    count by the same embedding, so a BPE run without ``vocab_size`` plans with 256."""
    return GPTConfig.from_preset(
        train.preset, vocab_size=train.vocab_size or 256, context_length=train.context_length, dropout=train.dropout
    )


def _step_seconds(model_config: GPTConfig, batch_size: int, steps: int = 2) -> float:
    """Median seconds of one training step (forward, loss, backward, AdamW) on random tokens."""
    torch.manual_seed(0)
    model = GPT(model_config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    T = model_config.context_length
    x = torch.randint(0, model_config.vocab_size, (batch_size, T + 1))
    times = []
    for i in range(steps + 1):
        t = time.perf_counter()
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()) + model.aux_loss()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first step warms up
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def steps_for_budget(budget_s: float, step_seconds: list[float], runs_per_kind: int) -> int:
    """Training steps that fit ``HEADROOM`` of ``budget_s`` for every run.

    Raises:
        UsageError: not even one step fits.
    """
    per_step = runs_per_kind * sum(step_seconds)
    steps = math.floor(HEADROOM * budget_s / per_step)
    if steps < 1:
        raise UsageError(
            f"a budget of {budget_s / 60:.2f} minutes fits no training step ({per_step:.2f} s per step over all "
            "runs); raise --budget-minutes or use a smaller --preset"
        )
    return steps


def _run(train_config: TrainConfig, log: Path, imports: tuple[str, ...] = ()) -> int:
    """Train in a child process (which imports ``imports`` first); return its peak memory in bytes."""
    run_dir = Path(train_config.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = write_text_atomic(run_dir / "compare-run.json", json.dumps(train_config.to_dict()))
    code = "import sys; from multihead.train.compare import run_child; run_child(sys.argv[1], sys.argv[2:])"
    with open(log, "w", encoding="utf-8") as f:
        child = subprocess.Popen([sys.executable, "-c", code, str(spec), *imports], stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
        raise RuntimeError(f"training {run_dir.name} failed (exit {child.returncode}): {' '.join(tail)}; see {log}")
    peak = usage.ru_maxrss * 1024  # Linux reports KiB
    cuda = run_dir / "compare-cuda-peak.json"
    if cuda.exists():
        peak = read_json_file(cuda)["peak_bytes"]
    return peak


def run_child(spec: str, imports: list[str] | tuple[str, ...] = ()) -> None:
    """The child process of one run: import ``imports`` (the parent's ``--import``
    modules; ``python -c`` searches the current folder first, as the parent
    did), train, and record the CUDA peak when there is one."""
    from .loop import train

    for name in imports:
        importlib.import_module(name)
    config = TrainConfig.from_dict(read_json_file(spec))
    train(config, progress=False)
    if torch.cuda.is_available():
        peak = {"peak_bytes": int(torch.cuda.max_memory_allocated())}
        write_text_atomic(Path(config.out) / "compare-cuda-peak.json", json.dumps(peak))


def _read_run(run_dir: Path, seed: int, peak: int) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line]
    curve = [[r["step"], r["val_loss"]] for r in rows if r.get("val_loss") is not None]
    if not curve:
        raise RuntimeError(f"{run_dir / 'metrics.jsonl'} has no validation loss")
    speeds = sorted(r["tokens_per_s"] for r in rows if r.get("tokens_per_s"))
    return {"seed": seed, "val_loss": curve[-1][1], "curve": curve,
            "tokens_per_s": speeds[len(speeds) // 2] if speeds else 0.0, "peak_memory_bytes": peak}  # fmt: skip


def _cpu() -> str:
    """The CPU model from /proc/cpuinfo, else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def plan_comparison(config: CompareConfig) -> tuple[TrainConfig, GPTConfig, list[KindPlan]]:
    """(the shared TrainConfig, the MHA model's config, one plan per kind): what
    ``compare`` runs, built without training anything.

    Raises:
        ValueError, TypeError: the shared setting or a kind's options do not
            make a model (the message names the value).
    """
    base = TrainConfig.from_dict({**DEFAULT_TRAIN, **config.train})
    model_base = _base_model_config(base)
    return base, model_base, [plan_kind(model_base, kind) for kind in config.kinds]


def compare(config: CompareConfig, *, command: str = "", echo=print) -> dict[str, Path]:
    """Train every kind for every seed and write the reports; return their paths.

    Args:
        config: what to run.
        command: the command line, recorded in the reports.
        echo: where progress lines go (``None``: silent).
    """
    say = echo or (lambda *_: None)
    base, model_base, plans = plan_comparison(config)
    steps = config.max_steps
    if steps is None:
        say(f"timing one training step of each of {len(plans)} kinds ...")
        batch = base.batch_size
        seconds = [_step_seconds(GPTConfig.from_dict({**model_base.to_dict(), "attention": p.kind,
                                                      "attention_options": p.attention_options,
                                                      "mlp_dim": p.mlp_dim}), batch) for p in plans]  # fmt: skip
        steps = steps_for_budget(60 * config.budget_minutes, seconds, len(config.seeds))
        say(f"{steps} steps per run fit {config.budget_minutes} minutes for {len(plans) * len(config.seeds)} runs")
    out = Path(config.out)
    rows, total, started = [], len(plans) * len(config.seeds), time.perf_counter()
    for i, plan in enumerate(plans):
        runs = []
        for j, seed in enumerate(config.seeds):
            run_dir = out / f"{plan.kind}-seed{seed}"
            t = time.perf_counter()
            peak = _run(_train_config(config, plan, seed, steps, run_dir), run_dir.with_suffix(".log"), config.imports)
            runs.append(_read_run(run_dir, seed, peak))
            n = i * len(config.seeds) + j + 1
            say(f"[{n}/{total}] {plan.kind} seed {seed}: val loss {runs[-1]['val_loss']:.3f} "
                f"({time.perf_counter() - t:.0f} s)")  # fmt: skip
        rows.append(summarize_kind(dataclasses.asdict(plan), runs))
    header = {
        "command": command or "multihead compare",
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{_cpu()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "preset": base.preset,
        "steps_per_run": steps,
        "tokens_per_run": steps * base.batch_size * model_base.context_length,
        "seeds": list(config.seeds),
        "minutes": round((time.perf_counter() - started) / 60, 2),
    }
    return write_reports(out, rows, header)
