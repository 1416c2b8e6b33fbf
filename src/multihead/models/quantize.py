"""Weight-only bfloat16 / int8 GPT for decoding: ``quantize_weights(model, "bf16" | "int8")``.

    fast = quantize_weights(gpt, "int8")             # a new GPT; gpt is unchanged
    fast.generate(idx, 32, temperature=0)           # float32 activations, int8 weights
    laid = quantize_weights(gpt, "fp32")             # same values, decode layout (W^T) for CPU

Every linear layer of the blocks (attention projections, MLP), the LM head
and the token embedding (one table when tied, as GPT-2's) become
``modules.weight_only`` layers; layer norms, the position embedding and the
biases stay float32. A GPT-2 small LM step then reads 249 MB (bf16) or 125 MB
(int8) of weights instead of 498 MB.

The result generates, scores (``model(idx, targets)``) and compiles
(``generate(compile_steps=True)``) as the float model does; it is for
inference: ``train()`` and ``save_checkpoint`` refuse it (quantize the float
model again after training or loading).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..modules.registry import attention_class, list_attention_kinds
from ..modules.weight_only import (
    WEIGHT_FORMATS,
    WeightOnlyEmbedding,
    WeightOnlyLinear,
    model_weights,
    refuse_training,
)
from .gpt import GPT

__all__ = [
    "quantize_weights", "weight_format", "refuse_weight_only", "QuantizedGPT", "WEIGHT_FORMATS",
]  # fmt: skip



class QuantizedGPT(GPT):
    """A ``GPT`` whose linear layers are weight-only (what ``quantize_weights`` returns): it
    generates and scores as a GPT does, and is for inference."""

    def train(self, mode: bool = True) -> QuantizedGPT:
        """Refused (ValueError, no layer's mode changed); ``train(False)`` is ``eval()``."""
        if mode:
            refuse_training(self)
        return super().train(mode)

    def num_parameters(self) -> int:
        """The float model's count: parameters and the weight-only layers' stored weights, each once."""
        return sum(t.numel() for t in model_weights(self))


def weight_format(model: nn.Module) -> str | None:
    """The format ("fp32", "bf16", "int8") of a model ``quantize_weights`` made, else None."""
    for m in model.modules():
        if isinstance(m, (WeightOnlyLinear, WeightOnlyEmbedding)):
            return m.format
    return None


def refuse_weight_only(model: nn.Module, action: str) -> None:
    """Raise ValueError naming ``action`` when ``model`` holds weight-only layers."""
    fmt = weight_format(model)
    if fmt is not None:
        raise ValueError(
            f"{action}: the model holds weight-only {fmt} layers, which are for inference; "
            f"{action} the float32 model it was quantized from"
        )


def quantize_weights(model: GPT, weights: str) -> GPT:
    """A copy of ``model`` whose linear layers, LM head and token embedding hold ``weights``.

    Args:
        model: a float32 ``GPT`` whose attention kind declares ``weight_only_layers``
            (mha, gqa, mqa among the kinds in the tree); not changed.
        weights: "bf16" (bfloat16 weights), "int8" (int8 with one bfloat16
            scale per output channel), or "fp32" (the same float32 values,
            each matrix stored transposed: the layout CPU BLAS multiplies a
            few decode rows by fastest); ``modules.weight_only``.

    Returns:
        a new :class:`QuantizedGPT` (a ``GPT``) in eval mode sharing no tensor with ``model``; the float
        weights are not copied on the way (only the small tensors are).

    Raises:
        TypeError: ``model`` is not a GPT.
        ValueError: another format, a model already quantized, another attention
            kind, or parameters that are not float32.
    """
    if not isinstance(model, GPT):
        raise TypeError(f"quantize_weights takes a GPT, got {type(model).__name__}")
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got weights={weights!r}")
    done = weight_format(model)
    if done is not None:
        raise ValueError(f"the model already holds {done} weights; quantize the float32 model instead")
    kind = model.config.attention
    if not attention_class(kind).weight_only_layers:
        able = [k for k in list_attention_kinds() if attention_class(k).weight_only_layers]
        raise ValueError(f"weight-only quantization supports attention {able} (kinds that declare "
                         f"weight_only_layers), got attention={kind!r}")  # fmt: skip
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    if dtypes != ["torch.float32"]:
        raise ValueError(f"quantize_weights takes a float32 model, got parameters of dtype {', '.join(dtypes)}")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    big = [m.weight for m in linears.values()] + [model.token_embedding.weight]
    memo: dict[int, object] = {id(w): None for w in big}  # deepcopy skips the float weights
    new = copy.deepcopy(model, memo)
    tied = model.lm_head.weight is model.token_embedding.weight
    with torch.no_grad():
        for name, linear in linears.items():
            parent, _, attr = name.rpartition(".")
            setattr(new.get_submodule(parent) if parent else new, attr, WeightOnlyLinear(linear, weights))
        table = new.lm_head if tied else WeightOnlyLinear(model.token_embedding, weights)
        new.token_embedding = WeightOnlyEmbedding(table)
    new.__class__ = QuantizedGPT  # the same modules; only train() and num_parameters() differ
    return new.eval()
