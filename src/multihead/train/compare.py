"""``multihead compare``: train one GPT per attention kind on the same data and budget.

    data tokenized once into OUT/       (compare_runs.prepare_shared_data)
    for kind in kinds:                  (compare_plan: options, size-matched MLP, costs)
        for seed in seeds:
            a child process runs train(TrainConfig(attention=kind, seed=seed, ...))
            into OUT/<kind>-seed<seed>/    (its own metrics.jsonl, checkpoint; output in OUT/<kind>-seed<seed>.log)
            peak memory = the child's peak resident set (CPU) or peak CUDA allocation
        OUT/compare.json, compare.md, compare.png   rewritten with every finished kind (compare_report)

Every run sees the same tokens: the same preset, data, tokenizer, batch
size, context and number of steps. ``--budget-minutes`` turns a wall-clock
budget into that number of steps: each kind's training step is timed here
for a few steps first, and the steps are those that fit the budget for all
runs together (with 25 % headroom for evaluation, data preparation and the
processes' start-up). Each run is a child process so its peak memory is its
own (``os.wait4`` resource usage). A comparison stopped by SIGINT/SIGTERM
keeps its finished runs; the same command continues with the others, and
the same command with more seeds trains only the new seeds' runs
(``compare_runs``). A run whose loss diverged is kept as a result with a NaN
loss (``multihead.train.divergence``); the report marks its kind.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import UsageError
from ..models.gpt import GPT, GPTConfig
from ..progress import ProgressBar, format_duration
from .compare_plan import KindPlan, default_kinds, plan_kind
from .compare_report import summarize_kind, write_reports
from .compare_runs import (
    Interrupted,
    check_continuation,
    comparison_started,
    interruptible,
    kept_result,
    prepare_shared_data,
    save_state,
    train_run,
)
from .config import TrainConfig

__all__ = ["CompareConfig", "compare", "plan_comparison", "continued_steps", "steps_for_budget", "DEFAULT_TRAIN", "EVAL_POINTS"]

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
        attention_options: per kind, options over its class's
            ``comparison_options`` (``--attention-option KIND:K=V``).
        smoke_test: a run that only shows every kind trains (``--quick``): the
            reports say so and leave out the speed, which a few steps cannot measure.
    """

    kinds: tuple[str, ...] = dataclasses.field(default_factory=default_kinds)
    seeds: tuple[int, ...] = (0, 1)
    max_steps: int | None = None
    budget_minutes: float = 18.0
    out: str = "runs/compare"
    train: dict[str, Any] = dataclasses.field(default_factory=dict)
    imports: tuple[str, ...] = ()
    attention_options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    smoke_test: bool = False

    def __post_init__(self) -> None:
        if not self.kinds or not self.seeds:
            raise ValueError(f"compare needs kinds and seeds, got kinds={self.kinds}, seeds={self.seeds}")
        if self.max_steps is None and not (isinstance(self.budget_minutes, (int, float)) and self.budget_minutes > 0):
            given = "unset" if self.budget_minutes is None else repr(self.budget_minutes)
            raise ValueError(f"without max_steps, budget_minutes must be a number > 0, got budget_minutes {given}")
        unknown = sorted(set(self.attention_options) - set(self.kinds))
        if unknown:
            raise ValueError(f"attention_options name kinds {unknown} that are not compared (kinds={list(self.kinds)})")


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
        train.preset, vocab_size=train.vocab_size or 256, context_length=train.context_length, dropout=train.dropout,
        layer_attention_options=train.layer_attention_options, positions=train.positions,
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
    plans = [plan_kind(model_base, kind, config.attention_options.get(kind)) for kind in config.kinds]
    return base, model_base, plans



def _run_dirs(config: CompareConfig) -> list[Path]:
    return [Path(config.out) / f"{kind}-seed{seed}" for kind in config.kinds for seed in config.seeds]


def continued_steps(config: CompareConfig) -> int | None:
    """The steps per run of the comparison in ``config.out`` that this one continues
    (the same config asked before), else None.

    Raises:
        UsageError: ``config.out`` holds another comparison or unknown training runs.
    """
    return check_continuation(Path(config.out), dataclasses.asdict(config), _run_dirs(config))


def _steps(config: CompareConfig, base: TrainConfig, model_base: GPTConfig, plans: list[KindPlan], say) -> int:
    if config.max_steps is not None:
        return config.max_steps
    say(f"timing one training step of each of {len(plans)} kinds ...")
    seconds = [_step_seconds(GPTConfig.from_dict({**model_base.to_dict(), "attention": p.kind,
                                                  "attention_options": p.attention_options,
                                                  "mlp_dim": p.mlp_dim}), base.batch_size) for p in plans]  # fmt: skip
    steps = steps_for_budget(60 * config.budget_minutes, seconds, len(config.seeds))
    say(f"{steps} steps per run fit {config.budget_minutes} minutes for {len(plans) * len(config.seeds)} runs")
    return steps


def compare(config: CompareConfig, *, command: str = "", echo=print) -> dict[str, Path]:
    """Train every kind for every seed and write the reports; return their paths.

    The reports are rewritten as each kind finishes. Runs that finished in an
    earlier call with the same config (a comparison stopped by a signal) are
    kept, not trained again.

    Args:
        config: what to run.
        command: the command line, recorded in the reports.
        echo: where progress lines go (``None``: silent); the live progress of
            each run goes to stderr (``multihead.progress``).

    Raises:
        Interrupted: SIGINT or SIGTERM (its ``kept`` lists the finished runs).
    """
    say = echo or (lambda *_: None)
    out, kept = Path(config.out), []
    with interruptible():
        try:
            base, model_base, plans = plan_comparison(config)
            steps = continued_steps(config)
            if steps is not None:
                say(f"continuing the comparison in {out}: {steps} steps per run; finished runs are kept")
            else:
                steps = _steps(config, base, model_base, plans, say)
            now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            began = comparison_started(out) or now
            save_state(out, dataclasses.asdict(config), steps, command or "multihead compare", began)
            prepare_shared_data(base, out)
            header = {
                "command": command or "multihead compare",
                "date": now if began == now else f"{began} to {now}",
                "machine": f"{_cpu()}, {os.cpu_count()} cores, torch {torch.__version__}",
                "preset": base.preset,
                "steps_per_run": steps,
                "tokens_per_run": steps * base.batch_size * model_base.context_length,
                "seeds": list(config.seeds),
                **({"smoke_test": True} if config.smoke_test else {}),
            }
            return _train_all(config, plans, steps, header, kept, say)
        except Interrupted as e:
            e.kept = kept
            raise


def _shower(bar: ProgressBar, start: float, spent: float, trained: int, left: int):
    """``show(step, metrics)`` for one run: its step and loss, and the ETA of all runs left
    (``left`` steps from this run's start) at the pace of the runs trained so far."""

    def show(step: int, metrics: dict[str, Any] | None) -> None:
        done, seconds = trained + step, spent + time.perf_counter() - start
        eta = seconds / done * (left - step) if done else 0.0
        loss = f"loss {metrics['train_loss']:.3f}" if metrics else "starting"
        bar.update(step, f"{loss} | all runs: eta {format_duration(eta)}")

    return show


def _train_all(config, plans, steps, header, kept, say) -> dict[str, Path]:
    out, rows, paths, seconds = Path(config.out), [], {}, 0.0  # seconds: of every run reported, kept ones too
    total, n = len(plans) * len(config.seeds), 0
    spent, trained = 0.0, 0  # seconds and steps of the runs trained by this call
    for plan in plans:
        runs = []
        for seed in config.seeds:
            n += 1
            run_dir, label = out / f"{plan.kind}-seed{seed}", f"[{n}/{total}] {plan.kind} seed {seed}"
            result, t = kept_result(run_dir), time.perf_counter()
            took = "kept from an earlier run"
            if result is None:
                bar = ProgressBar(steps, desc=label)
                show = _shower(bar, t, spent, trained, (total - n + 1) * steps)
                try:
                    result = train_run(_train_config(config, plan, seed, steps, run_dir), seed,
                                       data_from=out, imports=config.imports, show=show)  # fmt: skip
                finally:
                    bar.close()
                spent, trained = spent + time.perf_counter() - t, trained + steps
                took = f"{time.perf_counter() - t:.0f} s"
            got = (f"diverged at step {result['diverged']['step']} ({result['diverged']['which']} "
                   f"{result['diverged']['value']})" if result.get("diverged") else f"val loss {result['val_loss']:.3f}")
            say(f"{label}: {got} ({took})")
            kept.append(run_dir.name)
            runs.append(result)
            seconds += result.get("seconds", 0.0)
        rows.append(summarize_kind(dataclasses.asdict(plan), runs))
        minutes = round(seconds / 60, 2)  # the whole comparison's runs, whichever call trained them
        paths = write_reports(out, rows, {**header, "kinds_finished": f"{len(rows)} of {len(plans)}", "minutes": minutes})
    if config.smoke_test:
        say(f"a smoke test: {steps} steps show that every kind trains; its losses are no comparison and it has no speeds")
    return paths
