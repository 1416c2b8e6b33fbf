"""What a report says beside the times: FLOP/s against the measured GEMM
peak, the contenders not timed and why, and figures measured during setup.

    peak_for(config)                      # {"flop_per_s": ..., "device": ...} or None
    throughput(flops, summary, peak)      # per contender: FLOP/s, of peak, x floor
    extra_sections(record)                # markdown lines for the report

The FLOP floor of a step is its FLOPs divided by the GEMM peak
(``multihead.tools.machine_limits``: the best large square matrix product
torch runs on this device at this thread count): no kernel doing that many
matrix-product FLOPs runs faster. "time / FLOP floor" is the median time
over that floor.
"""

from __future__ import annotations

from typing import Any

from .timing import fmt_ms

__all__ = ["extra_sections", "peak_for", "ratio_matrix", "throughput"]


def peak_for(config: dict[str, Any]) -> dict[str, Any] | None:
    """The measured GEMM peak of the scenario's device and dtype
    (``multihead.tools.machine_limits``, cached), or None when the config
    does not ask for it (``peak``: False) or names no dtype."""
    if not config.get("peak") or "dtype" not in config:
        return None
    from multihead.tools.machine_limits import machine_limits

    device = "cuda" if str(config.get("device", "cpu")).startswith("cuda") else "cpu"
    limits = machine_limits(device, [str(config["dtype"])])
    return {"device": limits.device, "dtype": str(config["dtype"]), "threads": limits.threads,
            "date": limits.date, "flop_per_s": limits.peak_flops[str(config["dtype"])]}  # fmt: skip


def throughput(flops: dict[str, float], summary: dict[str, dict], peak: dict | None) -> dict[str, dict]:
    """Per timed contender with a FLOP count: FLOP/s at its median time and,
    against the GEMM peak, the fraction of it and the time over the FLOP
    floor (FLOPs / peak)."""
    out = {}
    for name, f in flops.items():
        if name not in summary:
            continue
        median = summary[name]["median"]
        row: dict[str, float] = {"flops": f, "flop_per_s": f / median}
        if peak:
            row["of_peak"] = row["flop_per_s"] / peak["flop_per_s"]
            row["floor_multiple"] = median / (f / peak["flop_per_s"])
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
        peaks = {(p["device"], p["dtype"]): p for res in record["results"] if (p := res.get("peak"))}
        for p in peaks.values():
            out.append(f"\nGEMM peak ({p['device']}, {p['dtype']}, {p['threads']} threads, measured {p['date']} "
                       f"by multihead.tools.machine_limits): {p['flop_per_s'] / 1e12:.3f} TFLOP/s")  # fmt: skip
    skipped = [(res["scenario"], n, w) for res in record["results"] for n, w in res.get("not_timed", {}).items()]
    if skipped:
        out += ["", "Not timed:", ""]
        out += [f"- {scenario}: {name}: {w['status']}: {w['reason']}" for scenario, name, w in skipped]
    notes = [(res["scenario"], n, v) for res in record["results"] for n, v in res.get("notes", {}).items()]
    if notes:
        out += ["", "Measured during setup:", ""]
        out += [f"- {scenario}: {name}: " + ", ".join(f"{k} {v}" for k, v in v.items()) for scenario, name, v in notes]
    return out


