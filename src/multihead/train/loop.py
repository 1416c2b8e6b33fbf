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

    config.json        the TrainConfig (of the latest checkpoint; ``run_files``)
    tokenizer/         the tokenizer (``load_tokenizer_dir``)
    data/train.bin     token files (``write_tokens``)
    data/val.bin
    metrics.jsonl      {"step", "train_loss", "aux_loss", "lr", "grad_norm",
                        "tokens_per_s", "elapsed_s"[, "val_loss"[, "heads"]]} per logged
                        step ("heads": ``track_heads``, ``head_tracking``)
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
A NaN or infinite loss stops the run at once (``multihead.train.divergence``).
SIGINT (Ctrl-C) or SIGTERM ends the run after the current step with a
checkpoint of it (``multihead.train.interrupt``: every rank stops after the
same step), so a resume continues as if nothing had happened.

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
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import UsageError
from ..models.checkpoint import read_config as read_model_config
from ..models.gpt import GPT
from ..models.run_dirs import CHECKPOINTS, latest_checkpoint
from . import checkpoint as ckpt
from . import shard
from .batches import Batches, val_batches
from .config import TrainConfig, config_differences, learning_rate
from .divergence import LossDiverged, check_finite, clear_outcome, write_outcome
from .head_tracking import check_trackable, seen_ids, tracked_heads
from .interrupt import StopSignals, TrainingInterrupted
from .pretrained import load_folder_weights
from .progress import Progress, format_duration
from .run_files import Metrics, batches_or_error, prepare_data, write_config
from .sampling import sample_line
from .steps import parameter_groups, validation_loss
from .tensor_parallel import TensorSplit, check_split, split_model
from .world import World, restore_rng, rng_states, training_device

__all__ = ["TrainResult", "train", "check_model", "parameter_groups", "validation_loss", "VAL_SEED"]

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
        tokens_per_s: training tokens per second of this call (all ranks;
            0 when it trained no step).
        model: the trained GPT (in eval mode, on the training device); a
            sharded run returns an unsharded copy on every rank.
        start: the step this call started from (the checkpoint's when
            resuming, else 0); ``steps - start`` steps were trained.
    """

    run_dir: Path
    val_loss: float
    train_loss: float | None
    steps: int
    tokens_per_s: float
    model: GPT
    start: int = 0


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
            (the message names the differing fields), at a step beyond
            max_steps, or whose optimizer state does not fit the model, a
            fresh run into a directory that holds a checkpoint.
        TypeError / ValueError: attention options the model refuses
            (checked on the meta device before anything is written).
        OSError: unreadable data (see ``load_corpus``).
        LossDiverged: a NaN or infinite loss or gradient norm stopped the run
            (``multihead.train.divergence``: nothing of that step written).
        TrainingInterrupted: SIGINT or SIGTERM stopped the run
            (``multihead.train.interrupt``): after a checkpoint of the step
            it was in, or at once on a second signal.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    world = World.from_env()
    if world.size % config.tensor_parallel:
        raise UsageError(f"tensor_parallel={config.tensor_parallel} must divide the number of processes, {world.size}")
    copies = world.size // config.tensor_parallel  # data-parallel copies of the model
    if config.batch_size % (copies * config.grad_accum):
        copies_text = "world_size" if config.tensor_parallel == 1 else (
            f"the data-parallel copies (world_size {world.size} / tensor_parallel {config.tensor_parallel})")
        raise UsageError(
            f"batch_size={config.batch_size} is not divisible by {copies_text} * grad_accum = "
            f"{copies} * {config.grad_accum} = {copies * config.grad_accum}"
        )
    run_dir = Path(config.out)
    state = _resume_state(config, run_dir, resume)
    model_config = config.model_config(config.vocab_size or 256) if state is None else None
    if state is None:
        check_model(config)
    else:
        try:
            model_config = read_model_config(state.directory)
        except (ValueError, OSError) as e:  # the user's damaged checkpoint
            raise UsageError(f"cannot resume from {state.directory}: {e}") from e
    try:
        check_split(model_config, world.size, config.tensor_parallel, config.shard and world.size > 1)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if config.track_heads:
        check_trackable(model_config)  # before anything is written
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
    latest = latest_checkpoint(run_dir)
    if not resume:
        if latest is not None:
            raise UsageError(
                f"{run_dir} already holds a training checkpoint ({latest.name}); resume it "
                "(resume=True, --resume) or choose another out directory"
            )
        return None
    if latest is None:
        raise UsageError(f"cannot resume: no checkpoint in {run_dir / CHECKPOINTS} (no 'latest' pointer)")
    try:
        state = ckpt.load_training_state(latest)
    except (ValueError, OSError) as e:  # a damaged or unreadable checkpoint of the user's run
        raise UsageError(f"cannot resume from {latest}: {e}") from e
    diff = config_differences(state.config, config)
    if diff:
        raise UsageError(
            f"cannot resume {latest}: it was trained with another config, {{field: (saved, given)}} = {diff}"
        )
    if config.max_steps < state.step:
        raise UsageError(
            f"cannot resume {latest} with max_steps={config.max_steps}: the checkpoint is at step {state.step}, "
            f"and a resumed run goes on from there (max_steps >= {state.step})"
        )
    return state


def check_model(config: TrainConfig, vocab_size: int | None = None) -> None:
    """Build the run's GPT on the meta device (no memory used), so the attention
    kind and its options are checked before anything is written.

    Args:
        vocab_size: the tokenizer's (None: ``config.vocab_size``, else 256; the
            vocabulary does not change what the options may be).

    Raises:
        TypeError / ValueError: the model's or the attention kind's refusal.
    """
    GPT(config.model_config(vocab_size or config.vocab_size or 256), device="meta")


def _schedule_change(state: ckpt.TrainingState, config: TrainConfig) -> str | None:
    """The line saying how a new max_steps moves the learning rate of the next step."""
    if state.config.max_steps == config.max_steps or state.step >= config.max_steps:
        return None
    before, after = learning_rate(state.step, state.config), learning_rate(state.step, config)
    return (
        f"max_steps {state.config.max_steps} -> {config.max_steps} rescales the cosine schedule: the learning "
        f"rate of step {state.step + 1} goes from {before:.3g} to {after:.3g} "
        "(see 'Checkpoints and resume' in docs/training.md)"
    )


@dataclass
class _Setup:
    """What one run trains: the model (``net`` wraps it under DDP), its optimizer and
    where the run starts (0, or the checkpoint's step, tokens and time)."""

    model: GPT
    net: nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    sharded: bool
    split: TensorSplit | None = None  # tensor parallelism (config.tensor_parallel > 1)
    start: int = 0
    tokens_seen: int = 0
    elapsed_before: float = 0.0


def _run(config, run_dir, state, world, device, progress, data_from=None) -> TrainResult:
    tokenizer, train_tokens, val_tokens = prepare_data(config, run_dir, world, state is not None, data_from)
    batches = batches_or_error(train_tokens, config, "train")
    batches_or_error(val_tokens, config, "val")
    val_sets = val_batches(val_tokens, batch_size=config.batch_size, context_length=config.context_length,
                           num_batches=config.eval_batches, seed=VAL_SEED)  # fmt: skip
    run = _setup(config, tokenizer.vocab_size, state, world, device)
    autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16,
                                 enabled=config.dtype == "bfloat16")  # fmt: skip
    metrics = Metrics(run_dir / "metrics.jsonl", run.start) if world.main else None
    if world.main:
        clear_outcome(run_dir)  # diverged.json of an earlier call
    bar = Progress(config.max_steps, run.start, enabled=progress if world.main else False)
    _announce(bar, run, config, run_dir, train_tokens.size, world)
    change = _schedule_change(state, config) if state is not None else None
    if change:
        bar.message(change)
    stop = StopSignals(run_dir)
    tokens_per_step = config.batch_size * config.context_length
    track = seen_ids(train_tokens, tokenizer.vocab_size) if config.track_heads else None
    train_time, log_time, log_tokens = 0.0, 0.0, 0
    val_loss: float | None = None
    train_loss = None
    run.model.train()
    try:
        stop.__enter__()  # SIGINT / SIGTERM: finish the step, checkpoint, TrainingInterrupted
        for step in range(run.start, config.max_steps):
            t0 = time.perf_counter()
            lr, train_loss, aux_loss, grad_norm = _train_step(run, batches, step, config, world, device, autocast)
            dt = time.perf_counter() - t0
            for which, value in (("training loss", train_loss), ("gradient norm", grad_norm)):
                check_finite(which, value, step=step + 1, lr=lr, run_dir=run_dir)  # the same on every rank
            train_time, log_time, log_tokens = train_time + dt, log_time + dt, log_tokens + tokens_per_step
            run.tokens_seen += tokens_per_step
            n = step + 1
            final = n == config.max_steps
            evaluate = final or n % config.eval_every == 0
            if evaluate:
                val_loss = validation_loss(run.model, val_sets, config, world, device, autocast, _data(run, world))
                check_finite("validation loss", val_loss, step=n, lr=lr, run_dir=run_dir)
                scored = {"val_loss": val_loss, **tracked_heads(run.model, track, config.context_length, sharded=run.sharded)}
            logged = evaluate or n % config.log_every == 0
            tokens_per_s = log_tokens / log_time if log_time > 0 else 0.0
            if logged and metrics is not None:
                record = {"step": n, "train_loss": train_loss, "aux_loss": aux_loss, "lr": lr,
                          "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                          "elapsed_s": run.elapsed_before + train_time}  # fmt: skip
                metrics.write({**record, **scored} if evaluate else record)
            bar.update(n, train_loss, tokens_per_s, val_loss=val_loss if evaluate else None, logged=logged)
            if config.sample_every and (final or n % config.sample_every == 0):
                bar.message(sample_line(run.model, tokenizer, val_tokens, n, device))
            if logged:
                log_time, log_tokens = 0.0, 0
            saved = final or n % config.checkpoint_every == 0
            if saved:
                _save(run, run_dir, n, config, world, device, elapsed_s=run.elapsed_before + train_time)
            signum = 0 if final else stop.agreed(world, device)  # the same on every rank
            if signum:
                if not saved:
                    _save(run, run_dir, n, config, world, device, elapsed_s=run.elapsed_before + train_time)
                raise TrainingInterrupted(signum, n, run_dir)
        stop.restore()
        if val_loss is None:  # nothing left to train: a finished run resumed
            val_loss = validation_loss(run.model, val_sets, config, world, device, autocast, _data(run, world))
    except LossDiverged as e:
        if world.main:
            write_outcome(e)
        raise
    finally:
        stop.restore()
        bar.close()
        if metrics is not None:
            metrics.close()
    speed = (config.max_steps - run.start) * tokens_per_step / train_time if train_time > 0 else 0.0
    if world.main and progress is not False and run.start == config.max_steps:
        bar.message(f"nothing to train: {run_dir} is already at step {run.start}; val loss {val_loss:.4f}")
    elif world.main and progress is not False:
        bar.message(
            f"done: {config.max_steps} steps, val loss {val_loss:.4f}, {speed:,.0f} tok/s, "
            f"{format_duration(train_time)} -> {run_dir}"
        )
    model = run.model
    if run.sharded:  # the AdamW state goes first: the full copy then needs 4 bytes per parameter
        run.optimizer.state.clear()
        model = shard.unsharded_copy(model, device)  # collective
    elif run.split is not None:
        run.optimizer.state.clear()
        state = run.split.model_state(model)  # collective
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model = GPT(model.config, device=device)
        model.load_state_dict(state)
    model.eval()
    return TrainResult(run_dir, val_loss, train_loss, config.max_steps, speed, model, run.start)


def _setup(config: TrainConfig, vocab_size: int, state, world: World, device) -> _Setup:
    """The model (the checkpoint's weights when resuming), sharded or wrapped for
    several processes, its AdamW with the checkpoint's state, and the RNG state."""
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    if state is not None:  # the checkpoint's model (an init_from run needs its folder no more)
        try:
            model = GPT(read_model_config(state.directory), device=device)
        except (ValueError, OSError) as e:  # the user's damaged checkpoint
            raise UsageError(f"cannot resume from {state.directory}: {e}") from e
        ckpt.load_model_weights(model, state.directory)  # the full weights, before any sharding
    else:
        model = GPT(config.model_config(vocab_size), device=device)
        if config.init_from is not None:
            load_folder_weights(model, config.init_from)
    sharded = config.shard and world.size > 1
    if sharded:
        shard.shard_model(model, device, world.size)  # before the optimizer: its parameters become DTensors
    whole = [p for g in parameter_groups(model, config.weight_decay) for p in g["params"]]  # one-process order
    if state is not None:
        try:
            ckpt.check_optimizer_shapes(state.optimizer, whole, str(state.directory))
        except ValueError as e:  # the user's checkpoint; the message names it
            raise UsageError(str(e)) from e
    split = None
    if config.tensor_parallel > 1:  # before the optimizer too: the split layers are new modules
        split = split_model(model, parameter_groups(model, config.weight_decay), world.size,
                            config.tensor_parallel, device)  # fmt: skip
    optimizer = torch.optim.AdamW(parameter_groups(model, config.weight_decay), lr=config.lr,
                                  betas=(config.beta1, config.beta2), eps=_ADAM_EPS, fused=False)  # fmt: skip
    params = [p for g in optimizer.param_groups for p in g["params"]]
    # dropout and gate noise, per data-parallel copy: the processes of one split model draw the
    # same numbers, so a dropout on their replicated activations drops the same entries
    torch.manual_seed(config.seed + 1 + (world.rank if split is None else split.dp_rank))
    net: nn.Module = model
    if world.size > 1 and not sharded and split is None:
        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    run = _Setup(model, net, optimizer, params, sharded, split)
    if state is not None:
        try:
            if sharded:
                shard.load_full_optimizer_state(model, optimizer, state.optimizer)
            elif split is not None:
                split.load_optimizer_state(model, optimizer, state.optimizer)
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
        f"training {run.model.num_parameters():,} parameters "
        f"({config.preset or 'from ' + str(config.init_from)}, {config.attention}) on "
        f"{tokens:,} tokens, {world.size} process(es){' sharded (FSDP2)' if run.sharded else ''}"
        f"{f' (heads split {run.split.mesh.size(1)} ways x {run.split.dp_size} data-parallel)' if run.split else ''}, "
        f"{torch.get_num_threads()} thread(s) each"
    )


def _train_step(run: _Setup, batches: Batches, step: int, config: TrainConfig, world: World, device, autocast):
    """One optimizer step (the module docstring's picture); returns (lr, LM loss,
    aux loss, gradient norm), the losses averaged over micro-batches and ranks."""
    lr = learning_rate(step, config)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    sums = torch.zeros(2, device=device)  # (LM loss, aux loss) summed over micro-batches
    rank, size = _data(run, world)
    for micro in range(config.grad_accum):
        x, y = batches.get(step, micro=micro, grad_accum=config.grad_accum, rank=rank, world_size=size)
        x, y = x.to(device), y.to(device)
        with _gradient_sync(run.net, world, run.sharded, last=micro == config.grad_accum - 1 or run.split is not None):
            with autocast():
                logits = run.net(x)  # (b, T, V)
                lm = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
                aux = run.model.aux_loss().float()
            ((lm + aux) / config.grad_accum).backward()
        sums += torch.stack([lm.detach(), aux.detach()])
    clip = config.grad_clip if config.grad_clip > 0 else math.inf
    if run.split is not None:
        run.split.sync_gradients(run.params)
        grad_norm = run.split.clip_grad_norm(run.model, clip)
        sums[1:] = run.split.whole(sums[1:])  # the aux loss of split heads: each rank holds its heads' part
    else:
        grad_norm = shard.full_value(torch.nn.utils.clip_grad_norm_(run.params, clip))  # sharded: a DTensor
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    losses = world.mean(sums / config.grad_accum)
    return lr, float(losses[0]), float(losses[1]), float(grad_norm)


def _save(run: _Setup, run_dir: Path, n: int, config: TrainConfig, world: World, device, *, elapsed_s: float) -> None:
    """The checkpoint after step n (collective: every rank calls it; rank 0 writes)."""
    rng = rng_states(world, device)
    # sharded or split: the full states, gathered (collective)
    if run.split is not None:
        model_state = run.split.model_state(run.model)
        optimizer_state = run.split.optimizer_state(run.model, run.optimizer)
    else:
        model_state = shard.full_model_state(run.model) if run.sharded else None
        optimizer_state = (
            shard.full_optimizer_state(run.model, run.optimizer) if run.sharded else run.optimizer.state_dict()
        )
    if world.main:
        ckpt.save_training_checkpoint(
            run_dir, step=n, model=run.model, model_state=model_state, optimizer_state=optimizer_state,
            config=config, rng=rng, tokens_seen=run.tokens_seen, elapsed_s=elapsed_s, world_size=world.size,
        )  # fmt: skip
        write_config(run_dir, config)  # config.json says what the latest checkpoint was trained with
    world.barrier()


def _data(run: _Setup, world: World) -> tuple[int, int]:
    """(rank, size) of this process among the data-parallel copies (every process without tensor parallelism)."""
    return (run.split.dp_rank, run.split.dp_size) if run.split is not None else (world.rank, world.size)


def _gradient_sync(net: nn.Module, world: World, sharded: bool, *, last: bool):
    """A context for one micro-batch's backward: gradients are averaged over the
    ranks on the last micro-batch only (DDP: ``no_sync``; FSDP2:
    ``set_requires_gradient_sync``)."""
    if sharded:
        net.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last or world.size == 1 else net.no_sync()
