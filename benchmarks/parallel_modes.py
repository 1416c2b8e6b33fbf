"""Two processes training one GPT: data parallel (DDP), sharded (FSDP2) and heads split (tensor parallel).

    python -m benchmarks.parallel_modes --preset shakespeare-cpu --steps 12 --rounds 3

Each round runs ``torchrun --nproc-per-node 2 -m multihead train`` once per
mode, the modes taking turns, on the same data, batch and steps, with one
thread per process; a mode's figure is the median over rounds of the
training tokens per second the run reports (all processes). CPU and gloo
only: these figures say how the modes compare on this machine, not on GPUs
with NVLink.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = {"ddp": [], "fsdp2": ["--shard"], "tensor-parallel": ["--tensor-parallel", "2"]}


def _run(mode: str, preset: str, steps: int, data: Path, out: Path) -> float:
    """Training tokens per second of one run."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "-m",
               "multihead", "train", "--preset", preset, "--data", str(data), "--max-steps", str(steps),
               "--batch-size", "16", "--context-length", "128", "--eval-every", str(steps), "--eval-batches", "1",
               "--checkpoint-every", str(steps), "--threads", "1", "--out", str(out), *MODES[mode]]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    speed = re.search(r"speed: ([\d,]+) tokens/s", done.stdout)
    return float(speed.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="shakespeare-cpu")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    speeds: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "text.txt"
        data.write_text("".join(f"line {i}: all the world's a stage, and all the men merely players.\n"
                                for i in range(4000)), encoding="utf-8")  # fmt: skip
        for r in range(args.rounds):
            for mode in MODES:
                speed = _run(mode, args.preset, args.steps, data, Path(tmp) / f"{mode}-{r}")
                speeds[mode].append(speed)
                print(f"round {r}: {mode} {speed:,.0f} tok/s", file=sys.stderr, flush=True)
    base = statistics.median(speeds["ddp"])
    print("| mode (2 processes, CPU, gloo) | tokens/s (median) | vs DDP |")
    print("|---|---|---|")
    for mode, values in speeds.items():
        print(f"| {mode} | {statistics.median(values):,.0f} | {statistics.median(values) / base:.2f}x |")


if __name__ == "__main__":
    main()
