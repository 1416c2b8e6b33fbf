"""A BERT encoder whose self-attention is multihead's attention module.

    input_ids [B, T] --word + position + token-type embeddings, LayerNorm--> x [B, T, C]
    x --(BertLayer) x num_layers--> last hidden state [B, T, C]

    BertLayer (post-LayerNorm, as in BERT):
        a = attention_norm(x + dropout(attention(x, key_mask)))
        y = output_norm(a + dropout(output(act(intermediate(a)))))

The attention is built by name through ``build_attention(config.attention)``,
so a checkpoint-compatible encoder (``"mha"``) and a randomly initialised
variant (``"gqa"``, ``"mqa"``) share one class. BERT's
``attention.output.dense`` is the attention module's ``out_proj``; its
``attention.self.query/key/value`` are the fused ``qkv_proj`` rows [q | k | v].

Module paths (stable, for tools that hook into layers)::

    encoder.embeddings                 BertEmbeddings
    encoder.layers[i]                  BertLayer
    encoder.layers[i].attention        MultiHeadAttention (or the configured kind)

The exact attention weights of layer i for a batch are
``encoder.layers[i].attention(hidden_states[i], key_mask=mask,
return_weights=True)[1]`` with ``hidden_states`` from
``forward(..., output_hidden_states=True)``.

Weights load from Hugging Face BERT names (with or without the ``bert.``
prefix) through :meth:`BertEncoder.from_hf_state_dict`, from safetensors
files only (:func:`load_safetensors`).

That key map (names and shapes, checked key by key) is ``models.bert_weights``,
beside the encoder it fills: the pretrained MiniLM in ``models.minilm`` loads
through it, and models never import a converter.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import dropout_probability, positive_int
from ..modules.head_selection import check_heads
from ..modules.registry import build_attention, check_kind, total_aux_loss
from .bert_weights import load_hf_weights, load_safetensors
from .head_layout import check_layer_heads, layer_head_options

__all__ = [
    "BERT_PRESETS",
    "BertConfig",
    "BertEmbeddings",
    "BertLayer",
    "BertEncoder",
    "layer_attention",
]

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),  # exact erf form, HF's "gelu"
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclasses.dataclass
class BertConfig:
    """Sizes of a BERT encoder.

    Args:
        vocab_size: V, rows of the word embedding.
        hidden_size: C, the model width.
        num_layers: number of encoder layers.
        num_heads: H query heads (C must be divisible by H).
        intermediate_size: width of the feed-forward layer.
        max_position_embeddings: longest input T.
        type_vocab_size: number of token types (segments).
        layer_norm_eps: epsilon of every LayerNorm.
        hidden_act: "gelu" (exact erf), "gelu_new"/"gelu_pytorch_tanh" (tanh
            approximation) or "relu".
        attention: registry name of the attention kind ("mha", "gqa", ...).
        num_kv_heads: G key/value heads for "gqa" (None otherwise).
        dropout: dropout on embeddings and residual branches (training only).
        attention_dropout: dropout on the attention weights (training only).
        layer_heads: query heads of each layer (None: ``num_heads`` in every
            layer), each in [1, num_heads]; written by
            ``tools.prune.prune_heads`` (see ``models.head_layout``).
        layer_kv_heads: key/value heads of each layer, with ``layer_heads``
            and ``num_kv_heads`` only (None: ``num_kv_heads``).
        attention_options: further keyword options of the attention kind,
            the same in every layer (JSON values; e.g. an "mla" layer's
            ``kv_lora_rank``, written by ``tools.convert_mla.to_mla``).

    Derived: ``head_dim`` = C // H (H = ``num_heads``, also where
    ``layer_heads`` differs).

    Raises:
        TypeError / ValueError: invalid sizes, an unknown activation or
            attention kind (the message lists the valid ones).
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    attention: str = "mha"
    num_kv_heads: int | None = None
    dropout: float = 0.1
    attention_dropout: float = 0.1
    layer_heads: list[int] | None = None
    layer_kv_heads: list[int] | None = None
    attention_options: dict = dataclasses.field(default_factory=dict)
    head_dim: int = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        ):
            positive_int(name, getattr(self, name))
        _, _, self.head_dim = check_heads(
            self.hidden_size, self.num_heads, self.num_kv_heads, None, width="hidden_size", config=True
        )
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and math.isfinite(eps)):
            raise ValueError(f"layer_norm_eps must be a positive finite float, got layer_norm_eps={eps!r}")
        self.layer_norm_eps = float(eps)
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unknown hidden_act {self.hidden_act!r}; valid: {sorted(_ACTIVATIONS)}")
        check_kind(self.attention)
        if not isinstance(self.attention_options, dict) or not all(isinstance(k, str) for k in self.attention_options):
            raise TypeError(f"attention_options must be a dict of option name -> value, got {self.attention_options!r}")
        self.dropout = dropout_probability(self.dropout, "dropout")
        self.attention_dropout = dropout_probability(self.attention_dropout, "attention_dropout")
        self.layer_heads, self.layer_kv_heads = check_layer_heads(
            attention=self.attention, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, layer_heads=self.layer_heads, layer_kv_heads=self.layer_kv_heads,
        )  # fmt: skip

    @classmethod
    def from_preset(cls, name: str, **overrides) -> BertConfig:
        """The preset ``name`` (exact, see ``BERT_PRESETS``) with optional overrides.

        Raises:
            ValueError: unknown name (the message lists the valid ones).
        """
        if name not in BERT_PRESETS:
            raise ValueError(f"unknown BERT preset {name!r}; valid: {sorted(BERT_PRESETS)}")
        return cls(**{**BERT_PRESETS[name], **overrides})

    @classmethod
    def from_hf_config(cls, config: Mapping | str | Path, **overrides) -> BertConfig:
        """Read a Hugging Face BERT ``config.json`` (a dict or a path to the file).

        Raises:
            FileNotFoundError: a path that does not exist.
            ValueError: unreadable JSON, a non-BERT model_type, a missing key,
                or a position embedding type other than "absolute".
            TypeError: ``config`` is neither a mapping nor a path.
        """
        if isinstance(config, (str, Path)):
            path = Path(config)
            try:
                config = json.loads(path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                raise FileNotFoundError(f"BERT config file not found: {path}") from None
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"{path}: not a valid JSON config ({exc})") from None
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping or a path, got {type(config).__name__}")
        model_type = config.get("model_type", "bert")
        if model_type != "bert":
            raise ValueError(f"config model_type must be 'bert', got model_type={model_type!r}")
        position = config.get("position_embedding_type", "absolute")
        if position != "absolute":
            raise ValueError(f"only absolute position embeddings are supported, got {position!r}")
        keys = {
            "vocab_size": "vocab_size",
            "hidden_size": "hidden_size",
            "num_layers": "num_hidden_layers",
            "num_heads": "num_attention_heads",
            "intermediate_size": "intermediate_size",
            "max_position_embeddings": "max_position_embeddings",
            "type_vocab_size": "type_vocab_size",
        }
        missing = [hf for hf in keys.values() if hf not in config]
        if missing:
            raise ValueError(f"BERT config is missing keys {missing}")
        fields = {ours: config[hf] for ours, hf in keys.items()}
        fields["layer_norm_eps"] = config.get("layer_norm_eps", 1e-12)
        fields["hidden_act"] = config.get("hidden_act", "gelu")
        fields["dropout"] = config.get("hidden_dropout_prob", 0.1)
        fields["attention_dropout"] = config.get("attention_probs_dropout_prob", 0.1)
        return cls(**{**fields, **overrides})


# One dict of presets, looked up by exact name.
BERT_PRESETS: dict[str, dict] = {
    # sentence-transformers/all-MiniLM-L6-v2 (nreimers/MiniLM-L6-H384-uncased)
    "minilm-l6": dict(
        vocab_size=30522, hidden_size=384, num_layers=6, num_heads=12, intermediate_size=1536,
        max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
    ),
    # sentence-transformers/all-MiniLM-L12-v2
    "minilm-l12": dict(
        vocab_size=30522, hidden_size=384, num_layers=12, num_heads=12, intermediate_size=1536,
        max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
    ),
    "bert-tiny": dict(  # google/bert_uncased_L-2_H-128_A-2
        vocab_size=30522, hidden_size=128, num_layers=2, num_heads=2, intermediate_size=512,
        max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
    ),
    "bert-base": dict(  # bert-base-uncased
        vocab_size=30522, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072,
        max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
    ),
    "bert-large": dict(  # bert-large-uncased
        vocab_size=30522, hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096,
        max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
    ),
}  # fmt: skip


class BertEmbeddings(nn.Module):
    """word(input_ids) + position(0..T-1) + token_type(token_type_ids), LayerNorm, dropout."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        C = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, C)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, C)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, C)
        self.norm = nn.LayerNorm(C, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        """input_ids, token_type_ids [B, T] (int64) -> [B, T, C]."""
        T = input_ids.shape[1]
        positions = torch.arange(T, device=input_ids.device)  # (T,), broadcast over B
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(positions)  # (B, T, C) + (T, C)
        return self.dropout(self.norm(x))


def layer_attention(config: BertConfig, layer: int = 0, **factory) -> nn.Module:
    """The attention of layer ``layer`` as ``config`` describes it (its head
    counts from ``layer_head_options``), freshly initialised."""
    options: dict = {"qkv_bias": True, "out_bias": True, "dropout": config.attention_dropout,
                     **config.attention_options, **factory}  # fmt: skip
    options.update(layer_head_options(config, layer))
    return build_attention(config.attention, embed_dim=config.hidden_size, **options)


class BertLayer(nn.Module):
    """One post-LayerNorm BERT layer (see the module docstring for the equations);
    ``layer`` picks its head counts when the config lists them per layer."""

    def __init__(self, config: BertConfig, layer: int = 0) -> None:
        super().__init__()
        C = config.hidden_size
        self.attention = layer_attention(config, layer)
        self.attention_norm = nn.LayerNorm(C, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(C, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, C)
        self.output_norm = nn.LayerNorm(C, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, C], key_mask [B, T] bool (True = real token) -> [B, T, C]."""
        a = self.attention(x, key_mask=key_mask)  # (B, T, C)
        a = self.attention_norm(x + self.dropout(a))
        y = self.output(self.act(self.intermediate(a)))  # (B, T, C) -> (B, T, I) -> (B, T, C)
        return self.output_norm(a + self.dropout(y))


class BertEncoder(nn.Module):
    """BERT encoder: embeddings and ``num_layers`` post-LayerNorm layers.

    Args:
        config: a :class:`BertConfig`.

    Attributes:
        embeddings: :class:`BertEmbeddings`.
        layers: ``nn.ModuleList`` of :class:`BertLayer`; ``layers[i].attention``
            is layer i's attention module.

    Training: attention kinds with a loss term of their own ("moh", "gated")
    need ``model.aux_loss()`` (their sum over layers, a 0-d zero for the
    others) added to the task loss by a plain training loop.
    """

    # multihead.parallel: the feed-forward column- then row-parallel (attention is split by heads)
    tensor_parallel_plan = {"layers.*.intermediate": "colwise", "layers.*.output": "rowwise"}

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        if not isinstance(config, BertConfig):
            raise TypeError(f"config must be a BertConfig, got {type(config).__name__}")
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config, i) for i in range(config.num_layers))

    def aux_loss(self) -> torch.Tensor:
        """Sum over layers of ``layer.attention.aux_loss()`` of the last forward: 0-d,
        with its gradient; a 0-d zero when no layer has one."""
        like = self.embeddings.word_embeddings.weight
        return total_aux_loss((layer.attention for layer in self.layers), like)

    def _check_inputs(self, input_ids, attention_mask, token_type_ids):
        cfg = self.config
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [B, T] with T >= 1, got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if T > cfg.max_position_embeddings:
            raise ValueError(f"sequence length T={T} exceeds max_position_embeddings={cfg.max_position_embeddings}")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size):
            raise ValueError(
                f"input_ids must lie in [0, {cfg.vocab_size}), got min {int(input_ids.min())} "
                f"and max {int(input_ids.max())}"
            )
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        elif not isinstance(token_type_ids, torch.Tensor) or tuple(token_type_ids.shape) != (B, T):
            shape = tuple(token_type_ids.shape) if isinstance(token_type_ids, torch.Tensor) else token_type_ids
            raise ValueError(f"token_type_ids must be a tensor of shape {(B, T)}, got {shape}")
        elif token_type_ids.numel() and (
            int(token_type_ids.min()) < 0 or int(token_type_ids.max()) >= cfg.type_vocab_size
        ):
            raise ValueError(f"token_type_ids must lie in [0, {cfg.type_vocab_size})")
        mask = None
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, T):
                shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask
                raise ValueError(f"attention_mask must be a tensor of shape {(B, T)} (1 = real token), got {shape}")
            mask = attention_mask.to(device=input_ids.device) != 0  # (B, T) bool, True = real token
        return input_ids.long(), mask, token_type_ids.long()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Encode a batch of token ids.

        Args:
            input_ids: [B, T] integer token ids.
            attention_mask: [B, T], 1 (or True) = real token, 0 = padding;
                None: every token is real. Passed to each attention as
                ``key_mask`` (bool, True = real key).
            token_type_ids: [B, T] segment ids (default zeros).
            output_hidden_states: also return every hidden state.

        Returns:
            last hidden state [B, T, C]; with ``output_hidden_states`` a pair
            (last [B, T, C], hidden_states): a tuple of num_layers + 1 tensors
            [B, T, C], the embeddings output then each layer's output (as
            Hugging Face's ``hidden_states``). Values at padded positions are
            computed but meaningless.

        Raises:
            TypeError / ValueError: wrong dtypes, shapes, ids out of range, or
                T > max_position_embeddings.
        """
        input_ids, mask, token_type_ids = self._check_inputs(input_ids, attention_mask, token_type_ids)
        x = self.embeddings(input_ids, token_type_ids)  # (B, T) -> (B, T, C)
        hidden = [x]
        for layer in self.layers:
            x = layer(x, key_mask=mask)
            hidden.append(x)
        if output_hidden_states:
            return x, tuple(hidden)
        return x

    # ------------------------------------------------------------------ weights
    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor], *, source: str = "state dict") -> None:
        """Copy Hugging Face BERT weights into this encoder, checking every key.

        Keys may carry a ``bert.`` prefix; ``pooler.*``, ``cls.*`` and
        ``embeddings.position_ids`` are ignored.

        Raises:
            TypeError: not a mapping of str to tensors.
            ValueError: missing keys, unexpected keys or wrong shapes (all
                listed, with ``source`` naming where the weights came from).
        """
        load_hf_weights(self, state_dict, source=source)

    @classmethod
    def from_hf_state_dict(
        cls, state_dict: Mapping[str, torch.Tensor], config: BertConfig, *, source: str = "state dict"
    ) -> BertEncoder:
        """A new encoder for ``config`` holding Hugging Face BERT weights (see
        :meth:`load_hf_state_dict`), in eval mode."""
        model = cls(config)
        model.load_hf_state_dict(state_dict, source=source)
        return model.eval()

    @classmethod
    def from_pretrained(cls, path: str | Path, config: BertConfig | None = None) -> BertEncoder:
        """Load a Hugging Face BERT folder (``config.json`` + ``model.safetensors``)
        or a ``.safetensors`` file (then ``config`` is required), in eval mode.

        Raises:
            FileNotFoundError: missing folder, config or weights file.
            ValueError: corrupt weights or weights that do not match the
                config (the message names the file).
        """
        path = Path(path)
        if path.is_dir():
            weights = path / "model.safetensors"
            if config is None:
                config = BertConfig.from_hf_config(path / "config.json")
        else:
            weights = path
            if config is None:
                raise ValueError(f"{path} is a file: pass config= (or the folder holding config.json)")
        return cls.from_hf_state_dict(load_safetensors(weights), config, source=str(weights))
