"""Attention peers: one self-attention layer computed by other code, all holding the same weights.

    layer = random_layer(embed_dim=768, num_heads=12, seed=0)
    peer = build_peer("torch_mha", layer, causal=True, seq=1024, device="cpu", dtype=torch.float32)
    y = peer.fn(x)                       # x (B, T, C) -> y (B, T, C)
    reason = disagreement(y, y_ours)     # None when close, else one line saying by how much

Every peer computes ``out = softmax(q k^T / sqrt(D) [+ causal mask]) v``
per head with q, k, v = x Wq^T, x Wk^T, x Wv^T split into H heads of
D = C / H, heads concatenated and projected by Wo^T. The weights have no
bias: modules that can drop their biases do (multihead, torch, the bare
SDPA floor, x-transformers, which has none), modules with built-in biases
(Hugging Face GPT-2, the textbook forms) hold zeros.

Peers (``PEERS``; ``needs`` is what must be importable, ``only`` the mode,
masking or device a peer is limited to):

    multihead            multihead.MultiHeadAttention (the subject)
    multihead_compiled   the same module through torch.compile(fullgraph=True)
    sdpa_floor           F.linear (fused QKV) + F.scaled_dot_product_attention + F.linear:
                         the least a module can do
    sdpa_flash / sdpa_cudnn / sdpa_efficient
                         the floor with SDPA held to one CUDA backend (CUDA only)
    torch_mha            torch.nn.MultiheadAttention(batch_first=True), need_weights=False
    x_transformers       x_transformers.Attention(flash=True) (optional: make bench-deps)
    hf_gpt2              transformers' GPT2Attention, sdpa attention (causal only)
    raschka              multihead.textbook.MultiHeadAttention (causal only)
    annotated            multihead.textbook.MultiHeadedAttention
    tutorial_split       multihead.textbook.SplitMultiHeadAttention
    tutorial_per_head    multihead.textbook.PerHeadMultiHeadAttention (a loop over heads)
    numpy_reference      multihead.reference.multihead_attention_vec, float64 NumPy
                         (forward only, CPU only; its output cast to the run's dtype)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "PEERS", "Layer", "NotApplicable", "Peer", "PeerMissing", "PeerSpec", "XT_PINS",
    "build_peer", "disagreement", "random_layer",
]  # fmt: skip

# What `make bench-deps` installs (each with --no-deps, so no torch is pulled).
XT_PINS = "x-transformers==2.31.10 einops==0.8.2 einx==0.4.3 loguru==0.7.3 torch-einops-utils==0.2.0 frozendict==2.5.1"


class PeerMissing(Exception):
    """An optional peer's package is not installed (the message says how to install it)."""


class NotApplicable(Exception):
    """A peer that cannot compute this scenario (e.g. causal-only in a non-causal one)."""


@dataclass(frozen=True)
class Layer:
    """Weights of one bias-free attention layer, nn.Linear layout (out, in), float32 on CPU.

    wq, wk, wv, wo: (C, C); num_heads H divides C.
    """

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    num_heads: int

    @property
    def embed_dim(self) -> int:
        return self.wq.shape[0]

    @property
    def wqkv(self) -> torch.Tensor:
        """(3C, C): the fused projection, query rows first."""
        return torch.cat([self.wq, self.wk, self.wv])


def random_layer(*, embed_dim: int, num_heads: int, seed: int = 0) -> Layer:
    """Weights drawn like nn.Linear's default (uniform, bound 1/sqrt(C))."""
    if embed_dim % num_heads:
        raise ValueError(f"num_heads={num_heads} must divide embed_dim={embed_dim}")
    g = torch.Generator().manual_seed(seed)
    bound = embed_dim**-0.5
    w = [(torch.rand(embed_dim, embed_dim, generator=g) * 2 - 1) * bound for _ in range(4)]
    return Layer(*w, num_heads=num_heads)


@dataclass
class Peer:
    """A built peer: ``fn(x)`` maps (B, T, C) to (B, T, C); ``params`` are its
    trainable tensors (their gradients are cleared before each training step)."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    params: list[torch.Tensor] = field(default_factory=list)
    module: nn.Module | None = None


Builder = Callable[..., Peer]


@dataclass(frozen=True)
class PeerSpec:
    build: Builder
    causal_only: bool = False
    forward_only: bool = False
    device: str | None = None  # "cpu" or "cuda" when limited to one


def _load(module: nn.Module, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy weights into ``module``'s tensors and zero every bias it has."""
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.zero_()


def _module_peer(module: nn.Module, fn) -> Peer:
    return Peer(fn=fn, params=list(module.parameters()), module=module)


def _multihead(layer: Layer, *, causal: bool, device, dtype, **_) -> Peer:
    import multihead

    C, H = layer.embed_dim, layer.num_heads
    m = multihead.MultiHeadAttention(C, H, qkv_bias=False, out_bias=False, device=device, dtype=dtype)
    _load(m, [(m.qkv_proj.weight, layer.wqkv), (m.out_proj.weight, layer.wo)])
    return _module_peer(m, lambda x: m(x, is_causal=causal))


def _multihead_compiled(layer: Layer, *, causal: bool, device, dtype, **_) -> Peer:
    peer = _multihead(layer, causal=causal, device=device, dtype=dtype)
    m = peer.module
    compiled = torch.compile(lambda x: m(x, is_causal=causal), fullgraph=True)
    return Peer(fn=compiled, params=peer.params, module=m)


def _floor(backend: str | None):
    def build(layer: Layer, *, causal: bool, device, dtype, **_) -> Peer:
        C, H = layer.embed_dim, layer.num_heads
        D = C // H
        w_qkv = layer.wqkv.to(device, dtype, copy=True).requires_grad_(True)
        w_o = layer.wo.to(device, dtype, copy=True).requires_grad_(True)
        kernel = None
        if backend is not None:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            kernel = getattr(SDPBackend, backend)

        def fn(x: torch.Tensor) -> torch.Tensor:
            B, T, _ = x.shape
            # (B, T, C) -> (B, T, 3, H, D) -> 3 x (B, H, T, D)
            q, k, v = F.linear(x, w_qkv).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
            if kernel is None:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            else:
                with sdpa_kernel(kernel):
                    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            # (B, H, T, D) -> (B, T, C)
            return F.linear(y.transpose(1, 2).reshape(B, T, C), w_o)

        return Peer(fn=fn, params=[w_qkv, w_o])

    return build


def _torch_mha(layer: Layer, *, causal: bool, seq: int, device, dtype, **_) -> Peer:
    m = nn.MultiheadAttention(layer.embed_dim, layer.num_heads, bias=False, batch_first=True,
                              device=device, dtype=dtype)  # fmt: skip
    _load(m, [(m.in_proj_weight, layer.wqkv), (m.out_proj.weight, layer.wo)])
    # the documented causal call: a bool mask (True = hidden) with is_causal=True
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1) if causal else None
    return _module_peer(m, lambda x: m(x, x, x, need_weights=False, attn_mask=mask, is_causal=causal)[0])


def _x_transformers(layer: Layer, *, causal: bool, device, dtype, **_) -> Peer:
    try:
        from x_transformers import Attention
    except ImportError as e:
        raise PeerMissing(f"x-transformers is not installed ({e}); `make bench-deps` installs {XT_PINS}") from None
    C, H = layer.embed_dim, layer.num_heads
    m = Attention(dim=C, heads=H, dim_head=C // H, flash=True, causal=causal).to(device, dtype)
    _load(m, [(m.to_q.weight, layer.wq), (m.to_k.weight, layer.wk), (m.to_v.weight, layer.wv),
              (m.to_out.weight, layer.wo)])  # fmt: skip
    return _module_peer(m, m)


def _hf_gpt2(layer: Layer, *, seq: int, device, dtype, **_) -> Peer:
    try:
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    except ImportError as e:
        raise PeerMissing(f"transformers is not installed ({e})") from None
    config = GPT2Config(n_embd=layer.embed_dim, n_head=layer.num_heads, n_positions=seq, attn_pdrop=0.0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="sdpa")  # fmt: skip
    m = GPT2Attention(config, layer_idx=0).to(device, dtype)
    # Conv1D keeps (in, out): the transposes of nn.Linear's weights
    _load(m, [(m.c_attn.weight, layer.wqkv.T), (m.c_proj.weight, layer.wo.T)])
    return _module_peer(m, lambda x: m(x)[0])


def _raschka(layer: Layer, *, seq: int, device, dtype, **_) -> Peer:
    from multihead.textbook import MultiHeadAttention

    C = layer.embed_dim
    m = MultiHeadAttention(C, C, seq, 0.0, layer.num_heads).to(device, dtype)
    _load(m, [(m.W_query.weight, layer.wq), (m.W_key.weight, layer.wk), (m.W_value.weight, layer.wv),
              (m.out_proj.weight, layer.wo)])  # fmt: skip
    return _module_peer(m, m)


def _annotated(layer: Layer, *, causal: bool, seq: int, device, dtype, **_) -> Peer:
    from multihead.textbook import MultiHeadedAttention, subsequent_mask

    m = MultiHeadedAttention(layer.num_heads, layer.embed_dim, dropout=0.0).to(device, dtype)
    _load(m, [(lin.weight, w) for lin, w in zip(m.linears, (layer.wq, layer.wk, layer.wv, layer.wo))])
    mask = subsequent_mask(seq).to(device) if causal else None
    return _module_peer(m, lambda x: m(x, x, x, mask))


def _keep_causal(seq: int, device) -> torch.Tensor:
    return torch.ones(seq, seq, dtype=torch.bool, device=device).tril()  # (T, T), True = attend


def _tutorial_split(layer: Layer, *, causal: bool, seq: int, device, dtype, **_) -> Peer:
    from multihead.textbook import SplitMultiHeadAttention

    m = SplitMultiHeadAttention(layer.embed_dim, layer.num_heads).to(device, dtype)
    _load(m, [(m.q_linear.weight, layer.wq), (m.k_linear.weight, layer.wk), (m.v_linear.weight, layer.wv),
              (m.out_linear.weight, layer.wo)])  # fmt: skip
    mask = _keep_causal(seq, device) if causal else None
    return _module_peer(m, lambda x: m(x, mask))


def _tutorial_per_head(layer: Layer, *, causal: bool, seq: int, device, dtype, **_) -> Peer:
    from multihead.textbook import PerHeadMultiHeadAttention

    m = PerHeadMultiHeadAttention(layer.embed_dim, layer.num_heads).to(device, dtype)
    D = layer.embed_dim // layer.num_heads
    pairs = [(m.output.weight, layer.wo)]
    for j, head in enumerate(m.heads):
        rows = slice(j * D, (j + 1) * D)
        pairs += [(head.q.weight, layer.wq[rows]), (head.k.weight, layer.wk[rows]), (head.v.weight, layer.wv[rows])]
    _load(m, pairs)
    mask = _keep_causal(seq, device) if causal else None
    return _module_peer(m, lambda x: m(x, x, x, mask))


def _numpy_reference(layer: Layer, *, causal: bool, dtype, **_) -> Peer:
    from multihead.reference import multihead_attention_vec

    W = layer.wqkv.T.double().numpy()  # (C, 3C): [Wq | Wk | Wv]
    Wp = layer.wo.T.double().numpy()  # (C, C)

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = multihead_attention_vec(x.detach().double().numpy(), W, layer.num_heads, Wp, do_mask=causal)
        return torch.from_numpy(y).to(dtype)

    return Peer(fn=fn)


PEERS: dict[str, PeerSpec] = {
    "multihead": PeerSpec(_multihead),
    "multihead_compiled": PeerSpec(_multihead_compiled),
    "sdpa_floor": PeerSpec(_floor(None)),
    "sdpa_flash": PeerSpec(_floor("FLASH_ATTENTION"), device="cuda"),
    "sdpa_cudnn": PeerSpec(_floor("CUDNN_ATTENTION"), device="cuda"),
    "sdpa_efficient": PeerSpec(_floor("EFFICIENT_ATTENTION"), device="cuda"),
    "torch_mha": PeerSpec(_torch_mha),
    "x_transformers": PeerSpec(_x_transformers),
    "hf_gpt2": PeerSpec(_hf_gpt2, causal_only=True),
    "raschka": PeerSpec(_raschka, causal_only=True),
    "annotated": PeerSpec(_annotated),
    "tutorial_split": PeerSpec(_tutorial_split),
    "tutorial_per_head": PeerSpec(_tutorial_per_head),
    "numpy_reference": PeerSpec(_numpy_reference, forward_only=True, device="cpu"),
}


def build_peer(name: str, layer: Layer, *, causal: bool, seq: int, device: str, dtype: torch.dtype,
               train: bool = False) -> Peer:  # fmt: skip
    """Build peer ``name`` holding ``layer``'s weights for sequences of ``seq`` tokens.

    Raises:
        KeyError: an unknown peer name (the message lists the known ones).
        PeerMissing: its optional package is not installed.
        NotApplicable: it cannot run this scenario (masking, mode or device).
    """
    if name not in PEERS:
        raise KeyError(f"unknown peer {name!r}; valid: {sorted(PEERS)}")
    spec = PEERS[name]
    if spec.causal_only and not causal:
        raise NotApplicable("causal attention only")
    if spec.forward_only and train:
        raise NotApplicable("forward only (no gradients)")
    if spec.device is not None and not str(device).startswith(spec.device):
        raise NotApplicable(f"runs on {spec.device} only")
    peer = spec.build(layer, causal=causal, seq=seq, device=device, dtype=dtype)
    if peer.module is not None:
        peer.module.train(train)
    return peer


def disagreement(got: torch.Tensor, want: torch.Tensor, *, atol_rel: float = 4e-6) -> str | None:
    """None when ``got`` matches ``want``, else one line with the largest difference.

    float32/float64: rtol 1.3e-6 and atol = max(1e-5, atol_rel * max|want|)
    (the entries are sums whose order differs from peer to peer); 16-bit
    types: rtol 1.6e-2, atol = 1e-2 * max|want|.
    """
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    low = {got.dtype, want.dtype} & {torch.float16, torch.bfloat16}
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    scale = float(want.abs().max()) if want.numel() else 0.0
    if low:
        rtol, atol = 1.6e-2, 1e-2 * scale
    else:
        rtol, atol = 1.3e-6, max(1e-5, atol_rel * scale)
    diff = (got - want).abs()
    bad = diff > atol + rtol * want.abs()
    if not bool(bad.any()) and bool(torch.isfinite(got).all()):
        return None
    return (f"max |difference| {float(diff.max()):.3g} at scale {scale:.3g} "
            f"({int(bad.sum())} of {bad.numel()} entries beyond atol {atol:.3g} + rtol {rtol:g})")  # fmt: skip
