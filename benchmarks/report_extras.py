"""What a report says beside the times: FLOP/s against the GEMM peak
measured in the same rounds, the contenders not timed and why, and figures
measured during setup.

    PEAK                                  # the name of the peak's step among the contenders
    peak_step(config)                     # a zero-arg step: one square matrix product, or None
    throughput(flops, samples, peak)      # per contender: FLOP/s, of peak, x floor
    extra_sections(record)                # markdown lines for the report

The GEMM peak is timed as one more contender, alternating with the others
round by round, so a shared machine's load falls on it as on them: the
product ``multihead.tools.machine_limits`` times (n x n, n = 2048 on CPU in
float32, 1024 in 16-bit types, 8192 on CUDA) at the scenario's device and
dtype, 2·n³ FLOPs. The FLOP floor of a step in round i is its FLOPs over
that round's peak: no kernel doing that many matrix-product FLOPs runs
faster. "time / FLOP floor" is the median over rounds of time / floor; "of
GEMM peak" is the contender's FLOP/s at its median time over the median
peak. The peak's step is left out of the ratios and the chart.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from .timing import fmt_ms

__all__ = ["PEAK", "extra_sections", "peak_step", "ratio_matrix", "throughput"]

PEAK = "gemm peak"


def peak_step(config: dict[str, Any]):
    """One n x n product at the scenario's device and dtype (2·n³ FLOPs), or
    None when the config does not ask for the peak (``peak``: False) or
    names no dtype. Returns (step, flops). ``peak_n`` in the config sets n."""
    if not config.get("peak") or "dtype" not in config:
        return None
    device = str(config.get("device", "cpu"))
    dtype = getattr(torch, str(config["dtype"]))
    n = config.get("peak_n") or (8192 if device.startswith("cuda") else 2048 if dtype == torch.float32 else 1024)
    n = int(n)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def step() -> None:
        a @ b

    return step, 2 * n**3


def throughput(flops: dict[str, float], samples: dict[str, list[float]],
               peak: dict[str, Any] | None) -> dict[str, dict]:  # fmt: skip
    """Per timed contender with a FLOP count: FLOP/s at its median time and,
    when ``peak`` ({"flops": per product, "samples_s": per round}) is given,
    the fraction of the median peak and the median per-round time / floor."""
    out = {}
    peaks = [peak["flops"] / t for t in peak["samples_s"]] if peak else []
    for name, f in flops.items():
        if name not in samples:
            continue
        median = statistics.median(samples[name])
        row: dict[str, float] = {"flops": f, "flop_per_s": f / median}
        if peaks:
            row["of_peak"] = row["flop_per_s"] / statistics.median(peaks)
            row["floor_multiple"] = statistics.median(t / (f / p) for t, p in zip(samples[name], peaks))
        out[name] = row
    return out


def ratio_matrix(record: dict[str, Any]) -> list[str]:
    """One row per compared pair, one column per scenario: the per-round
    median ratio (a blank where the pair was not timed in that scenario)."""
    timed = [res for res in record["results"] if res.get("ratios")]
    if len(timed) < 2:
        return []
    pairs: dict[str, dict[str, float]] = {}
    for res in timed:
        for name, ratio in res["ratios"].items():
            num, den = ratio.get("numerator", name), ratio.get("denominator", res["baseline"])
            pairs.setdefault(f"{num} / {den}", {})[res["scenario"]] = ratio["per_round"]["median"]
    head = [res["scenario"] for res in timed]
    out = ["", "Per-round median ratios, one column per scenario:", "",
           "| ratio | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]  # fmt: skip
    for pair, cells in pairs.items():
        out.append(f"| {pair} | " + " | ".join(f"{cells[h]:.3f}" if h in cells else "" for h in head) + " |")
    return out


def extra_sections(record: dict[str, Any]) -> list[str]:
    """Ratios by scenario, throughput against the GEMM peak, contenders not
    timed, setup figures."""
    out: list[str] = ratio_matrix(record)
    rows = [(res, name, t) for res in record["results"] for name, t in res.get("throughput", {}).items()]
    if rows:
        out += ["", "| scenario | contender | GFLOP per step | median ms | TFLOP/s | of GEMM peak | time / FLOP floor |",
                "|---|---|---|---|---|---|---|"]  # fmt: skip
        for res, name, t in rows:
            of_peak = f"{t['of_peak']:.1%}" if "of_peak" in t else "-"
            floor = f"{t['floor_multiple']:.2f}x" if "floor_multiple" in t else "-"
            out.append(f"| {res['scenario']} | {name} | {t['flops'] / 1e9:.2f} | {fmt_ms(res['summary_s'][name]['median'])} "
                       f"| {t['flop_per_s'] / 1e12:.3f} | {of_peak} | {floor} |")  # fmt: skip
        for res in record["results"]:
            if p := res.get("peak"):
                out.append(f"\n{res['scenario']}: GEMM peak in the same rounds ({p['n']} x {p['n']} {p['dtype']} "
                           f"products): median {p['flop_per_s'] / 1e12:.3f} TFLOP/s "
                           f"(range {p['min_flop_per_s'] / 1e12:.3f}-{p['max_flop_per_s'] / 1e12:.3f})")  # fmt: skip
    skipped = [(res["scenario"], n, w) for res in record["results"] for n, w in res.get("not_timed", {}).items()]
    if skipped:
        out += ["", "Not timed:", ""]
        out += [f"- {scenario}: {name}: {w['status']}: {w['reason']}" for scenario, name, w in skipped]
    notes = [(res["scenario"], n, v) for res in record["results"] for n, v in res.get("notes", {}).items()]
    if notes:
        out += ["", "Measured during setup:", ""]
        out += [f"- {scenario}: {name}: " + ", ".join(f"{k} {v}" for k, v in v.items()) for scenario, name, v in notes]
    return out


