"""Weight-only bfloat16 / int8 linear layers and embeddings, for decoding.

Decoding one token reads every weight once for little arithmetic, so its
speed is the weight bytes over the memory bandwidth. These layers keep the
weights in fewer bytes and the activations in the model's dtype (float32):

    fp32:  W^T [K, N] stored as float32, transposed               (4 bytes per weight)
    bf16:  W [N, K] stored as bfloat16                          (2 bytes per weight)
    int8:  W [N, K] ~ Q [N, K] (int8, |Q| <= 127) * s [N]       (1 byte per weight)
           s = absmax of each output row / 127, rounded up to a bfloat16 value

    x [..., K] (float32) --to bfloat16--> matrix product with the stored
    weights (float32 accumulation) --> [..., N] --+ bias (float32)--> float32

"fp32" keeps the values and only the layout changes: ``x @ W^T`` with W^T
contiguous is the product CPU BLAS runs fastest for a few rows (the layout
of Hugging Face's GPT-2 ``Conv1D``); nothing is rounded. The bf16 and int8
products run on bfloat16 inputs (the compute dtype the kernels take): on CPU a one-row product is ``torch.mv`` (bf16) or
``torch._weight_int8pack_mm`` (int8 weights, bf16 activations, per-channel
scales, for K a multiple of ``INT8_KERNEL_K_MULTIPLE``; both read only the
stored bytes), several rows ``F.linear`` in bfloat16 (int8 weights
converted per call for more than ``INT8_KERNEL_ROWS`` rows, where the
conversion is spread over the rows, or for other K).
On CUDA both formats run ``F.linear`` in bfloat16 (int8 converted per call:
it saves memory, not time). The scales are bfloat16 values so the int8
kernel reads them exactly.

Rounding, per weight: bf16 |W - bf16(W)| <= 2^-8 |W|; int8 |W - Q s| <= s / 2.
The activations are rounded to bfloat16 (relative 2^-8) and so are the
products' outputs before the bias is added.

These layers are for inference: ``train()`` refuses, and they hold no
parameters (the stored weights are buffers), so nothing trains them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "WEIGHT_FORMATS",
    "INT8_KERNEL_ROWS",
    "INT8_KERNEL_K_MULTIPLE",
    "WeightOnlyLinear",
    "WeightOnlyEmbedding",
    "int8_per_channel",
    "dequantize",
    "layer_dtype_device",
    "refuse_training",
    "model_weights",
]

WEIGHT_FORMATS = ("fp32", "bf16", "int8")
INT8_KERNEL_ROWS = 16  # up to this many rows the int8 kernel; more: convert the weights once per call
INT8_KERNEL_K_MULTIPLE = 16  # the CPU int8 kernel reads K in blocks of 16 (other widths give wrong results)


@torch.library.custom_op("multihead::weight_only_mv", mutates_args=())
def _opaque_mv(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``torch.mv`` kept whole under ``torch.compile`` (inductor would rewrite it as its own, slower reduction)."""
    return torch.mv(w, x)


@_opaque_mv.register_fake
def _(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return w.new_empty(w.shape[0])


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 rows with one scale per output row.

    Args:
        weight: [N, K] floating.

    Returns:
        (q [N, K] int8 in [-127, 127], scale [N] bfloat16), with
        |weight - q * scale| <= scale / 2 elementwise; a row of zeros gets scale 1.
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0  # (N,)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    s16 = scale.to(torch.bfloat16)
    low = s16.float() < scale  # rounded down: step to the next bfloat16 above, so |w / s| <= 127
    s16 = torch.where(low, (s16.view(torch.int16) + 1).view(torch.bfloat16), s16)
    q = torch.round(w / s16.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, s16


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The matrix a stored weight stands for, [N, K] in ``dtype``: ``stored`` [N, K] (bf16, or int8
    with ``scale`` [N]), or [K, N] float32 (the transposed "fp32" layout)."""
    if stored.is_floating_point() and stored.dtype != torch.bfloat16:
        return stored.t().to(dtype)
    w = stored.to(dtype)
    return w if scale is None else w * scale.to(dtype)[:, None]


def layer_dtype_device(linear: nn.Module) -> tuple[torch.dtype, torch.device]:
    """(dtype of the inputs and outputs, device) of ``nn.Linear`` or :class:`WeightOnlyLinear`,
    without reading a weight that would have to be dequantized."""
    if isinstance(linear, WeightOnlyLinear):
        return linear.compute_dtype, linear.stored.device
    return linear.weight.dtype, linear.weight.device


def refuse_training(module: nn.Module) -> None:
    """Raise ValueError (one line) when ``module`` holds weight-only layers: call before any
    mode changes, so a refused ``train()`` leaves every layer as it was."""
    for m in module.modules():
        if isinstance(m, _InferenceOnly):
            raise ValueError(
                f"this model holds weight-only {m.format} layers, which are for inference: "
                "train the float32 model and quantize it afterwards"
            )


def model_weights(module: nn.Module) -> list[torch.Tensor]:
    """Each parameter of ``module`` once (tied ones too), with the stored weights and
    biases of its weight-only layers (buffers, as they do not train)."""
    tensors = {id(p): p for p in module.parameters()}
    for m in module.modules():
        if isinstance(m, _InferenceOnly):
            tensors.update((id(t), t) for t in (m.stored, getattr(m, "bias", None)) if t is not None)
    return list(tensors.values())


class _InferenceOnly(nn.Module):
    """Refuses training mode (``train()``) with one line."""

    format: str

    def train(self, mode: bool = True):
        if mode:
            refuse_training(self)
        return super().train(False)


class WeightOnlyLinear(_InferenceOnly):
    """``nn.Linear`` with its weight stored in bfloat16 or int8 (per-output-channel scales).

    Args:
        linear: the float layer (weight [N, K], optional bias [N]; or an
            ``nn.Embedding``, whose table is read as [V, K]); not changed.
        weight_format: "fp32" (transposed, same values), "bf16" or "int8".

    Buffers: ``stored`` [N, K] (bfloat16 or int8), ``scale`` [N] (bfloat16, int8
    only), ``bias`` [N] (the layer's dtype) or None.

    Forward: x [..., K] in the layer's dtype -> [..., N] in that dtype.
    """

    def __init__(self, linear: nn.Linear, weight_format: str) -> None:
        super().__init__()
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
        self.format = weight_format
        self.compute_dtype = linear.weight.dtype
        self.out_features, self.in_features = linear.weight.shape
        if weight_format == "fp32":
            stored, scale = linear.weight.detach().t().clone(memory_format=torch.contiguous_format), None  # (K, N)
        elif weight_format == "bf16":
            stored, scale = linear.weight.detach().to(torch.bfloat16), None
        else:
            stored, scale = int8_per_channel(linear.weight)
        self.register_buffer("stored", stored.contiguous())
        self.register_buffer("scale", scale)
        bias = getattr(linear, "bias", None)  # an nn.Embedding table has none
        bias = None if bias is None else bias.detach().clone()
        self.register_buffer("bias", bias)
        self.training = False

    @property
    def weight(self) -> torch.Tensor:
        """The matrix this layer multiplies by, [N, K] in the compute dtype (dequantized on each read)."""
        return dequantize(self.stored, self.scale, self.compute_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights={self.format}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] (see the module docstring for the kernels)."""
        lead = x.shape[:-1]
        if self.format == "fp32":  # (M, K) @ (K, N) + bias
            x2 = x.reshape(-1, self.in_features)
            y = x2 @ self.stored if self.bias is None else torch.addmm(self.bias, x2, self.stored)
            return y.view(*lead, self.out_features)
        xb = x.to(torch.bfloat16).reshape(-1, self.in_features)  # (..., K) -> (M, K)
        rows, cpu = xb.shape[0], x.device.type == "cpu"
        if self.format == "bf16":
            if cpu and rows == 1:  # (N,)
                mv = _opaque_mv if torch.compiler.is_compiling() else torch.mv
                y = mv(self.stored, xb.view(-1))
            else:
                y = F.linear(xb, self.stored)  # (M, N)
        elif cpu and rows <= INT8_KERNEL_ROWS and self.in_features % INT8_KERNEL_K_MULTIPLE == 0:
            y = torch._weight_int8pack_mm(xb, self.stored, self.scale)  # (M, K) x (N, K)^T * s -> (M, N)
        else:
            y = F.linear(xb, self.stored.to(torch.bfloat16)).to(self.compute_dtype) * self.scale.to(self.compute_dtype)
        y = y.to(self.compute_dtype) if self.bias is None else torch.add(self.bias, y)  # bf16 + f32 -> f32
        return y.view(*lead, self.out_features)  # (M, N) or (N,) -> (..., N)


class WeightOnlyEmbedding(_InferenceOnly):
    """Token embedding whose table is a :class:`WeightOnlyLinear`'s stored rows (tied LM
    head) or its own; a lookup dequantizes only the rows it reads.

    Forward: ids [...] -> [..., K] in the compute dtype.
    """

    def __init__(self, table: WeightOnlyLinear) -> None:
        super().__init__()
        self.format, self.compute_dtype = table.format, table.compute_dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.register_buffer("stored", table.stored)
        self.register_buffer("scale", table.scale)
        self.training = False

    @property
    def weight(self) -> torch.Tensor:
        """The table, [V, K] in the compute dtype (dequantized on each read)."""
        return dequantize(self.stored, self.scale, self.compute_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, weights={self.format}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)  # index_select takes int8 tables on every device (CUDA's embedding kernel does not)
        if self.format == "fp32":  # the table is stored transposed, (K, V)
            return self.stored.index_select(1, flat).t().reshape(*ids.shape, self.embedding_dim)
        rows = self.stored.index_select(0, flat).to(self.compute_dtype)  # (n, K)
        if self.scale is not None:
            rows = rows * self.scale.index_select(0, flat).to(self.compute_dtype)[:, None]  # (n, K) * (n, 1)
        return rows.view(*ids.shape, self.embedding_dim)
