"""The one-token steps ``generate(compile_steps=True)`` compiles, and the CUDA-graph ones.

    compiled_steps(model, caches, device) -> step(feed [B, 1], caches) -> logits [B, V]

On CPU (or for a model that does not qualify) the steps grow the
``KVCache``s through torch.compile(fullgraph=True) in inductor's default
mode. On CUDA, for a model whose blocks all decode over ``GraphKVCache``s
(``uses_cuda_graphs``), ``GraphSteps``: the fixed-shape step compiled with
mode="reduce-overhead" and static shapes, recorded once as a CUDA graph and
replayed (``models.generation``'s module docstring draws it).

The step buffers are kept per model (``_STEP_BUFFERS``, the last shapes
only, freed with the model), each ``context_length`` positions long, so that
every call with the same batch size replays the same graph over the same
addresses, whatever its prompt length and number of new tokens. Each model
and batch size is one compile of ``_graph_step``; dynamo's
``recompile_limit`` (8 by default) caps how many one process makes, and past
it torch.compile raises (under fullgraph=True): raise
``torch._dynamo.config.recompile_limit`` to decode with more models or
batch sizes.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch

from ..modules.graph_cache import GraphKVCache, supports_graph_steps
from ..modules.kv_cache import KVCache

__all__ = ["compiled_steps", "uses_cuda_graphs", "GraphSteps"]


def uses_cuda_graphs(model, caches, device: torch.device) -> bool:
    """Whether ``compile_steps`` records the steps as a CUDA graph: on CUDA, for a
    model whose every block decodes over a ``GraphKVCache`` (``modules.graph_cache``)."""
    blocks = getattr(model, "blocks", None)
    return (device.type == "cuda" and blocks is not None and all(type(c) is KVCache for c in caches)
            and all(supports_graph_steps(b.attn) for b in blocks))  # fmt: skip


def compiled_steps(model, caches, device: torch.device):
    """``step(feed [B, 1], caches) -> logits [B, V]`` for the one-token steps after the prefill.

    On CUDA, when the model qualifies: ``GraphSteps`` (torch.compile
    mode="reduce-overhead", a CUDA graph replayed every step). Otherwise the
    steps over the growing ``KVCache`` through torch.compile(fullgraph=True)
    in its default mode (the cache length symbolic: two compiles, ``modules.kv_cache``).
    """
    if uses_cuda_graphs(model, caches, device):
        return GraphSteps(model, {"mode": "reduce-overhead", "dynamic": False})
    step = torch.compile(lambda feed, kv: model(feed, kv_caches=kv, logits_to_keep=1), fullgraph=True)
    return lambda feed, kv: step(feed, kv)[:, -1]  # (B, 1, V) -> (B, V)


def _graph_step(model, feed: torch.Tensor, caches: list[GraphKVCache], position: torch.Tensor) -> torch.Tensor:
    """One token over the GraphKVCaches; moves ``position`` on by one. logits [B, V]."""
    logits = model(feed, kv_caches=caches, logits_to_keep=1)[:, -1]  # (B, 1, V) -> (B, V)
    position.add_(1)
    return logits


class GraphSteps:
    """The one-token steps of ``generate`` calls over ``GraphKVCache``s.

    The first step of a call copies the prefilled caches' keys and values
    into the model's step buffers (``_STEP_BUFFERS``: kept per model,
    ``context_length`` positions long, reused by every call of the same
    batch size, so their addresses never change) at a device-side position =
    the prompt's length. The buffers
    and the position are static addresses
    (``torch._dynamo.mark_static_address``: the in-place writes of a step
    stay inside the recorded graph and nothing is copied in), and
    ``_graph_step`` is compiled with ``options`` (torch.compile's keywords;
    fullgraph=True): every step has the same shapes and no Python int that
    changes, so one compile serves every step and every later call, and
    "reduce-overhead" records it once as a CUDA graph (cudagraph trees: a
    warm-up run, a recording, then replays, in this and later calls). The
    logits are cloned: the graph's output buffer is overwritten by the next
    replay. The caller's ``KVCache``s are left as the prefill wrote them.
    """

    def __init__(self, model, options: dict) -> None:
        self.model, self.options = model, options
        self.state = None

    def __call__(self, feed: torch.Tensor, caches: list) -> torch.Tensor:
        if self.state is None:
            self.state = _step_buffers(self.model, caches, self.options)
            n = caches[0].length
            for g, c in zip(self.state.caches, caches):
                g.k[:, :, :n].copy_(c.k[:, :, :n])
                g.v[:, :, :n].copy_(c.v[:, :, :n])
            self.state.position.fill_(n)
        state = self.state
        feed = feed.clone(memory_format=torch.contiguous_format)  # strides (1, 1) every step: a view of tokens recompiles
        torch.compiler.cudagraph_mark_step_begin()
        return state.step(self.model, feed, state.caches, state.position).clone()


class _StepBuffers(NamedTuple):
    key: tuple  # the caches' shapes, dtypes and device, and the compile options
    caches: list  # GraphKVCache per block
    position: torch.Tensor  # [1] long
    step: Any  # the compiled _graph_step


_STEP_BUFFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its last _StepBuffers


def _step_buffers(model, caches: list, options: dict) -> _StepBuffers:
    """The model's step buffers for caches of ``caches``' batch, heads and widths,
    each ``context_length`` positions long whatever the call's prompt and number of
    new tokens (new ones, marked static, when these differ from the last call's)."""
    S_max = model.config.context_length  # one shape for every call of this batch size: no recompile
    key = (tuple((_shape(c.k, S_max), _shape(c.v, S_max), c.k.dtype) for c in caches), caches[0].k.device,
           tuple(sorted(options.items())))  # fmt: skip
    state = _STEP_BUFFERS.get(model)
    if state is None or state.key != key:
        _STEP_BUFFERS.pop(model, None)  # free the old buffers first
        position = torch.zeros(1, dtype=torch.long, device=caches[0].k.device)
        graph_caches = [GraphKVCache(_empty_like(c, S_max), position) for c in caches]
        for t in (position, *(b for c in graph_caches for b in (c.k, c.v))):
            torch._dynamo.mark_static_address(t, guard=False)
        step = torch.compile(_graph_step, fullgraph=True, **options)
        state = _STEP_BUFFERS[model] = _StepBuffers(key, graph_caches, position, step)
    return state


def _shape(t: torch.Tensor, S_max: int) -> tuple[int, ...]:
    """[B, G, S, D] -> (B, G, S_max, D)."""
    B, G, _, D = t.shape
    return B, G, S_max, D


def _empty_like(cache: KVCache, S_max: int) -> KVCache:
    """A new ``KVCache`` with buffers shaped as ``cache``'s but ``S_max`` positions long."""
    B, G, _, D = cache.k.shape
    return KVCache(B, G, S_max, D, value_dim=cache.v.shape[3], value_heads=cache.v.shape[1], dtype=cache.k.dtype,
                   device=cache.k.device)  # fmt: skip
