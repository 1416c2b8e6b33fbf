"""Where a GPT's prefill and decoding sit on the roofline: FLOPs, bytes moved, intensity, bound.

    costs = phase_costs(config, batch=1, context=1024, bytes_per_element=4)
    costs["prefill"].intensity          # FLOPs per byte
    bound(costs["decode"], limits)      # "memory" or "compute" on this machine

Two phases of a GPT (``models.gpt``), each counted from the model's own layers,
every block with its own attention layer (its kind's ``cost()`` with its
heads, key/value heads and options: local and global layers, per-layer
heads after pruning; the MLP, embeddings and LM head from their shapes):

    prefill   one forward over T = context tokens of each of B sequences
              (causal; logits at every position, as ``GPT.forward`` returns)
    decode    one new token per sequence over a cache of S = context tokens
              (its query sees the S cached keys and its own)

FLOPs follow ``modules.cost``: 2 per multiply-add of the matrix products,
split into projections (the attention layers' input and output
projections), attention core, MLP and LM head.

Bytes moved are a lower bound at ``bytes_per_element``: every weight read
once per phase (the token embedding only at the looked-up rows, unless the
LM head reads it whole; a learned position table, ``positions="learned"``,
at the new tokens' position rows), the KV cache read (decode: the S cached
tokens, a windowed layer only its last window - 1) and written (T new
tokens in every block), and activations: each matrix product reads its input
and writes its output once, as fused kernels do (attention's score matrix is
never written). A local block's cache (``modules.window_cache``) also copies
its kept window once per call; the bound leaves that copy out.

The KV cache's size (``kv_cache_bytes``) is that of the caches
``GPT.make_kv_caches(B, n)`` builds once the phase has written n positions
(n = T after the prefill, S = context + 1 after the decode step): a global
block allocates n positions, a local block holds min(n, window)
(``window_cache.cached_positions``), so bytes per token depend on the context.

Arithmetic intensity = FLOPs / bytes. Against a machine's GEMM peak P
(FLOP/s) and stream bandwidth W (byte/s) a phase is compute-bound when its
intensity exceeds P / W (the ridge point), and cannot run faster than
max(FLOPs / P, bytes / W).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.gpt import GPT, GPTConfig
from ..modules.window_cache import cached_positions

__all__ = ["BlockCost", "PhaseCost", "phase_costs", "bound", "floor_seconds"]


@dataclass(frozen=True)
class BlockCost:
    """One block's attention in one phase (its own layer's ``cost()``).

    Attributes:
        layer: the block's index.
        heads, kv_heads: its query and key/value heads.
        window: its ``window`` option (None: global).
        projection_flops, core_flops: of its attention layer.
        kv_cache_bytes_per_token: what its cache holds per token of one sequence.
        kv_cache_read: bytes of cached keys/values the phase reads (a
            window reads at most its last window - 1 positions).
        kv_cache_positions: positions of one sequence its cache holds at the
            phase's end (a local block: at most its window).
    """

    layer: int
    heads: int
    kv_heads: int
    window: int | None
    projection_flops: int
    core_flops: int
    kv_cache_bytes_per_token: int
    kv_cache_read: int
    kv_cache_positions: int


@dataclass(frozen=True)
class PhaseCost:
    """FLOPs and bytes of one phase.

    Attributes:
        phase: "prefill" or "decode".
        tokens: tokens processed (B·T for prefill, B for one decode step).
        flops: {"projections", "attention core", "mlp", "lm head"} -> FLOPs.
        bytes: {"weights", "kv cache read", "kv cache written", "activations"} -> bytes.
        kv_cache_bytes_per_token: all layers, one sequence.
        kv_cache_bytes: the caches of all B sequences and layers at the
            phase's end (module docstring).
        blocks: each block's attention (``BlockCost``), in order.
    """

    phase: str
    tokens: int
    flops: dict[str, int]
    bytes: dict[str, int]
    kv_cache_bytes_per_token: int
    kv_cache_bytes: int = 0
    blocks: tuple[BlockCost, ...] = ()

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.total_flops / self.total_bytes


def _block(block, layer: int, phase: str, B: int, T: int, S: int, nbytes: int) -> tuple[BlockCost, int]:
    """(the block's attention cost, its activation elements) for T new tokens over S keys."""
    attn = block.attn
    # the kind's own count: projections of the T new tokens only (cached keys are not projected
    # again); the core over S keys, causal top-left in prefill, every key (or the window's) for a
    # decode query
    cost = attn.cost(T, S, batch=B, causal=phase == "prefill", bytes_per_element=nbytes)
    projections = attn.cost(T, T, batch=B, bytes_per_element=nbytes).projection_flops
    window = attn.sliding_window
    cached = S - T if window is None else min(S - T, window - 1)  # cached positions the new queries see
    per_token = cost.kv_cache_bytes_per_token
    H, G, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    C, M, N = attn.embed_dim, block.mlp.fc.out_features, B * T
    qkv = (H + 2 * G) * D
    # qkv; the core reads q and the new keys/values (cached ones: "kv cache read") and writes
    # its output; out_proj; fc, proj
    elements = N * (C + qkv) + N * (H * D + 2 * G * D + H * D) + N * (H * D + C) + N * (C + M) + N * (M + C)
    held = cached_positions(attn, S)  # the phase's S positions, or a local cache's window of them
    described = BlockCost(layer, H, G, window, projections, cost.core_flops, per_token, B * cached * per_token, held)
    return described, elements


def _phase(model: GPT, phase: str, B: int, T: int, S: int, nbytes: int) -> PhaseCost:
    """B sequences, T new tokens each, attending over S keys (S = T for prefill); every block
    counted with its own attention layer (per-layer heads, windows and options)."""
    config = model.config
    C, V = config.embed_dim, config.vocab_size
    N = B * T  # token rows
    blocks, activations = [], 0
    for layer, block in enumerate(model.blocks):
        described, elements = _block(block, layer, phase, B, T, S, nbytes)
        blocks.append(described)
        activations += elements
    mlp = sum(2 * N * (b.mlp.fc.in_features * b.mlp.fc.out_features * 2) for b in model.blocks)
    flops = {
        "projections": sum(b.projection_flops for b in blocks),
        "attention core": sum(b.core_flops for b in blocks),
        "mlp": mlp,
        "lm head": 2 * N * C * V,
    }
    tied = config.tie_embeddings
    block_params = sum(p.numel() for p in model.blocks.parameters())
    tables = ("blocks.", "token_embedding.", "position_embedding.", "lm_head.")
    other = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(tables))  # ln_f
    # looked-up rows: the position table's T rows (learned positions only: no table otherwise), the
    # token embedding's N rows when the LM head does not read it whole
    table = 0 if model.position_embedding is None else T * C
    weights = block_params + other + table + V * C + (0 if tied else N * C)
    kv_token = sum(b.kv_cache_bytes_per_token for b in blocks)
    return PhaseCost(
        phase=phase,
        tokens=N,
        flops=flops,
        bytes={
            "weights": weights * nbytes,
            "kv cache read": sum(b.kv_cache_read for b in blocks),
            "kv cache written": N * kv_token,
            "activations": (activations + N * (C + V)) * nbytes,  # + the LM head's input and logits
        },
        kv_cache_bytes_per_token=kv_token,
        kv_cache_bytes=B * sum(b.kv_cache_positions * b.kv_cache_bytes_per_token for b in blocks),
        blocks=tuple(blocks),
    )


def phase_costs(config: GPTConfig, *, batch: int = 1, context: int = 1024, bytes_per_element: int = 2) -> dict[str, PhaseCost]:
    """{"prefill": ..., "decode": ...} for a GPT of ``config`` (built on the meta device).

    Raises:
        ValueError: batch or context below 1, or a context beyond the model's.
    """
    for name, value in (("batch", batch), ("context", context), ("bytes_per_element", bytes_per_element)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if context > config.context_length:
        raise ValueError(f"context={context} exceeds the model's context_length={config.context_length}")
    model = GPT(config, device="meta")
    return {
        "prefill": _phase(model, "prefill", batch, context, context, bytes_per_element),
        "decode": _phase(model, "decode", batch, 1, context + 1, bytes_per_element),
    }


def floor_seconds(cost: PhaseCost, peak_flops: float, bandwidth: float) -> float:
    """The roofline's lower bound on the time: max(FLOPs / peak, bytes / bandwidth)."""
    return max(cost.total_flops / peak_flops, cost.total_bytes / bandwidth)


def bound(cost: PhaseCost, peak_flops: float, bandwidth: float) -> str:
    """"compute" when the intensity exceeds the ridge point peak / bandwidth, else "memory"."""
    return "compute" if cost.intensity > peak_flops / bandwidth else "memory"
