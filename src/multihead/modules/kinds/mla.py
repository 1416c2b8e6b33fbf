"""Multi-head Latent Attention (MLA; DeepSeek-V2, arXiv:2405.04434, and DeepSeek-V3).

Keys and values of every head come from one shared latent c (kv_lora_rank L
channels per token, RMS-normalised); a few decoupled rope channels (R) carry
the position, with ONE rope key shared by all heads::

    x (B, T, C) --q_proj--> q_h = [q_N,h | q_R,h]          (or q_a_proj -> q_a_norm -> q_b_proj)
    x_k (B, S, kdim) --kv_a_proj--> [c_raw | k_R]        (B, S, L + R)
    c = kv_a_norm(c_raw);  [k_N,h | v_h] = kv_b_proj(c)   per head Dn + Dv
    score_h = scale · (q_N,h · k_N,h + rope(q_R,h) · rope(k_R))
    out = out_proj(concat_h softmax(score_h) v_h)

``kv_norm=False`` leaves the latent as projected (c = c_raw, no gain), and
R = 0 gives no rope part (keys are the per-head k_N,h alone): together they
express an MHA layer whose key and value projections were factored through
a latent (``tools.convert_mla.to_mla``).

scale = 1/sqrt(Dn + R), times m² with YaRN (``mla_latent``). Rope is
interleaved (adjacent pairs, as DeepSeek) unless ``rope`` says otherwise and
acts on the R rope channels only; ``qk_norm`` RMS-normalises those R channels
of every query head and of the shared rope key (the latent has its own norm).

Two paths, chosen by ``decode`` (an attribute that can be changed; it
governs every call, cached or not, and ``make_kv_cache`` allocates its cache):

* "naive": per-head keys [k_N,h | k_R] [B, H, S, Dn + R] and values
  [B, H, S, Dv] are built and cached (H·(Dn + R + Dv) elements per token).
* "absorbed": the key up-projection W_UK,h folds into the query and the
  value up-projection W_UV,h into the output, so the core is MQA over one
  key head [c | k_R] (L + R) and one value head c (L)::

      q'_h = [q_N,h W_UK,h | q_R,h]      (B, H, T, L + R)
      k'   = [c | k_R]                   (B, 1, S, L + R)  cached: L + R per token
      o_h  = softmax(scale · q'_h k'ᵀ) c · W_UV,hᵀ          (B, H, T, Dv)

  q_N,h W_UK,h · c = q_N,h · (W_UK,h c) = q_N,h · k_N,h: the scores, the
  weights and the output are those of the naive path up to float rounding.

Observers receive each path's own q and k (scale · q·kᵀ gives the scores).
"""

from __future__ import annotations

import torch
from torch import nn

from ..._checks import non_negative_int, positive_int
from ..base import AttentionLayer
from ..cost import AttentionCost, visible_pairs
from ..head_selection import head_rows, load_selected
from ..kv_cache import KVCache, LatentKVCache
from ..norms import HeadRMSNorm
from ..registry import register_attention
from ..window_cache import WindowLatentKVCache
from .mla_latent import rotate, yarn_frequencies, yarn_mscale, yarn_options

__all__ = ["MultiHeadLatentAttention"]

DECODE_PATHS = ("naive", "absorbed")


def _interleaved_by_default(rope: object) -> object:
    if rope is True:
        return {"interleaved": True}
    if isinstance(rope, dict) and "interleaved" not in rope:
        return {**rope, "interleaved": True}
    return rope


@register_attention("mla")
class MultiHeadLatentAttention(AttentionLayer):
    """DeepSeek's Multi-head Latent Attention with naive and absorbed decoding.

    Args:
        embed_dim: C; num_heads: H.
        q_lora_rank: 0 for one query projection ``q_proj`` [H·(Dn+R), C];
            else the bottleneck ``q_a_proj`` [q_lora_rank, C] -> ``q_a_norm``
            (RMSNorm) -> ``q_b_proj`` [H·(Dn+R), q_lora_rank].
        kv_lora_rank: L, the latent width (default 4·head_dim).
        qk_nope_head_dim: Dn (default head_dim); qk_rope_head_dim: R
            (default 2·max(1, head_dim // 4); 0: no rope part, then rope and
            qk_norm are refused); v_head_dim: Dv (default head_dim).
        kv_norm: True (default): ``kv_a_norm`` RMS-normalises the latent;
            False: no norm, the latent is kv_a_proj's output (no ``kv_a_norm``).
        yarn: None, or a dict ``factor``, ``original_seq_len`` and optionally
            ``beta_fast`` (32), ``beta_slow`` (1), ``mscale`` (1): YaRN rope
            frequencies and the softmax scale times m² (needs ``rope``).
        decode: "absorbed" (default) or "naive" (module docstring).
        norm_eps: eps of ``q_a_norm`` and ``kv_a_norm`` (1e-6, DeepSeek's).
        options: as ``AttentionLayer``: head_dim (the default of Dn, Dv and
            L, R), kdim, qkv_bias (biases of q_proj / q_a_proj / q_b_proj and
            kv_a_proj; kv_b_proj has none: it is folded away when absorbed),
            out_bias, dropout, rope (on the R channels; interleaved unless a
            dict says ``interleaved: False``), qk_norm (over the R channels),
            device, dtype. num_kv_heads and vdim are refused: keys and values
            come from one latent of the key input.

    Forward as ``AttentionLayer.forward``; ``value`` must be None or the key
    tensor. ``return_weights`` gives softmax(score_h) [B, H, T, S].

    Raises:
        TypeError / ValueError: invalid sizes, decode, yarn or rope options.
    """

    kind = "mla"
    refused_options = ("num_kv_heads", "vdim")
    independent_heads = True
    head_independence = (
        "the latent, its norm and the rope key are shared inputs of every head, but each head has its own rows "
        "of the query and key/value up-projections and its own columns of out_proj, and nothing else couples them"
    )

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        q_lora_rank: int = 0,
        kv_lora_rank: int | None = None,
        qk_nope_head_dim: int | None = None,
        qk_rope_head_dim: int | None = None,
        v_head_dim: int | None = None,
        yarn: dict | None = None,
        decode: str = "absorbed",
        norm_eps: float = 1e-6,
        kv_norm: bool = True,
        **options,
    ) -> None:
        super().__init__(embed_dim, num_heads, **options)
        self.vdim = self.kdim  # a value tensor can only be the key tensor
        H, D = self.num_heads, self.head_dim
        if isinstance(q_lora_rank, bool) or not isinstance(q_lora_rank, int) or q_lora_rank < 0:
            raise ValueError(f"q_lora_rank must be an int >= 0 (0: no query bottleneck), got q_lora_rank={q_lora_rank!r}")
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = positive_int("kv_lora_rank", 4 * D if kv_lora_rank is None else kv_lora_rank)
        self.qk_nope_head_dim = positive_int("qk_nope_head_dim", D if qk_nope_head_dim is None else qk_nope_head_dim)
        R = 2 * max(1, D // 4) if qk_rope_head_dim is None else qk_rope_head_dim
        self.qk_rope_head_dim = non_negative_int("qk_rope_head_dim", R)
        if not isinstance(kv_norm, bool):
            raise TypeError(f"kv_norm must be a bool, got kv_norm={kv_norm!r}")
        self.v_head_dim = positive_int("v_head_dim", D if v_head_dim is None else v_head_dim)
        self.decode = decode
        self.yarn = yarn_options(yarn)
        L, R, Dn, Dv = self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim
        bias, f = self.qkv_bias, self.factory
        if q_lora_rank:
            self.q_a_proj = nn.Linear(embed_dim, q_lora_rank, bias=bias, **f)
            self.q_a_norm = HeadRMSNorm(q_lora_rank, norm_eps, **f)
            self.q_b_proj = nn.Linear(q_lora_rank, H * (Dn + R), bias=bias, **f)
        else:
            self.q_proj = nn.Linear(embed_dim, H * (Dn + R), bias=bias, **f)
        self.kv_a_proj = nn.Linear(self.kdim, L + R, bias=bias, **f)
        self.kv_a_norm = HeadRMSNorm(L, norm_eps, **f) if kv_norm else None
        self.kv_b_proj = nn.Linear(L, H * (Dn + Dv), bias=False, **f)
        self.init_output(H * Dv, embed_dim)
        rope, qk_norm = self._positions
        if R == 0 and (rope or qk_norm):
            raise ValueError(f"rope={rope!r} and qk_norm={qk_norm!r} act on the rope channels; qk_rope_head_dim=0 "
                             "has none: give qk_rope_head_dim > 0 or leave rope and qk_norm off")  # fmt: skip
        self._positions = (_interleaved_by_default(rope), qk_norm)
        try:
            self.init_positions(R)
        except ValueError as err:
            raise ValueError(f"{err} [mla rope rotates the qk_rope_head_dim={R} channels]") from None
        if self.yarn is not None and self.rope is None:
            raise ValueError(f"yarn={yarn!r} scales rope frequencies; it needs rope=True or a rope dict")
        self.scale = (Dn + R) ** -0.5 * (1.0 if self.yarn is None else yarn_mscale(self.yarn) ** 2)
        self.init_options.update(q_lora_rank=q_lora_rank, kv_lora_rank=L, qk_nope_head_dim=Dn, qk_rope_head_dim=R,
                                 v_head_dim=Dv, yarn=yarn, decode=decode, norm_eps=norm_eps, kv_norm=kv_norm)  # fmt: skip

    @property
    def decode(self) -> str:
        """"naive" or "absorbed": the path of every call and the layout of ``make_kv_cache``."""
        return self._decode

    @decode.setter
    def decode(self, path: str) -> None:
        if path not in DECODE_PATHS:
            raise ValueError(f"decode must be one of {DECODE_PATHS}, got decode={path!r}")
        self._decode = path

    # ------------------------------------------------------------------ projections
    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, Dn, L], W_UV [H, Dv, L]): kv_b_proj's head blocks [k_N | v]."""
        W = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return W[:, : self.qk_nope_head_dim], W[:, self.qk_nope_head_dim :]

    def project(self, query, key=None, value=None):
        """naive: q [B, H, T, Dn+R], k [B, H, S, Dn+R], v [B, H, S, Dv];
        absorbed: q [B, H, T, L+R], k [B, 1, S, L+R] = [c | k_R], v [B, 1, S, L] = c.
        The rope channels are last and not yet normalised or rotated."""
        if key is None:
            key = query
        elif value is not None and value is not key and not (value.shape == key.shape
                                                             and value.data_ptr() == key.data_ptr()):  # fmt: skip
            raise ValueError("mla derives keys and values from one latent of the key input: pass value=None "
                             f"or the key tensor itself (got a value tensor {tuple(value.shape)} other than key)")  # fmt: skip
        H, L, R, Dn = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim
        (B, T, _), S = query.shape, key.shape[1]
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(query))) if self.q_lora_rank else self.q_proj(query)
        q = q.view(B, T, H, Dn + R).transpose(1, 2)  # (B, T, H*(Dn+R)) -> (B, H, T, Dn+R)
        kv = self.kv_a_proj(key)  # (B, S, L + R)
        c, k_r = kv[..., :L], kv[..., L:].unsqueeze(1)  # (B, S, L), (B, 1, S, R)
        c = c if self.kv_a_norm is None else self.kv_a_norm(c)
        if self.decode == "naive":
            up = self.kv_b_proj(c).view(B, S, H, Dn + self.v_head_dim).transpose(1, 2)  # (B, S, H*(Dn+Dv)) -> (B, H, S, Dn+Dv)
            k = torch.cat([up[..., :Dn], k_r.expand(B, H, S, R)], dim=-1)  # (B, H, S, Dn + R)
            return q, k, up[..., Dn:]
        W_uk, _ = self._up_weights()
        q_c = torch.einsum("bhtd,hdl->bhtl", q[..., :Dn], W_uk)  # (B, H, T, Dn) -> (B, H, T, L)
        c = c.unsqueeze(1)  # (B, 1, S, L)
        return torch.cat([q_c, q[..., Dn:]], dim=-1), torch.cat([c, k_r], dim=-1), c

    def position_qk(self, q, k, q_pos, k_pos):
        """qk_norm, then rope, on the last R channels of q and of the one shared
        rope key (head 0's copy in the naive layout, expanded back to every head)."""
        if self.qk_norm is None and self.rope is None:
            return q, k
        R = self.qk_rope_head_dim
        q_r, k_r = q[..., -R:], k[:, :1, :, -R:]  # (B, H, T, R), (B, 1, S, R)
        if self.qk_norm is not None:
            q_r, k_r = self.qk_norm(q_r, k_r)
        if self.rope is not None:
            q_r, k_r = self._rotate(q_r, q_pos), self._rotate(k_r, k_pos)
        B, G, S, _ = k.shape
        return torch.cat([q[..., :-R], q_r], dim=-1), torch.cat([k[..., :-R], k_r.expand(B, G, S, R)], dim=-1)

    def _rotate(self, x: torch.Tensor, positions) -> torch.Tensor:
        if self.yarn is None:
            return self.rope(x, positions)
        freqs = yarn_frequencies(self.rope["rotary_dim"], self.rope["base"], self.yarn, device=x.device)
        return rotate(x, positions, freqs, interleaved=self.rope["interleaved"])

    # ------------------------------------------------------------------ cache and core
    def make_kv_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None, device=None):
        """absorbed: a ``LatentKVCache`` [B, 1, max_len, L+R]; naive: a ``KVCache``
        with keys [B, H, max_len, Dn+R] and values [B, H, max_len, Dv]."""
        ref = self.out_proj.weight
        dtype, device = dtype or ref.dtype, device or ref.device
        if self.decode == "absorbed":
            return LatentKVCache(batch_size, max_len, self.kv_lora_rank, self.qk_rope_head_dim, dtype=dtype,
                                 device=device)  # fmt: skip
        return KVCache(batch_size, self.num_heads, max_len, self.qk_nope_head_dim + self.qk_rope_head_dim,
                       value_dim=self.v_head_dim, dtype=dtype, device=device)  # fmt: skip

    def write_cache(self, cache, k, v, extra):
        """Append to the cache of this layer's ``decode`` path; refuse the other layout."""
        if (self.decode == "absorbed") != isinstance(cache, (LatentKVCache, WindowLatentKVCache)):
            raise ValueError(
                f"this mla layer decodes {self.decode!r} but kv_cache is a {type(cache).__name__} of the other "
                "path: build the cache with make_kv_cache after setting decode"
            )
        k, v = cache.update(k, v)
        return k, v, extra

    def core(self, q, k, v, extra, **call):
        """naive: ``functional.attention``; absorbed: attention over the latent
        (one key/value head), then each head's W_UV: (B, H, T, L) -> (B, H, T, Dv)."""
        out, weights = super().core(q, k, v, extra, **call)
        if self.decode == "absorbed":
            _, W_uv = self._up_weights()
            out = torch.einsum("bhtl,hdl->bhtd", out, W_uv)
        return out, weights

    # ------------------------------------------------------------------ accounting
    def cost(self, T, S=None, *, batch=1, causal=False, bytes_per_element=2) -> AttentionCost:
        """FLOPs, parameters and cache bytes of one call on this layer's path.

        With P visible pairs, Dq = Dn + R, Rq = q_lora_rank:
        projections = 2·B·(T·(C·H·Dq, or C·Rq + Rq·H·Dq) + S·kdim·(L+R) + T·H·Dv·C)
            + naive: 2·B·S·L·H·(Dn+Dv) (kv_b_proj)
            + absorbed: 2·B·T·H·L·(Dn + Dv) (q_N W_UK and the latent output times W_UV);
        core = 2·B·H·P·(Dq + Dv) naive, 2·B·H·P·(L + R + L) absorbed.
        Cache per token: naive H·(Dn + R + Dv), absorbed L + R elements.
        Norms, rope and qk_norm are elementwise and not counted.
        """
        S = T if S is None else S
        H, C, L, R = self.num_heads, self.embed_dim, self.kv_lora_rank, self.qk_rope_head_dim
        Dn, Dv, Rq = self.qk_nope_head_dim, self.v_head_dim, self.q_lora_rank
        Dq, pairs = Dn + R, visible_pairs(T, S, causal=causal, window=self.sliding_window)
        q_proj = T * (C * Rq + Rq * H * Dq if Rq else C * H * Dq)
        proj = q_proj + S * self.kdim * (L + R) + T * H * Dv * C
        if self.decode == "naive":
            proj, core, cached = proj + S * L * H * (Dn + Dv), H * pairs * (Dq + Dv), H * (Dq + Dv)
        else:
            proj, core, cached = proj + T * H * L * (Dn + Dv), H * pairs * (L + R + L), L + R
        params = sum(p.numel() for p in self.parameters())
        return AttentionCost(2 * batch * core, 2 * batch * proj, params, cached * bytes_per_element)

    # ------------------------------------------------------------------ heads
    def subset_heads(self, heads: list[int], kv_heads: list[int]) -> MultiHeadLatentAttention:
        """The kept heads' rows of the query projection (q_proj or q_b_proj) and
        of kv_b_proj, their columns of out_proj and their sink logits; the latent
        and rope-key projections and the norms stay whole."""
        dev = self.out_proj.weight.device
        Dq, Dkv = self.qk_nope_head_dim + self.qk_rope_head_dim, self.qk_nope_head_dim + self.v_head_dim
        q_name = "q_b_proj" if self.q_lora_rank else "q_proj"
        rows = {q_name: head_rows(heads, Dq, dev), "kv_b_proj": head_rows(heads, Dkv, dev)}
        state = {name: t[rows[name.split(".")[0]]] if name.split(".")[0] in rows else t
                 for name, t in self.state_dict().items()}  # fmt: skip
        state["out_proj.weight"] = state["out_proj.weight"][:, head_rows(heads, self.v_head_dim, dev)]
        if "sinks" in state:
            state["sinks"] = state["sinks"][heads]  # (H,) -> (H',): each head's sink logit
        new = type(self)(self.embed_dim, len(heads), head_dim=self.head_dim, device="meta",
                         dtype=self.out_proj.weight.dtype, **self.init_options)  # fmt: skip
        new.decode = self.decode
        return load_selected(new, state, self)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_nope_head_dim={self.qk_nope_head_dim}, qk_rope_head_dim={self.qk_rope_head_dim}, "
                f"v_head_dim={self.v_head_dim}, decode={self.decode!r}"
                + ("" if self.kv_a_norm is not None else ", kv_norm=False")
                + ("" if self.yarn is None else f", yarn={self.yarn}"))  # fmt: skip
