"""Command line: list, run and report benchmark cases.

    python -m benchmarks.run --list
    python -m benchmarks.run CASE [--quick] [--rounds N] [--warmup N]
                             [--threads N] [--scenario NAME ...] [--device cuda]
                             [--set KEY=VALUE ...] [--out DIR] [--check]

Prints a markdown table and writes ``<out>/<case>-<timestamp>.json`` (all
samples, summaries, config, machine) and ``.md`` (the table with the
command, machine, date and load) and ``.png`` (a bar chart of the ratios),
each written to a temporary name first and moved into place with
``os.replace``. ``--check`` sets every scenario up (the agreement checks)
and calls each step once, timing nothing.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import importlib.util
import json
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from .registry import Case, load_cases
from .report_extras import PEAK, extra_sections, peak_step, throughput
from .timing import compare, fmt_ms, summarize, threads, time_alternating

RESULTS = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------- machine
def cpu_model() -> str:
    """The CPU model from /proc/cpuinfo (``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """Where and with what the benchmark ran."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count()
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "cuda": torch.cuda.is_available(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import multihead

        info["multihead"] = multihead.__version__
    except ImportError:  # pragma: no cover - the package is in this repo
        info["multihead"] = None
    return info


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


# ---------------------------------------------------------------- running
def _sync(config: dict[str, Any]):
    """``torch.cuda.synchronize`` for a CUDA scenario (None on CPU)."""
    return torch.cuda.synchronize if str(config.get("device", "cpu")).startswith("cuda") else None


def run_case(
    case: Case,
    *,
    quick: bool = False,
    overrides: dict[str, Any] | None = None,
    scenarios: list[str] | None = None,
    log=print,
    dry: bool = False,
) -> dict[str, Any]:
    """Set up and time every scenario of ``case``; return the result record.

    With ``dry=True`` nothing is timed: each scenario is set up (which runs
    the case's agreement checks) and every step called once; the record
    lists the contenders and those not timed, without samples.
    """
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    results = []
    for scenario in scenarios or list(case.scenarios):
        config = case.resolve(scenario, quick=quick, overrides=overrides)
        with threads(config.get("threads")):
            num_threads = torch.get_num_threads()
            steps = case.setup(config)
            not_timed = {name: {"status": status, "reason": reason}
                         for name, (status, reason) in getattr(steps, "not_timed", {}).items()}  # fmt: skip
            entry: dict[str, Any] = {
                "scenario": scenario,
                "config": config,
                "threads": num_threads,
                "not_timed": not_timed,
                "flops": dict(getattr(steps, "flops", {})),
                "notes": dict(getattr(steps, "notes", {})),
            }
            for name, why in not_timed.items():
                log(f"[{case.name}] {scenario}: not timed: {name} ({why['status']}: {why['reason']})")
            baseline = case.subject or case.baseline or next(iter(steps))
            if baseline not in steps:
                raise KeyError(f"baseline {baseline!r} is not a contender of {case.name}: {list(steps)}")
            if dry:
                for step in steps.values():
                    step()
                results.append({**entry, "baseline": baseline, "order": list(steps),
                                "load_average_before": load_average()})  # fmt: skip
                del steps
                continue
            gemm = peak_step(config) if entry["flops"] else None
            if gemm is not None:
                steps[PEAK] = gemm[0]
            log(f"[{case.name}] {scenario}: contenders {list(steps)}, "
                f"warmup {config['warmup']}, rounds {config['rounds']}, number {config['number']}, "
                f"threads {num_threads}")
            load_before = load_average()

            def progress(done: int, total: int) -> None:
                if done == total or done % max(1, total // 5) == 0:
                    log(f"    round {done}/{total}")

            samples = time_alternating(
                steps,
                warmup=int(config["warmup"]),
                rounds=int(config["rounds"]),
                number=int(config["number"]),
                sync=_sync(config),
                progress=progress,
            )
            load_after = load_average()
            del steps
        peak = None
        if gemm is not None:
            per_round = [gemm[1] / t for t in samples[PEAK]]
            n = round((gemm[1] / 2) ** (1 / 3))
            peak = {"flops": gemm[1], "n": n, "dtype": str(config["dtype"]), "samples_s": samples.pop(PEAK),
                    "flop_per_s": statistics.median(per_round), "min_flop_per_s": min(per_round),
                    "max_flop_per_s": max(per_round)}  # fmt: skip
        summary = {name: summarize(xs) for name, xs in samples.items()}
        if case.subject:
            ratios = {name: {**compare(samples[baseline], xs), "numerator": baseline, "denominator": name}
                      for name, xs in samples.items() if name != baseline}  # fmt: skip
        else:
            ratios = {name: {**compare(xs, samples[baseline]), "numerator": name, "denominator": baseline}
                      for name, xs in samples.items() if name != baseline}  # fmt: skip
        results.append(
            {
                **entry,
                "baseline": baseline,
                "order": list(samples),
                "load_average_before": load_before,
                "load_average_after": load_after,
                "samples_s": samples,
                "summary_s": summary,
                "ratios": ratios,
                "peak": peak,
                "throughput": throughput(entry["flops"], samples, peak),
            }
        )
    return {
        "case": case.name,
        "description": case.description,
        "quick": quick,
        "dry": dry,
        "overrides": overrides or {},
        "command": "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "started": started,
        "machine": machine_info(),  # its "date" is when the run finished
        "results": results,
    }


# ---------------------------------------------------------------- reporting
def markdown_table(record: dict[str, Any]) -> str:
    """One row per (scenario, ratio); times are medians in ms with the
    interquartile range; the ratio is contender / baseline (for a case with
    a ``subject``: the subject over each other contender)."""
    lines = [
        (
            "| scenario | contender | median ms [IQR] | baseline | baseline median ms [IQR] "
            "| ratio of medians | per-round ratio: median [IQR] (min-max) |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for res in record["results"]:
        for name, ratio in res.get("ratios", {}).items():
            num, den = ratio.get("numerator", name), ratio.get("denominator", res["baseline"])
            s, b = res["summary_s"][num], res["summary_s"][den]
            pr = ratio["per_round"]
            lines.append(
                f"| {res['scenario']} | {num} "
                f"| {fmt_ms(s['median'])} [{fmt_ms(s['q1'])}-{fmt_ms(s['q3'])}] "
                f"| {den} | {fmt_ms(b['median'])} [{fmt_ms(b['q1'])}-{fmt_ms(b['q3'])}] "
                f"| {ratio['ratio_of_medians']:.3f} "
                f"| {pr['median']:.3f} [{pr['q1']:.3f}-{pr['q3']:.3f}] ({pr['min']:.3f}-{pr['max']:.3f}) |"
            )
    return "\n".join(lines)


def markdown_report(record: dict[str, Any]) -> str:
    m = record["machine"]
    res0 = record["results"][0] if record["results"] else {}
    timing = ", ".join(f"{k} {res0.get('config', {}).get(k)}" for k in ("warmup", "rounds", "number"))
    loads = [x for res in record["results"] for x in (res.get("load_average_before"), res.get("load_average_after")) if x]
    device = res0.get("config", {}).get("device", "cpu")
    gpu = f"; device {torch.cuda.get_device_name()}" if str(device).startswith("cuda") and torch.cuda.is_available() else ""
    if record.get("dry"):
        body = ["(dry run: set up and called once, not timed)", ""]
        body += [f"- {res['scenario']}: {', '.join(res['order'])}" for res in record["results"]]
    else:
        body = [markdown_table(record)]
    return "\n".join(
        [
            f"# {record['case']}{' (quick)' if record['quick'] else ''}",
            "",
            record["description"],
            "",
            f"- command: `{record['command']}`",
            f"- date: {record.get('started', '?')} to {m['date']}",
            (
                f"- machine: {m['cpu_model']}, {m['cpus_usable']} usable CPUs of {m['cpu_count']}, "
                f"{m['platform']}{gpu}"
            ),
            f"- torch {m['torch']}, {res0.get('threads', m['torch_num_threads'])} threads; multihead {m['multihead']}",
            f"- load average (1, 5, 15 min): {loads[0] if loads else '?'} before, {loads[-1] if loads else '?'} after",
            f"- timing: {timing}; contenders alternate within each round",
            "",
            *body,
            *extra_sections(record),
            "",
        ]
    )


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a staged file renamed into place
    (``multihead.io.write_text_atomic``: the usual file mode, fsynced)."""
    from multihead.io import write_text_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)


def _parse_set(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value  # a bare string such as float32
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("case", nargs="?", help="case name (see --list)")
    parser.add_argument("--list", action="store_true", help="list the registered cases and exit")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of seconds")
    parser.add_argument("--rounds", type=int, help="measured rounds (overrides the case)")
    parser.add_argument("--warmup", type=int, help="warm-up rounds (overrides the case)")
    parser.add_argument("--number", type=int, help="calls per measurement (overrides the case)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads for the run")
    parser.add_argument("--scenario", action="append", help="run only this scenario (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (value parsed as a Python literal)")
    parser.add_argument("--device", help="run on this device where the case supports it (cpu, cuda)")
    parser.add_argument("--check", action="store_true",
                        help="set up every scenario (agreement checks) and call each step once; time nothing")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"results folder (default {RESULTS})")
    args = parser.parse_args(argv)

    cases = load_cases()
    if args.list or not args.case:
        for name, case in sorted(cases.items()):
            print(f"{name}: {case.description}")
            print(f"    scenarios: {', '.join(case.scenarios)}")
        return 0 if args.list else 2
    if args.case not in cases:
        print(f"unknown case {args.case!r}; valid: {sorted(cases)}", file=sys.stderr)
        return 2
    case = cases[args.case]
    if args.device is not None and "device" not in case.config:
        takes = sorted(name for name, c in cases.items() if "device" in c.config)
        print(f"case {args.case!r} runs on the CPU only and takes no --device; cases that do: {takes}", file=sys.stderr)
        return 2
    overrides = _parse_set(args.set)
    for key in ("rounds", "warmup", "number", "threads", "device"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    for s in args.scenario or []:
        if s not in case.scenarios:
            print(f"unknown scenario {s!r}; valid: {list(case.scenarios)}", file=sys.stderr)
            return 2

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    record = run_case(case, quick=args.quick, overrides=overrides, scenarios=args.scenario, log=log, dry=args.check)
    report = markdown_report(record)
    print(report)
    write_record(record, report, args.out, log=log)
    return 0


def write_record(record: dict[str, Any], report: str, out: Path, *, log=print) -> Path:
    """``<out>/<case>-<timestamp>``: .json (the record), .md (``report``) and,
    for a timed run with ratios, .png (``benchmarks.chart``); each written to
    a temporary name and moved into place. Returns the path without suffix."""
    stamp = dt.datetime.now().strftime("%Y%m%dT%H%M%S")
    base = out / f"{record['case']}-{stamp}"
    write_atomic(base.with_suffix(".json"), json.dumps(record, indent=1, default=str) + "\n")
    write_atomic(base.with_suffix(".md"), report)
    wrote = [".json", ".md"]
    if any(res.get("ratios") for res in record["results"]):
        if importlib.util.find_spec("matplotlib") is None:
            log("no chart: matplotlib is not installed")
        else:
            from .chart import ratio_chart

            ratio_chart([record], base.with_suffix(".png"))
            wrote.append(".png")
    log(f"wrote {base}{{{','.join(wrote)}}}")
    return base


if __name__ == "__main__":
    sys.exit(main())
