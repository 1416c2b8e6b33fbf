"""Decoding on CUDA gives the CPU's tokens: window-sized caches of local blocks
(a prefill longer than the window, steps, left padding, past the context),
streaming caches past the context (``generate(streaming=(k, w))``), and
weight-only bf16 / int8 models, each on a tiny float32 GPT against the same
eager ``generate`` on the CPU. Greedy tokens must be equal, or differ only
where the two best logits tie within float32 rounding (``assert_greedy_agrees``);
logits within float32's tolerance (docs/testing.md)."""

from __future__ import annotations

import copy

import pytest
import torch
from support.paths import assert_cached_generation_agrees, assert_greedy_agrees

from multihead import KVCache, WindowKVCache
from multihead.models import GPT, GPTConfig, quantize_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
V = 61


def _model(**overrides) -> GPT:
    torch.manual_seed(0)
    config = dict(vocab_size=V, context_length=24, embed_dim=32, num_layers=3, num_heads=4, positions="rope",
                  attention="gqa", num_kv_heads=2, layer_attention_options=[{"window": 4}, {"window": 4}, {}])  # fmt: skip
    return GPT(GPTConfig(**{**config, **overrides})).eval()


def _ids(B, T, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _generate(model, prompt, n, device, **kw):
    """Greedy tokens and logits of ``model`` moved to ``device``, returned on the CPU."""
    on = copy.deepcopy(model).to(device)
    moved = {name: (x.to(device) if isinstance(x, torch.Tensor) else x) for name, x in kw.items()}
    with torch.no_grad():
        tokens, logits = on.generate(prompt.to(device), n, temperature=0, return_logits=True, **moved)
    assert tokens.device.type == torch.device(device).type
    return tokens.cpu(), logits.cpu()


def check_window_caches(device: str) -> None:
    model = _model()
    caches = copy.deepcopy(model).to(device).make_kv_caches(2, 20)
    assert [type(c) for c in caches] == [WindowKVCache, WindowKVCache, KVCache]
    assert all(c.k.device.type == torch.device(device).type for c in caches)
    prompt = _ids(2, 7)  # longer than the window of 4
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :5] = 0  # row 0: five pads, more than the window
    for kw in ({}, {"attention_mask": mask}):
        want, want_logits = _generate(model, prompt, 30, "cpu", **kw)  # 30 steps: past the context of 24
        got, got_logits = _generate(model, prompt, 30, device, **kw)
        assert_greedy_agrees(got, want, got_logits, want_logits, start=7)
    on = copy.deepcopy(model).to(device)
    assert_cached_generation_agrees(on, prompt.to(device), 12)  # window caches vs no cache on the device


def test_cuda_window_caches_decode_the_cpu_tokens():
    check_window_caches("cuda")


def check_streaming(device: str) -> None:
    model = _model(context_length=16, layer_attention_options=[{"window": 3}, {}])
    prompt = _ids(2, 9, seed=2)  # longer than sinks + window: fed on token by token
    want, want_logits = _generate(model, prompt, 40, "cpu", streaming=(2, 6))
    got, got_logits = _generate(model, prompt, 40, device, streaming=(2, 6))
    assert got.shape == (2, 49)
    assert_greedy_agrees(got, want, got_logits, want_logits, start=9)


def test_cuda_streaming_generation_past_the_context_decodes_the_cpu_tokens():
    check_streaming("cuda")


def check_quantized(fmt: str, device: str) -> None:
    """The quantized model decodes the same tokens on the device as on the CPU
    (bf16 and int8 run other kernels there, so logits agree to their rounding:
    the two best logits of every step are further apart than twice the full
    forward's difference, and each step's logits differ by less than half that gap)."""
    torch.manual_seed(1)
    model = GPT(GPTConfig.from_preset("tiny", context_length=48)).eval()
    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(2))
    cpu = quantize_weights(model, fmt)
    gpu = quantize_weights(copy.deepcopy(model).to(device), fmt)
    assert gpu.lm_head.stored.device.type == torch.device(device).type
    with torch.no_grad():
        want, steps = cpu.generate(prompt, 16, temperature=0, return_logits=True)
        got, got_steps = gpu.generate(prompt.to(device), 16, temperature=0, return_logits=True)
        err = float((gpu(want.to(device)).cpu() - cpu(want)).abs().max())
    top = steps.topk(2, dim=-1).values  # (B, n, 2)
    gap = float((top[..., 0] - top[..., 1]).min())  # the closest call of any step
    assert gap > 2 * err, (fmt, gap, err)
    assert torch.equal(got.cpu(), want)
    # each step's logits (one-row products on the CPU, F.linear on CUDA) closer than half that gap
    assert float((got_steps.cpu() - steps).abs().max()) < gap / 2


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
def test_cuda_quantized_greedy_tokens_equal_the_cpu_ones(fmt):
    check_quantized(fmt, "cuda")
