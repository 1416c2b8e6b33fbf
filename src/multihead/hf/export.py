"""Write a multihead model as a Hugging Face transformers folder.

    export_hf(gpt, "out")        ->  GPT2LMHeadModel.from_pretrained("out")
    export_hf(minilm, "out")     ->  BertModel.from_pretrained("out"), SentenceTransformer("out")

What the folder holds::

    out/config.json              model_type "gpt2" (architectures GPT2LMHeadModel) or "bert" (BertModel)
    out/model.safetensors        the weights under transformers' names, in the model's dtype
                                 (GPT: ``convert.hf_gpt2``, the tied LM head stored once;
                                 BERT: ``BertEncoder``'s key map, no pooler)
    out/tokenizer.json           the tokenizer (see below), with tokenizer_config.json
    out/modules.json             a SentenceEncoder only: its sentence-transformers pooling
    out/sentence_bert_config.json, out/1_Pooling/config.json        and normalisation

Tokenizer: the one given (a ``tokenizers.Tokenizer``, a tokenizer of
``multihead.train.tokenizer``, or a tokenizer.json path), else a
SentenceEncoder's own; a byte-level GPT (vocab 256) without one gets a
tokenizer.json whose ids are the UTF-8 bytes (a byte-level BPE without
merges). Otherwise no tokenizer files are written (``hf.export_files``).

What transformers cannot represent is refused with the reason, before
anything is written (``check_hf_export``): an attention kind other than
plain multi-head attention with one key/value head per query head (GQA,
MQA, MoH, ...), attention options GPT-2 lacks (rope, qk_norm, ...), a GPT without
GPT-2's learned position table (``positions`` other than "learned"), and a
pruned model (per-layer head counts): transformers' GPT-2 and BERT configs
hold one head count for every layer and derive the head size from it
(width / heads). ``zero_heads=True`` writes a pruned model anyway, at its
unpruned size: every removed head comes back with zero query, key, value
and output weights, so it adds exactly zero and the outputs are the pruned
model's. A GPT without the q/k/v bias (``qkv_bias=False``) is written with
a zero bias (GPT-2 always has one).

The folder is written whole: into a staging folder beside it, then renamed
into place. An existing folder is replaced only when it holds nothing but
files this export writes (a previous export); anything else is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .export_files import sentence_files, special_tokens, tokenizer_file

__all__ = ["export_hf", "check_hf_export", "export_tokenizer", "pruned", "EXPORT_FILES", "check_export_folder"]

# Every entry an export may write (files, and the 1_Pooling folder).
EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "modules.json",
                "sentence_bert_config.json", "1_Pooling")  # fmt: skip


# ------------------------------------------------------------------ what can be exported
def _parts(model: nn.Module):
    """(family "gpt" or "bert", the GPT or BertEncoder, the SentenceEncoder or None)."""
    from ..models.bert import BertEncoder
    from ..models.gpt import GPT
    from ..models.minilm import SentenceEncoder

    if isinstance(model, GPT):
        return "gpt", model, None
    if isinstance(model, SentenceEncoder):
        return "bert", model.encoder, model
    if isinstance(model, BertEncoder):
        return "bert", model, None
    raise TypeError(
        f"export_hf takes a multihead GPT, BertEncoder or SentenceEncoder, got {type(model).__name__}"
    )


def check_hf_export(model: nn.Module, *, zero_heads: bool = False) -> str:
    """The transformers class ``model`` exports as, or the reason it cannot.

    Returns:
        "GPT2LMHeadModel" or "BertModel".

    Raises:
        TypeError: not a GPT, BertEncoder or SentenceEncoder.
        ValueError: what transformers cannot hold (see the module docstring).
    """
    from ..models.head_layout import plain_multi_head

    family, inner, _ = _parts(model)
    config = inner.config
    target = "GPT2LMHeadModel" if family == "gpt" else "BertModel"
    H = config.num_heads
    if not plain_multi_head(config):
        kv = "" if config.num_kv_heads is None else f" with {config.num_kv_heads} key/value heads for {H} query heads"
        raise ValueError(
            f"transformers' {target} has plain multi-head attention (one key/value head per query head); "
            f"this model's attention is {config.attention!r}{kv}, which it cannot hold"
        )
    if getattr(config, "positions", "learned") != "learned":
        raise ValueError(
            f"transformers' {target} has a learned absolute position table (wpe); this model's "
            f"positions={config.positions!r} has none, which it cannot hold"
        )
    options = dict(getattr(config, "attention_options", {}) or {})
    for per_layer in getattr(config, "layer_attention_options", None) or []:  # local / global layers
        options.update(per_layer)
    if options:
        why = []
        if options.get("rope"):
            why.append("rope (GPT-2 has learned absolute positions, no rotary embeddings)")
        if options.get("qk_norm"):
            why.append("qk_norm (GPT-2 does not normalise queries and keys)")
        others = sorted(k for k in options if k not in ("rope", "qk_norm") or not options[k])
        if others:
            why.append(f"{', '.join(others)} (GPT-2's attention has no such options)")
        raise ValueError(f"transformers' {target} cannot hold this model's attention options {options}: {'; '.join(why)}")
    if pruned(model) and not zero_heads:
        raise ValueError(
            f"transformers' {target} config holds one head count for every layer and derives the head size "
            f"from it (width / heads); this pruned model keeps {config.layer_heads} of {H} heads of size "
            f"{config.head_dim}: pass zero_heads=True (multihead export --zero-heads) to write the removed "
            "heads back as zero heads (the same outputs, the unpruned size)"
        )
    return target


def pruned(model: nn.Module) -> bool:
    """Whether some layer of ``model`` has fewer than ``num_heads`` heads (per-layer ``layer_heads``)."""
    config = _parts(model)[1].config
    return config.layer_heads is not None and any(h != config.num_heads for h in config.layer_heads)


# ------------------------------------------------------------------ weights
def _padded(t: torch.Tensor, size: int, dim: int = 0) -> torch.Tensor:
    """``t`` with zeros appended along ``dim`` up to ``size``."""
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _full_heads(attention: nn.Module, H: int, D: int) -> dict[str, torch.Tensor]:
    """q, k, v weights [H*D, C] and biases [H*D], out_proj weight [C, H*D] and bias [C]
    of a layer with h <= H heads: the missing heads zero, a missing bias zero."""
    out = {}
    for letter, (W, b) in attention.projection_weights().items():
        W = W.detach()
        out[f"{letter}.weight"] = _padded(W, H * D)
        out[f"{letter}.bias"] = _padded(W.new_zeros(W.shape[0]) if b is None else b.detach(), H * D)
    out["out.weight"] = _padded(attention.out_proj.weight.detach(), H * D, dim=1)
    out["out.bias"] = attention.out_proj.bias.detach()
    return out


def _gpt2_tensors(model) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel weights of a GPT (uniform, or padded to num_heads), lm_head left out when tied."""
    from ..convert.hf_gpt2 import gpt_to_hf_state_dict
    from ..models.gpt import GPT

    config = model.config
    if config.layer_heads is not None or not config.qkv_bias:
        full = config.to_dict()
        full.pop("layer_heads", None)
        full["qkv_bias"] = True
        uniform = type(config).from_dict(full)
        state = dict(model.state_dict())
        H, D = config.num_heads, config.head_dim
        for i, block in enumerate(model.blocks):
            heads = _full_heads(block.attn, H, D)
            prefix = f"blocks.{i}.attn."
            for key in [k for k in state if k.startswith(prefix)]:
                del state[key]
            state[prefix + "qkv_proj.weight"] = torch.cat([heads[f"{x}.weight"] for x in "qkv"])
            state[prefix + "qkv_proj.bias"] = torch.cat([heads[f"{x}.bias"] for x in "qkv"])
            state[prefix + "out_proj.weight"], state[prefix + "out_proj.bias"] = heads["out.weight"], heads["out.bias"]
        model = GPT(uniform, device="meta", dtype=model.token_embedding.weight.dtype)
        model.load_state_dict(state, strict=True, assign=True)
        if uniform.tie_embeddings:
            model.lm_head.weight = model.token_embedding.weight
    tensors = gpt_to_hf_state_dict(model)
    if model.config.tie_embeddings:
        tensors.pop("lm_head.weight")  # transformers ties it to transformer.wte.weight
    return tensors


def _bert_tensors(encoder) -> dict[str, torch.Tensor]:
    """BertModel weights of a BertEncoder (heads padded to num_heads), no pooler."""
    from ..models.bert_weights import hf_name_map

    config = encoder.config
    H, D = config.num_heads, config.head_dim
    state = encoder.state_dict()
    names = hf_name_map(encoder)  # ours -> (transformers name, shape): the key map of models.bert_weights
    tensors = {}
    for i, layer in enumerate(encoder.layers):
        heads = _full_heads(layer.attention, H, D)
        for letter in "qkv":
            for suffix in ("weight", "bias"):
                tensors[names[f"layers.{i}.attention.{letter}_proj.{suffix}"][0]] = heads[f"{letter}.{suffix}"]
        for suffix in ("weight", "bias"):
            tensors[names[f"layers.{i}.attention.out_proj.{suffix}"][0]] = heads[f"out.{suffix}"]
    for ours, (hf, _) in names.items():
        if hf not in tensors:
            tensors[hf] = state[ours].detach()
    return tensors


# ------------------------------------------------------------------ configs
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _gpt2_config(model, special: dict[str, int]) -> dict[str, Any]:
    config = model.config
    full = config.to_dict()
    full.pop("layer_heads", None)
    full["qkv_bias"] = True
    hf = type(config).from_dict(full).to_hf_config()
    eos = special.get("eos")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **hf, "bos_token_id": eos,
            "eos_token_id": eos, "dtype": _dtype_name(model.token_embedding.weight.dtype)}  # fmt: skip


def _bert_config(encoder, special: dict[str, int]) -> dict[str, Any]:
    c = encoder.config
    return {
        "architectures": ["BertModel"], "model_type": "bert", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "intermediate_size": c.intermediate_size, "hidden_act": c.hidden_act, "hidden_dropout_prob": c.dropout,
        "attention_probs_dropout_prob": c.attention_dropout, "max_position_embeddings": c.max_position_embeddings,
        "type_vocab_size": c.type_vocab_size, "layer_norm_eps": c.layer_norm_eps,
        "position_embedding_type": "absolute", "pad_token_id": special.get("pad", 0),
        "dtype": _dtype_name(encoder.embeddings.word_embeddings.weight.dtype),
    }  # fmt: skip


# ------------------------------------------------------------------ tokenizers
def export_tokenizer(model: nn.Module, given: Any = None):
    """The ``tokenizers.Tokenizer`` an export of ``model`` writes (a fresh copy,
    no padding or truncation), or None (see the module docstring).

    Raises:
        TypeError: a tokenizer of another type.
        ValueError: an unreadable tokenizer.json, or more tokens than the model's vocabulary.
    """
    family, inner, sentence = _parts(model)
    if given is None and sentence is not None:
        given = sentence.tokenizer
    return tokenizer_file(given, inner.config.vocab_size, byte_default=family == "gpt")


# ------------------------------------------------------------------ the folder
def check_export_folder(folder: str | os.PathLike, flag: str | None = None) -> Path:
    """``folder`` as a Path, checked to be new, empty or a previous export (only
    ``EXPORT_FILES`` in it), in a folder this process can write.

    Raises:
        ValueError: a file, a folder holding anything else, or a place that
            cannot be written (the message names ``flag`` and the path).
    """
    from ..paths import output_folder

    label = flag or "folder"
    path = output_folder(label, folder)
    if path.is_dir():
        foreign = sorted(p.name for p in path.iterdir() if p.name not in EXPORT_FILES)
        if foreign:
            raise ValueError(
                f"{label} {os.fspath(folder)}: holds {foreign[:5]}{' ...' if len(foreign) > 5 else ''}, which an "
                "export would remove: give a new folder, an empty one or a previous export"
            )
    return path


def _write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def _install(staging: Path, target: Path) -> None:
    """Rename the complete ``staging`` folder to ``target`` (a previous export there is replaced)."""
    for path in staging.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        os.rename(target, old)
    try:
        os.rename(staging, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_hf(
    model: nn.Module,
    folder: str | os.PathLike,
    *,
    tokenizer: Any = None,
    zero_heads: bool = False,
) -> Path:
    """Write ``model`` as a Hugging Face folder that transformers' ``from_pretrained`` loads.

    Args:
        model: a ``GPT`` (-> ``GPT2LMHeadModel``), a ``BertEncoder`` or a
            ``SentenceEncoder`` such as ``load_minilm()`` (-> ``BertModel``;
            a SentenceEncoder also as a sentence-transformers folder).
        folder: the folder to write (new, empty or a previous export).
        tokenizer: a ``tokenizers.Tokenizer``, a ``multihead.train``
            tokenizer or a tokenizer.json path; None: a SentenceEncoder's
            own, bytes for a vocab-256 GPT, else none.
        zero_heads: write a pruned model at its unpruned size with the
            removed heads as zero heads (see the module docstring).

    Returns:
        ``folder`` as a Path.

    Raises:
        TypeError: another kind of model or tokenizer.
        ValueError: a model transformers cannot hold (``check_hf_export``),
            a tokenizer larger than the vocabulary, or a folder that cannot
            be written; all before anything is written.
    """
    from safetensors.torch import save_file

    from ..io import remove_stale_temps

    family, inner, sentence = _parts(model)
    check_hf_export(model, zero_heads=zero_heads)
    target = check_export_folder(folder)
    tok = export_tokenizer(model, tokenizer)
    special, named = special_tokens(family, tok)

    with torch.no_grad():
        tensors = _gpt2_tensors(inner) if family == "gpt" else _bert_tensors(inner)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    files: dict[str, Any] = {"config.json": _gpt2_config(inner, special) if family == "gpt" else _bert_config(inner, special)}
    if tok is not None:
        config = inner.config
        limit = sentence.max_seq_length if sentence is not None else getattr(config, "context_length", None)
        limit = limit or getattr(config, "max_position_embeddings", None)
        files["tokenizer_config.json"] = {"tokenizer_class": "PreTrainedTokenizerFast", **named,
                                          **({"model_max_length": limit} if limit else {})}  # fmt: skip
    if sentence is not None:
        files.update(sentence_files(sentence, inner.config.hidden_size))
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target)
    staging = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    os.mkdir(staging)
    try:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        if tok is not None:
            tok.save(str(staging / "tokenizer.json"))
        for name, value in files.items():
            _write_json(staging / name, value)
        _install(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
