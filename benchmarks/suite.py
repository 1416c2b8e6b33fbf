"""Run a plan of benchmark cases and write one summary.

    python -m benchmarks.suite                      # quick plan (what `make bench` runs), a few minutes
    python -m benchmarks.suite --plan full          # every case at its full sizes (about an hour on 2 cores)
    python -m benchmarks.suite --plan cuda --out DIR   # the CUDA subset (bfloat16), a few minutes on an H100
    python -m benchmarks.suite --check              # set up and call every step once, time nothing
    python -m benchmarks.suite --set rounds=5       # a config override for every case of the plan

Each case of the plan runs through ``benchmarks.run.run_case`` and writes
its own ``<out>/<case>-<timestamp>.json/.md/.png``; the suite then writes
``<out>/suite-<plan>-<timestamp>.md`` (every report, one after the other)
and ``.png`` (every ratio of the plan in one bar chart), each written to a
temporary name and moved into place.

Plans (``PLANS``): a list of (case, scenarios or None for all, overrides,
quick). The quick plan runs the smoke sizes of attention_peers (book-size
scenarios at B=2, T=128 and the small every-peer scenario), kinds_vs_mha,
long_context (T / 16) and compile_vs_eager's MHA forward; the full plan
runs attention_peers, kinds_vs_mha, long_context, compile_vs_eager and
mha_vs_torch at their own sizes; the cuda plan runs attention_peers,
long_context and kinds_vs_mha with ``device=cuda, dtype=bfloat16``
(adding torch.compile and the SDPA flash, cuDNN and memory-efficient
backends to the peers).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import shlex
import sys
from pathlib import Path
from typing import Any

from .registry import load_cases
from .run import RESULTS, _parse_set, markdown_report, run_case, write_atomic, write_record

__all__ = ["PLANS", "main", "run_plan"]

Item = tuple[str, list[str] | None, dict[str, Any], bool]

CUDA = {"device": "cuda", "dtype": "bfloat16", "warmup": 3, "rounds": 10, "number": 10}

PLANS: dict[str, list[Item]] = {
    "quick": [
        ("attention_peers", ["forward, causal", "fwd+bwd, causal", "small forward, causal"], {}, True),
        ("kinds_vs_mha", None, {}, True),
        ("long_context", ["forward T=8192", "fwd+bwd T=2048"], {}, True),
        ("compile_vs_eager", ["mha forward"], {}, True),
    ],
    "full": [
        ("attention_peers", None, {}, False),
        ("kinds_vs_mha", None, {}, False),
        ("long_context", None, {}, False),
        ("compile_vs_eager", None, {}, False),
        ("mha_vs_torch", None, {}, False),
    ],
    "cuda": [
        ("attention_peers", ["forward, causal", "fwd+bwd, causal"], CUDA, False),
        ("long_context", None, {**CUDA, "rounds": 5, "number": 3}, False),
        ("kinds_vs_mha", None, {**CUDA, "batch": 8, "seq": 1024}, False),
    ],
}


def run_plan(plan: str, *, out: Path | None, threads: int | None = None, only: list[str] | None = None,
             dry: bool = False, extra: dict[str, Any] | None = None, log=print) -> list[dict[str, Any]]:  # fmt: skip
    """Run every item of ``PLANS[plan]`` (only the cases in ``only`` when
    given, with ``extra`` config overrides on top of the plan's); write each
    record under ``out`` (None: write nothing); return the records."""
    cases = load_cases()
    records = []
    for name, scenarios, overrides, quick in PLANS[plan]:
        if only and name not in only:
            continue
        overrides = {**overrides, **(extra or {}), **({"threads": threads} if threads is not None else {})}
        record = run_case(cases[name], quick=quick, overrides=overrides, scenarios=scenarios, log=log, dry=dry)
        record["command"] = "python -m benchmarks.suite " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        if out is not None:
            write_record(record, markdown_report(record), out, log=log)
        records.append(record)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", default="quick", choices=sorted(PLANS), help="which cases and sizes (default quick)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"results folder (default {RESULTS})")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads for every case")
    parser.add_argument("--only", action="append", help="run only this case of the plan (repeatable)")
    parser.add_argument("--check", action="store_true", help="set up and call every step once; time nothing")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key in every case of the plan (a Python literal)")
    args = parser.parse_args(argv)
    planned = [item[0] for item in PLANS[args.plan]]
    unknown = [c for c in args.only or [] if c not in planned]
    if unknown:
        print(f"--only {unknown}: not in plan {args.plan!r}, which runs {planned}", file=sys.stderr)
        return 2
    if args.plan == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--plan cuda: torch sees no CUDA device", file=sys.stderr)
            return 2

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    stamp = dt.datetime.now().strftime("%Y%m%dT%H%M%S")
    records = run_plan(args.plan, out=args.out, threads=args.threads, only=args.only, dry=args.check,
                       extra=_parse_set(args.set), log=log)  # fmt: skip
    summary = "\n\n".join(markdown_report(r) for r in records)
    print(summary)
    base = args.out / f"suite-{args.plan}-{stamp}"
    write_atomic(base.with_suffix(".md"), summary)
    chart = not args.check and importlib.util.find_spec("matplotlib") is not None
    if chart:
        from .chart import ratio_chart

        ratio_chart(records, base.with_suffix(".png"))
    log(f"wrote {base}.md" + (f" and {base}.png" if chart else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
