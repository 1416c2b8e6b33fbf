"""roofline.png: the machine's roof and where each phase sits (and runs, when measured)."""

from __future__ import annotations

from pathlib import Path

from ..io import write_atomic
from .machine_limits import MachineLimits
from .roofline import PhaseCost


def plot_roofline(path: str | Path, costs: dict[str, PhaseCost], limits: MachineLimits, dtype: str,
                  measured_s: dict[str, float] | None = None, title: str = "") -> Path:  # fmt: skip
    """Write a log-log roofline: attainable FLOP/s against FLOPs per byte, each phase's
    floor as an open marker on the roof and its measured FLOP/s as a filled one.

    Raises:
        ImportError: matplotlib is missing (``pip install multihead[viz]``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peak, bandwidth = limits.peak_flops[dtype], limits.bandwidth
    intensities = [c.intensity for c in costs.values()]
    lo, hi = min(intensities + [peak / bandwidth]) / 4, max(intensities + [peak / bandwidth]) * 4
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    xs = [lo, peak / bandwidth, hi]
    ax.plot(xs, [min(peak, x * bandwidth) / 1e9 for x in xs], color="black", lw=1.5,
            label=f"roof: {peak / 1e9:.0f} GFLOP/s {dtype} GEMM, {bandwidth / 1e9:.1f} GB/s")  # fmt: skip
    colours = {"prefill": "tab:blue", "decode": "tab:orange"}
    for name, cost in costs.items():
        attainable = min(peak, cost.intensity * bandwidth)
        ax.plot([cost.intensity], [attainable / 1e9], "o", mfc="none", color=colours.get(name, "gray"),
                ms=9, label=f"{name}: floor")  # fmt: skip
        if measured_s and name in measured_s:
            ax.plot([cost.intensity], [cost.total_flops / measured_s[name] / 1e9], "o", color=colours.get(name, "gray"),
                    ms=7, label=f"{name}: measured")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte moved)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(title or limits.device, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out = Path(path)
    write_atomic(out, lambda staged: fig.savefig(staged, format="png"))
    plt.close(fig)
    return out
