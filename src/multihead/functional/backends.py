"""Backend registry: functions with one signature, chosen by name.

A backend is ``forward(request) -> (out, weights | None)`` plus
``not_supported(request) -> list[str]``. ``"auto"`` picks the first backend
in ``AUTO_ORDER`` that supports the request; asking for a named backend that
cannot serve the request raises ``ValueError`` listing every reason. Nothing
falls back silently.

``AUTO_ORDER`` is sdpa, flex, math: the fused ``sdpa`` kernel first; ``flex``
where it is the only fused path (soft-capping), on the devices named in its
``auto_devices`` (CUDA: on a CPU it compiles for seconds per shape family
and serves inference only, so ``auto`` uses ``math`` there; name
``backend="flex"`` to use it); ``math`` serves everything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .flex_backend import flex_attention_backend, flex_not_supported
from .math_backend import math_attention
from .request import AttentionRequest
from .sdpa_backend import sdpa_attention, sdpa_not_supported

__all__ = ["Backend", "BACKENDS", "AUTO_ORDER", "register_backend", "list_backends", "select_backend"]

Forward = Callable[[AttentionRequest], "tuple[torch.Tensor, torch.Tensor | None]"]


@dataclass(frozen=True)
class Backend:
    """A named attention implementation."""

    name: str
    forward: Forward
    not_supported: Callable[[AttentionRequest], list[str]]
    description: str
    auto_devices: tuple[str, ...] | None = None  # device types "auto" picks it on (None: all)


def _always(_: AttentionRequest) -> list[str]:
    return []


BACKENDS: dict[str, Backend] = {}
AUTO_ORDER: list[str] = ["sdpa", "flex", "math"]


def register_backend(backend: Backend) -> None:
    """Add (or replace) a backend in the registry."""
    BACKENDS[backend.name] = backend


register_backend(
    Backend("math", math_attention, _always, "explicit scores and softmax; exact weights")
)
register_backend(
    Backend("sdpa", sdpa_attention, sdpa_not_supported, "torch scaled_dot_product_attention kernels")
)
register_backend(
    Backend("flex", flex_attention_backend, flex_not_supported, "torch flex_attention, compiled; score and block masks",
            auto_devices=("cuda",))  # fmt: skip
)


def list_backends() -> list[str]:
    """Names accepted by ``backend=`` (besides ``"auto"``)."""
    return sorted(BACKENDS)


def select_backend(name: str, req: AttentionRequest) -> Backend:
    """Return the backend that will serve ``req``.

    Raises:
        ValueError: unknown name, or a named backend that cannot serve
            ``req`` (the message lists why).
    """
    if name == "auto":
        for candidate in AUTO_ORDER:
            backend = BACKENDS[candidate]
            if backend.auto_devices is not None and req.q.device.type not in backend.auto_devices:
                continue
            if not backend.not_supported(req):
                return backend
        raise ValueError("no backend supports this request")  # math supports all
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; valid: {['auto', *list_backends()]}")
    backend = BACKENDS[name]
    reasons = backend.not_supported(req)
    if reasons:
        raise ValueError(f"backend {name!r} cannot serve this call: " + "; ".join(reasons))
    return backend
