"""``GPTConfig`` and Hugging Face's ``GPT2Config``: what GPT-2 can hold, and the translation.

    config_fields_from_hf(hf_config)   GPT2Config (object or dict) -> GPTConfig fields
    gpt2_config_kwargs(config)         GPTConfig -> GPT2Config keyword arguments
    require_gpt2_layout(config)        ValueError for what GPT-2's weights cannot hold

``GPTConfig.from_hf_config`` / ``.to_hf_config`` call the first two; the
weight converters (``convert.hf_gpt2``, ``hf.export``) check the layout first.
GPT-2's layout is one format: a learned position table, a c_attn with a bias
and one key and one value head per query head, the same heads in every block.
"""

from __future__ import annotations

from typing import Any

from .head_layout import plain_multi_head

__all__ = ["config_fields_from_hf", "gpt2_config_kwargs", "require_gpt2_layout"]


def config_fields_from_hf(hf_config: Any) -> dict[str, Any]:
    """The ``GPTConfig`` fields of a Hugging Face ``GPT2Config`` (object or its dict).

    Raises:
        ValueError: options the GPT does not implement (another activation,
            different dropout rates per site, cross-attention, scaled or
            upcast attention variants).
    """
    d = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    get = d.get
    act = get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"only the GELU tanh approximation is implemented, got activation_function={act!r}")
    C = get("n_embd", 768)
    rates = {k: get(k, 0.1) for k in ("embd_pdrop", "attn_pdrop", "resid_pdrop")}
    if len(set(rates.values())) > 1:
        raise ValueError(f"one dropout rate is used everywhere; got different rates {rates}")
    for flag, want in (
        ("add_cross_attention", False),
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("reorder_and_upcast_attn", False),
    ):
        if bool(get(flag, want)) != want:
            raise ValueError(f"{flag}={get(flag)!r} is not supported (only {flag}={want})")
    return dict(
        vocab_size=get("vocab_size", 50257),
        context_length=get("n_positions", 1024),
        embed_dim=C,
        num_layers=get("n_layer", 12),
        num_heads=get("n_head", 12),
        dropout=float(next(iter(rates.values()))),
        layer_norm_eps=get("layer_norm_epsilon", 1e-5),
        tie_embeddings=bool(get("tie_word_embeddings", True)),
        mlp_dim=None if get("n_inner") in (None, 4 * C) else get("n_inner"),
    )


def gpt2_config_kwargs(config: Any) -> dict[str, Any]:
    """Keyword arguments for ``transformers.GPT2Config`` of a ``GPTConfig``.

    Raises:
        ValueError: a configuration GPT-2 cannot express (``require_gpt2_layout``).
    """
    require_gpt2_layout(config)
    return {
        "vocab_size": config.vocab_size,
        "n_positions": config.context_length,
        "n_embd": config.embed_dim,
        "n_layer": config.num_layers,
        "n_head": config.num_heads,
        "activation_function": "gelu_new",
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "layer_norm_epsilon": config.layer_norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "n_inner": config.mlp_dim,
    }


def require_gpt2_layout(config: Any) -> None:
    """Refuse a config whose weights Hugging Face GPT-2 cannot hold.

    Raises:
        ValueError: attention other than "mha" with all heads, qkv_bias=False,
            per-layer head counts, or positions other than a learned table.
    """
    if not plain_multi_head(config):
        raise ValueError(
            "Hugging Face GPT-2 weights exist only for attention='mha' with num_kv_heads == num_heads (its c_attn "
            "holds one key and one value head per query head and no other kind's weights); "
            f"got attention={config.attention!r}, num_kv_heads={config.num_kv_heads}, num_heads={config.num_heads}"
        )
    if not config.qkv_bias:
        raise ValueError("Hugging Face GPT-2 always has a c_attn bias; got qkv_bias=False")
    if config.layer_heads is not None:
        raise ValueError(f"Hugging Face GPT-2 has num_heads in every block; got layer_heads={config.layer_heads}")
    if config.positions != "learned":
        raise ValueError(f"Hugging Face GPT-2 has a learned position table (wpe); got positions={config.positions!r}")
