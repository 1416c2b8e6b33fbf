"""Where the time goes: torch.profiler over a case's contenders.

    python -m benchmarks.profile_ops CASE --scenario NAME [--rounds N] [--quick]
                                    [--set KEY=VALUE ...] [--top K]

Profiles one step of every contender per round, alternating like the timer
(after one unprofiled warm-up call each), and prints, per operator, the
median over rounds of its self CPU time in ms, one column per contender.
A diagnostic, not a measurement: the profiler adds overhead, so take the
figures from ``benchmarks.run`` and use this to see which kernels differ.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict

from torch.profiler import ProfilerActivity, profile

from .registry import load_cases
from .run import _parse_set
from .timing import threads


def profile_case(case, scenario: str, *, rounds: int, quick: bool, overrides: dict) -> dict:
    """{contender: {op: [self CPU ms per round]}} plus a "TOTAL" entry."""
    config = case.resolve(scenario, quick=quick, overrides=overrides)
    with threads(config.get("threads")):
        steps = case.setup(config)
        for step in steps.values():
            step()
        per: dict[str, dict[str, list[float]]] = {n: defaultdict(list) for n in steps}
        for _ in range(rounds):
            for name, step in steps.items():
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    step()
                total = 0.0
                for event in prof.key_averages():
                    ms = event.self_cpu_time_total / 1e3
                    per[name][event.key].append(ms)
                    total += ms
                per[name]["TOTAL"].append(total)
    return per


def table(per: dict, top: int) -> str:
    names = list(per)

    def med(name: str, op: str) -> float:
        xs = per[name].get(op, [])
        return statistics.median(xs) if xs else 0.0

    ops = {op for n in names for op in per[n] if op != "TOTAL"}
    ops = sorted(ops, key=lambda op: -max(med(n, op) for n in names))[:top]
    lines = ["| op (median self CPU ms) | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]
    for op in [*ops, "TOTAL"]:
        lines.append(f"| {op} | " + " | ".join(f"{med(n, op):.1f}" for n in names) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_ops", description=__doc__.split("\n\n")[0])
    parser.add_argument("case")
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    cases = load_cases()
    if args.case not in cases:
        print(f"unknown case {args.case!r}; valid: {sorted(cases)}", file=sys.stderr)
        return 2
    per = profile_case(cases[args.case], args.scenario, rounds=args.rounds, quick=args.quick,
                       overrides=_parse_set(args.set))
    print(f"{args.case} / {args.scenario} ({args.rounds} rounds)\n")
    print(table(per, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
