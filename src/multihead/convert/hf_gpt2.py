"""Hugging Face GPT-2 weights to and from a multihead ``GPT``.

    model = gpt_from_hf_state_dict(hf_model.state_dict(), GPTConfig.from_hf_config(hf_model.config))
    hf_model.load_state_dict(gpt_to_hf_state_dict(model))

Hugging Face name -> multihead name (``GPT2LMHeadModel``; ``GPT2Model`` has
no ``transformer.`` prefix and no ``lm_head``)::

    transformer.wte / wpe              token_embedding / position_embedding
    transformer.h.{i}.ln_1, ln_2       blocks.{i}.ln_1, ln_2
    transformer.h.{i}.attn.c_attn      blocks.{i}.attn.qkv_proj   (Conv1D (C, 3C) = Linear weight transposed)
    transformer.h.{i}.attn.c_proj      blocks.{i}.attn.out_proj   (transposed)
    transformer.h.{i}.mlp.c_fc, c_proj blocks.{i}.mlp.fc, proj    (transposed)
    transformer.ln_f, lm_head          ln_f, lm_head (tied to the token embedding)

The causal-mask buffers of older transformers versions (``attn.bias``,
``attn.masked_bias``) are skipped. The config translation itself is
:meth:`GPTConfig.from_hf_config` / :meth:`GPTConfig.to_hf_config`.
"""

from __future__ import annotations

import torch

from ..models.checkpoint import check_state_shapes
from ..models.gpt import GPT, GPTConfig
from ..models.gpt_hf_config import require_gpt2_layout
from ..models.quantize import refuse_weight_only

__all__ = ["gpt_from_hf_state_dict", "gpt_to_hf_state_dict"]

_CONV1D = ("c_attn", "c_proj", "c_fc")
_TOP = {
    "transformer.wte.weight": "token_embedding.weight",
    "transformer.wpe.weight": "position_embedding.weight",
    "transformer.ln_f.weight": "ln_f.weight",
    "transformer.ln_f.bias": "ln_f.bias",
    "lm_head.weight": "lm_head.weight",
}
_BLOCK = {
    "ln_1": "ln_1",
    "attn.c_attn": "attn.qkv_proj",
    "attn.c_proj": "attn.out_proj",
    "ln_2": "ln_2",
    "mlp.c_fc": "mlp.fc",
    "mlp.c_proj": "mlp.proj",
}


def gpt_from_hf_state_dict(state_dict: dict[str, torch.Tensor], config: GPTConfig | None = None) -> GPT:
    """Build a ``GPT`` holding Hugging Face GPT-2 weights.

    Conv1D weights are stored (in, out), the transpose of ``nn.Linear``;
    ``c_attn`` columns are [q | k | v], the row order of ``qkv_proj``.
    The model gets the dtype of ``transformer.wte.weight`` and its own
    copies of the tensors.

    Args:
        state_dict: ``transformer.wte.weight`` [V, C], ``transformer.wpe.weight``
            [T_max, C], ``transformer.h.{i}.{ln_1,attn.c_attn,attn.c_proj,ln_2,mlp.c_fc,mlp.c_proj}.*``,
            ``transformer.ln_f.*`` and optionally ``lm_head.weight`` [V, C]
            (the ``transformer.`` prefix may be absent).
        config: sizes and options; None infers them from the shapes with
            head_dim 64, as in every released GPT-2.

    Returns:
        the model (in training mode, like a fresh module).

    Raises:
        ValueError: attention other than "mha", missing, unexpected or
            mis-shaped tensors, or an untied ``lm_head.weight`` with
            ``tie_embeddings=True``.
    """
    sd = dict(state_dict)
    if not any(k.startswith("transformer.") for k in sd):
        sd = {f"transformer.{k}": v for k, v in sd.items()}
    for key in ("transformer.wte.weight", "transformer.wpe.weight"):
        if key not in sd:
            raise ValueError(f"not a GPT-2 state dict: {key!r} is missing")
    if config is None:
        config = _inferred_config(sd)
    require_gpt2_layout(config)
    ours = {}
    for key, value in sd.items():
        name = _hf_to_ours(key)
        if name is None:
            continue  # causal-mask buffers of older transformers versions
        if name == "lm_head.weight" and config.tie_embeddings:
            if not torch.equal(value, sd["transformer.wte.weight"]):
                raise ValueError(
                    "lm_head.weight differs from transformer.wte.weight: the checkpoint is untied; "
                    "pass a config with tie_embeddings=False"
                )
            continue
        ours[name] = value.detach().t() if _is_conv1d_weight(key) else value.detach()
    dtype = sd["transformer.wte.weight"].dtype
    model = GPT(config, device="meta", dtype=dtype)
    check_state_shapes(model, {k: v.shape for k, v in ours.items()}, "Hugging Face GPT-2 state dict")
    model.load_state_dict({k: v.contiguous().clone() for k, v in ours.items()}, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.token_embedding.weight
    return model


def gpt_to_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """``model``'s weights under ``GPT2LMHeadModel`` names (detached copies,
    Conv1D weights transposed to (in, out)).

    Raises:
        ValueError: attention other than "mha", qkv_bias=False or per-layer head counts,
            or weight-only layers (``models.quantize``).
    """
    require_gpt2_layout(model.config)
    refuse_weight_only(model, "export")
    out = {}
    for name, value in model.state_dict().items():
        key = _ours_to_hf(name)
        out[key] = (value.t() if _is_conv1d_weight(key) else value).detach().contiguous().clone()
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def _inferred_config(sd: dict[str, torch.Tensor]) -> GPTConfig:
    """The config of released GPT-2 checkpoints (head_dim 64) sized by ``sd``'s shapes."""
    V, C = sd["transformer.wte.weight"].shape
    layers = {int(k.split(".")[2]) for k in sd if k.startswith("transformer.h.")}
    if C % 64 != 0:
        raise ValueError(f"cannot infer num_heads for embed_dim={C} (not a multiple of 64); pass config")
    return GPTConfig(
        vocab_size=V,
        context_length=sd["transformer.wpe.weight"].shape[0],
        embed_dim=C,
        num_layers=max(layers) + 1 if layers else 0,
        num_heads=C // 64,
        tie_embeddings="lm_head.weight" not in sd or torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"]),
    )


def _is_conv1d_weight(hf_key: str) -> bool:
    return hf_key.endswith(".weight") and any(f".{p}." in hf_key for p in _CONV1D)


def _hf_to_ours(key: str) -> str | None:
    """HF key -> our key; None for buffers to skip; the HF key itself when unknown
    (so the key check reports it as unexpected)."""
    if key in _TOP:
        return _TOP[key]
    parts = key.split(".")
    if len(parts) >= 5 and parts[:2] == ["transformer", "h"]:
        sub, leaf = ".".join(parts[3:-1]), parts[-1]
        if sub == "attn" and leaf in ("bias", "masked_bias"):
            return None
        if sub in _BLOCK:
            return f"blocks.{parts[2]}.{_BLOCK[sub]}.{leaf}"
    return key


def _ours_to_hf(name: str) -> str:
    for hf, ours in _TOP.items():
        if name == ours:
            return hf
    _, i, rest = name.split(".", 2)
    sub, leaf = rest.rsplit(".", 1)
    hf_sub = {v: k for k, v in _BLOCK.items()}[sub]
    return f"transformer.h.{i}.{hf_sub}.{leaf}"
