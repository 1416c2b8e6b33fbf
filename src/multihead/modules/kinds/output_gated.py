"""Output-gated attention (Qiu et al. 2025, "Gated Attention for Large Language
Models", arXiv:2505.06708; the full-attention layers of Qwen3-Next).

A query-dependent sigmoid gate multiplies each head's attention output
before the output projection (the paper's position G1). The gate logits come
from the same input as the queries, through more rows of the query
projection::

    x --qkv_proj--> q (B, H, T, D) | gate logits (B, H, T, E) | k, v (B, G, S, D)
      [--qk_norm (RMS over D) --> rope (rotate q, k)]
      --functional.attention (fused SDPA)--> o (B, H, T, D)
      --o * sigmoid(gate logits)--> (B, H, T, D)   (E broadcast over D)
      --merge heads--> out_proj --> (B, T, C)

    gate="headwise":    E = 1, one gate per head and token
    gate="elementwise": E = D, one gate per output channel and token

``qkv_proj``'s output rows are [q heads (H·D) | gates (H·E) | k heads (G·D)
| v heads (G·D)], each block head-major. Cross-attention projects the q and
gate rows from the query and the k and v rows from the key. The official
column layouts (per key/value group in the paper's repository, per head in
Qwen3-Next) are permuted into this one by ``multihead.convert``
(``qwen_gated``, ``qwen3_next``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..base import AttentionLayer
from ..cost import AttentionCost, visible_pairs
from ..head_selection import head_rows, load_selected
from ..norms import QKNorm, check_eps
from ..projections import fused_qkv, split_heads
from ..registry import register_attention

__all__ = ["OutputGatedAttention"]

GATES = ("headwise", "elementwise")


@register_attention("output_gated")
class OutputGatedAttention(AttentionLayer):
    """Multi-head attention (GQA too) whose head outputs pass through a sigmoid gate.

    Args:
        embed_dim, num_heads, options (num_kv_heads, head_dim, qkv_bias,
            out_bias, dropout, rope, qk_norm, device, dtype): as
            :class:`AttentionLayer`; ``qkv_bias`` covers the gate rows too.
            ``rope`` takes a partial ``rotary_dim`` (Qwen3-Next rotates the
            first quarter of each head, rotate-half form).
        gate: "elementwise" (default, E = D) or "headwise" (E = 1).
        qk_norm_eps: eps of the q/k RMS norms (with ``qk_norm``; default 1e-6).
        qk_norm_unit_offset: the q/k norm gains are (1 + weight), the
            weights starting at zero (Qwen3-Next's parametrisation).

    Attributes:
        gate_width: E, the gate logits per head.
        kind: "output_gated".

    ``return_weights`` and observers get the softmax probabilities that mix
    the values, [B, H, T, S]; the gate acts after that mixing (on the head
    outputs, channel by channel for the elementwise gate), so it is not in
    them. Head hooks (``register_head_hook``) see the gated head outputs.

    Raises:
        ValueError: invalid sizes or options, an unknown ``gate``, a negative
            or infinite ``qk_norm_eps``.
        TypeError: ``kdim``/``vdim`` (one fused projection of the model
            width), a non-bool ``qk_norm_unit_offset``.
    """

    kind = "output_gated"
    refused_options = ("kdim", "vdim")  # one fused projection of the model width
    independent_heads = True
    selects_weights = True  # its core passes the selection to functional.attention and gates only the output
    head_independence = (
        "each head attends with its own query rows (and its group's key/value rows), its gate comes from its own "
        "rows of the query projection and scales only its own output, which reaches out_proj through its own "
        "columns; a key/value head goes with its whole group"
    )

    @classmethod
    def comparison_options(cls, kind: str, num_heads: int) -> dict:
        """The elementwise gate at mha's head counts: the gate is the only difference from "mha"."""
        return {"gate": "elementwise"}

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        gate: str = "elementwise",
        qk_norm_eps: float = 1e-6,
        qk_norm_unit_offset: bool = False,
        **options,
    ) -> None:
        super().__init__(embed_dim, num_heads, **options)
        if gate not in GATES:
            raise ValueError(f"gate must be one of {list(GATES)}, got gate={gate!r}")
        if not isinstance(qk_norm_unit_offset, bool):
            raise TypeError(f"qk_norm_unit_offset must be a bool, got qk_norm_unit_offset={qk_norm_unit_offset!r}")
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        self.gate = gate
        self.gate_width = 1 if gate == "headwise" else D
        qk_norm_eps = check_eps(qk_norm_eps)
        self.init_options.update(gate=gate, qk_norm_eps=qk_norm_eps, qk_norm_unit_offset=qk_norm_unit_offset)
        rows = H * D + H * self.gate_width + 2 * G * D
        self.qkv_proj = nn.Linear(embed_dim, rows, bias=self.qkv_bias, **self.factory)
        self.init_output(H * D, embed_dim)
        self.init_positions(D)
        if self.qk_norm is not None:  # the same slot in the module, with this kind's eps and gain form
            self.qk_norm = QKNorm(D, qk_norm_eps, unit_offset=qk_norm_unit_offset, **self.factory)

    # ------------------------------------------------------------------ projections
    def _widths(self) -> tuple[int, int, int]:
        """(query + gate rows, key rows, value rows) of ``qkv_proj``."""
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        return H * (D + self.gate_width), G * D, G * D

    def _heads(self, query, key, value):
        """q [B, H, T, D], gate logits [B, H, T, E], k and v [B, G, S, D]."""
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        qg, k, v = fused_qkv(self.qkv_proj, query, key, value, self._widths())
        q, gate = qg.split([H * D, H * self.gate_width], dim=-1)  # (B, T, H*D), (B, T, H*E)
        return split_heads(q, H), split_heads(gate, H), split_heads(k, G), split_heads(v, G)

    def project(self, query, key=None, value=None):
        """q [B, H, T, D], k and v [B, G, S, D] (key None: self-attention; S may be 0)."""
        q, _, k, v = self._heads(query, key, value)
        return q, k, v

    def to_heads(self, query, key=None, value=None):
        """As :meth:`project`, plus this call's gate logits [B, H, T, E] in
        ``extra["gate"]`` (from the queries' input: nothing is cached for them)."""
        q, gate, k, v = self._heads(query, key, value)
        return q, k, v, {"gate": gate}

    def core(self, q, k, v, extra, **call):
        """The fused attention core, then each head's output times sigmoid(gate logits).

        Returns:
            (out [B, H, T, D] gated, weights [B, H, T, S] or None): the
            weights are the softmax probabilities, without the gate.
        """
        out, weights = super().core(q, k, v, extra, **call)
        return out * torch.sigmoid(extra["gate"]).to(out.dtype), weights  # (B, H, T, E) over (B, H, T, D)

    # ------------------------------------------------------------------ heads
    def subset_heads(self, heads: list[int], kv_heads: list[int]) -> OutputGatedAttention:
        """The kept heads' q, gate, k and v rows of ``qkv_proj`` and out_proj columns
        (qk_norm gains are shared by every head and stay whole)."""
        H, G, D, E = self.num_heads, self.num_kv_heads, self.head_dim, self.gate_width
        dev = self.out_proj.weight.device
        q_rows = head_rows(heads, D, dev)
        rows = torch.cat([
            q_rows, head_rows(heads, E, dev, offset=H * D),
            head_rows(kv_heads, D, dev, offset=H * (D + E)), head_rows(kv_heads, D, dev, offset=H * (D + E) + G * D),
        ])  # fmt: skip
        state = dict(self.state_dict())
        for suffix in ("weight", "bias"):
            if f"qkv_proj.{suffix}" in state:
                state[f"qkv_proj.{suffix}"] = state[f"qkv_proj.{suffix}"][rows]
        state["out_proj.weight"] = state["out_proj.weight"][:, q_rows]  # (C, H*D) -> (C, H'*D)
        if "sinks" in state:
            state["sinks"] = state["sinks"][heads]  # (H,) -> (H',): each head's sink logit
        new = type(self)(
            self.embed_dim, len(heads), num_kv_heads=len(kv_heads), head_dim=D,
            device="meta", dtype=self.out_proj.weight.dtype, **self.init_options,
        )  # fmt: skip
        return load_selected(new, state, self)

    def cost(
        self,
        T: int,
        S: int | None = None,
        *,
        batch: int = 1,
        causal: bool = False,
        bytes_per_element: int = 2,
    ) -> AttentionCost:
        """FLOPs, parameters and cache bytes of one call (``modules.cost`` conventions).

        core = 2·B·H·P·(D + D) with P visible (query, key) pairs;
        projections = 2·B·(T·C·H·(D + E) + 2·S·C·G·D + T·H·D·C): the gate
        logits are E more rows per head of the query projection. The sigmoid
        and the B·H·T·D gate multiplications are elementwise and not counted,
        nor are rope and qk_norm (whose 2·D gains are among the parameters);
        the cache holds 2·G·D elements per token (no gates: they come from
        the queries).
        """
        S = T if S is None else S
        H, G, D, C, E = self.num_heads, self.num_kv_heads, self.head_dim, self.embed_dim, self.gate_width
        core = 2 * batch * H * visible_pairs(T, S, causal=causal, window=self.sliding_window) * (D + D)
        proj = 2 * batch * (T * C * H * (D + E) + 2 * S * C * G * D + T * H * D * C)
        params = sum(p.numel() for p in self.parameters())
        return AttentionCost(core, proj, params, 2 * G * D * bytes_per_element)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gate={self.gate!r}"
