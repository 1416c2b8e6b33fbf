"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

    src [B, S] --embed*sqrt(C) + sin/cos positions--> encoder layers --> memory [B, S, C]
    tgt [B, T] --embed*sqrt(C) + sin/cos positions--> decoder layers --> out_proj --> logits [B, T, V]

One attention kind (``build_attention(config.attention, ...)``) plays three roles:

    encoder self-attention   query = key = value = x,   key padding: src_key_mask
    decoder self-attention   query = key = value = y,   causal (+ tgt_key_mask)
    decoder cross-attention  query = y, key = value = memory, key padding: src_key_mask

Each sublayer is wrapped in a residual connection, pre-norm ``x + drop(f(norm(x)))``
(the Annotated Transformer's SublayerConnection, ``norm_first=True``, with a final
LayerNorm after each stack) or post-norm ``norm(x + drop(f(x)))`` (the paper).

Decoding with ``kv_caches`` (``make_kv_caches``): decoder self-attention appends to a
static ``KVCache`` per layer (a ``WindowKVCache`` of its last w positions for a layer
with ``window=w``, ``modules.window_cache``); cross-attention fills one cache per layer with the
memory's keys/values on the first call and reuses it on every later step, through
the attention module's own API (``kv_cache`` with ``key``: ``modules.base``), so
every kind, observers included, decodes the same way.

The encoder and decoder layers and the decoder's cache are in
``transformer_layers``; the copy task's batches in ``copy_task``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from .._checks import dropout_probability, non_negative_int, positive_int
from ..modules.registry import attention_class, build_attention, check_kind, total_aux_loss
from ..modules.window_cache import window_cache
from .head_layout import check_layer_heads, layer_head_options
from .transformer_layers import DecoderCache, DecoderLayer, EncoderLayer

__all__ = ["TransformerConfig", "PRESETS", "Transformer", "ATTENTION_ROLES", "transformer_attention"]

# Attention options the config derives from its own fields, and those fields.
CONFIG_OPTIONS = {"embed_dim": "embed_dim", "num_heads": "num_heads", "head_dim": "embed_dim / num_heads",
                  "num_kv_heads": "num_kv_heads", "dropout": "attention_dropout",
                  "device": "Transformer(config).to(device)", "dtype": "Transformer(config).to(dtype)"}  # fmt: skip

# The three places an attention layer sits, and the config fields listing their per-layer head counts.
ATTENTION_ROLES = {
    "encoder": ("encoder_layer_heads", "encoder_layer_kv_heads"),  # encoder.{i}.self_attn
    "decoder": ("decoder_layer_heads", "decoder_layer_kv_heads"),  # decoder.{i}.self_attn
    "cross": ("cross_layer_heads", "cross_layer_kv_heads"),        # decoder.{i}.cross_attn
}


@dataclass
class TransformerConfig:
    """Sizes and options of an encoder-decoder Transformer.

    Attributes:
        src_vocab_size, tgt_vocab_size: V of the source and target vocabularies.
        embed_dim: C (d_model). num_encoder_layers, num_decoder_layers: N of each stack.
        num_heads: H. num_kv_heads: G for "gqa"/"mqa" (None: the kind's default).
        ffn_dim: hidden width of the ReLU feed-forward sublayer.
        dropout: on embeddings + positions and on every sublayer output.
        attention_dropout: on the attention weights (training only).
        attention: registry name of the attention kind ("mha", "gqa", "mqa", ...).
        attention_options: further keyword options of that kind for every attention
            layer (JSON values, e.g. {"overlap": 2} for "overlapping", {"qk_norm": True});
            what this config sets itself (sizes, head counts, ``attention_dropout``)
            is refused there (``CONFIG_OPTIONS``), and so is ``window`` (it makes a
            layer causal, the encoder's too). Cross-attention layers leave out the
            kind's ``self_attention_options`` (rope, alibi, window): queries and
            memory keys share no position axis.
        norm_first: pre-norm (True, the Annotated Transformer) or post-norm (the paper).
        layer_norm_eps: eps of every LayerNorm.
        max_len: number of sinusoidal positions (longest source or target).
        pad_id, bos_id, eos_id: special target tokens (pad_id also in the source).
        tie_embeddings: share the target embedding with the output projection.
        share_embeddings: share one embedding between source and target (needs
            src_vocab_size == tgt_vocab_size); with ``tie_embeddings`` this is the
            paper's single matrix for both embeddings and the pre-softmax projection.
        encoder_layer_heads, decoder_layer_heads, cross_layer_heads: query heads
            of each encoder self-attention, decoder self-attention and decoder
            cross-attention layer (None: ``num_heads`` in every one), each in
            [1, num_heads]; written by ``tools.prune.prune_heads`` (see
            ``models.head_layout``). head_dim stays embed_dim // num_heads.
        encoder_layer_kv_heads, decoder_layer_kv_heads, cross_layer_kv_heads:
            key/value heads of the same layers, with the matching ``*_layer_heads``
            and ``num_kv_heads`` only (None: ``num_kv_heads``).

    Raises:
        TypeError / ValueError: naming the offending field and value.
    """

    src_vocab_size: int
    tgt_vocab_size: int
    embed_dim: int = 512
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int | None = None
    ffn_dim: int = 2048
    dropout: float = 0.1
    attention_dropout: float = 0.0
    attention: str = "mha"
    attention_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    norm_first: bool = True
    layer_norm_eps: float = 1e-5
    max_len: int = 5000
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    tie_embeddings: bool = False
    share_embeddings: bool = False
    encoder_layer_heads: list[int] | None = None
    encoder_layer_kv_heads: list[int] | None = None
    decoder_layer_heads: list[int] | None = None
    decoder_layer_kv_heads: list[int] | None = None
    cross_layer_heads: list[int] | None = None
    cross_layer_kv_heads: list[int] | None = None

    def __post_init__(self) -> None:
        for name in ("src_vocab_size", "tgt_vocab_size", "embed_dim", "num_encoder_layers",
                     "num_decoder_layers", "num_heads", "ffn_dim", "max_len"):
            positive_int(name, getattr(self, name))
        if self.num_kv_heads is not None:
            positive_int("num_kv_heads", self.num_kv_heads)
        self.dropout = dropout_probability(self.dropout, "dropout")
        self.attention_dropout = dropout_probability(self.attention_dropout, "attention_dropout")
        for name in ("norm_first", "tie_embeddings", "share_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {name}={getattr(self, name)!r}")
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0 or math.isinf(eps):
            raise ValueError(f"layer_norm_eps must be a positive float, got layer_norm_eps={eps!r}")
        for name in ("pad_id", "bos_id", "eos_id"):
            value = non_negative_int(name, getattr(self, name))
            if value >= self.tgt_vocab_size:
                raise ValueError(f"{name}={value} is outside the target vocabulary (tgt_vocab_size={self.tgt_vocab_size})")
        if self.pad_id >= self.src_vocab_size:
            raise ValueError(f"pad_id={self.pad_id} is outside the source vocabulary (src_vocab_size={self.src_vocab_size})")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(f"share_embeddings needs src_vocab_size == tgt_vocab_size, got "
                             f"{self.src_vocab_size} and {self.tgt_vocab_size}")
        if len({self.pad_id, self.bos_id, self.eos_id}) != 3:
            raise ValueError(f"pad_id, bos_id, eos_id must differ, got {self.pad_id}, {self.bos_id}, {self.eos_id}")
        check_kind(self.attention)
        if not isinstance(self.attention_options, dict) or not all(isinstance(k, str) for k in self.attention_options):
            raise TypeError(f"attention_options must be a dict of option name -> value, got {self.attention_options!r}")
        taken = {k: CONFIG_OPTIONS[k] for k in self.attention_options if k in CONFIG_OPTIONS}
        if taken:
            raise ValueError(f"attention_options {sorted(taken)} are set by the config or the model: use {taken}")
        if self.attention_options.get("window") is not None:  # it includes causality: the encoder would lose its future
            raise ValueError(
                f"attention_options window={self.attention_options['window']} would make every self-attention layer "
                "causal and local, the encoder's too; give decoder layers a window one by one: "
                "model.decoder[i].self_attn = multihead.models.transformer.transformer_attention(config, 'decoder', i, "
                "window=w)"
            )
        with torch.device("meta"):  # the kind's own checks (head sizes, num_kv_heads, options), no memory used
            build_attention(self.attention, embed_dim=self.embed_dim, num_heads=self.num_heads,
                            **self.layer_options())
        for role, (heads, kv) in ATTENTION_ROLES.items():
            layers = self.num_encoder_layers if role == "encoder" else self.num_decoder_layers
            try:
                counts = check_layer_heads(attention=self.attention, num_layers=layers, num_heads=self.num_heads,
                                           num_kv_heads=self.num_kv_heads, layer_heads=getattr(self, heads),
                                           layer_kv_heads=getattr(self, kv))
            except (TypeError, ValueError) as err:
                raise type(err)(f"{heads} / {kv}: {err}") from None
            setattr(self, heads, counts[0])
            setattr(self, kv, counts[1])

    @property
    def head_dim(self) -> int:
        """D = embed_dim // num_heads (also in layers with fewer heads)."""
        return self.embed_dim // self.num_heads

    def layer_options(self) -> dict:
        """Keyword options passed to ``build_attention`` for every attention layer
        (before its per-layer head counts)."""
        options: dict[str, Any] = {"dropout": self.attention_dropout}
        if self.num_kv_heads is not None:
            options["num_kv_heads"] = self.num_kv_heads
        return {**options, **self.attention_options}  # disjoint: CONFIG_OPTIONS are refused

    @classmethod
    def from_preset(cls, name: str, **overrides) -> TransformerConfig:
        """The preset ``name`` (exact match in ``PRESETS``) with fields replaced by ``overrides``.

        Raises:
            ValueError: unknown name (the message lists the valid ones).
        """
        if name not in PRESETS:
            raise ValueError(f"unknown Transformer preset {name!r}; valid presets: {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


PRESETS: dict[str, TransformerConfig] = {
    # The paper's base model (Table 3): post-norm, a shared 37000-token BPE vocabulary and
    # one matrix for both embeddings and the pre-softmax projection (section 3.4).
    "base": TransformerConfig(
        src_vocab_size=37000, tgt_vocab_size=37000, embed_dim=512, num_encoder_layers=6,
        num_decoder_layers=6, num_heads=8, ffn_dim=2048, dropout=0.1, norm_first=False,
        tie_embeddings=True, share_embeddings=True,
    ),
    # The Annotated Transformer's copy task (V = 11, N = 2), small enough to train on a CPU.
    "copy-task": TransformerConfig(
        src_vocab_size=11, tgt_vocab_size=11, embed_dim=64, num_encoder_layers=2,
        num_decoder_layers=2, num_heads=4, ffn_dim=128, dropout=0.0, max_len=128,
    ),
}


class _RoleLayout(NamedTuple):
    """The fields ``layer_head_options`` reads, for the layers of one role."""

    num_heads: int
    num_kv_heads: int | None
    head_dim: int
    layer_heads: list[int] | None
    layer_kv_heads: list[int] | None


def transformer_attention(config: TransformerConfig, role: str, layer: int, **factory) -> nn.Module:
    """The attention of ``role`` ("encoder", "decoder" or "cross", see ``ATTENTION_ROLES``)
    in layer ``layer`` as ``config`` describes it (its head counts from
    ``layer_head_options``), freshly initialised.

    Raises:
        ValueError: an unknown role.
    """
    if role not in ATTENTION_ROLES:
        raise ValueError(f"role must be one of {list(ATTENTION_ROLES)}, got role={role!r}")
    heads, kv = ATTENTION_ROLES[role]
    layout = _RoleLayout(config.num_heads, config.num_kv_heads, config.head_dim, getattr(config, heads),
                         getattr(config, kv))
    options = {**config.layer_options(), **layer_head_options(layout, layer), **factory}
    if role == "cross":  # no position axis shared by the queries and the memory's keys
        for name in attention_class(config.attention).self_attention_options:
            options.pop(name, None)
    return build_attention(config.attention, embed_dim=config.embed_dim, **options)


def sinusoidal_positions(max_len: int, embed_dim: int) -> torch.Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/C)), PE[pos, 2i+1] = cos(same); returns [max_len, C]."""
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]  # (max_len, 1)
    freq = torch.exp(torch.arange(0, embed_dim, 2, dtype=torch.float64) * (-math.log(10000.0) / embed_dim))
    pe = torch.zeros(max_len, embed_dim, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq[: embed_dim // 2])
    return pe.float()


class Transformer(nn.Module):
    """Encoder-decoder Transformer; see the module docstring for the picture.

    Parameters with more than one dimension are initialised Xavier-uniform, as the
    Annotated Transformer's ``make_model`` does. Module names: ``src_embed``,
    ``tgt_embed``, ``encoder.{i}`` / ``decoder.{i}`` with ``self_attn``,
    ``cross_attn``, ``ffn``, ``sublayers.{j}.norm``; ``encoder_norm``, ``decoder_norm``
    (identity for post-norm) and ``out_proj``.

    Training: attention kinds with a loss term of their own ("moh", "gated")
    need ``model.aux_loss()`` (their sum over every encoder self-, decoder
    self- and cross-attention, a 0-d zero for the others) added to the
    task loss by a plain training loop.

    Args:
        config: a ``TransformerConfig``.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
        self.config = c = config
        C = c.embed_dim
        common = {"dropout": c.dropout, "norm_first": c.norm_first, "eps": c.layer_norm_eps}

        def attn(role: str, i: int) -> nn.Module:
            return transformer_attention(c, role, i)

        self.tgt_embed = nn.Embedding(c.tgt_vocab_size, C)
        self.src_embed = self.tgt_embed if c.share_embeddings else nn.Embedding(c.src_vocab_size, C)
        self.register_buffer("positions", sinusoidal_positions(c.max_len, C), persistent=False)
        self.dropout = nn.Dropout(c.dropout)
        self.encoder = nn.ModuleList(
            EncoderLayer(attn("encoder", i), C, c.ffn_dim, **common) for i in range(c.num_encoder_layers))
        self.decoder = nn.ModuleList(
            DecoderLayer(attn("decoder", i), attn("cross", i), C, c.ffn_dim, **common)
            for i in range(c.num_decoder_layers))
        final = (lambda: nn.LayerNorm(C, eps=c.layer_norm_eps)) if c.norm_first else nn.Identity
        self.encoder_norm, self.decoder_norm = final(), final()
        self.out_proj = nn.Linear(C, c.tgt_vocab_size)
        if c.tie_embeddings:
            self.out_proj.weight = self.tgt_embed.weight
        for p in self.parameters():  # each shared parameter once
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def aux_loss(self) -> torch.Tensor:
        """Sum of ``aux_loss()`` of the last forward over the encoder self-attention,
        decoder self-attention and cross-attention modules: 0-d, with its gradient;
        a 0-d zero when none has one."""
        modules = [layer.self_attn for layer in self.encoder]
        modules += [m for layer in self.decoder for m in (layer.self_attn, layer.cross_attn)]
        return total_aux_loss(modules, self.out_proj.weight)

    # ----------------------------------------------------------------- checks
    def _tokens(self, name: str, x: object, vocab: int) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.long:
            raise TypeError(f"{name} must be a torch.long tensor [B, L], got {getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() != 2:
            raise ValueError(f"{name} must be [B, L], got shape {tuple(x.shape)}")
        if x.numel() and (int(x.min()) < 0 or int(x.max()) >= vocab):
            raise ValueError(f"{name} ids must be in [0, {vocab}), got min {int(x.min())}, max {int(x.max())}")
        return x

    @staticmethod
    def _mask(name: str, mask: object, shape: tuple[int, int]) -> torch.Tensor | None:
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"{name} must be a bool tensor (True = real token), got {getattr(mask, 'dtype', type(mask).__name__)}")
        if tuple(mask.shape) != shape:
            raise ValueError(f"{name} must be [B, L] = {list(shape)}, got {list(mask.shape)}")
        return mask

    def _embed(self, embed: nn.Embedding, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        L = tokens.shape[1]
        if offset + L > self.config.max_len:
            raise ValueError(f"positions {offset}..{offset + L - 1} exceed max_len={self.config.max_len}")
        x = embed(tokens) * math.sqrt(self.config.embed_dim)  # (B, L) -> (B, L, C)
        return self.dropout(x + self.positions[offset : offset + L].to(x.dtype))

    # ------------------------------------------------------------------- API
    def encode(self, src: torch.Tensor, src_key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encode source tokens.

        Args:
            src: [B, S] token ids. src_key_mask: [B, S] bool, True = real token.

        Returns:
            memory [B, S, C]. Rows at padded positions are computed but never read.
        """
        self._tokens("src", src, self.config.src_vocab_size)
        mask = self._mask("src_key_mask", src_key_mask, tuple(src.shape))
        x = self._embed(self.src_embed, src)
        for layer in self.encoder:
            x = layer(x, mask)
        return self.encoder_norm(x)

    def make_kv_caches(self, batch_size: int, max_len: int) -> DecoderCache:
        """A ``DecoderCache`` for ``decode``: room for ``max_len`` target positions per row.
        A decoder self-attention layer with a window keeps only its last ``window``
        positions (``window_cache``); cross-attention caches hold the whole memory."""
        return DecoderCache([window_cache(layer.self_attn, batch_size, max_len) for layer in self.decoder])

    def decode(self, tgt: torch.Tensor, memory: torch.Tensor, *, src_key_mask: torch.Tensor | None = None,
               tgt_key_mask: torch.Tensor | None = None, kv_caches: DecoderCache | None = None,
               return_cross_weights: bool = False):
        """Decode target tokens against the encoder memory.

        Args:
            tgt: [B, T] target ids (starting with bos when decoding from scratch).
            memory: [B, S, C] from ``encode``.
            src_key_mask: [B, S] bool, True = real source token.
            tgt_key_mask: bool, True = real target token: [B, T], or with
                ``kv_caches`` [B, kv_caches.length + T] (every position cached so far).
            kv_caches: from ``make_kv_caches``: ``tgt`` continues the cached positions
                (position offset ``kv_caches.length``); cross keys/values of ``memory``
                are computed on the first call and reused.
            return_cross_weights: also return the exact cross-attention weights.

        Returns:
            logits [B, T, V], or (logits, tuple of [B, H, T, S] weights, one per decoder layer).

        Raises:
            TypeError / ValueError: ids, shapes, masks, a memory other than the cached one.
        """
        self._tokens("tgt", tgt, self.config.tgt_vocab_size)
        B, T = tgt.shape
        if not isinstance(memory, torch.Tensor):
            raise TypeError(f"memory must be a torch.Tensor [B, S, C], got {type(memory).__name__}")
        if memory.dim() != 3 or memory.shape[0] != B or memory.shape[2] != self.config.embed_dim:
            raise ValueError(f"memory must be [B={B}, S, C={self.config.embed_dim}], got {list(memory.shape)}")
        src_mask = self._mask("src_key_mask", src_key_mask, (B, memory.shape[1]))
        offset = 0 if kv_caches is None else kv_caches.length
        tgt_mask = self._mask("tgt_key_mask", tgt_key_mask, (B, offset + T))
        cross: list = [None] * len(self.decoder)
        if kv_caches is not None:
            if len(kv_caches) != len(self.decoder):
                raise ValueError(f"kv_caches has {len(kv_caches)} layers, the decoder {len(self.decoder)}")
            if kv_caches.memory is None:
                kv_caches.memory = memory
                kv_caches.cross = [layer.cross_attn.make_kv_cache(B, memory.shape[1]) for layer in self.decoder]
            elif memory is not kv_caches.memory:
                raise ValueError("kv_caches hold another memory's keys/values; pass that memory or call reset()")
            cross = kv_caches.cross
        x = self._embed(self.tgt_embed, tgt, offset)
        weights = []
        for i, layer in enumerate(self.decoder):
            x, w = layer(x, memory, src_key_mask=src_mask, tgt_key_mask=tgt_mask,
                         self_cache=None if kv_caches is None else kv_caches[i], cross_cache=cross[i],
                         return_weights=return_cross_weights)
            weights.append(w)
        logits = self.out_proj(self.decoder_norm(x))  # (B, T, C) -> (B, T, V)
        return (logits, tuple(weights)) if return_cross_weights else logits

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, *, src_key_mask: torch.Tensor | None = None,
                tgt_key_mask: torch.Tensor | None = None, return_cross_weights: bool = False):
        """Teacher-forced logits: ``decode(tgt, encode(src))``.

        Args:
            src: [B, S]; tgt: [B, T] (the decoder input, e.g. the target without its last token).
            src_key_mask: [B, S]; tgt_key_mask: [B, T]; bool, True = real token.
            return_cross_weights: also return the cross-attention weights, as ``decode``.

        Returns:
            logits [B, T, V], or (logits, tuple of [B, H, T, S] per decoder layer).
        """
        memory = self.encode(src, src_key_mask)
        return self.decode(tgt, memory, src_key_mask=src_key_mask, tgt_key_mask=tgt_key_mask,
                           return_cross_weights=return_cross_weights)

    def cross_attention_weights(self, src: torch.Tensor, tgt: torch.Tensor, *,
                                src_key_mask: torch.Tensor | None = None,
                                tgt_key_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Exact decoder cross-attention weights (pre-dropout), without gradients.

        Returns:
            one [B, H, T, S] tensor per decoder layer; row t of head h is the distribution
            over source positions of target position t (zero at padded source positions).
        """
        with torch.no_grad():
            _, weights = self(src, tgt, src_key_mask=src_key_mask, tgt_key_mask=tgt_key_mask,
                              return_cross_weights=True)
        return list(weights)

    @torch.no_grad()
    def greedy_decode(self, src: torch.Tensor, max_len: int, *, src_key_mask: torch.Tensor | None = None,
                      use_cache: bool = True, return_logits: bool = False):
        """Greedy decoding from ``bos_id``; a row stops at ``eos_id`` and is then padded with ``pad_id``.

        Call ``eval()`` first (dropout is otherwise active). With ``use_cache`` each step
        feeds one token through the KV caches; without, the whole prefix is recomputed.
        Both give the same tokens and (to float tolerance) the same logits.

        Args:
            src: [B, S]. max_len: most tokens per row, bos included.
            src_key_mask: [B, S] bool, True = real token.

        Returns:
            tokens [B, L] with L <= max_len (tokens[:, 0] = bos; L < max_len once every
            row has emitted eos), or (tokens, logits [B, L - 1, V]) with ``return_logits``.
        """
        positive_int("max_len", max_len)
        if max_len - 1 > self.config.max_len:
            raise ValueError(f"max_len - 1 = {max_len - 1} decoder positions exceed config.max_len={self.config.max_len}")
        c = self.config
        memory = self.encode(src, src_key_mask)
        B = src.shape[0]
        tokens = torch.full((B, 1), c.bos_id, dtype=torch.long, device=src.device)
        done = torch.zeros(B, dtype=torch.bool, device=src.device)
        caches = self.make_kv_caches(B, max_len - 1) if use_cache and max_len > 1 else None
        steps = []
        for _ in range(max_len - 1):
            inp = tokens[:, -1:] if caches is not None else tokens
            logits = self.decode(inp, memory, src_key_mask=src_key_mask, kv_caches=caches)[:, -1]
            nxt = logits.argmax(-1).masked_fill(done, c.pad_id)  # (B, V) -> (B,)
            steps.append(logits)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            done |= nxt == c.eos_id
            if bool(done.all()):
                break
        if not return_logits:
            return tokens
        empty = memory.new_zeros(B, 0, c.tgt_vocab_size)
        return tokens, (torch.stack(steps, dim=1) if steps else empty)
