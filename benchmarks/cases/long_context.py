"""Long context: multihead against its peers at T = 2048, 4096 and 8192, with peak memory.

One causal self-attention layer (embed 768, 12 heads, B=1, float32, CPU),
the peers of ``attention_peers`` that scale to long sequences (the bare
SDPA floor, torch.nn.MultiheadAttention, x-transformers, HF GPT2Attention;
the textbook forms, which hold (B, H, T, T) scores, are left to the
book-size case), checked equal to multihead first, forward (eval,
``no_grad``) and forward+backward. Ratios are multihead / peer.

Peak memory of one step of every timed contender is measured in a fresh
child process per contender (peak resident-set growth, VmHWM; CUDA: peak
``torch.cuda.max_memory_allocated``), see ``benchmarks.memory``; the
figures are in the report under "Measured during setup" and in the JSON
(``notes``). Turn it off with ``--set memory=False``. ``--quick`` runs
every scenario at T / 16 (128 to 512).
"""

from __future__ import annotations

from typing import Any

from ..memory import peak_mib
from ..registry import Contenders, register
from .attention_peers import peer_steps

PEERS = ["multihead", "sdpa_floor", "torch_mha", "x_transformers", "hf_gpt2"]


def setup_long(config: dict[str, Any]) -> Contenders:
    config = {**config, "seq": int(config["seq"]) // int(config["seq_divisor"])}  # --quick: T / 16
    names = list(config["peers"])
    out = peer_steps(config, names)
    if config["memory"]:
        for name in list(out):
            spec = {k: config[k] for k in ("batch", "seq", "embed_dim", "num_heads", "causal", "mode", "dtype",
                                           "device", "seed", "threads")}  # fmt: skip
            mib = peak_mib({**spec, "peer": name})
            if mib is not None:
                how = "peak CUDA allocation" if str(config["device"]).startswith("cuda") else "peak RSS growth"
                out.notes[name] = {f"{how} (MiB)": round(mib, 1)}
    return out


@register(
    "long_context",
    description=(
        "multihead vs the bare SDPA floor, torch.nn.MultiheadAttention, x-transformers and HF GPT2Attention on "
        "causal self-attention at T = 2048, 4096, 8192 (embed 768, 12 heads, B=1, float32), forward and "
        "forward+backward, with the peak memory of one step of each (child process: RSS growth)."
    ),
    config={
        "embed_dim": 768, "num_heads": 12, "batch": 1, "seq": 2048, "dtype": "float32", "device": "cpu",
        "seed": 0, "mode": "forward", "causal": True, "peers": PEERS, "memory": True, "peak": True,
        "seq_divisor": 1, "warmup": 1, "rounds": 5, "number": 1,
    },  # fmt: skip
    quick={"seq_divisor": 16, "warmup": 1, "rounds": 2},
    scenarios={
        "forward T=2048": {"seq": 2048},
        "forward T=4096": {"seq": 4096},
        "forward T=8192": {"seq": 8192},
        "fwd+bwd T=2048": {"seq": 2048, "mode": "train"},
        "fwd+bwd T=8192": {"seq": 8192, "mode": "train", "rounds": 3},
    },
    subject="multihead",
)
def setup(config: dict[str, Any]) -> Contenders:
    return setup_long(config)
