"""Where a GPT's prefill and decoding sit on the roofline: FLOPs, bytes moved, intensity, bound.

    costs = phase_costs(config, batch=1, context=1024, bytes_per_element=4)
    costs["prefill"].intensity          # FLOPs per byte
    bound(costs["decode"], limits)      # "memory" or "compute" on this machine

Two phases of a GPT (``models.gpt``), each counted from the model's own layers
(the attention kind's ``cost()``; the MLP, embeddings and LM head from their
shapes):

    prefill   one forward over T = context tokens of each of B sequences
              (causal; logits at every position, as ``GPT.forward`` returns)
    decode    one new token per sequence over a cache of S = context tokens
              (its query sees the S cached keys and its own)

FLOPs follow ``modules.cost``: 2 per multiply-add of the matrix products,
split into projections (the attention layers' input and output
projections), attention core, MLP and LM head.

Bytes moved are a lower bound at ``bytes_per_element``: every weight read
once per phase (the token embedding only at the looked-up rows, unless the
LM head reads it whole), the KV cache read (decode: S cached tokens) and
written (T new tokens), and activations: each matrix product reads its
input and writes its output once, as fused kernels do (attention's score
matrix is never written).

Arithmetic intensity = FLOPs / bytes. Against a machine's GEMM peak P
(FLOP/s) and stream bandwidth W (byte/s) a phase is compute-bound when its
intensity exceeds P / W (the ridge point), and cannot run faster than
max(FLOPs / P, bytes / W).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.gpt import GPT, GPTConfig

__all__ = ["PhaseCost", "phase_costs", "bound", "floor_seconds"]


@dataclass(frozen=True)
class PhaseCost:
    """FLOPs and bytes of one phase.

    Attributes:
        phase: "prefill" or "decode".
        tokens: tokens processed (B·T for prefill, B for one decode step).
        flops: {"projections", "attention core", "mlp", "lm head"} -> FLOPs.
        bytes: {"weights", "kv cache read", "kv cache written", "activations"} -> bytes.
        kv_cache_bytes_per_token: all layers, one sequence.
    """

    phase: str
    tokens: int
    flops: dict[str, int]
    bytes: dict[str, int]
    kv_cache_bytes_per_token: int

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


def _phase(model: GPT, phase: str, B: int, T: int, S: int, nbytes: int) -> PhaseCost:
    """B sequences, T new tokens each, attending over S keys (S = T for prefill)."""
    config = model.config
    C, V, L = config.embed_dim, config.vocab_size, config.num_layers
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    M = mlp.fc.out_features
    # the kind's own count: projections of the T new tokens only (cached keys are not projected
    # again); the core over S keys, causal top-left in prefill, every key for a decode query
    cost = attn.cost(T, S, batch=B, causal=phase == "prefill", bytes_per_element=nbytes)
    projections = attn.cost(T, T, batch=B, bytes_per_element=nbytes).projection_flops
    N = B * T  # token rows
    flops = {
        "projections": L * projections,
        "attention core": L * cost.core_flops,
        "mlp": L * 2 * N * (C * M + M * C),
        "lm head": 2 * N * C * V,
    }
    tied = config.tie_embeddings
    block_params = sum(p.numel() for p in model.blocks.parameters())
    other = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(("blocks.", "token_embedding.", "lm_head.")))
    weights = block_params + other + V * C + (0 if tied else N * C)  # LM head whole; untied: looked-up rows too
    H, G, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = (H + 2 * G) * D
    # qkv; the core reads q and the new keys/values (cached ones: "kv cache read") and writes
    # its output; out_proj
    per_block = N * (C + qkv) + N * (H * D + 2 * G * D + H * D) + N * (H * D + C)
    per_block += N * (C + M) + N * (M + C)  # fc, proj
    kv_token = L * cost.kv_cache_bytes_per_token
    return PhaseCost(
        phase=phase,
        tokens=N,
        flops=flops,
        bytes={
            "weights": weights * nbytes,
            "kv cache read": 0 if phase == "prefill" else B * (S - T) * kv_token,
            "kv cache written": N * kv_token,
            "activations": (L * per_block + N * (C + V)) * nbytes,  # + the LM head's input and logits
        },
        kv_cache_bytes_per_token=kv_token,
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
