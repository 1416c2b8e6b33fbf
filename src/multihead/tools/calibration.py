"""What the attention conversions (``convert_heads.to_gqa``, ``convert_mla.to_mla``) share.

    backbone, attentions = backbone_of(model, "to_gqa")   # GPT or BertEncoder, its attention modules
    check_kind(i, attentions[i], "to_gqa")                # a layer whose kind regroups key/values, or ValueError
    run_calibration(model, backbone, layers, calibration, hook)   # every batch through the backbone
    new = rebuilt(backbone, config)          # a fresh model of the new config, unchanged weights kept
    new = finished(model, backbone, new)     # train mode restored, a SentenceEncoder rewrapped

``model`` is a GPT, a BertEncoder or a SentenceEncoder (its ``encoder`` is
the backbone). Calibration batches take the forms listed in the
``convert_heads`` module docstring: input_ids [B, T], for an encoder also
(input_ids, attention_mask [B, T]) pairs or ``Tokenized`` batches, for a
SentenceEncoder also lists of sentences.

``run_calibration`` registers ``hook(i)`` as a forward pre-hook (with
kwargs) of ``layers[i]``: it sees the layer's input x [B, T, C] as
``args[0]`` and the padding mask [B, T] (True = real token) as
``kwargs.get("key_mask")``, None without padding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..models.bert import BertEncoder
from ..models.gpt import GPT
from ..models.minilm import SentenceEncoder

__all__ = ["convertible_kinds", "backbone_of", "check_kind", "run_batch", "run_calibration", "rebuilt", "finished"]



def convertible_kinds() -> list[str]:
    """The registered kinds the conversions take: those whose class declares ``regroups_key_values``."""
    from ..modules.registry import attention_class, list_attention_kinds

    return [name for name in list_attention_kinds() if attention_class(name).regroups_key_values]


def backbone_of(model: nn.Module, caller: str) -> tuple[GPT | BertEncoder, list[nn.Module]]:
    """The model whose layers are converted and its attention modules, in layer order.

    Raises:
        TypeError: ``model`` is none of the three classes (the message names ``caller``).
    """
    if isinstance(model, SentenceEncoder):
        model = model.encoder
    if isinstance(model, GPT):
        return model, [block.attn for block in model.blocks]
    if isinstance(model, BertEncoder):
        return model, [layer.attention for layer in model.layers]
    raise TypeError(f"{caller} takes a GPT, BertEncoder or SentenceEncoder, got {type(model).__name__}")


def check_kind(i: int, attn: nn.Module, caller: str) -> None:
    """Refuse layer ``i`` unless its kind declares ``regroups_key_values``.

    Raises:
        ValueError: another kind or class (the message names ``caller``).
    """
    if not getattr(type(attn), "regroups_key_values", False):
        raise ValueError(
            f"layer {i} is attention kind {getattr(attn, 'kind', type(attn).__name__)!r} "
            f"({type(attn).__name__}); {caller} converts only {convertible_kinds()} layers"
        )


def run_batch(model: nn.Module, backbone: nn.Module, batch, n: int) -> None:
    """Run calibration batch number ``n`` (its forms: the module docstring) through ``backbone``.

    Raises:
        TypeError: a batch of none of the forms. ValueError: a mask of another shape.
    """
    ids, mask = batch, None
    if isinstance(backbone, BertEncoder):
        if isinstance(model, SentenceEncoder) and isinstance(batch, list) and batch and all(
            isinstance(s, str) for s in batch
        ):
            batch = model.tokenize(batch)
        if hasattr(batch, "input_ids") and hasattr(batch, "attention_mask"):
            ids, mask = batch.input_ids, batch.attention_mask
        elif isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch):
            ids, mask = batch
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        forms = "a [B, T] tensor of token ids"
        if isinstance(backbone, BertEncoder):
            forms += ", a pair (input_ids [B, T], attention_mask [B, T])"
            forms += ", or a list of sentences" if isinstance(model, SentenceEncoder) else ""
        got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(batch).__name__
        raise TypeError(f"calibration batch {n} must be {forms}; got {got}")
    if mask is None:
        backbone(ids)
    else:
        backbone(ids, attention_mask=mask)  # raises ValueError on a mask of another shape


@torch.no_grad()
def run_calibration(model: nn.Module, backbone: nn.Module, layers: list[nn.Module], calibration: Iterable,
                    hook: Callable[[int], Callable]) -> None:  # fmt: skip
    """Every calibration batch through ``backbone`` in eval mode, ``hook(i)`` observing ``layers[i]``.

    The hooks are removed and the backbone's train mode restored afterwards, also on an error.

    Raises:
        ValueError: ``calibration`` holds no batches. TypeError: as ``run_batch``.
    """
    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    was_training = backbone.training
    backbone.eval()
    try:
        count = 0
        for n, batch in enumerate(calibration):
            run_batch(model, backbone, batch, n)
            count += 1
        if count == 0:
            raise ValueError("calibration holds no batches")
    finally:
        for h in handles:
            h.remove()
        backbone.train(was_training)


def rebuilt(backbone: nn.Module, config) -> nn.Module:
    """A fresh GPT or BertEncoder (as ``backbone``) of ``config`` on the same device and dtype, holding
    every weight of ``backbone`` whose name and shape did not change (the attention layers are written afterwards)."""
    param = next(backbone.parameters())
    if isinstance(backbone, GPT):
        new = GPT(config, device=param.device, dtype=param.dtype)
    else:
        new = BertEncoder(config).to(device=param.device, dtype=param.dtype)
    new_state = new.state_dict()
    kept = {k: v for k, v in backbone.state_dict().items() if k in new_state and new_state[k].shape == v.shape}
    new.load_state_dict(kept, strict=False)
    return new


def finished(model: nn.Module, backbone: nn.Module, new: nn.Module) -> nn.Module:
    """``new`` (the converted backbone) in ``backbone``'s train mode; for a SentenceEncoder ``model``,
    wrapped with its tokenizer, length limit, pooling and normalisation, in its train mode."""
    new.train(backbone.training)
    if isinstance(model, SentenceEncoder):
        new = SentenceEncoder(
            new, model.tokenizer, max_seq_length=model.max_seq_length, pooling=model.pooling, normalize=model.normalize
        )
        new.train(model.training)
    return new
