"""Start-up time of the ``multihead`` command and of ``import multihead``, two source trees compared.

    python -m benchmarks.startup --before OLD/src --after src --rounds 9

Each round runs every case once per tree, the trees taking turns (before, after,
before, ...), each in a fresh interpreter with that tree first on PYTHONPATH; the
first round is a warm-up and is thrown away. Prints the median wall-clock seconds
of every case and tree as a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CASES = {
    "multihead --help": ["-m", "multihead", "--help"],
    "multihead --version": ["-m", "multihead", "--version"],
    "import torch": ["-c", "import torch"],
    "import multihead": ["-c", "import multihead"],
    "import torch, multihead; MultiHeadAttention": ["-c", "import torch, multihead; multihead.MultiHeadAttention"],
    "import multihead.tools": ["-c", "import multihead.tools"],
}


def _seconds(src: str, args: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.abspath(src), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the src folder of the old tree")
    parser.add_argument("--after", default="src", help="the src folder of the new tree")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    times: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.rounds + 1):
        for name, case in CASES.items():
            for tree in ("before", "after"):
                t = _seconds(getattr(args, tree), case)
                if round_:  # round 0 warms the file cache
                    times.setdefault((name, tree), []).append(t)
    print(f"| case | before: median s | after: median s | (rounds: {args.rounds}) |\n|---|---|---|---|")
    for name in CASES:
        before, after = (statistics.median(times[name, tree]) for tree in ("before", "after"))
        print(f"| `{name}` | {before:.2f} | {after:.2f} | |")


if __name__ == "__main__":
    main()
