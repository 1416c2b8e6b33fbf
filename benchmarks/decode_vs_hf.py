"""Greedy decoding: multihead's ``GPT.generate`` against Hugging Face ``GPT2LMHeadModel.generate``.

    python -m benchmarks.decode_vs_hf --threads 1 --rounds 5
    python -m benchmarks.decode_vs_hf --profile fp32       # where one batch-1 step spends its time
    python -m benchmarks.decode_vs_hf --device cuda --modes eager compiled --formats fp32 bf16 --rounds 3

One GPT-2 small shaped model (random weights, seed 0, float32) and the
Hugging Face model built from it (``gpt_to_hf_state_dict``: the same
weights), a 16-token prompt per row, 32 new tokens. Before anything is timed
both generate greedily and their tokens must be identical (batch 1 and 8).

Contenders, one ``generate`` call each, taking turns round by round
(``benchmarks.timing.time_alternating``):

* batch 1: Hugging Face, multihead float32 (eager steps and
  ``compile_steps=True``), float32 in the transposed decode layout
  (``quantize_weights(model, "fp32")``, "fp32-T"), and weight-only bf16 /
  int8 (``quantize_weights``), each eager and compiled;
* batch 8: Hugging Face, multihead float32 and fp32-T, eager and compiled.

``--formats`` keeps some of fp32, fp32-T, bf16, int8 (bf16 and int8 run at
batch 1 only), ``--modes`` eager and/or compiled, ``--device`` cpu or cuda
(default: cuda when there is one). On CUDA ``compile_steps=True`` replays the
one-token step as a CUDA graph (``models.generation``); its compile happens
in the token check before the timed rounds, and every call is timed between
two ``torch.cuda.synchronize()``.

Reported: tokens/s (median), the speed against Hugging Face, whether the
greedy tokens are Hugging Face's ("yes", or the first new token that
differs), batch-1 tokens/s
as a fraction of the weight-streaming limit (the model's weight bytes over
the copy bandwidth ``tools.machine_limits`` measured: every weight is read
once per step), and for bf16 / int8 the speed against float32 beside their
logit error (``tools.logit_error``). The 1-minute load average is printed
before and after: the machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from benchmarks.timing import threads, time_alternating
from multihead.convert.hf_gpt2 import gpt_to_hf_state_dict
from multihead.models.gpt import GPT, GPTConfig
from multihead.models.quantize import quantize_weights
from multihead.tools.logit_error import logit_error
from multihead.tools.machine_limits import machine_limits

PROMPT = 16
FORMATS = ("fp32", "fp32-T", "bf16", "int8")


def hf_twin(model: GPT):
    """``GPT2LMHeadModel`` with ``model``'s weights, greedy without an end token."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = GPT2LMHeadModel(GPT2Config(**model.config.to_hf_config())).eval()
    hf.load_state_dict(gpt_to_hf_state_dict(model))
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter and buffer (a tied table counted once): what one step streams."""
    seen = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in seen.values())


def contenders(models: dict[str, torch.nn.Module], hf, idx: torch.Tensor, new: int, modes: list[str]) -> dict:
    """name -> zero-argument generate call."""
    steps = {"Hugging Face": lambda: hf.generate(idx, max_new_tokens=new, do_sample=False)}
    for name, m in models.items():
        for mode in modes:
            compiled = mode == "compiled"
            steps[f"{name} {mode}"] = lambda m=m, c=compiled: m.generate(idx, new, temperature=0, compile_steps=c)
    return steps


def check_same_tokens(steps: dict, want: torch.Tensor, formats: tuple[str, ...] = ("fp32", "fp32-T")) -> dict:
    """name -> "yes" or "from new token k" against Hugging Face's greedy tokens (every
    contender called once: the compiled ones compile here). A float32 contender that
    differs stops the run on CPU; on CUDA (other kernels, other rounding) it is reported."""
    same = {}
    for name, call in steps.items():
        got = call()
        if torch.equal(got, want):
            same[name] = "yes"
            continue
        first = int((got != want).any(0).nonzero()[0]) - PROMPT
        same[name] = f"from new token {first}"
        if name.split()[0] in formats:
            message = f"{name} generated other tokens than Hugging Face from new token {first} on"
            if want.device.type != "cuda":
                sys.exit(f"{message}: not timing")
            print(f"warning: {message} (CUDA kernels round differently near a tie)")
    return same


def profile_step(model: GPT, rows: int) -> None:
    """torch.profiler table of ten eager batch-``rows`` steps over a cache."""
    from torch.profiler import ProfilerActivity, profile

    idx = torch.randint(0, model.config.vocab_size, (rows, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        caches = model.make_kv_caches(rows, PROMPT + 12)
        model(idx, kv_caches=caches, logits_to_keep=1)
        tok = idx[:, -1:]
        model(tok, kv_caches=caches, logits_to_keep=1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                model(tok, kv_caches=caches, logits_to_keep=1)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2-small")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default 1,8)")
    parser.add_argument("--modes", nargs="+", choices=("eager", "compiled"), default=["eager", "compiled"],
                        help="eager and/or compiled steps (default both)")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS),
                        help="weight formats (default all; bf16 and int8 at batch 1 only)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--remeasure-limits", action="store_true", help="measure the copy bandwidth again (cached)")
    parser.add_argument("--profile", choices=("fp32", "bf16", "int8"), help="profile one batch-1 step and exit")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    torch._dynamo.config.recompile_limit = 64  # three models x two batch sizes, each compiled for its own cache
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset(args.preset)).eval()
    with threads(args.threads):
        if args.profile:
            profile_step(model if args.profile == "fp32" else quantize_weights(model, args.profile), 1)
            return
        run(model, args)


def run(model: GPT, args: argparse.Namespace) -> None:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    hf = hf_twin(model).to(device)
    model = model.to(device)
    kinds = {"fp32-T": "fp32", "bf16": "bf16", "int8": "int8"}
    quantized = {f: quantize_weights(model, kinds[f]) for f in args.formats if f != "fp32"}
    limits = machine_limits(device.type, ["float32"], remeasure=args.remeasure_limits)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    load = [os.getloadavg()[0]]
    print(f"# {args.preset}, {args.new_tokens} new tokens, prompt {PROMPT}; {limits.device}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; copy bandwidth {limits.bandwidth / 1e9:.1f} GB/s")  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for rows in (int(b) for b in args.batches.split(",")):
        idx = torch.randint(0, model.config.vocab_size, (rows, PROMPT), generator=gen).to(device)
        models = {"fp32": model, **quantized} if "fp32" in args.formats else dict(quantized)
        if rows > 1:
            models = {f: m for f, m in models.items() if f in ("fp32", "fp32-T")}
        steps = contenders(models, hf, idx, args.new_tokens, args.modes)
        with torch.no_grad():
            want = hf.generate(idx, max_new_tokens=args.new_tokens, do_sample=False)
            same = check_same_tokens(steps, want)
            times = time_alternating(steps, warmup=1, rounds=args.rounds, sync=sync)
        rate = {name: rows * args.new_tokens / statistics.median(t) for name, t in times.items()}
        print(f"\n| batch {rows} | tokens/s (median of {args.rounds}) | vs Hugging Face | greedy tokens = Hugging Face's | vs fp32 same mode | fraction of weight-streaming limit |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for name, r in rate.items():
            fmt = name.split()[0]
            m = {"fp32": model, **quantized}.get(fmt, model)
            limit = limits.bandwidth / weight_bytes(m)  # steps per second when every weight byte is read once
            base = rate.get(f"fp32 {name.split()[-1]}", r)  # Hugging Face: against itself
            frac = f"{r / rows / limit:.2f} (limit {limit:.1f} steps/s)" if rows == 1 else ""
            print(f"| {name} | {r:.1f} | {r / rate['Hugging Face']:.2f}x | {same[name]} | {r / base:.2f}x | {frac} |")
        if rows == 1 and any(f in quantized for f in ("bf16", "int8")):
            print()
            for f, q in quantized.items():
                if f != "fp32-T":
                    print(f"{f} logit error vs fp32: {logit_error(model, q, idx, args.new_tokens).line()}")
    load.append(os.getloadavg()[0])
    print(f"\n1-minute load average: {load[0]:.2f} before, {load[1]:.2f} after")


if __name__ == "__main__":
    main()
