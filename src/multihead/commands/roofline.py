"""``multihead roofline``: where a GPT's prefill and decoding sit against this machine's limits.

    multihead roofline --preset gpt2-small --context 512
    multihead roofline --attention gqa --attention-option num_kv_heads=4 --batch 8 --measure --out roof
    multihead roofline --positions rope --layer-attention-options '[{"window": 128}, {}]'
    multihead roofline --checkpoint runs/tiny --context 64

The model is a preset with the flags ``multihead train`` takes for its
attention (``--attention``, ``--attention-option``,
``--layer-attention-options``, ``--positions``), or the config of a
``--checkpoint`` (a GPT checkpoint or a training run: its latest one).
Every block is counted with its own attention layer (``tools.roofline``).

Prints, per phase, the FLOPs (projections / attention core / MLP / LM head),
the bytes moved (weights / KV cache read / written / activations), the
arithmetic intensity, the bound on this machine and the time floor;
``--measure`` also times the real model (random weights) and prints how far
each phase is from its floor. With ``--out DIR``: roofline.md, roofline.json
and roofline.png. The machine's limits are measured on first use and cached
(``multihead.tools.machine_limits``).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..models.gpt import GPT_PRESETS
from .checking import checking
from .imports import add_import_argument, import_modules
from .train import FLAGS, parse_attention_options

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MODEL_FIELDS = ("layer_attention_options", "positions")  # GPTConfig fields set by multihead train's flags


DESCRIPTION = (
    "Where a GPT's prefill and one decoding step sit against this machine's measured limits: FLOPs by part, "
    "bytes moved, arithmetic intensity, the bound (compute or memory) and the time floor; --measure also times "
    "the real model. The model is a preset with multihead train's attention flags (per-layer options, "
    "positions) or a --checkpoint's config; every block is counted with its own attention layer, and blocks "
    "that differ (local and global layers, pruned heads) get a line each. The limits (GEMM peak per dtype, copy "
    "bandwidth) are measured once and cached. See docs/roofline.md."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The description and flags of ``multihead roofline``."""
    parser.description = DESCRIPTION
    parser.add_argument("--preset", help=f"GPT preset: {', '.join(GPT_PRESETS)} (default gpt2-small)")
    parser.add_argument("--attention", metavar="KIND", help="attention kind (default mha)")
    parser.add_argument("--attention-option", dest="attention_option", action="append", metavar="K=V",
                        help="option of the attention kind (V read as JSON when it parses); repeat for more")  # fmt: skip
    for field in MODEL_FIELDS:  # as multihead train reads them
        flag = next(f for f in FLAGS if f.field == field)
        parser.add_argument(flag.name, dest=flag.field, type=flag.type, metavar=flag.metavar, help=flag.help)
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="the config of a GPT checkpoint or of a training run's latest one, instead of a preset")  # fmt: skip
    parser.add_argument("--batch", type=int, default=1, metavar="B", help="sequences (default 1)")
    parser.add_argument("--context", type=int, default=None, metavar="T",
                        help="prompt tokens of the prefill, cached tokens of the decode step (default 1024, or "
                             "the model's context_length - 1 when that is smaller)")  # fmt: skip
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES), help="weights and activations (default float32)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="default: cuda when available")
    parser.add_argument("--measure", action="store_true", help="also time the real model (random weights)")
    parser.add_argument("--remeasure-limits", action="store_true", help="measure the machine again instead of the cache")
    parser.add_argument("--out", metavar="DIR", help="write roofline.md, roofline.json and roofline.png here")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="also print one rank's share with heads split over N processes (multihead.parallel)")  # fmt: skip
    add_import_argument(parser)


@dataclass
class Job:
    config: object
    label: str
    batch: int
    context: int
    dtype: str
    device: str
    measure: bool
    remeasure: bool
    out: Path | None
    tensor_parallel: int = 1


def prepare(args: argparse.Namespace) -> Job:
    """Check every argument and build the config (nothing is measured or written).

    Raises:
        ValueError: unknown preset or kind, bad options, sizes, or a CUDA device that is not there.
    """
    import torch

    from ..models.gpt import GPT

    import_modules(args.imports)
    config, label = _model(args)
    GPT(config, device="meta")  # the kind and its options, checked
    if args.context is None:  # the decode step adds one position to the cached ones
        args.context = min(1024, config.context_length - 1)
    for flag, value in (("--batch", args.batch), ("--context", args.context)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.context + 1 > config.context_length:
        raise ValueError(f"--context {args.context}: the decode step needs {args.context + 1} positions, "
                         f"more than the model's context_length {config.context_length}")  # fmt: skip
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device")
    out = None if args.out is None else Path(args.out)
    if out is not None and out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    if args.tensor_parallel < 1:
        raise ValueError(f"--tensor-parallel must be at least 1, got {args.tensor_parallel}")
    if args.tensor_parallel > 1:
        from ..parallel.costs import rank_cost

        rank_cost(config, args.tensor_parallel)  # the heads, G and the MLP must split that many ways
    return Job(config, label, args.batch, args.context, args.dtype, device, args.measure, args.remeasure_limits, out,
               args.tensor_parallel)  # fmt: skip


def _model(args: argparse.Namespace):
    """(GPTConfig, label) of ``--checkpoint``, or of the preset and the attention flags.

    Raises:
        ValueError: a model flag with --checkpoint, an unknown preset, bad options.
        FileNotFoundError: a checkpoint with no config.
    """
    from ..models.gpt import GPTConfig

    fields = {f: getattr(args, f) for f in MODEL_FIELDS if getattr(args, f) is not None}
    if args.checkpoint is not None:
        from ..models.checkpoint import read_config

        given = [n for n, v in (("--preset", args.preset), ("--attention", args.attention),
                                ("--attention-option", args.attention_option)) if v is not None]  # fmt: skip
        given += ["--" + f.replace("_", "-") for f in fields]
        if given:
            raise ValueError(f"--checkpoint {args.checkpoint} brings its own model; {', '.join(given)} cannot be "
                             "given with it")  # fmt: skip
        config, label = read_config(args.checkpoint), f"checkpoint {args.checkpoint}"
    else:
        label = args.preset or "gpt2-small"
        if label not in GPT_PRESETS:
            raise ValueError(f"--preset {label!r}: unknown; valid: {', '.join(GPT_PRESETS)}")
        options = parse_attention_options(args.attention_option)
        if args.attention:  # else the config's default kind
            fields["attention"] = args.attention
        config = GPTConfig.from_preset(label, attention_options=options, **fields)
    label += f", {config.attention}{' ' + str(config.attention_options) if config.attention_options else ''}"
    if config.layer_attention_options:
        label += f", per layer {config.layer_attention_options}"
    if config.layer_heads:
        label += f", heads per layer {config.layer_heads}"
    if config.positions != "learned":
        label += f", positions {config.positions}"
    return config, label


def measure(job: Job, repeats: int = 3) -> dict[str, float]:
    """Best-of-``repeats`` seconds of one prefill forward and one decode step of the real model."""
    import torch

    from ..models.gpt import GPT

    dtype = getattr(torch, job.dtype)
    model = GPT(job.config, device=job.device, dtype=dtype).eval()
    idx = torch.randint(0, job.config.vocab_size, (job.batch, job.context + 1), device=job.device)
    caches = model.make_kv_caches(job.batch, job.context + 1)

    def sync():
        if job.device == "cuda":
            torch.cuda.synchronize()

    def best(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return min(times)

    def decode_step():
        for cache, state in zip(caches, filled):
            cache.restore_state(state)  # the same step each time
        model(idx[:, job.context :], kv_caches=caches)

    with torch.no_grad():
        prefill = best(lambda: model(idx[:, : job.context]))
        model(idx[:, : job.context], kv_caches=caches)  # fill the cache once
        filled = [cache.save_state() for cache in caches]
        decode = best(decode_step)
    return {"prefill": prefill, "decode": decode}


def _table(job: Job, costs, limits, measured) -> list[str]:
    from ..tools.roofline import bound, floor_seconds

    peak, bandwidth = limits.peak_flops[job.dtype], limits.bandwidth
    lines = [
        f"{job.label}: batch {job.batch}, context {job.context}, {job.dtype} on {limits.device} ({limits.threads} threads)",
        f"machine (measured {limits.date}): {peak / 1e9:.1f} GFLOP/s {job.dtype} GEMM, {bandwidth / 1e9:.1f} GB/s copy; "
        f"ridge point {peak / bandwidth:.1f} FLOP/byte",
        "",
        "| phase | GFLOP: proj / core / mlp / lm head | MB moved: weights / kv read / kv written / activations "
        "| FLOP/byte | bound | floor ms |" + (" measured ms | floor / measured |" if measured else ""),
        "|---|---|---|---|---|---|" + ("---|---|" if measured else ""),
    ]
    for name, c in costs.items():
        f = " / ".join(f"{v / 1e9:.3g}" for v in c.flops.values())
        b = " / ".join(f"{v / 1e6:.3g}" for v in c.bytes.values())
        floor = floor_seconds(c, peak, bandwidth)
        row = (f"| {name} | {c.total_flops / 1e9:.3g}: {f} | {c.total_bytes / 1e6:.4g}: {b} | {c.intensity:.3g} "
               f"| {bound(c, peak, bandwidth)} | {floor * 1e3:.3g} |")  # fmt: skip
        if measured:
            row += f" {measured[name] * 1e3:.3g} | {floor / measured[name]:.2f} |"
        lines.append(row)
    decode = costs["decode"]
    kv, held = decode.kv_cache_bytes_per_token, decode.kv_cache_bytes
    local = sorted({b.window for b in decode.blocks if b.kv_cache_positions < job.context + 1})
    lines += ["", f"KV cache: {kv:,} bytes per token of one sequence ({job.dtype}, all {job.config.num_layers} layers); "
              f"{held:,} bytes for {job.batch} sequence(s) at {job.context + 1} positions after the decode step"
              + (f" (local blocks hold their last {', '.join(map(str, local))} positions)" if local else "")]
    if job.tensor_parallel > 1:
        from ..parallel.costs import rank_cost

        share = rank_cost(job.config, job.tensor_parallel, bytes_per_element=DTYPE_BYTES[job.dtype])
        lines.append(
            f"split over {job.tensor_parallel} processes, one rank holds {share.parameters:,} parameters and "
            f"{share.kv_cache_bytes_per_token:,} KV-cache bytes per token; each block all-reduces "
            f"{share.all_reduce_bytes_per_token:,} bytes per token in a forward (multihead.parallel.costs)"
        )
    return lines + _block_table(costs, job.batch)


def _spans(layers: list[int]) -> str:
    """[0, 1, 2, 4] -> "0-2, 4"."""
    spans: list[list[int]] = []
    for i in layers:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _block_table(costs, batch: int) -> list[str]:
    """Blocks of each kind (heads, key/value heads, window) with their attention's share and
    the size of their caches after the decode step (``batch`` sequences); none when every
    block is alike."""
    prefill, decode = costs["prefill"].blocks, costs["decode"].blocks
    groups: dict[tuple, list[int]] = {}
    for b in prefill:
        groups.setdefault((b.heads, b.kv_heads, b.window), []).append(b.layer)
    if len(groups) < 2:
        return []
    lines = ["", "| blocks | heads / kv heads | window | GFLOP prefill: proj / core | GFLOP decode: proj / core "
             "| MB kv read (decode) | KV bytes/token | MB kv cache (decode) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for (heads, kv_heads, window), layers in groups.items():
        p, d = [prefill[i] for i in layers], [decode[i] for i in layers]
        flops = [f"{sum(b.projection_flops for b in x) / 1e9:.3g} / {sum(b.core_flops for b in x) / 1e9:.3g}" for x in (p, d)]
        lines.append(f"| {len(layers)}: {_spans(layers)} | {heads} / {kv_heads} | {window or 'global'} | {flops[0]} "
                     f"| {flops[1]} | {sum(b.kv_cache_read for b in d) / 1e6:.3g} "
                     f"| {sum(b.kv_cache_bytes_per_token for b in d):,} "
                     f"| {sum(b.kv_cache_positions * b.kv_cache_bytes_per_token for b in d) * batch / 1e6:.3g} |")  # fmt: skip
    return lines


def run(args: argparse.Namespace) -> int:
    with checking():
        job = prepare(args)
    from ..io import write_text_atomic
    from ..tools.machine_limits import machine_limits
    from ..tools.roofline import phase_costs

    nbytes = DTYPE_BYTES[job.dtype]
    costs = phase_costs(job.config, batch=job.batch, context=job.context, bytes_per_element=nbytes)
    print(f"measuring this machine's {job.dtype} GEMM peak and copy bandwidth (cached after the first time) ...",
          flush=True)  # fmt: skip
    limits = machine_limits(job.device, [job.dtype], remeasure=job.remeasure)
    measured = measure(job) if job.measure else None
    lines = _table(job, costs, limits, measured)
    print("\n".join(lines))
    if job.out is not None:
        from ..tools.roofline_plot import plot_roofline

        job.out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(job.out / "roofline.md", "\n".join(lines) + "\n")
        record = {"model": job.label, "config": job.config.to_dict(), "batch": job.batch, "context": job.context,
                  "dtype": job.dtype, "limits": asdict(limits), "measured_s": measured,
                  "phases": {n: {**asdict(c), "intensity": c.intensity} for n, c in costs.items()}}  # fmt: skip
        write_text_atomic(job.out / "roofline.json", json.dumps(record, indent=2) + "\n")
        plot_roofline(job.out / "roofline.png", costs, limits, job.dtype, measured, title=lines[0])
        print(f"wrote {job.out / 'roofline.md'}, roofline.json and roofline.png")
    return 0
