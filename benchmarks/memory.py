"""Peak memory of one step of one attention peer (``benchmarks.peers``).

    peak_mib({"peer": "multihead", "batch": 1, "seq": 8192, "embed_dim": 768, "num_heads": 12,
              "causal": True, "mode": "forward", "dtype": "float32", "device": "cpu", "seed": 0})

CPU: measured in a fresh child process (``python -m benchmarks.memory
SPEC_JSON``), so nothing another contender allocated is counted. The child
builds the peer and its input, runs one step at 16 tokens (kernels and
allocator warmed), reads its resident set (VmRSS), resets the high-water
mark (writing "5" to /proc/self/clear_refs), runs one step at the full
length and prints the new high-water mark (VmHWM) minus that resident set:
the peak resident-set growth of the step, in MiB. Linux only (None elsewhere).

CUDA: in this process, ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats`` minus the memory allocated before the step:
the peak of tensors the caching allocator handed out, not what the driver
reserved.

A step is a forward under ``no_grad`` (mode "forward") or forward +
``backward(grad_out)`` (mode "train").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["peak_mib"]

ROOT = Path(__file__).resolve().parent.parent


def _step(spec: dict[str, Any], seq: int):
    from .peers import build_peer, random_layer

    dtype = getattr(torch, spec["dtype"])
    device, train = spec["device"], spec["mode"] == "train"
    layer = random_layer(embed_dim=spec["embed_dim"], num_heads=spec["num_heads"], seed=spec["seed"])
    peer = build_peer(spec["peer"], layer, causal=spec["causal"], seq=seq, device=device, dtype=dtype, train=train)
    x = torch.randn(spec["batch"], seq, spec["embed_dim"], device=device, dtype=dtype, requires_grad=train)
    grad_out = torch.randn_like(x) if train else None

    def step() -> None:
        if train:
            peer.fn(x).backward(grad_out)
        else:
            with torch.no_grad():
                peer.fn(x)

    return step


def _status_kib(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def _probe(spec: dict[str, Any]) -> float:
    """In the child: MiB of resident-set growth during one full-length step."""
    torch.set_num_threads(int(spec.get("threads") or 1))
    _step(spec, 16)()
    step = _step(spec, spec["seq"])
    rss = _status_kib("VmRSS:")
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # the high-water mark restarts from the current resident set
    step()
    return (_status_kib("VmHWM:") - rss) / 1024


def peak_mib(spec: dict[str, Any]) -> float | None:
    """Peak memory growth (MiB) of one step; None where it cannot be measured."""
    if str(spec["device"]).startswith("cuda"):
        step = _step(spec, spec["seq"])
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    if not os.path.exists("/proc/self/clear_refs"):
        return None
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", json.dumps(spec)],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"memory probe for {spec['peer']} failed:\n{res.stderr[-2000:]}")
    return float(res.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(_probe(json.loads(sys.argv[1])))
