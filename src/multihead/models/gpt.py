"""GPT-2 on multihead's attention: ``GPTConfig``, presets and ``GPT``.

    idx [B, T] --token_embedding (+ position_embedding)--> x [B, T, C] --dropout-->
      num_layers x Block:  x = x + attn(ln_1(x))   (causal, pre-LayerNorm)
                           x = x + mlp(ln_2(x))    (C -> 4C -> C, GELU tanh)
      --ln_f--> --lm_head (tied to token_embedding)--> logits [B, T, vocab]

The attention of every block is built by name with ``build_attention`` so the
same model compares attention kinds (``GPTConfig(attention="gqa",
num_kv_heads=2)``). With ``attention="mha"`` the weights map one to one onto
Hugging Face's ``GPT2LMHeadModel`` (``multihead.convert.hf_gpt2``).
``GPTConfig(positions="rope" | "alibi" | "none")`` drops GPT-2's learned
position table for positions the attention computes (``gpt_positions``),
which lets ``generate(..., streaming=(sinks, window))`` run past the context.

Left-padded batches (``attention_mask`` [B, S], 1 = real token, Hugging
Face's polarity) count positions over real tokens only, as Hugging Face does
for batched generation (``gpt_inputs``: the forward's input checks).

A block (``gpt_blocks``) is pre-LayerNorm attention then MLP; the
translation to and from Hugging Face's ``GPT2Config`` is ``gpt_hf_config``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

import torch
from torch import nn

from .._checks import dropout_probability, positive_int
from ..modules.calls import rollback_all_on_error
from ..modules.head_selection import check_heads
from ..modules.registry import check_kind, total_aux_loss
from ..modules.window_cache import window_cache
from .generation import generate as generate_tokens
from .gpt_blocks import Block
from .gpt_hf_config import config_fields_from_hf, gpt2_config_kwargs
from .gpt_inputs import (
    LMOutput,
    check_caches,
    check_logits_to_keep,
    check_parameter_dtypes,
    check_token_ids,
    graph_step_inputs,
    loss_of,
    positions_from_mask,
    scored_tokens,
    token_positions,
)
from .gpt_positions import check_positions, check_streaming_call, streaming_caches
from .gpt_presets import GPT_PRESETS
from .head_layout import check_layer_heads
from .layer_options import check_layer_options

__all__ = [
    "GPTConfig",
    "GPT_PRESETS",
    "GPT",
    "positions_from_mask",
]


# ---------------------------------------------------------------------- config
@dataclass
class GPTConfig:
    """Sizes and options of a GPT-2 style decoder.

    Args:
        vocab_size: number of token ids.
        context_length: the longest sequence (Hugging Face's ``n_positions``).
        embed_dim: C, the model width.
        num_layers: number of blocks.
        num_heads: H query heads per block; divides ``embed_dim``; fixes
            head_dim = embed_dim // num_heads even where ``layer_heads`` differs.
        num_kv_heads: G key/value heads (None: the attention kind's default).
        attention: attention kind for ``build_attention`` ("mha", "gqa", "mqa", ...).
        attention_options: further keyword options of that kind (JSON values,
            e.g. ``{"shared_heads": 2}`` for "moh"), passed to ``build_attention``.
        dropout: on embeddings, attention weights and both residual branches
            (training mode only).
        layer_norm_eps: epsilon of every LayerNorm.
        qkv_bias: bias on the query/key/value projection.
        tie_embeddings: the LM head shares the token embedding matrix.
        mlp_dim: the MLP's hidden width (None: 4 * embed_dim, GPT-2's;
            Hugging Face's ``n_inner``).
        layer_heads: query heads of each block (None: ``num_heads`` in
            every block), each in [1, num_heads]; written by
            ``tools.prune.prune_heads`` (see ``models.head_layout``).
        layer_kv_heads: key/value heads of each block, with
            ``layer_heads`` and ``num_kv_heads`` only (None: ``num_kv_heads``).
        layer_attention_options: None, or dicts of options over
            ``attention_options`` per block (a shorter list repeats: local and
            global layers, ``models.layer_options``).
        positions: "learned" (GPT-2's position table), "rope", "alibi" or
            "none" (no table; rope or ALiBi in every block, or nothing:
            ``models.gpt_positions``).

    ``to_dict`` leaves out ``layer_heads`` / ``layer_kv_heads`` /
    ``layer_attention_options`` while they are None, and ``positions`` while it is
    "learned", so configs of uniform GPT-2 models read and write as before.

    Raises:
        TypeError / ValueError: a field of the wrong type or value (the
            message names the field and the value).
    """

    vocab_size: int
    context_length: int
    embed_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    attention: str = "mha"
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    qkv_bias: bool = True
    tie_embeddings: bool = True
    attention_options: dict[str, Any] = field(default_factory=dict)
    mlp_dim: int | None = None
    layer_heads: list[int] | None = None
    layer_kv_heads: list[int] | None = None
    layer_attention_options: list[dict[str, Any]] | None = None
    positions: str = "learned"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "num_layers"):
            positive_int(name, getattr(self, name))
        check_heads(self.embed_dim, self.num_heads, self.num_kv_heads, None, config=True)
        if self.mlp_dim is not None:
            positive_int("mlp_dim", self.mlp_dim)
        if not isinstance(self.attention, str):
            raise TypeError(f"attention must be a str, got attention={self.attention!r}")
        check_kind(self.attention)
        self.dropout = dropout_probability(self.dropout)
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (0 < eps < math.inf):
            raise ValueError(f"layer_norm_eps must be a positive finite float, got layer_norm_eps={eps!r}")
        self.layer_norm_eps = float(eps)
        for name in ("qkv_bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {name}={getattr(self, name)!r}")
        if not isinstance(self.attention_options, dict) or not all(isinstance(k, str) for k in self.attention_options):
            raise TypeError(f"attention_options must be a dict of option name -> value, got {self.attention_options!r}")
        self.layer_attention_options = check_layer_options(self.layer_attention_options, self.num_layers)
        self.positions = check_positions(self.positions)
        self.layer_heads, self.layer_kv_heads = check_layer_heads(
            attention=self.attention, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, layer_heads=self.layer_heads, layer_kv_heads=self.layer_kv_heads,
        )  # fmt: skip

    @property
    def head_dim(self) -> int:
        """D = embed_dim // num_heads."""
        return self.embed_dim // self.num_heads

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """The preset ``name`` (exact match) with some fields replaced.

        Raises:
            ValueError: an unknown preset (the message lists the valid names)
                or an unknown field in ``overrides``.
        """
        if name not in GPT_PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; valid presets: {sorted(GPT_PRESETS)}")
        return cls.from_dict({**GPT_PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        """Build from a plain dict (e.g. parsed JSON); unknown keys are an error.

        Raises:
            TypeError: ``values`` is not a dict.
            ValueError: unknown or missing fields, or invalid values.
        """
        if not isinstance(values, dict):
            raise TypeError(f"a GPTConfig is built from a dict, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig field(s) {unknown}; valid fields: {sorted(known)}")
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing = sorted(required - set(values))
        if missing:
            raise ValueError(f"missing GPTConfig field(s) {missing}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (``from_dict`` inverts it); per-layer
        head counts only when set."""
        values = asdict(self)
        for name in ("layer_heads", "layer_kv_heads", "layer_attention_options"):
            if values[name] is None:
                del values[name]
        if values["positions"] == "learned":
            del values["positions"]
        return values

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> GPTConfig:
        """Translate a Hugging Face ``GPT2Config`` (object or its dict).

        Raises:
            ValueError: options this model does not implement (another
                activation, different dropout rates per site,
                cross-attention, scaled or upcast attention variants).
        """
        return cls(**config_fields_from_hf(hf_config))

    def to_hf_config(self) -> dict[str, Any]:
        """Keyword arguments for ``transformers.GPT2Config`` (attention="mha" only).

        Raises:
            ValueError: a configuration GPT-2 cannot express.
        """
        return gpt2_config_kwargs(self)


# ---------------------------------------------------------------------- model
class GPT(nn.Module):
    """GPT-2 language model with attention built by name.

    Args:
        config: a :class:`GPTConfig`.
        device, dtype: of the parameters.

    Weights start as GPT-2 does: normal(0, 0.02) for linear and embedding
    weights, zero biases, and normal(0, 0.02 / sqrt(2 * num_layers)) for the
    two projections that write into the residual stream, using torch's
    global generator (seed it for reproducible models).

    Training: ``logits, loss = model(idx, targets)`` (nanoGPT's targets, the
    next tokens) or ``model(idx, labels=idx).loss`` (Hugging Face's labels,
    shifted inside); see :meth:`forward`. Some attention kinds ("moh",
    "gated") ask for a loss term of their own; a plain training loop adds
    ``model.aux_loss()`` (their sum over blocks, a 0-d zero for the others)
    to that language-model loss.
    """

    # multihead.parallel: the MLP column- then row-parallel (attention is split by heads)
    tensor_parallel_plan = {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}
    # with sequence parallelism: the norms work on slices of the sequence, cut at the first
    # block's input and gathered after the last norm (the LM head sees every position)
    sequence_parallel_plan = {"norms": ["blocks.*.ln_1", "blocks.*.ln_2", "ln_f"], "slice": "blocks.0", "gather": "ln_f"}

    def __init__(self, config: GPTConfig, *, device: torch.device | str | None = None, dtype=None) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        factory = {"device": device, "dtype": dtype}
        C = config.embed_dim
        self.token_embedding = nn.Embedding(config.vocab_size, C, **factory)
        learned = config.positions == "learned"
        self.position_embedding = nn.Embedding(config.context_length, C, **factory) if learned else None
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i, **factory) for i in range(config.num_layers))
        self.ln_f = nn.LayerNorm(C, eps=config.layer_norm_eps, **factory)
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False, **factory)
        self._init_weights()
        if config.tie_embeddings:
            self.lm_head.weight = self.token_embedding.weight

    def _init_weights(self) -> None:
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, mean=0.0, std=0.02)
                    if getattr(m, "bias", None) is not None:
                        nn.init.zeros_(m.bias)
                elif isinstance(m, nn.LayerNorm):
                    nn.init.ones_(m.weight)
                    nn.init.zeros_(m.bias)
            std = 0.02 / math.sqrt(2 * self.config.num_layers)
            for block in self.blocks:
                nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=std)
                nn.init.normal_(block.attn.out_proj.weight, mean=0.0, std=std)  # every AttentionLayer has one

    def num_parameters(self) -> int:
        """Parameters counted once (the tied LM head is not counted twice)."""
        return sum(p.numel() for p in self.parameters())

    def aux_loss(self) -> torch.Tensor:
        """Sum over blocks of ``block.attn.aux_loss()`` of the last forward: 0-d, with
        gradient to the router/gate parameters; a 0-d zero when no block has one."""
        return total_aux_loss((block.attn for block in self.blocks), self.lm_head.weight)

    def make_kv_caches(self, batch_size: int, max_len: int) -> list[Any]:
        """One cache per block, each taking up to ``max_len`` positions: a block
        whose layer has a window keeps only its last ``window`` of them
        (``modules.window_cache``), the others allocate all ``max_len``.

        Raises:
            ValueError: ``max_len`` larger than ``config.context_length``.
        """
        positive_int("max_len", max_len)
        if max_len > self.config.context_length:
            raise ValueError(f"max_len={max_len} exceeds context_length={self.config.context_length}")
        return [window_cache(block.attn, batch_size, max_len) for block in self.blocks]

    def make_streaming_caches(self, batch_size: int, *, sink_tokens: int, window: int, max_step: int) -> list[Any]:
        """One ``StreamingKVCache`` per block: the first ``sink_tokens`` positions and
        the last ``window``, placed at their cache slots, for decoding past
        ``context_length`` (``models.gpt_positions``); up to ``max_step`` new
        positions per forward.

        Raises:
            ValueError: a model with a learned position table, sink_tokens +
                window > context_length, or a kind with a cache of its own.
        """
        return streaming_caches(self, batch_size, sink_tokens=sink_tokens, window=window, max_step=max_step)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        kv_caches: list[Any] | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor | LMOutput:
        """Next-token logits for every position, and the loss when given targets or labels.

            logits = model(idx)                          # [B, T, vocab]
            logits, loss = model(idx, targets)           # nanoGPT: targets = the next tokens
            out = model(idx, labels=idx); out.loss       # Hugging Face: labels shifted inside

        Args:
            idx: [B, T] token ids, torch.int64 or torch.int32.
            targets: [B, T], nanoGPT's convention: targets[:, t] is the token
                after idx[:, t] (not shifted here); -1 is ignored.
            labels: [B, T], Hugging Face's convention: the input ids
                themselves, shifted here (logits[:, t] is scored on
                labels[:, t + 1]); -100 is ignored (set it at padding:
                ``attention_mask`` does not exclude pads from the loss).
            attention_mask: [B, S] with 1/True = real token, 0 = padding
                (Hugging Face's polarity), S = cached length + T. Pads are
                never attended; positions count real tokens only.
            position_ids: [B, T] or [1, T], torch.int64 or torch.int32;
                default from ``attention_mask`` (``gpt_inputs.token_positions``)
                or cached length + arange(T).
            kv_caches: one cache per block from :meth:`make_kv_caches`; this
                call appends its T positions and attends over everything
                cached (a local block: the last ``window`` positions) (caches expose the cached length as ``.length``, a
                Python int, equal in every block). Every cache is checked
                before any is written, and a call that fails anyway leaves
                every cache's length as it was. Streaming caches from
                :meth:`make_streaming_caches` hold any number of positions
                (no ``context_length`` limit; no ``attention_mask`` or
                ``position_ids``). ``GraphKVCache``s (``modules.graph_cache``,
                one token per call at their shared device-side position,
                over every slot of the buffers: one shape for every step, what
                ``generate`` records as a CUDA graph) take neither either.
            logits_to_keep: 0 (default) for logits at every position, N for
                the last N only, as Hugging Face's argument: decoding needs
                the last position's, and the LM head is the largest product
                of a step (``generate`` passes 1). Not with targets or labels.

        Returns:
            logits [B, T, vocab_size] ([B, N, vocab_size] with
            ``logits_to_keep=N``); with ``targets`` or ``labels`` an
            ``LMOutput(logits, loss)``: a pair that unpacks as nanoGPT's
            ``logits, loss``, with ``.logits`` and ``.loss`` as Hugging
            Face's outputs (``gpt_inputs.next_token_loss``: the mean
            cross-entropy, at least float32, without ``aux_loss()``).

        Under ``torch.compile(fullgraph=True)`` the forward and a cached
        decoding step trace without graph breaks: the checks that read the
        data (token ids and ``position_ids`` in range) run in eager mode
        only, shape and dtype checks everywhere. The cache length is a
        Python int, symbolic after the first new length, so decoding step
        after step compiles twice in all (``modules.kv_cache``).

        Raises:
            TypeError: idx, targets, labels or position_ids of another dtype
                (e.g. uint8 or float), parameters of mixed dtypes (a block
                converted alone; the message names both), a cache length
                that is not an int.
            ValueError: both targets and labels, wrong shapes, token ids or positions out of range
                (eager), a sequence longer than ``context_length``, a wrong
                number of caches, caches of different lengths or batch
                sizes, or too little room in a cache (all before any cache
                is written); logits_to_keep negative, or with targets or labels.
        """
        B, T = check_token_ids(idx, self.config.vocab_size)
        want = scored_tokens(targets, labels, B, T, self.config.vocab_size)  # checked before the model runs
        check_logits_to_keep(logits_to_keep, want is not None)
        check_parameter_dtypes(self)
        if kv_caches is not None and hasattr(kv_caches[0], "visible_slots"):  # GraphKVCache: one fixed shape
            key_padding, position_ids = graph_step_inputs(kv_caches, self.blocks, attention_mask, position_ids, B, T)
        elif kv_caches is not None and hasattr(kv_caches[0], "sink_tokens"):  # streaming: any length, no table
            check_caches(kv_caches, len(self.blocks), B, T)
            key_padding = check_streaming_call(self.config, attention_mask, position_ids)
        else:
            past = 0 if kv_caches is None else check_caches(kv_caches, len(self.blocks), B, T)
            key_padding, position_ids = token_positions(
                attention_mask, position_ids, B=B, T=T, past=past, context_length=self.config.context_length,
                device=idx.device,
            )  # fmt: skip
        x = self.token_embedding(idx)  # (B, T, C)
        if self.position_embedding is not None:
            x = x + self.position_embedding(position_ids)
        x = self.dropout(x)
        with rollback_all_on_error(kv_caches):
            for i, block in enumerate(self.blocks):
                x = block(x, key_mask=key_padding, kv_cache=None if kv_caches is None else kv_caches[i])
        if logits_to_keep:
            x = x[:, -logits_to_keep:]  # (B, T, C) -> (B, N, C): the LM head only where asked
        logits = self.lm_head(self.ln_f(x))  # (B, T, C) -> (B, T, vocab)
        return logits if want is None else LMOutput(logits, loss_of(logits, want))

    # GPT.generate(idx [B, T0], max_new_tokens, *, temperature, top_k, top_p, eos, pad,
    # attention_mask, generator, use_cache, return_logits, compile_steps, streaming): ``models.generation.generate``
    # with this model, temperature 0 greedy.
    generate = generate_tokens

    # ------------------------------------------------------------- HF config
    @classmethod
    def from_hf_config(cls, hf_config: Any) -> GPT:
        """A freshly initialised model sized by a Hugging Face GPT2Config
        (object or dict); see :meth:`GPTConfig.from_hf_config`."""
        return cls(GPTConfig.from_hf_config(hf_config))
