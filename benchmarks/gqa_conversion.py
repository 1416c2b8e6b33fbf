"""Validation loss of a trained GPT converted from MHA to GQA/MQA ("mean", "aligned").

    .venv/bin/python -m benchmarks.gqa_conversion RUN_DIR [--step N] [--calib-batches 8] [--recover-steps 200]

RUN_DIR is a ``multihead train`` run directory (read only). The validation
batches are the run's own fixed ones (``val_batches`` of data/val.bin with
VAL_SEED, the run's batch size, context and eval_batches), so the original
model's figure is the run's last logged val_loss. Calibration batches for
"aligned" are drawn from data/train.bin (``Batches`` with seed
``--calib-seed``), a different file from the validation tokens. Each
converted model is then given a short recovery training
(``tools.recovery.recover``, objective "kl": its next-token distributions
distilled towards the original model's) of ``--recover-steps`` AdamW steps
at peak rate ``--recover-lr``, each step on a fresh batch of
``--recover-batch-size`` windows of data/train.bin (seed ``--recover-seed``);
0 steps: no recovery. Prints a markdown table: validation loss before and
after recovery, in nats per token (per byte for a byte-level run), KV-cache
bytes per token (``cost()`` of every layer, float32 elements) and parameters.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from multihead.models.checkpoint import load_checkpoint
from multihead.tools.convert_heads import to_gqa
from multihead.tools.flops import kv_cache_size
from multihead.tools.recovery import recover
from multihead.train.batches import Batches, read_tokens, val_batches
from multihead.train.loop import VAL_SEED


def _val_loss(model, sets) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in sets:
            logits = model(x)  # (B, T, V)
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"))
            count += y.numel()
    return total / count


def _logits(model, x):
    return model(x)  # (B, T, V)


def _kv_bytes(model) -> int:
    return kv_cache_size(model).bytes_per_token  # float32 weights: 4 bytes per element, as the commands print it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--calib-batches", type=int, default=8)
    parser.add_argument("--calib-batch-size", type=int, default=16)
    parser.add_argument("--calib-seed", type=int, default=99)
    parser.add_argument("--recover-steps", type=int, default=200, help="recovery steps (0: none)")
    parser.add_argument("--recover-lr", type=float, default=1e-3, help="peak learning rate of the recovery")
    parser.add_argument("--recover-batch-size", type=int, default=16)
    parser.add_argument("--recover-seed", type=int, default=7)
    args = parser.parse_args()
    run = json.loads((args.run_dir / "config.json").read_text())
    ckpts = sorted((args.run_dir / "checkpoints").glob("step-*"))
    ckpt = args.run_dir / "checkpoints" / f"step-{args.step:06d}" if args.step is not None else ckpts[-1]
    model = load_checkpoint(ckpt).eval()
    T = run["context_length"]
    sets = val_batches(
        read_tokens(args.run_dir / "data" / "val.bin"),
        batch_size=run["batch_size"],
        context_length=T,
        num_batches=run["eval_batches"],
        seed=VAL_SEED,
    )
    train = Batches(
        read_tokens(args.run_dir / "data" / "train.bin"),
        batch_size=args.calib_batch_size,
        context_length=T,
        seed=args.calib_seed,
    )
    calibration = [train.get(i)[0] for i in range(args.calib_batches)]
    windows = Batches(
        read_tokens(args.run_dir / "data" / "train.bin"),
        batch_size=args.recover_batch_size,
        context_length=T,
        seed=args.recover_seed,
    )
    recovery = [windows.get(i)[0] for i in range(args.recover_steps)]  # (B, T) token ids, one batch per step
    H = model.config.num_heads
    print(
        f"checkpoint {ckpt}; validation {run['eval_batches']} x {run['batch_size']} x {T} tokens; "
        f"calibration {args.calib_batches} x {args.calib_batch_size} x {T} training tokens"
    )
    print(
        f"recovery: {args.recover_steps} steps of {args.recover_batch_size} x {T} training tokens, "
        f"lr {args.recover_lr}, kl objective"
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print(
        "| model | G | val loss (nats/token) | after recovery | KV cache bytes/token (fp32, all layers) "
        "| parameters | convert s | recovery s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    original = _val_loss(model, sets)
    print(f"| original (mha) | {H} | {original:.4f} | - | {_kv_bytes(model)} | {model.num_parameters()} | - | - |")
    for G in sorted((g for g in range(1, H) if H % g == 0), reverse=True):
        for method in ("mean", "aligned"):
            start = time.perf_counter()
            new = to_gqa(model, G, method=method, calibration=calibration if method == "aligned" else None).eval()
            seconds = time.perf_counter() - start
            loss = _val_loss(new, sets)
            after, recover_s = "-", "-"
            if recovery:
                start = time.perf_counter()
                recover(new, model, recovery, _logits, steps=len(recovery), lr=args.recover_lr, progress=False)
                recover_s = f"{time.perf_counter() - start:.1f}"
                after = f"{_val_loss(new, sets):.4f}"
            print(
                f"| {method} -> {new.config.attention} | {G} | {loss:.4f} | {after} | {_kv_bytes(new)} | "
                f"{new.num_parameters()} | {seconds:.1f} | {recover_s} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
