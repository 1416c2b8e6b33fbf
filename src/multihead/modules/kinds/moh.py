"""Mixture-of-Head attention (MoH; Jin et al. 2024, arXiv:2410.11842).

Each token weights the outputs of its heads before the output projection;
routed heads it did not choose get weight 0 and, on the sparse path, are
never computed for it::

    heads:    0 .. hs-1 (shared, always on) | hs .. H-1 (routed: top-hr of E = H - hs)
    token n:  [ w0·g_s ............ ]       [ 0   w1·g_r   0   w1·g_r   0 ... ]
    y[n] = out_proj( concat_h gates[n, h] · o_h[n] )

Two paths compute the same gated outputs (``moh_paths``): the sparse path
(default) runs the routed heads only over the query rows that chose them
(causal rows in blocks, ``moh_causal``), the dense path (``path="dense"``,
the official code's) every head, then gated. They agree to 1e-10 in float64.
The tensor-parallel cut is ``moh_parallel``.

Rope / QK-norm (``rope=``, ``qk_norm=``: the layer's ``rope`` and
``qk_norm`` submodules), on the head dim D of every query head [B, H, T, D] and key head [B, G, S, D]::

    project -> route (on the raw projected q) -> qk_norm -> rope
            -> KV-cache write (rotated keys) -> dense or sparse core

Both paths receive the same normalised/rotated q and k (the sparse path
gathers its rows from the rotated q). The ``query_norm`` router reads the
projected q BEFORE qk_norm and rope, the order of the official MoH-LLaMA3
(router on ``q_proj`` output, RoPE afterwards; LLaMA3 has no QK-norm);
rope alone would not change the norms (a rotation), but QK-norm would
flatten them. The learned router reads the tokens x and is unaffected.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..._checks import non_negative_int
from ..base import AttentionLayer
from ..cost import AttentionCost, visible_pairs
from ..projections import fused_qkv, split_heads
from ..registry import register_attention
from .moh_parallel import moh_part
from .moh_paths import check_mask, dense_heads, sparse_heads
from .moh_router import balance_loss, route

__all__ = ["MoHAttention", "load_balancing_loss"]

ROUTERS = ("learned", "query_norm")
PATHS = ("sparse", "dense")


class MoHAttention(AttentionLayer):
    """Multi-head attention whose heads are mixed per token by a router.

    Gates (learned router, the MoH-DiT/ViT one), for token x and E = H - hs::

        p = softmax(routed_gate(x))  [E];  S = top-hr of p
        g_r = hr · p·1[S] / max(sum_S p, eps)          eps = finfo(dtype).eps
        g_s = hs · softmax(shared_gate(x)) [hs]   ([1] when hs == 1)
        w = 2 · softmax(mix_gate(x)) [2];  gates = [w0·g_s, w1·g_r]
        (hs == 0: gates = g_r;  hr == 0: hs == H and gates = g_s)

    ``router="query_norm"`` is the parameter-free MoH-LLaMA3 router: the
    selected routed heads are the hr with the largest query norm ||q_h||
    (the official softmax of norms / std is monotone, so selecting by norm
    is the same choice and has no 0/0 when all norms are equal); gates are
    1 for shared and selected heads, 0 otherwise; there is no aux loss.

    Differences from the official code: hs == 1 uses a constant shared gate
    of 1 (the MoH-ViT rule; MoH-DiT fails there); the query_norm router's
    always-on block has hs ones (the official one has E, right only when
    hs == E); gates and the load-balance frequencies use the model dtype.

    Load balance (learned router, training mode, hr > 0): each forward sets
    ``self.last_balance_loss`` = l_aux = E · sum_e mean_tokens(p_e) ·
    frac_tokens_choosing(e) (gradient only through p); ``None`` after an
    eval-mode forward or without a learned router. ``aux_loss()`` returns
    aux_loss_coeff · l_aux (a 0-d zero when there is none): the term a
    training loop adds to its loss (models sum it over layers);
    ``load_balancing_loss(model)`` instead averages over layers, as the
    official training loops do.

    The forward is ``AttentionLayer.forward`` (arguments, masks and cache as
    :class:`MultiHeadAttention`, key/value width C; the router reads the
    query tokens) with one more keyword, ``path`` ("sparse" or "dense",
    default ``self.path``). ``return_weights`` gives weights[b, h, t] =
    gates[b, t, h] · the softmax probabilities of head h, the weights that
    mix the values (rows of routed heads a token did not choose are 0);
    observers receive the same. Asking for weights (or registering an
    observer) runs the dense path. The cache keeps keys/values of every head
    (any later query may choose any head).

    Args:
        embed_dim: C. num_heads: H.
        shared_heads: hs, always-active heads 0..hs-1 (default H // 2).
        routed_heads: hr, routed heads chosen per token from heads hs..H-1
            (default max(1, (H - hs) // 2): 75 % active with the default hs).
        router: "learned" or "query_norm".
        aux_loss_coeff: weight of the load-balance loss (0.01, the papers').
        num_kv_heads: G key/value heads (GQA, default H); head_dim: D.
        qkv_bias, out_bias, dropout: as ``MultiHeadAttention``.
        path: "sparse" (compute only active (token, head) pairs) or "dense";
            ``forward(path=...)`` overrides it per call.
        rope: rotary position embeddings on q and k, as
            ``MultiHeadAttention`` (False, True or a dict of ``apply_rope``
            options ``base``, ``interleaved``, ``rotary_dim``); applied on D
            after routing, before the cache write and the attention core.
        qk_norm: per-head RMS norm of q and k over D (gains
            ``qk_norm.q_norm.weight`` / ``qk_norm.k_norm.weight`` [D]),
            applied after routing and before rope.
        device, dtype: of the parameters.

    Raises:
        ValueError / TypeError: invalid sizes or options (the message names
            the values), routed_heads > H - shared_heads, routed_heads == 0
            with shared_heads != H.
    """

    kind = "moh"
    refused_options = ("kdim", "vdim", "alibi", "softcap", "sinks")  # one fused projection of the model width
    option_refusals = {
        "sinks": "its core is its own, not functional.attention's softmax with a sink column",
        "alibi": "its core runs the routed heads on their own paths, which do not pass ALiBi slopes",
        "softcap": "its core runs the routed heads on their own paths, which do not pass a softcap",
    }
    forward_options = ("path",)
    head_independence = (
        "the router couples the heads: each token's gates come from a softmax and a top-k over the heads, "
        "so removing one head changes the gates, and the choice, of the others"
    )

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        shared_heads: int | None = None,
        routed_heads: int | None = None,
        router: str = "learned",
        aux_loss_coeff: float = 0.01,
        path: str = "sparse",
        **options,
    ) -> None:
        super().__init__(embed_dim, num_heads, **options)
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        hs = H // 2 if shared_heads is None else non_negative_int("shared_heads", shared_heads)
        if hs > H:
            raise ValueError(f"shared_heads={hs} exceeds num_heads={H}")
        E = H - hs
        if routed_heads is None:
            hr = max(1, E // 2) if E else 0
        else:
            hr = non_negative_int("routed_heads", routed_heads)
        if hr > E:
            raise ValueError(
                f"routed_heads={hr} exceeds the {E} routed candidates (num_heads={H} - shared_heads={hs})"
            )
        if hr == 0 and E:
            raise ValueError(
                f"routed_heads=0 needs shared_heads == num_heads={H} (every head shared), got shared_heads={hs}"
            )
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got router={router!r}")
        if isinstance(aux_loss_coeff, bool) or not isinstance(aux_loss_coeff, (int, float)) or not (
            math.isfinite(aux_loss_coeff) and aux_loss_coeff >= 0
        ):
            raise ValueError(f"aux_loss_coeff must be a finite float >= 0, got aux_loss_coeff={aux_loss_coeff!r}")
        self.path = self._check_path(path)
        self.shared_heads, self.routed_heads, self.num_candidates = hs, hr, E
        # a tensor-parallel part (tensor_parallel_part): its heads' span of the full layer's H, and its
        # share of the load-balance loss; the whole layer: (0, H) and 1
        self.window, self.aux_share = (0, H), 1.0
        self.router, self.aux_loss_coeff = router, float(aux_loss_coeff)
        factory = self.factory
        self.qkv_proj = nn.Linear(embed_dim, (H + 2 * G) * D, bias=self.qkv_bias, **factory)
        self.init_output(H * D, embed_dim)
        learned = router == "learned"
        self.routed_gate = nn.Linear(embed_dim, E, bias=False, **factory) if learned and hr else None
        self.mix_gate = nn.Linear(embed_dim, 2, bias=False, **factory) if learned and hr and hs else None
        self.shared_gate = nn.Linear(embed_dim, hs, bias=False, **factory) if learned and hs > 1 else None
        self.init_positions(D)
        self.last_balance_loss: torch.Tensor | None = None

    @staticmethod
    def _check_path(path: str) -> str:
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got path={path!r}")
        return path

    def aux_loss(self) -> torch.Tensor:
        """aux_loss_coeff · l_aux of the last forward, the load-balance term of the
        training loss: 0-d, on the device and dtype of ``out_proj.weight``; a
        0-d zero when the last forward was in eval mode or has no learned router."""
        w = self.out_proj.weight
        if self.last_balance_loss is None:
            return torch.zeros((), device=w.device, dtype=w.dtype)
        return (self.aux_loss_coeff * self.aux_share * self.last_balance_loss).to(w.dtype)

    @property
    def active_heads(self) -> int:
        """Heads each token uses: hs + hr (all H when hr == 0)."""
        return self.shared_heads + self.routed_heads

    # ------------------------------------------------------------------ pieces
    def project(
        self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, H, T, D], k and v [B, G, S, D] from query [B, T, C] (and key/value [B, S, C])."""
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = fused_qkv(self.qkv_proj, query, key, value, (H * D, G * D, G * D))
        return split_heads(q, H), split_heads(k, G), split_heads(v, G)

    def route(
        self, x: torch.Tensor, q: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Gates of every (token, head).

        Args:
            x: [B, T, C] query tokens; q: [B, H, T, D] their projected queries.

        Returns:
            gates [B, T, H]; selected [B, T, E] bool (routed heads each token
            chose) or None when every head is active; p [B, T, E] router
            probabilities (learned router with hr > 0) or None.
        """
        return route(self, x, q)

    @staticmethod
    def balance_loss(p: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """l_aux = E · sum_e mean(p[..., e]) · mean(chosen[..., e]); p, chosen [B, T, E]."""
        return balance_loss(p, chosen)

    # ------------------------------------------------------------------ forward
    def to_heads(self, query, key=None, value=None):
        """q, k, v and the routing of this call: ``extra`` = {"gates" [B, T, H],
        "chosen" [B, T, E] or None} from :meth:`route` on the projected q
        (before qk_norm and rope, as MoH-LLaMA3 routes before RoPE). In
        training with the learned router, also sets ``last_balance_loss``."""
        q, k, v = self.project(query, key, value)
        gates, chosen, p = self.route(query, q)
        B, T, _ = query.shape
        self.last_balance_loss = None
        if self.training and p is not None and B * T:  # chosen is None when hr == E: every head chosen
            every = torch.ones_like(p, dtype=torch.bool) if chosen is None else chosen
            self.last_balance_loss = self.balance_loss(p, every)
        lo, hi = self.window
        if (lo, hi) != (0, self.shared_heads + self.num_candidates):  # a part: its heads' gates and choices
            hs = self.shared_heads
            gates = gates[..., lo:hi]  # (B, T, H) -> (B, T, H')
            chosen = None if chosen is None else chosen[..., max(lo, hs) - hs : max(hi, hs) - hs]
        return q, k, v, {"gates": gates, "chosen": chosen}

    def core(self, q, k, v, extra, *, attn_mask, backend, return_weights, path=None, **call):
        """:meth:`mix_heads` with this call's gates; ``path`` defaults to ``self.path``."""
        path = self._check_path(self.path if path is None else path)
        B, H, T, _ = q.shape
        check_mask(attn_mask, B, H, T, k.shape[2])
        mixed, weights = self.mix_heads(
            q, k, v, extra["gates"], extra["chosen"], attn_mask=attn_mask, return_weights=return_weights,
            backend=backend, path=path, **call,
        )  # fmt: skip
        return mixed.transpose(1, 2), weights  # (B, T, H, D) -> (B, H, T, D)

    def mix_heads(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        gates: torch.Tensor,
        chosen: torch.Tensor | None,
        *,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        causal_alignment: str = "top_left",
        return_weights: bool = False,
        backend: str = "auto",
        path: str = "sparse",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention core: gated head outputs, before the output projection.

        Args:
            q: [B, H, T, D]; k, v: [B, G, S, D] (from :meth:`project`, cache applied).
            gates: [B, T, H]; chosen: [B, T, E] bool or None (from :meth:`route`).
            attn_mask: merged mask (2-D (T, S) or 4-D broadcastable to (B, H, T, S)).
            path: "sparse" (only chosen (token, head) pairs; not with
                ``return_weights``) or "dense" (every head, then gated).

        Returns:
            (mixed [B, T, H, D] = gates[b, t, h] · o_h[b, t], weights
            [B, H, T, S] gated probabilities or None).
        """
        core = dict(
            is_causal=is_causal, causal_alignment=causal_alignment, dropout_p=self.dropout,
            training=self.training, backend=backend,
        )
        B, _, T, _ = q.shape
        if path == "sparse" and chosen is not None and not return_weights and B * T * k.shape[2]:
            shared = max(0, min(self.window[1], self.shared_heads) - self.window[0])  # of this part's heads
            if chosen.shape[-1]:
                return sparse_heads(q, k, v, gates, chosen, attn_mask, core, shared_heads=shared), None
        return dense_heads(q, k, v, gates, attn_mask, core, return_weights)

    # ------------------------------------------------------------------ tensor parallelism
    def tensor_parallel_part(self, heads: list[int]) -> MoHAttention:
        """One tensor-parallel rank's part: query heads ``heads`` (a contiguous block, whole
        key/value groups or a share of one) with their q/k/v rows and out_proj columns.

        The router stays whole: each part computes every gate from the same
        tokens and keeps its heads', so the parts' outputs sum to the layer's.
        Each part reports ``aux_loss()`` times its share of the heads, so the
        parts' load-balance losses (and their gradients) sum to the layer's.

        Raises:
            ValueError: heads that are not a contiguous block, a part of a part,
                or the ``query_norm`` router with a choice to make (it ranks
                every head's query norm, which a part does not hold).
        """
        return moh_part(self, heads)

    # ------------------------------------------------------------------ cost
    def cost(
        self,
        T: int,
        S: int | None = None,
        *,
        batch: int = 1,
        causal: bool = False,
        bytes_per_element: int = 2,
        active_heads: int | None = None,
    ) -> AttentionCost:
        """FLOPs, parameters and cache bytes of one call (``modules.cost`` conventions).

        The core is counted for the EXPECTED active heads A = hs + hr of every
        query row (the sparse path; pass ``active_heads=H`` for the dense
        path, which computes every head). With P visible (query, key) pairs:

            core = 2·B·A·P·(D + D)              (causal: A/H of each head's
                                                 visible pairs, in expectation)
            projections = 2·B·(T·C·H·D + 2·S·C·G·D + T·H·D·C) + 2·B·T·C·R

        with R = E + 2 + hs router logits of the learned router (only the
        gates that exist: E if hr > 0, 2 if hs > 0 and hr > 0, hs if hs > 1;
        R = 0 for ``query_norm``). Q/K/V and output projections are dense.
        rope and qk_norm are elementwise and not counted; the qk_norm gains
        (2·D) are among the parameters.
        The sparse path runs the routed heads as one batch padded to M, the
        most rows any (batch row, routed head) received, so the work it
        actually does is 2·B·(hs·T + E·M)·S·(D + D) (non-causal); with
        balanced routing M is close to its expectation hr·T/E (inside
        ``torch.compile``, where M would need a host sync, M = T). Causal
        rows longer than one block of L positions are padded per block
        (M_c rows in block c), each seeing c·L + L keys (``moh_causal``).
        """
        S = T if S is None else S
        H, G, D, C = self.num_heads, self.num_kv_heads, self.head_dim, self.embed_dim
        A = self.active_heads if active_heads is None else active_heads
        core = 2 * batch * A * visible_pairs(T, S, causal=causal, window=self.sliding_window) * (D + D)
        R = sum(m.out_features for m in (self.routed_gate, self.mix_gate, self.shared_gate) if m is not None)
        proj = 2 * batch * (T * C * H * D + 2 * S * C * G * D + T * H * D * C) + 2 * batch * T * C * R
        params = sum(p.numel() for p in self.parameters())
        return AttentionCost(core, proj, params, 2 * G * D * bytes_per_element)

    def extra_repr(self) -> str:
        parts = [f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}"]
        if self.num_kv_heads != self.num_heads:
            parts.append(f"num_kv_heads={self.num_kv_heads}")
        parts += [f"head_dim={self.head_dim}", f"shared_heads={self.shared_heads}",
                  f"routed_heads={self.routed_heads}", f"router={self.router!r}", f"path={self.path!r}"]
        if self.rope is not None:
            parts.append(f"rope={self.rope}")
        return ", ".join(parts)


def load_balancing_loss(model: nn.Module) -> torch.Tensor:
    """aux_loss_coeff · l_aux averaged over the MoH layers of ``model`` that set
    one in their last forward (training mode); 0 when none did. Add it to the
    training loss (the official ``0.01 · sum(losses) / max(len(losses), 1)``)."""
    terms = [m.aux_loss_coeff * m.aux_share * m.last_balance_loss for m in model.modules() if isinstance(m, MoHAttention)
             and m.last_balance_loss is not None]
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).mean()


@register_attention("moh", MoHAttention)
def _moh(*, embed_dim: int, num_heads: int, **options) -> MoHAttention:
    return MoHAttention(embed_dim, num_heads, **options)
