"""This machine's roofline: GEMM peak per dtype and stream bandwidth, measured once and cached.

    limits = machine_limits("cpu", ["float32"])    # measured on first use, then read from the cache
    limits.peak_flops["float32"], limits.bandwidth  # FLOP/s, byte/s

GEMM peak: the best of a few square matrix products (n = 2048 on CPU in
float32, 1024 in 16-bit types; 8192 on CUDA), 2·n³ FLOPs each. Bandwidth:
the best of a few copies of a 256 MiB buffer, counted as read plus written
(2 x 256 MiB). Both are what torch reaches on this machine with its current
thread count, not a datasheet figure.

The cache (``$MULTIHEAD_CACHE`` or ``~/.cache/multihead``, file
``machine-limits.json``) keys each measurement by device name, thread count
and torch version, and keeps its date; ``remeasure=True`` measures again.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..io import read_json_file, write_text_atomic

__all__ = ["MachineLimits", "machine_limits", "measure_limits", "device_name"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MachineLimits:
    """Measured limits of one device.

    Attributes:
        device: "cpu: <model>" or "cuda: <name>".
        threads: torch's intra-op threads when measured.
        torch: torch version.
        date: ISO date of the measurement.
        peak_flops: dtype name -> FLOP/s of a large matrix product.
        bandwidth: byte/s of a large copy (read + write).
    """

    device: str
    threads: int
    torch: str
    date: str
    peak_flops: dict[str, float]
    bandwidth: float

    def ridge(self, dtype: str) -> float:
        """FLOPs per byte above which a kernel of ``dtype`` is compute-bound."""
        return self.peak_flops[dtype] / self.bandwidth


def device_name(device: str) -> str:
    """"cpu: <CPU model>" or "cuda: <GPU name>"."""
    if device == "cuda":
        return f"cuda: {torch.cuda.get_device_name()}"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"cpu: {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"cpu: {platform.processor() or platform.machine()}"


def _best(fn, repeats: int, device: str) -> float:
    """The fastest of ``repeats`` timed calls (one untimed warm-up), in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def measure_limits(device: str = "cpu", dtypes: list[str] | tuple[str, ...] = ("float32",), *, repeats: int = 5,
                   gemm_size: int | None = None, copy_bytes: int = 256 * 2**20) -> MachineLimits:  # fmt: skip
    """Measure the GEMM peak of each dtype and the copy bandwidth now (no cache).

    Raises:
        ValueError: an unknown dtype or device, or CUDA asked for without one.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise ValueError(f"unknown dtypes {unknown}; valid: {list(DTYPES)}")
    peak = {}
    for name in dtypes:
        n = gemm_size or (8192 if device == "cuda" else 2048 if name == "float32" else 1024)
        a = torch.randn(n, n, device=device).to(DTYPES[name])
        b = torch.randn(n, n, device=device).to(DTYPES[name])
        peak[name] = 2 * n**3 / _best(lambda: a @ b, repeats, device)  # noqa: B023 - called at once
    src = torch.empty(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    src.fill_(1.0)
    bandwidth = 2 * copy_bytes / _best(lambda: dst.copy_(src), repeats, device)
    return MachineLimits(
        device=device_name(device), threads=torch.get_num_threads(), torch=torch.__version__,
        date=dt.date.today().isoformat(), peak_flops=peak, bandwidth=bandwidth,
    )  # fmt: skip


def cache_path() -> Path:
    root = os.environ.get("MULTIHEAD_CACHE") or Path.home() / ".cache" / "multihead"
    return Path(root) / "machine-limits.json"


def machine_limits(device: str = "cpu", dtypes: list[str] | tuple[str, ...] = ("float32",), *,
                   remeasure: bool = False) -> MachineLimits:  # fmt: skip
    """Cached limits of ``device`` for ``dtypes``; the missing ones are measured and saved.

    Raises:
        ValueError: see :func:`measure_limits`.
    """
    path = cache_path()
    key = f"{device_name(device)} | {torch.get_num_threads()} threads | torch {torch.__version__}"
    try:
        cached = read_json_file(path)
    except (OSError, ValueError):  # none yet, or unreadable: measure and write a new one
        cached = {}
    entry = cached.get(key)
    if not remeasure and isinstance(entry, dict) and all(d in entry.get("peak_flops", {}) for d in dtypes):
        try:
            return MachineLimits(**entry)
        except TypeError:
            pass  # an entry of another layout: measure again
    known = entry.get("peak_flops", {}) if isinstance(entry, dict) and not remeasure else {}
    limits = measure_limits(device, [d for d in dtypes if d not in known])
    if known:  # keep what was measured before (the peaks and the bandwidth); add the new dtypes' peaks
        limits = MachineLimits(**{**asdict(limits), "bandwidth": entry.get("bandwidth", limits.bandwidth),
                                  "peak_flops": {**limits.peak_flops, **known}})  # fmt: skip
    cached[key] = asdict(limits)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(cached, indent=2, sort_keys=True) + "\n")
    return limits
