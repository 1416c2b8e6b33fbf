"""The option and model checks of ``multihead convert``, worded with its flags.

    G = check_options(to, num_kv_heads, method, ...)      # before --out is checked
    check_family_options(kind, hf, calibration_data, heldout_lines)  # once the source's family is known
    check_gqa_model(model, G, method)  /  check_mla_model(model, kv_rank)   # the loaded model
    config, layers = model_layers(model)                  # a GPT's or a SentenceEncoder's attention layers

Each check raises ValueError with one line naming the offending flags and
values (the refusals of ``tools.convert_heads.to_gqa`` and
``tools.convert_mla.to_mla``, said before anything is converted or written).
"""

from __future__ import annotations

from torch import nn

from ..tools.calibration import convertible_kinds
from ..tools.convert_heads import METHODS
from ..tools.convert_mla import MLA_METHODS
from .encoder_inputs import check_heldout_lines
from .recovery_option import check_recover_steps

__all__ = [
    "TARGETS", "UNCALIBRATED", "check_options", "check_family_options", "model_layers", "check_gqa_model",
    "check_mla_model",
]  # fmt: skip

# The command's conversions, named after what their layers become: "gqa" and "mqa" (G = 1) run
# tools.to_gqa, whose layers are the MultiHeadAttention kind of their head counts (kind_name);
# "mla" runs tools.to_mla. Which layers they take is the kinds' regroups_key_values.
TARGETS = ("gqa", "mqa", "mla")
UNCALIBRATED = ("mean", "svd")  # the methods that read no data


def check_options(to: str, num_kv_heads: int | None, method: str, calibration_data: str | None,
                  calibration_batches: int | None, heldout: int | None, recover_steps: int,
                  kv_rank: int | None) -> int | None:  # fmt: skip
    """G, from --to and --num-kv-heads (None for --to mla); the other options checked."""
    if to not in TARGETS:
        raise ValueError(f"--to {to}: unknown target; valid: {', '.join(TARGETS)}")
    if to == "mqa" and num_kv_heads not in (None, 1):
        raise ValueError(f"--to mqa has one key/value head; --num-kv-heads {num_kv_heads} is for --to gqa")
    if to == "gqa" and num_kv_heads is None:
        raise ValueError("--to gqa needs --num-kv-heads G, the key/value heads of every layer (--to mqa: G = 1)")
    if to == "mla" and num_kv_heads is not None:
        raise ValueError(f"--num-kv-heads {num_kv_heads} is for --to gqa; --to mla takes --kv-rank R")
    if to != "mla" and kv_rank is not None:
        raise ValueError(f"--kv-rank {kv_rank} is for --to mla (the latent's channels); --to {to} takes G heads")
    if to == "mla" and kv_rank is None:
        raise ValueError("--to mla needs --kv-rank R, the channels of the latent every layer caches per token")
    if to == "mla" and kv_rank < 1:
        raise ValueError(f"--kv-rank {kv_rank}: give a number of latent channels >= 1")
    valid = MLA_METHODS if to == "mla" else METHODS
    if method not in valid:
        raise ValueError(f"--method {method}: unknown method for --to {to}; valid: {', '.join(valid)}")
    check_recover_steps(recover_steps)
    if method in UNCALIBRATED and not recover_steps:
        given = [
            f
            for f, v in (("--calibration-data", calibration_data), ("--calibration-batches", calibration_batches))
            if v is not None
        ]
        if given:
            raise ValueError(f'{" and ".join(given)} only go with --method aligned or activation or --recover-steps '
                             f'("{method}" uses no calibration)')
    if calibration_batches is not None and calibration_batches < 1:
        raise ValueError(f"--calibration-batches {calibration_batches}: give a number >= 1")
    check_heldout_lines(heldout)
    return 1 if to == "mqa" else num_kv_heads if to == "gqa" else None


def check_family_options(kind: str, hf: str | None, calibration_data: str | None, heldout_lines: int | None) -> None:
    """The options that only one family of source takes (``kind``: "gpt" or "encoder", ``model_sources.family``)."""
    if calibration_data is not None and (kind == "encoder" or hf is not None):
        raise ValueError(f"--calibration-data {calibration_data} is for a GPT --checkpoint; "
                         f"{'an encoder' if kind == 'encoder' else 'a GPT-2 --hf folder'} calibrates on "
                         "Shakespeare's text through its own tokenizer")  # fmt: skip
    if kind == "gpt" and heldout_lines is not None:
        raise ValueError(f"--heldout-lines {heldout_lines} is for encoders (--model, a BERT --hf, a sentence-encoder "
                         "--checkpoint); a GPT is measured on validation text")  # fmt: skip


def model_layers(model) -> tuple[object, list[nn.Module]]:
    """(config, attention layers) of a GPT or a SentenceEncoder."""
    from ..models.gpt import GPT

    if isinstance(model, GPT):
        return model.config, [block.attn for block in model.blocks]
    return model.encoder.config, [layer.attention for layer in model.encoder.layers]


def check_gqa_model(model, num_kv_heads: int, method: str) -> None:
    """The to_gqa refusals, worded with the command's flags."""
    config, layers = model_layers(model)
    H, counts, G = config.num_heads, config.layer_heads, num_kv_heads
    if counts is None:
        if not 1 <= G <= H:
            raise ValueError(f"--num-kv-heads {G} out of range: the model has {H} heads, so G is in 1..{H}")
        if H % G:
            raise ValueError(f"--num-kv-heads {G} does not divide the model's {H} heads")
    elif not 1 <= G <= min(counts):
        raise ValueError(f"--num-kv-heads {G} out of range: the model's layers have {counts} query heads "
                         f"after pruning, so G is in 1..{min(counts)}")  # fmt: skip
    for i, attn in enumerate(layers):
        kind = getattr(attn, "kind", type(attn).__name__)
        if not getattr(type(attn), "regroups_key_values", False):
            raise ValueError(
                f"layer {i} is attention kind {kind!r}, which has no key/value heads to merge; "
                f"convert takes {', '.join(convertible_kinds())} layers"
            )
        if attn.num_kv_heads % G:
            pruned = f" ({attn.num_heads} query heads after pruning)" if counts is not None else ""
            raise ValueError(f"--num-kv-heads {G} does not divide layer {i}'s {attn.num_kv_heads} key/value heads"
                             f"{pruned}")  # fmt: skip
        if method == "aligned" and (attn.rope is not None or attn.qk_norm is not None):
            raise ValueError(
                f"--method aligned rotates keys, which does not commute with rope or qk_norm (layer {i} has "
                f"rope={attn.rope is not None}, qk_norm={attn.qk_norm is not None}): use --method mean"
            )


def check_mla_model(model, kv_rank: int) -> None:
    """The to_mla refusals, worded with the command's flags."""
    _, layers = model_layers(model)
    for i, attn in enumerate(layers):
        kind = getattr(attn, "kind", type(attn).__name__)
        if not getattr(type(attn), "regroups_key_values", False):
            raise ValueError(f"layer {i} is attention kind {kind!r}; --to mla converts {', '.join(convertible_kinds())} layers")
        found = [n for n in ("rope", "qk_norm", "sinks") if getattr(attn, n) is not None]
        if found:
            raise ValueError(f"layer {i} has {', '.join(found)}: --to mla converts models with absolute positions "
                             "and without qk_norm or sinks (see docs/surgery.md)")  # fmt: skip
        width = 2 * attn.num_kv_heads * attn.head_dim
        if kv_rank > width:
            raise ValueError(f"--kv-rank {kv_rank} out of range: layer {i}'s keys and values have {width} channels "
                             f"(2 x {attn.num_kv_heads} heads x {attn.head_dim}), so R is in 1..{width}")  # fmt: skip
