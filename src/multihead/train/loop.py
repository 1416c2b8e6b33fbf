"""The training loop of ``multihead train``: ``train(config)`` -> ``TrainResult``.

One optimizer step (step s = 0, 1, ..., reading ``Batches.get(s, ...)``)::

    lr = learning_rate(s, config)                       warm-up, then cosine
    for micro in 0 .. grad_accum - 1:                   (gradients synced on the last only)
        x, y = this rank's micro-batch [b, T]           b = batch_size / (world_size * grad_accum)
        loss = cross_entropy(model(x), y) + model.aux_loss()     (bfloat16: under autocast)
        (loss / grad_accum).backward()
    clip_grad_norm_(grad_clip); AdamW step; zero grads

then, counting completed steps n = s + 1: evaluation when n % eval_every == 0,
a metrics line when n % log_every == 0 or at an evaluation, a checkpoint when
n % checkpoint_every == 0; all three at the last step.

Run directory (``config.out``)::

    config.json        the TrainConfig
    tokenizer/         the tokenizer (``load_tokenizer_dir``)
    data/train.bin     token files (``write_tokens``)
    data/val.bin
    metrics.jsonl      {"step", "train_loss", "aux_loss", "lr", "grad_norm",
                        "tokens_per_s", "elapsed_s"[, "val_loss"]} per logged step
    checkpoints/       see ``multihead.train.checkpoint``

Weight decay: AdamW's decoupled decay acts on the 2-D+ weights of the linear
layers (and of attention kinds' own matrices: routers, mixing weights); never
on biases, norm gains, 1-D gate parameters or the embeddings. The token
embedding is tied to the LM head, so that shared matrix is an embedding and
is not decayed (minGPT's choice; nanoGPT decays it).

Exact resume: a step reads its batch from (seed, step) alone, and a checkpoint
holds the weights, the optimizer tensors, the step and every rank's torch
generator, so ``train(config, resume=True)`` after a kill -9 continues with
the very numbers the uninterrupted run computes (on the same machine and
thread count); ``metrics.jsonl`` is cut back to the checkpoint's step first.

Data parallel: under torchrun (``WORLD_SIZE`` > 1) each process joins the
process group (gloo on CPU, nccl on CUDA), the model is wrapped in
``DistributedDataParallel`` and rank r trains on its slice of every global
batch; gradients are averaged, so the run follows the one-process run with
the same global batch (to float32 rounding). Rank 0 alone prepares the data
and writes files and progress; reported losses are means over all ranks.
With ``config.shard`` the model is sharded with FSDP2 instead
(``multihead.train.shard``): the same step, with each rank holding 1/N of the
weights, gradients and optimizer state; checkpoints are gathered to the full
model and written in the same format, so a run resumes with or without it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import UsageError
from ..io import write_atomic, write_text_atomic
from ..models.gpt import GPT, GPTConfig
from . import checkpoint as ckpt
from . import shard
from .batches import Batches, read_tokens, val_batches, write_tokens
from .config import TrainConfig, config_differences, learning_rate
from .corpus import load_corpus
from .progress import Progress, format_duration
from .tokenizer import load_tokenizer_dir, train_tokenizer
from .world import World, restore_rng, rng_states, training_device

__all__ = ["TrainResult", "train", "parameter_groups", "validation_loss", "VAL_SEED"]

VAL_SEED = 1234  # the fixed validation batches
_ADAM_EPS = 1e-8


@dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
        run_dir: the run directory.
        val_loss: validation loss (nats per token) after the last step.
        train_loss: language-model loss of the last step (nats per token).
        steps: optimizer steps completed (max_steps).
        tokens_per_s: training tokens per second of this call (all ranks).
        model: the trained GPT (in eval mode, on the training device); a
            sharded run returns an unsharded copy on every rank.
    """

    run_dir: Path
    val_loss: float
    train_loss: float | None
    steps: int
    tokens_per_s: float
    model: GPT


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: [{"params": decayed, "weight_decay": weight_decay},
    {"params": the rest, "weight_decay": 0.0}].

    Decayed: parameters with 2 or more dimensions that are not embeddings
    (``nn.Embedding`` weights, also when tied to the LM head). Not decayed:
    biases, norm gains, 1-D gates, embeddings. Each tied tensor appears once.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, rest = [], []
    for p in model.parameters():  # tied tensors once
        if p.requires_grad:
            (decay if p.dim() >= 2 and id(p) not in embeddings else rest).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


# ------------------------------------------------------------------ data
def _prepare_data(config: TrainConfig, run_dir: Path, world: World, resume: bool, data_from: Path | None = None):
    """(tokenizer, train tokens, val tokens); rank 0 builds and writes them on a fresh run
    (``data_from``: links to the token files another run directory holds, see ``train``)."""
    data = run_dir / "data"
    if world.main and not resume:
        if data_from is None:
            corpus = load_corpus(config.data)
            tokenizer = train_tokenizer(config.tokenizer, corpus.train, config.vocab_size)
            splits = {
                name: np.asarray(tokenizer.encode(text)) for name, text in (("train", corpus.train), ("val", corpus.val))
            }
        else:
            tokenizer = load_tokenizer_dir(data_from / "tokenizer")
            splits = {name: read_tokens(data_from / "data" / f"{name}.bin") for name in ("train", "val")}
        for name, ids in splits.items():
            _batches_or_error(ids, config, name)  # refuse before anything is written
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / "config.json", json.dumps(config.to_dict(), indent=2) + "\n")
        tokenizer.save(run_dir / "tokenizer")
        data.mkdir(exist_ok=True)
        for name, ids in splits.items():
            if data_from is None:
                write_tokens(ids, data / f"{name}.bin")
            else:
                _link_file(data_from / "data" / f"{name}.bin", data / f"{name}.bin")
    world.barrier()
    if world.main and resume:
        write_text_atomic(run_dir / "config.json", json.dumps(config.to_dict(), indent=2) + "\n")
    return load_tokenizer_dir(run_dir / "tokenizer"), read_tokens(data / "train.bin"), read_tokens(data / "val.bin")


def _link_file(source: Path, target: Path) -> None:
    """``target`` becomes a hard link to ``source`` (one copy on disk), replaced atomically;
    a copy where the file system has no hard links."""
    staged = target.with_name(f".{target.name}.{os.getpid()}.link")
    staged.unlink(missing_ok=True)
    try:
        os.link(source, staged)
    except OSError:
        write_atomic(target, lambda path: shutil.copyfile(source, path))
        return
    os.replace(staged, target)


def _batches_or_error(tokens: np.ndarray, config: TrainConfig, split: str) -> Batches:
    try:
        return Batches(tokens, batch_size=config.batch_size, context_length=config.context_length, seed=config.seed)
    except ValueError as e:
        raise UsageError(f"{split} split of data={config.data!r}: {e}") from None


# ------------------------------------------------------------------ metrics
class _Metrics:
    """``metrics.jsonl``, appended and flushed line by line (rank 0 only)."""

    def __init__(self, path: Path, keep_through: int | None) -> None:
        self.path = path
        kept = []
        if keep_through is not None and path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut by a kill
                if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= keep_through:
                    kept.append(line + "\n")
        write_text_atomic(path, "".join(kept))  # what an uninterrupted run has at this step
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


# ------------------------------------------------------------------ steps
def validation_loss(model: GPT, sets, config: TrainConfig, world: World, device, autocast) -> float:
    """Mean LM loss (nats per token) over the fixed validation batches, rows
    split over ranks, in eval mode under no_grad. Every rank runs the same
    number of forwards (grad_accum per batch), as FSDP2's all-gathers need."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, token count)
    rows = config.batch_size // world.size
    chunk = rows // config.grad_accum
    with torch.no_grad():
        for x, y in sets:
            x, y = x[world.rank * rows : (world.rank + 1) * rows], y[world.rank * rows : (world.rank + 1) * rows]
            for i in range(0, rows, chunk):
                xc, yc = x[i : i + chunk].to(device), y[i : i + chunk].to(device)
                with autocast():
                    logits = model(xc)  # (b, T, V)
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), yc.reshape(-1), reduction="sum")
                total[0] += loss.double()
                total[1] += yc.numel()
    if world.size > 1:
        dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1])


# ------------------------------------------------------------------ train
def train(
    config: TrainConfig, *, resume: bool = False, progress: bool | None = None, data_from: str | Path | None = None
) -> TrainResult:
    """Train a GPT as ``config`` says (see the module docstring for the step,
    the run directory and data parallelism).

    Args:
        config: the run's settings.
        resume: continue the run in ``config.out`` from its latest checkpoint.
        progress: False silences the progress bar and lines; None/True show
            them on stderr (rank 0 only).
        data_from: a directory holding ``tokenizer/`` and ``data/{train,val}.bin``
            made from this config's data, tokenizer and vocab_size (``multihead
            compare`` tokenizes once for all its runs): a fresh run links its
            token files to those instead of tokenizing the corpus again.

    Returns:
        a :class:`TrainResult`.

    Raises:
        UsageError: (a ValueError) batch_size not divisible by world_size *
            grad_accum, a split shorter than context_length + 1 tokens,
            ``resume`` without a checkpoint, a checkpoint of another config
            (the message names the differing fields) or whose optimizer state
            does not fit the model, a fresh run into a directory that holds
            a checkpoint.
        OSError: unreadable data (see ``load_corpus``).
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    world = World.from_env()
    if config.batch_size % (world.size * config.grad_accum):
        raise UsageError(
            f"batch_size={config.batch_size} is not divisible by world_size * grad_accum = "
            f"{world.size} * {config.grad_accum} = {world.size * config.grad_accum}"
        )
    run_dir = Path(config.out)
    state = _resume_state(config, run_dir, resume)
    threads_before = torch.get_num_threads()
    threads = config.threads or max(1, (os.cpu_count() or 1) // world.local_size)
    torch.set_num_threads(threads)
    owns_group = False
    try:
        device = training_device(config, world)
        if world.size > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            owns_group = True
        return _run(config, run_dir, state, world, device, progress, None if data_from is None else Path(data_from))
    finally:
        if owns_group:
            dist.destroy_process_group()
        torch.set_num_threads(threads_before)


def _resume_state(config: TrainConfig, run_dir: Path, resume: bool) -> ckpt.TrainingState | None:
    latest = ckpt.latest_checkpoint(run_dir)
    if not resume:
        if latest is not None:
            raise UsageError(
                f"{run_dir} already holds a training checkpoint ({latest.name}); resume it "
                "(resume=True, --resume) or choose another out directory"
            )
        return None
    if latest is None:
        raise UsageError(f"cannot resume: no checkpoint in {run_dir / ckpt.CHECKPOINTS} (no 'latest' pointer)")
    try:
        state = ckpt.load_training_state(latest)
    except (ValueError, OSError) as e:  # a damaged or unreadable checkpoint of the user's run
        raise UsageError(f"cannot resume from {latest}: {e}") from e
    diff = config_differences(state.config, config)
    if diff:
        raise UsageError(
            f"cannot resume {latest}: it was trained with another config, {{field: (saved, given)}} = {diff}"
        )
    return state


@dataclass
class _Setup:
    """What one run trains: the model (``net`` wraps it under DDP), its optimizer and
    where the run starts (0, or the checkpoint's step, tokens and time)."""

    model: GPT
    net: nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    sharded: bool
    start: int = 0
    tokens_seen: int = 0
    elapsed_before: float = 0.0


def _run(config, run_dir, state, world, device, progress, data_from=None) -> TrainResult:
    tokenizer, train_tokens, val_tokens = _prepare_data(config, run_dir, world, state is not None, data_from)
    batches = _batches_or_error(train_tokens, config, "train")
    _batches_or_error(val_tokens, config, "val")
    val_sets = val_batches(val_tokens, batch_size=config.batch_size, context_length=config.context_length,
                           num_batches=config.eval_batches, seed=VAL_SEED)  # fmt: skip
    run = _setup(config, tokenizer.vocab_size, state, world, device)
    autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16,
                                 enabled=config.dtype == "bfloat16")  # fmt: skip
    metrics = _Metrics(run_dir / "metrics.jsonl", run.start) if world.main else None
    bar = Progress(config.max_steps, run.start, enabled=progress if world.main else False)
    _announce(bar, run, config, run_dir, train_tokens.size, world)
    tokens_per_step = config.batch_size * config.context_length
    train_time, log_time, log_tokens = 0.0, 0.0, 0
    val_loss: float | None = None
    train_loss = None
    run.model.train()
    try:
        for step in range(run.start, config.max_steps):
            t0 = time.perf_counter()
            lr, train_loss, aux_loss, grad_norm = _train_step(run, batches, step, config, world, device, autocast)
            dt = time.perf_counter() - t0
            train_time, log_time, log_tokens = train_time + dt, log_time + dt, log_tokens + tokens_per_step
            run.tokens_seen += tokens_per_step
            n = step + 1
            final = n == config.max_steps
            evaluate = final or n % config.eval_every == 0
            if evaluate:
                val_loss = validation_loss(run.model, val_sets, config, world, device, autocast)
            logged = evaluate or n % config.log_every == 0
            tokens_per_s = log_tokens / log_time if log_time > 0 else 0.0
            if logged and metrics is not None:
                record = {"step": n, "train_loss": train_loss, "aux_loss": aux_loss, "lr": lr,
                          "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                          "elapsed_s": run.elapsed_before + train_time}  # fmt: skip
                metrics.write({**record, "val_loss": val_loss} if evaluate else record)
            bar.update(n, train_loss, tokens_per_s, val_loss=val_loss if evaluate else None, logged=logged)
            if logged:
                log_time, log_tokens = 0.0, 0
            if final or n % config.checkpoint_every == 0:
                _save(run, run_dir, n, config, world, device, elapsed_s=run.elapsed_before + train_time)
        if val_loss is None:  # nothing left to train: a finished run resumed
            val_loss = validation_loss(run.model, val_sets, config, world, device, autocast)
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
    speed = (config.max_steps - run.start) * tokens_per_step / train_time if train_time > 0 else 0.0
    if world.main and progress is not False:
        bar.message(
            f"done: {config.max_steps} steps, val loss {val_loss:.4f}, {speed:,.0f} tok/s, "
            f"{format_duration(train_time)} -> {run_dir}"
        )
    model = run.model
    if run.sharded:  # the AdamW state goes first: the full copy then needs 4 bytes per parameter
        run.optimizer.state.clear()
        model = shard.unsharded_copy(model, device)  # collective
    model.eval()
    return TrainResult(run_dir, val_loss, train_loss, config.max_steps, speed, model)


def _setup(config: TrainConfig, vocab_size: int, state, world: World, device) -> _Setup:
    """The model (the checkpoint's weights when resuming), sharded or wrapped for
    several processes, its AdamW with the checkpoint's state, and the RNG state."""
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    gpt_config = GPTConfig.from_preset(
        config.preset, vocab_size=vocab_size, context_length=config.context_length, attention=config.attention,
        attention_options=dict(config.attention_options), dropout=config.dropout, mlp_dim=config.mlp_dim,
    )  # fmt: skip
    model = GPT(gpt_config, device=device)
    sharded = config.shard and world.size > 1
    if state is not None:
        ckpt.load_model_weights(model, state.directory)  # the full weights, before any sharding
    if sharded:
        shard.shard_model(model, device, world.size)  # before the optimizer: its parameters become DTensors
    optimizer = torch.optim.AdamW(parameter_groups(model, config.weight_decay), lr=config.lr,
                                  betas=(config.beta1, config.beta2), eps=_ADAM_EPS, fused=False)  # fmt: skip
    params = [p for g in optimizer.param_groups for p in g["params"]]
    torch.manual_seed(config.seed + 1 + world.rank)  # dropout and gate noise, per rank
    net: nn.Module = model
    if world.size > 1 and not sharded:
        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    run = _Setup(model, net, optimizer, params, sharded)
    if state is not None:
        try:
            ckpt.check_optimizer_shapes(state.optimizer, params, str(state.directory))
        except ValueError as e:  # the user's checkpoint; the message names it
            raise UsageError(str(e)) from e
        try:
            if sharded:
                shard.load_full_optimizer_state(model, optimizer, state.optimizer)
            else:
                optimizer.load_state_dict(state.optimizer)
        except (ValueError, KeyError) as e:
            raise UsageError(f"{state.directory}: the optimizer state does not fit the model: {e}") from None
        restore_rng(state.rng, world, device)
        run.start, run.tokens_seen, run.elapsed_before = state.step, state.tokens_seen, state.elapsed_s
    return run


def _announce(bar: Progress, run: _Setup, config: TrainConfig, run_dir: Path, tokens: int, world: World) -> None:
    if run.start:
        bar.message(f"resuming {run_dir} at step {run.start}")
        return
    bar.message(
        f"training {run.model.num_parameters():,} parameters ({config.preset}, {config.attention}) on "
        f"{tokens:,} tokens, {world.size} process(es){' sharded (FSDP2)' if run.sharded else ''}, "
        f"{torch.get_num_threads()} thread(s) each"
    )


def _train_step(run: _Setup, batches: Batches, step: int, config: TrainConfig, world: World, device, autocast):
    """One optimizer step (the module docstring's picture); returns (lr, LM loss,
    aux loss, gradient norm), the losses averaged over micro-batches and ranks."""
    lr = learning_rate(step, config)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    sums = torch.zeros(2, device=device)  # (LM loss, aux loss) summed over micro-batches
    for micro in range(config.grad_accum):
        x, y = batches.get(step, micro=micro, grad_accum=config.grad_accum, rank=world.rank, world_size=world.size)
        x, y = x.to(device), y.to(device)
        with _gradient_sync(run.net, world, run.sharded, last=micro == config.grad_accum - 1):
            with autocast():
                logits = run.net(x)  # (b, T, V)
                lm = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
                aux = run.model.aux_loss().float()
            ((lm + aux) / config.grad_accum).backward()
        sums += torch.stack([lm.detach(), aux.detach()])
    clip = config.grad_clip if config.grad_clip > 0 else math.inf
    grad_norm = shard.full_value(torch.nn.utils.clip_grad_norm_(run.params, clip))  # sharded: a DTensor
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    losses = world.mean(sums / config.grad_accum)
    return lr, float(losses[0]), float(losses[1]), float(grad_norm)


def _save(run: _Setup, run_dir: Path, n: int, config: TrainConfig, world: World, device, *, elapsed_s: float) -> None:
    """The checkpoint after step n (collective: every rank calls it; rank 0 writes)."""
    rng = rng_states(world, device)
    # sharded: the full states, gathered to rank 0 (collective)
    model_state = shard.full_model_state(run.model) if run.sharded else None
    optimizer_state = (
        shard.full_optimizer_state(run.model, run.optimizer) if run.sharded else run.optimizer.state_dict()
    )
    if world.main:
        ckpt.save_training_checkpoint(
            run_dir, step=n, model=run.model, model_state=model_state, optimizer_state=optimizer_state,
            config=config, rng=rng, tokens_seen=run.tokens_seen, elapsed_s=elapsed_s, world_size=world.size,
        )  # fmt: skip
    world.barrier()


def _gradient_sync(net: nn.Module, world: World, sharded: bool, *, last: bool):
    """A context for one micro-batch's backward: gradients are averaged over the
    ranks on the last micro-batch only (DDP: ``no_sync``; FSDP2:
    ``set_requires_gradient_sync``)."""
    if sharded:
        net.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last or world.size == 1 else net.no_sync()
