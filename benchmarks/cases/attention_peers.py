"""multihead.MultiHeadAttention against every peer computing the same layer (``benchmarks.peers``).

One self-attention layer (bias-free weights shared by every peer), at the
book configuration by default: B=8, T=1024, C=768, H=12, float32, CPU.
Scenarios: forward (eval, ``no_grad``) and forward+backward (train mode,
dropout 0, input requiring grad, ``backward(grad_out)`` with gradients
cleared first), each causal and non-causal, and two small scenarios
(B=2, T=64, C=64, H=4) where the slow forms run too: the loop over heads
and the float64 NumPy reference.

Before anything is timed, every peer's output (and in fwd+bwd its input
gradient) is compared with multihead's (``peers.disagreement``); a peer
that differs is refused (recorded, never timed), one that raises a
RuntimeError on its first call (an SDPA backend with no kernel for these
inputs) is recorded as failed, one whose package is missing or that cannot
run the scenario (causal-only forms in a
non-causal scenario, the NumPy reference under backward, CUDA-only
backends on CPU) is recorded as such. Ratios are multihead / peer
(below 1: multihead is faster).

Every contender gets the same FLOP count: the layer's own cost
(``MultiHeadAttention.cost``: matrix products, visible pairs only when
causal), times 3 for forward+backward (the backward's two products per
forward product). With ``peak`` (on, except in the small scenarios, where
per-call overheads dominate) the runner times the GEMM peak in the same
rounds and reports TFLOP/s, the fraction of the peak and the time over the
FLOP floor.

``--device cuda`` runs on the GPU (set ``--set dtype=bfloat16`` for the
flash kernels): ``cuda_peers`` are added there (torch.compile of the module
and the SDPA floor held to the flash, cuDNN and memory-efficient backends).
"""

from __future__ import annotations

from typing import Any

import torch

from ..peers import NotApplicable, PeerMissing, build_peer, disagreement, random_layer
from ..registry import Contenders, register

BOOK_PEERS = ["multihead", "sdpa_floor", "torch_mha", "x_transformers", "hf_gpt2", "raschka", "annotated",
              "tutorial_split"]  # fmt: skip
ALL_PEERS = [*BOOK_PEERS, "tutorial_per_head", "numpy_reference"]
CUDA_PEERS = ["multihead_compiled", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient"]


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"unknown dtype {name!r}")
    return dtype


def layer_flops(config: dict[str, Any]) -> int:
    """FLOPs of one step: the layer's forward cost (x3 with backward)."""
    import multihead

    B, T, C, H = (int(config[k]) for k in ("batch", "seq", "embed_dim", "num_heads"))
    with torch.device("meta"):
        m = multihead.MultiHeadAttention(C, H, qkv_bias=False, out_bias=False)
    forward = m.cost(T, batch=B, causal=bool(config["causal"])).total_flops
    return forward * (3 if config["mode"] == "train" else 1)


def peer_steps(config: dict[str, Any], names: list[str]) -> Contenders:
    """Build the peers ``names`` (the first is the one the others must agree
    with), check them, and return one step function per agreeing peer."""
    B, T, C, H = (int(config[k]) for k in ("batch", "seq", "embed_dim", "num_heads"))
    causal, mode = bool(config["causal"]), config["mode"]
    if mode not in ("forward", "train"):
        raise ValueError(f"mode must be 'forward' or 'train', got {mode!r}")
    device, dtype = str(config.get("device", "cpu")), dtype_of(config["dtype"])
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA device")
    train = mode == "train"
    layer = random_layer(embed_dim=C, num_heads=H, seed=int(config["seed"]))
    out = Contenders()
    peers = {}
    for name in names:
        try:
            peers[name] = build_peer(name, layer, causal=causal, seq=T, device=device, dtype=dtype, train=train)
        except PeerMissing as e:
            out.not_timed[name] = ("missing", str(e))
        except NotApplicable as e:
            out.not_timed[name] = ("n/a", str(e))
    subject = names[0]
    if subject not in peers:
        raise RuntimeError(f"{subject} could not be built: {out.not_timed.get(subject)}")
    gen = torch.Generator().manual_seed(int(config["seed"]) + 1)
    x = torch.randn(B, T, C, generator=gen).to(device, dtype)
    grad_out = torch.randn(B, T, C, generator=gen).to(device, dtype)

    def forward_step(peer):
        def step() -> None:
            with torch.no_grad():
                peer.fn(x)

        return step

    def train_step(peer, inp):
        def step() -> None:
            inp.grad = None
            for p in peer.params:
                p.grad = None
            peer.fn(inp).backward(grad_out)

        return step

    inputs = {name: x.clone().requires_grad_(True) for name in peers} if train else {}
    results = {}
    for name, peer in list(peers.items()):
        try:
            if train:
                train_step(peer, inputs[name])()
                with torch.no_grad():
                    results[name] = (peer.fn(x), inputs[name].grad)
            else:
                with torch.no_grad():
                    results[name] = (peer.fn(x), None)
        except RuntimeError as e:  # e.g. an SDPA backend without a kernel for these inputs
            if name == subject:
                raise
            out.not_timed[name] = ("failed", str(e).strip().splitlines()[0][:300])
            del peers[name]
    want_y, want_g = results[subject]
    flops = layer_flops(config)
    for name, peer in peers.items():
        got_y, got_g = results[name]
        reason = disagreement(got_y, want_y)
        if reason is None and train:
            reason = disagreement(got_g, want_g, atol_rel=1e-5)
            reason = reason and f"input gradients: {reason}"
        if reason is not None:
            out.not_timed[name] = ("refused", f"differs from {subject}, not timed: {reason}")
            continue
        out[name] = train_step(peer, inputs[name]) if train else forward_step(peer)
        out.flops[name] = flops
    return out


def setup_peers(config: dict[str, Any]) -> Contenders:
    names = list(config["peers"])
    if str(config.get("device", "cpu")).startswith("cuda"):
        names += [n for n in config["cuda_peers"] if n not in names]
    return peer_steps(config, names)


@register(
    "attention_peers",
    description=(
        "multihead.MultiHeadAttention vs every peer computing the same bias-free self-attention layer with the "
        "same weights (bare SDPA floor, torch.nn.MultiheadAttention, x-transformers, HF GPT2Attention, textbook "
        "forms, NumPy reference at small sizes); book configuration B=8, T=1024, C=768, H=12; outputs checked "
        "equal first; ratios multihead / peer."
    ),
    config={
        "embed_dim": 768, "num_heads": 12, "batch": 8, "seq": 1024, "dtype": "float32", "device": "cpu",
        "seed": 0, "mode": "forward", "causal": True, "peers": BOOK_PEERS, "cuda_peers": CUDA_PEERS,
        "peak": True, "warmup": 2, "rounds": 10, "number": 1,
    },  # fmt: skip
    quick={"batch": 2, "seq": 128, "warmup": 1, "rounds": 3},
    scenarios={
        "forward, causal": {"mode": "forward", "causal": True},
        "fwd+bwd, causal": {"mode": "train", "causal": True},
        "forward, non-causal": {"mode": "forward", "causal": False},
        "fwd+bwd, non-causal": {"mode": "train", "causal": False},
        "small forward, causal": {"mode": "forward", "batch": 2, "seq": 64, "embed_dim": 64, "num_heads": 4,
                                  "peers": ALL_PEERS, "number": 20, "peak": False},  # fmt: skip
        "small fwd+bwd, causal": {"mode": "train", "batch": 2, "seq": 64, "embed_dim": 64, "num_heads": 4,
                                  "peers": ALL_PEERS, "number": 10, "peak": False},  # fmt: skip
    },
    subject="multihead",
)
def setup(config: dict[str, Any]) -> Contenders:
    return setup_peers(config)
