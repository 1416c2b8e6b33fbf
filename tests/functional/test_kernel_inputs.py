"""Which q, k and v the CUDA kernels take as they are (``lse_backend.kernel_ready``): the rule is
about addresses and strides only, so it is checked here on CPU tensors of the same layouts. On a
GPU, views into a fused projection whose strides are not multiples of 16 bytes gave wrong
bfloat16 results; aligned ones are passed uncopied (``benchmarks/cuda_views.py``)."""

from __future__ import annotations

import pytest
import torch

from multihead.functional.lse_backend import cuda_kernel_inputs, kernel_ready


def _fused_views(C: int, H: int, dtype: torch.dtype, device: str = "cpu", B: int = 2, T: int = 5) -> list[torch.Tensor]:
    """q, k, v [B, H, T, D] as ``MultiHeadAttention`` cuts them from one (B, T, 3C) projection."""
    qkv = torch.randn(B, T, 3 * C, dtype=dtype, device=device)
    assert qkv.data_ptr() % 16 == 0
    return [qkv[..., i * C : (i + 1) * C].view(B, T, H, C // H).transpose(1, 2) for i in range(3)]


@pytest.mark.parametrize(
    "C, H, dtype, ready",
    [(768, 12, torch.bfloat16, [True] * 3),  # D=64: every stride and start a multiple of 16 bytes
     (40, 5, torch.bfloat16, [True] * 3),  # D=8 elements = 16 bytes
     (36, 3, torch.bfloat16, [False] * 3),  # rows of 108 elements = 216 bytes
     (36, 3, torch.float32, [True] * 3),  # the same widths in 4-byte elements: 432-byte rows
     (20, 5, torch.bfloat16, [False] * 3),  # D=4: 8-byte heads
     (48, 2, torch.float16, [True] * 3)],
)  # fmt: skip
def test_views_of_a_fused_projection_are_ready_when_their_strides_are_16_byte_multiples(C, H, dtype, ready):
    views = _fused_views(C, H, dtype)
    assert [kernel_ready(t) for t in views] == ready
    assert not any(t.is_contiguous() for t in views)


def test_a_start_off_16_bytes_or_a_last_stride_other_than_1_is_not_ready():
    buffer = torch.empty(4 * 64 + 4, dtype=torch.float32)
    assert kernel_ready(buffer[:256].view(4, 64))
    assert not kernel_ready(buffer[2:258].view(4, 64))  # contiguous, but 8 bytes off
    assert kernel_ready(buffer[4:260].view(4, 64))  # 16 bytes off
    assert not kernel_ready(buffer[:256].view(64, 4).t())  # rows read with a stride of 4 elements
    assert kernel_ready(torch.empty(1, 3, 1, 8)[:, :, :, :])


def test_dimensions_of_length_one_do_not_count():
    """A single batch row or head may carry any stride: it is never stepped over."""
    t = torch.empty(1, 1, 6, 8).as_strided((1, 1, 6, 8), (3, 5, 8, 1))  # odd strides on length-1 dims
    assert kernel_ready(t)
    assert not kernel_ready(torch.empty(2, 50).as_strided((2, 6, 8), (50, 8, 1)))  # 200-byte batch stride


def test_cpu_tensors_are_returned_as_they_are():
    views = _fused_views(36, 3, torch.bfloat16)
    assert all(a is b for a, b in zip(cuda_kernel_inputs(*views), views))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copies_exactly_the_views_that_are_not_ready():
    for C, H in ((768, 12), (36, 3)):
        views = _fused_views(C, H, torch.bfloat16, "cuda")
        out = cuda_kernel_inputs(*views)
        for before, after in zip(views, out):
            assert (after is before) == kernel_ready(before)
            assert torch.equal(after, before) and (after is before or after.is_contiguous())
