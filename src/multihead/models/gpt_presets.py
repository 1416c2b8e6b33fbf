"""The named GPT sizes of ``GPTConfig.from_preset``."""

from __future__ import annotations

from typing import Any

__all__ = ["GPT_PRESETS"]

# Sizes of the released GPT-2 checkpoints (all use head_dim 64), and three small
# byte-level models (vocab 256) that train and sample on a CPU.
GPT_PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-small": dict(vocab_size=50257, context_length=1024, embed_dim=768, num_layers=12, num_heads=12),
    "gpt2-medium": dict(vocab_size=50257, context_length=1024, embed_dim=1024, num_layers=24, num_heads=16),
    "gpt2-large": dict(vocab_size=50257, context_length=1024, embed_dim=1280, num_layers=36, num_heads=20),
    "gpt2-xl": dict(vocab_size=50257, context_length=1024, embed_dim=1600, num_layers=48, num_heads=25),
    "tiny": dict(vocab_size=256, context_length=128, embed_dim=64, num_layers=2, num_heads=4),
    # `multihead train`'s default model, there at context 128 (0.8M parameters, head_dim 32): on a
    # 2-core AMD EPYC VM (2026-11-24) a step of 32 x 128 tokens takes 0.24-0.33 s with 2 threads,
    # so TrainConfig's 1600 steps take 7-9 minutes (docs/training.md).
    "mini": dict(vocab_size=256, context_length=256, embed_dim=128, num_layers=4, num_heads=4),
    # A 6-layer byte model (4.8M parameters, head_dim 64): a step of 16 x 128 tokens takes 0.51 s
    # on the same machine; in the same 9 minutes it learns less than "mini" (docs/training.md).
    "shakespeare-cpu": dict(vocab_size=256, context_length=128, embed_dim=256, num_layers=6, num_heads=4),
}
