"""``TrainConfig``: every setting of a ``multihead train`` run, flat and validated.

The learning rate follows :func:`learning_rate`, a linear warm-up then a
cosine decay over the optimizer steps 0 .. max_steps - 1::

    lr |      ______
       |     /      ``--.._
       |    /              ``-.._
       |   /                     ``--.__ min_lr
       +--|--------|------------------|---> step
          0   warmup - 1         max_steps - 1

A config is a dataclass of JSON values: ``to_dict`` / ``from_dict`` round
trip it through ``config.json`` and checkpoint headers.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .._checks import dropout_probability, non_negative_int, positive_int
from ..models.gpt import GPT_PRESETS, GPTConfig
from ..models.gpt_positions import check_positions
from ..models.layer_options import check_layer_options
from ..modules.registry import check_kind

__all__ = [
    "TrainConfig", "RESUMABLE_CHANGES", "DEFAULT_WARMUP", "DEFAULT_CONTEXT", "learning_rate", "config_differences",
]  # fmt: skip

# Fields a resumed run may change: they decide how long to train, how often to
# report and where to write, never what a step computes (``threads`` only
# changes the order of float sums, as on another machine; ``shard`` only how
# the processes hold the model, and its checkpoints are the full model in the
# same format, so a run may switch between FSDP2 and DDP on resume;
# ``tensor_parallel`` likewise; ``track_heads`` scores the model with a generator of its own).
RESUMABLE_CHANGES = frozenset(
    {"max_steps", "eval_every", "log_every", "checkpoint_every", "sample_every", "out", "threads", "shard",
     "tensor_parallel", "track_heads"}
)  # fmt: skip
_TOKENIZERS = ("bytes", "bpe")
_DTYPES = ("float32", "bfloat16")
_DEVICES = ("auto", "cpu", "cuda")
DEFAULT_WARMUP = 40  # steps of warm-up of a long run; a short one warms up for a tenth of its steps
DEFAULT_CONTEXT = 128  # tokens per training sequence, unless the model allows fewer


def _float(name: str, value: object, *, low: float = 0.0, include_low: bool = True, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {name}={value!r} ({type(value).__name__})")
    v = float(value)
    above = v >= low if include_low else v > low
    if not (math.isfinite(v) and above and v <= high):
        lo = "[" if include_low else "("
        hi = "]" if math.isfinite(high) else ")"
        raise ValueError(f"{name} must be a finite float in {lo}{low}, {high}{hi}, got {name}={value!r}")
    return v


@dataclass
class TrainConfig:
    """Settings of one training run of a GPT (see ``multihead.train.train``).

    Data and tokens:
        data: "shakespeare" (the plays, split by play) or the path of a UTF-8
            text file (its last lines become the validation split).
        tokenizer: "bytes" (256 ids) or "bpe" (byte-level BPE trained on the
            training text; with ``init_from``, the folder's). None: "bytes",
            or "bpe" with ``init_from``.
        vocab_size: BPE vocabulary size (>= 257; None: the tokenizer's
            default); must be None or 256 with "bytes".

    Model:
        preset: a name of ``GPT_PRESETS``; its vocab_size is replaced by the
            tokenizer's. None: "mini", or no preset with ``init_from``.
        init_from: a Hugging Face GPT-2 folder to fine-tune
            (``multihead.train.pretrained``): the model, its weights and its
            tokenizer come from it, so preset, vocab_size, mlp_dim,
            attention options (of every layer or per layer) and positions
            cannot be given and the attention is "mha";
            context_length None takes the folder's n_positions.
        attention: attention kind ("mha", "gqa", "moh", "gated", ...).
        attention_options: further options of that kind (JSON values).
        layer_attention_options: None, or a list of dicts of options per
            block over ``attention_options`` (a shorter list repeats over the
            layers: ``[{"window": 64}, {}]`` alternates local and global
            layers; ``GPTConfig.layer_attention_options``).
        positions: "learned" (GPT-2's position table), "rope", "alibi" or
            "none" (``GPTConfig.positions``; without a table the trained
            model can stream past its context).
        context_length: T of the training sequences; None: DEFAULT_CONTEXT
            = 128 (a short context trains faster per byte on a CPU), at most
            the preset's, and with ``init_from`` the folder's n_positions. A
            longer one than the model's is refused.
        dropout: dropout probability of the model in training mode.
        mlp_dim: the MLP hidden width (None: the preset's, 4 x its width);
            ``multihead compare`` sets it to match parameter counts.

    Optimisation (AdamW, decoupled weight decay on the 2-D+ weights of the
    linear layers only; see ``multihead.train.loop``):
        batch_size: sequences per optimizer step, over all processes and
            micro-batches (the global batch).
        grad_accum: micro-batches per process per step; batch_size must be
            divisible by world_size * grad_accum.
        max_steps: optimizer steps of the whole run.
        lr, min_lr: peak and final learning rate (min_lr <= lr).
        warmup: steps of linear warm-up (< max_steps); None: the run's
            length decides, min(DEFAULT_WARMUP, max_steps // 10) = min(40,
            max_steps // 10), so a 20-step run warms up for 2.
        weight_decay, grad_clip (max global grad norm; 0 = off), beta1, beta2.
        dtype: "float32", or "bfloat16" (autocast; parameters and optimizer
            state stay float32).

    Reporting and files:
        eval_every, eval_batches: validation loss every that many steps (and
            at the end) over that many fixed batches of batch_size sequences.
        log_every: one metrics line every that many steps (and at evaluation
            steps and the end).
        checkpoint_every: a checkpoint every that many steps (and at the end).
        sample_every: a short greedy sample printed every that many steps
            (and at the end; ``multihead.train.sampling``); None: none.
        track_heads: at every evaluation, score every head's causal roles
            (previous-token, duplicate-token, induction, ...) and write them
            in that step's metrics line (``multihead.train.head_tracking``;
            ``multihead heads RUN_DIR`` plots them). Needs context_length >= 4
            and no tensor parallelism.
        seed: model initialisation, dropout and sampling of the batches.
        out: the run directory (None: ``runs/<preset>-<attention>``).
        threads: torch intra-op threads (None: the machine's cores, divided
            among the processes of one machine under torchrun).
        device: "auto" (CUDA when available, else CPU), "cpu" or "cuda".
        shard: under torchrun with 2+ processes, shard the model with FSDP2
            (``fully_shard`` on every block, then on the model) instead of
            wrapping it in DistributedDataParallel: each process keeps 1/N
            of the weights, gradients and AdamW state. One process trains
            the whole model either way, so there it changes nothing (as DDP
            is not used with one process either). Checkpoints hold the full
            model in the same format with and without it.
        tensor_parallel: under torchrun, split every layer's heads (and
            MLP) over this many processes (``multihead.parallel``); the
            process count divided by it are data-parallel copies
            (``multihead.train.tensor_parallel``). 1: none. Checkpoints hold
            the full model either way.

    The defaults train the "mini" preset (4 layers, 128 wide, 0.8M
    parameters) at context 128 on the plays in bytes: 1600 steps of 32 x
    128 tokens (6.6M tokens) at a peak rate of 5e-3, sized for a 2-core CPU
    (under 9 minutes there, to a validation loss of 1.59 nats per byte;
    the measured run and the runs that chose these values are in
    docs/training.md).

    A resumed run may change only the fields in ``RESUMABLE_CHANGES``
    (max_steps, eval_every, log_every, checkpoint_every, sample_every, out,
    threads, shard, tensor_parallel, track_heads).

    Raises:
        TypeError / ValueError: a field of the wrong type or value; the
            message names the field and the value.
    """

    data: str = "shakespeare"
    tokenizer: str | None = None
    vocab_size: int | None = None
    preset: str | None = None
    init_from: str | None = None
    attention: str = "mha"
    attention_options: dict[str, Any] = field(default_factory=dict)
    layer_attention_options: list[dict[str, Any]] | None = None
    positions: str = "learned"
    context_length: int | None = None
    batch_size: int = 32
    grad_accum: int = 1
    max_steps: int = 1600
    lr: float = 5e-3
    min_lr: float = 1e-4
    warmup: int | None = None
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.95
    dropout: float = 0.0
    mlp_dim: int | None = None
    eval_every: int = 400
    eval_batches: int = 20
    log_every: int = 10
    checkpoint_every: int = 400
    sample_every: int | None = None
    seed: int = 0
    dtype: str = "float32"
    out: str | None = None
    threads: int | None = None
    device: str = "auto"
    shard: bool = False
    tensor_parallel: int = 1
    track_heads: bool = False

    def __post_init__(self) -> None:
        if self.init_from is not None:
            self._check_init_from()
        if self.tokenizer is None:
            self.tokenizer = "bpe" if self.init_from is not None else "bytes"
        if self.preset is None and self.init_from is None:
            self.preset = "mini"
        for name in ("data", "tokenizer", "attention", "dtype", "device") + (("preset",) if self.preset else ()):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise TypeError(f"{name} must be a non-empty str, got {name}={value!r}")
        if self.tokenizer not in _TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {list(_TOKENIZERS)}, got tokenizer={self.tokenizer!r}")
        if self.vocab_size is not None:
            positive_int("vocab_size", self.vocab_size)
            if self.tokenizer == "bytes" and self.vocab_size != 256:
                raise ValueError(f"the bytes tokenizer has 256 ids, got vocab_size={self.vocab_size}")
            if self.tokenizer == "bpe" and self.vocab_size < 257:
                raise ValueError(f"a BPE vocabulary needs at least 257 ids, got vocab_size={self.vocab_size}")
        if self.preset is not None and self.preset not in GPT_PRESETS:
            raise ValueError(f"unknown GPT preset preset={self.preset!r}; valid presets: {sorted(GPT_PRESETS)}")
        check_kind(self.attention)
        if not isinstance(self.attention_options, dict) or not all(isinstance(k, str) for k in self.attention_options):
            raise TypeError(f"attention_options must be a dict of option name -> value, got {self.attention_options!r}")
        self.positions = check_positions(self.positions)
        if self.preset is not None:  # the folder's model of init_from refuses them in _check_init_from
            layers = GPT_PRESETS[self.preset]["num_layers"]
            self.layer_attention_options = check_layer_options(self.layer_attention_options, layers)
        if self.preset is None:  # init_from: the folder's n_positions, read only when needed
            if self.context_length is None:
                from .pretrained import folder_model_config

                self.context_length = folder_model_config(self.init_from).context_length
            longest = self.context_length  # checked against the folder with the model (check_folder)
        else:
            longest = GPT_PRESETS[self.preset]["context_length"]
        if self.context_length is None:
            self.context_length = min(DEFAULT_CONTEXT, longest)
        positive_int("context_length", self.context_length)
        if self.context_length > longest:
            raise ValueError(
                f"context_length={self.context_length} is longer than preset {self.preset!r} allows "
                f"(context_length={longest})"
            )
        for name in ("batch_size", "grad_accum", "max_steps", "eval_every", "eval_batches", "log_every"):
            positive_int(name, getattr(self, name))
        positive_int("checkpoint_every", self.checkpoint_every)
        if self.sample_every is not None:
            positive_int("sample_every", self.sample_every)
        if self.mlp_dim is not None:
            positive_int("mlp_dim", self.mlp_dim)
        if self.warmup is None:
            self.warmup = min(DEFAULT_WARMUP, self.max_steps // 10)
        non_negative_int("warmup", self.warmup)
        non_negative_int("seed", self.seed)
        if self.batch_size % self.grad_accum != 0:
            raise ValueError(
                f"batch_size must be divisible by grad_accum, got batch_size={self.batch_size} and "
                f"grad_accum={self.grad_accum}"
            )
        if self.warmup >= self.max_steps:
            raise ValueError(
                f"warmup must be shorter than max_steps, got warmup={self.warmup}, max_steps={self.max_steps}"
            )
        self.lr = _float("lr", self.lr, include_low=False)
        self.min_lr = _float("min_lr", self.min_lr)
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr must be <= lr, got min_lr={self.min_lr}, lr={self.lr}")
        self.weight_decay = _float("weight_decay", self.weight_decay)
        self.grad_clip = _float("grad_clip", self.grad_clip)
        self.beta1 = _float("beta1", self.beta1, high=0.999999)
        self.beta2 = _float("beta2", self.beta2, high=0.999999)
        self.dropout = dropout_probability(self.dropout)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got dtype={self.dtype!r}")
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {list(_DEVICES)}, got device={self.device!r}")
        if self.out is None:
            model = self.preset or os.path.basename(os.path.normpath(self.init_from)) or "pretrained"
            self.out = os.path.join("runs", f"{model}-{self.attention}")
        if not isinstance(self.out, str) or not self.out:
            raise TypeError(f"out must be a non-empty str (a directory), got out={self.out!r}")
        if self.threads is not None:
            positive_int("threads", self.threads)
        if not isinstance(self.shard, bool):
            raise TypeError(f"shard must be a bool, got shard={self.shard!r} ({type(self.shard).__name__})")
        positive_int("tensor_parallel", self.tensor_parallel)
        self._check_track_heads()

    def _check_track_heads(self) -> None:
        if not isinstance(self.track_heads, bool):
            raise TypeError(f"track_heads must be a bool, got track_heads={self.track_heads!r}")
        if self.track_heads and self.context_length < 4:
            raise ValueError(f"track_heads needs context_length >= 4 (a sequence and its repeat), got {self.context_length}")
        if self.track_heads and self.tensor_parallel > 1:
            raise ValueError(
                f"track_heads does not go with tensor_parallel={self.tensor_parallel} (each process holds some heads only)"
            )

    def _check_init_from(self) -> None:
        """What cannot go with ``init_from`` (the folder decides the model and tokenizer)."""
        if not isinstance(self.init_from, str) or not self.init_from:
            raise TypeError(f"init_from must be a non-empty str (a folder), got init_from={self.init_from!r}")
        given = {name: getattr(self, name) for name in ("preset", "vocab_size", "mlp_dim") if getattr(self, name)}
        for name in ("attention_options", "layer_attention_options"):
            if getattr(self, name):
                given[name] = getattr(self, name)
        if self.positions != "learned":
            given["positions"] = self.positions
        if given:
            raise ValueError(
                f"init_from takes the model and its tokenizer from {self.init_from}; {given} cannot go with it"
            )
        if self.tokenizer not in (None, "bpe"):
            raise ValueError(f"init_from uses the folder's BPE tokenizer; tokenizer={self.tokenizer!r} cannot go with it")
        if self.attention != "mha":  # the format's limit: GPT-2's c_attn holds H query, H key and H value heads
            raise ValueError(
                f"init_from loads GPT-2's multi-head attention: attention must be 'mha', got attention="
                f"{self.attention!r}; a Hugging Face GPT-2 folder holds one key and one value head per query head "
                "and no other kind's weights (multihead convert turns the trained run into another kind)"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Build from a plain dict (parsed JSON); unknown keys are an error.

        Raises:
            TypeError: ``values`` is not a dict.
            ValueError: unknown fields or invalid values.
        """
        if not isinstance(values, dict):
            raise TypeError(f"a TrainConfig is built from a dict, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig field(s) {unknown}; valid fields: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (``from_dict`` inverts it)."""
        return asdict(self)

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The GPTConfig this run trains, with the tokenizer's ``vocab_size``
        (with ``init_from``: the folder's model, read from its config.json,
        whose vocabulary holds the tokenizer's ids).

        Raises:
            ValueError / TypeError: options the model refuses (building the
                model checks the attention options themselves).
        """
        if self.init_from is not None:  # the folder's model: its vocabulary and positions
            from .pretrained import check_folder

            folder = check_folder(self.init_from, self.context_length)
            return GPTConfig.from_dict({**folder.to_dict(), "dropout": self.dropout})
        return GPTConfig.from_preset(
            self.preset, vocab_size=vocab_size, context_length=self.context_length, attention=self.attention,
            attention_options=dict(self.attention_options), dropout=self.dropout, mlp_dim=self.mlp_dim,
            layer_attention_options=self.layer_attention_options, positions=self.positions,
        )  # fmt: skip


def config_differences(saved: TrainConfig, given: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """{field: (saved, given)} for every field outside ``RESUMABLE_CHANGES`` that differs."""
    a, b = saved.to_dict(), given.to_dict()
    return {k: (a[k], b[k]) for k in a if k not in RESUMABLE_CHANGES and a[k] != b[k]}


def learning_rate(step: int, config: TrainConfig) -> float:
    """The learning rate of optimizer step ``step`` (0-based).

    Linear warm-up lr * (step + 1) / warmup for step < warmup (reaching lr at
    step warmup - 1), then a cosine from lr at step warmup down to min_lr at
    step max_steps - 1; min_lr after that (a run extended past its schedule).
    """
    lr, min_lr, warmup, last = config.lr, config.min_lr, config.warmup, config.max_steps - 1
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= last:
        return min_lr if last > warmup else lr
    ratio = (step - warmup) / (last - warmup)  # in [0, 1)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
