"""The per-rank memory and communication table of docs/parallel.md.

    python -m benchmarks.tp_costs

Computed by ``multihead.parallel.costs.rank_cost`` from the layers the
sharded model holds (bfloat16: 2 bytes per element); nothing is timed.
"""

from __future__ import annotations

from multihead.models.gpt import GPTConfig
from multihead.parallel.costs import rank_cost

LAYOUTS = {
    "gpt2-small": GPTConfig.from_preset("gpt2-small"),
    "gpt2-medium": GPTConfig.from_preset("gpt2-medium"),
    "gpt2-large": GPTConfig.from_preset("gpt2-large"),
    "gpt2-xl": GPTConfig.from_preset("gpt2-xl"),
    # key/value heads replicated once the degree exceeds G
    "gpt2-small gqa G=2": GPTConfig.from_preset("gpt2-small", attention="gqa", attention_options={"num_kv_heads": 2}),
    "gpt2-small mqa": GPTConfig.from_preset("gpt2-small", attention="mqa"),
    # LLaMA-2-7B's attention (C 4096, 32 heads, 32 layers) with 8 key/value
    # heads, on GPT-2's two-matrix MLP of width 11008
    "llama-like gqa": GPTConfig(vocab_size=32000, context_length=4096, embed_dim=4096, num_layers=32,
                                num_heads=32, attention="gqa", attention_options={"num_kv_heads": 8},
                                mlp_dim=11008),  # fmt: skip
}


def main() -> None:
    print("| model | TP | parameters per rank | KV cache per token, per rank | all-reduce bytes per token, per layer (forward) |")
    print("|---|---|---|---|---|")
    for name, config in LAYOUTS.items():
        for degree in (1, 2, 4, 8):
            try:
                cost = rank_cost(config, degree)
            except ValueError as e:
                print(f"| {name} | {degree} | - | - | refused: {e} |")
                continue
            print(f"| {name} | {degree} | {cost.parameters / 1e6:.1f} M | {cost.kv_cache_bytes_per_token / 1024:.1f} KiB | "
                  f"{cost.all_reduce_bytes_per_token:,} |")  # fmt: skip


if __name__ == "__main__":
    main()
