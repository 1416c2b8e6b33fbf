"""Hard-concrete head gates (Voita et al. 2019): attention whose heads can be pruned.

Voita, Talbot, Moiseev, Sennrich, Titov, "Analyzing Multi-Head Self-Attention:
Specialized Heads Do the Heavy Lifting, the Rest Can Be Pruned" (ACL 2019,
arXiv:1905.09418; official code ``lena-voita/the-story-of-heads``,
``MultiHeadAttnConcrete``). Every query head h gets a scalar gate g_h in
[0, 1] that scales its output before the output projection::

    x --project--> q (B, H, T, D), k/v (B, G, S, D)
      [--qk_norm (RMS over D) --> rope (rotate q, k over D)]
      --functional.attention--> heads (B, H, T, D)
      --x g_h per head--> (B, H, T, D) --merge heads--> out_proj --> (B, T, C)

The optional ``rope`` / ``qk_norm`` steps (off by default) are those of
:class:`MultiHeadAttention`: applied to the projected q [B, H, T, D] and
k [B, G, S, D] on the head dim D, before the KV-cache write and the
attention; the gates act only on the head outputs afterwards.

The gate is a stretched hard-concrete variable with log-parameter
``log_alpha[h]`` (Louizos et al., arXiv:1712.01312)::

    training: u ~ U(eps, 1 - eps), one draw per head per call, shared by the
              whole batch; s = sigmoid((ln u - ln(1 - u) + log_alpha) / T)
    eval:     s = sigmoid(log_alpha)                 (no noise, no temperature)
    both:     g = clip(s (high - low) + low, 0, 1)   (low, high) = (-0.1, 1.1)

    gate g  0 ..........(0, 1)..........1
    eval:   log_alpha <= ln(1/11)  |  between  |  log_alpha >= ln 11
            head closed: removable |  scaled   |  head fully open

The L0 penalty ``l0_penalty()`` = l0_coef * sum_h P(g_h != 0) (the expected
number of open heads) is differentiable in ``log_alpha``. The paper's loss is
cross-entropy + concrete_coef * mean over gated layers of each layer's
penalty (:func:`concrete_penalty`); the official scripts use concrete_coef
0.1 and vary it to keep more or fewer heads.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import nn

from .. import hard_concrete
from ..cost import AttentionCost
from ..registry import register_attention
from .mha import MultiHeadAttention

__all__ = ["GatedHeadAttention", "concrete_penalty"]


def _positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite float > 0, got {name}={value!r}")
    return float(value)


class GatedHeadAttention(MultiHeadAttention):
    """Multi-head attention with a hard-concrete gate on each query head.

    A :class:`MultiHeadAttention` (same parameters, same state-dict names,
    GQA, cross-attention and KV cache unchanged) plus ``log_alpha`` [H].
    Training mode samples the gates (reparametrised, from torch's global
    generator: one ``torch.rand(H)`` per call, drawn before the attention
    dropout, so seeding torch reproduces them; like dropout, only in
    training). Eval mode uses the deterministic gates, for which cached
    decoding equals recomputation. A head whose eval gate is exactly 0
    (``closed_heads()``) contributes nothing and can be removed.

    Args:
        embed_dim, num_heads, options (num_kv_heads, head_dim, kdim, vdim,
        qkv_bias, out_bias, dropout, device, dtype): as :class:`MultiHeadAttention`.
        rope, qk_norm (options too): as :class:`MultiHeadAttention` (both off by default):
            per-head RMS norm (gains ``qk_norm.q_norm.weight`` /
            ``qk_norm.k_norm.weight``, [D] each) and then rotary embeddings,
            applied to the projected q [B, H, T, D] and k [B, G, S, D] over
            the head dim D, after ``project`` and before the KV-cache write
            (the cache holds normalised, rotated keys) and the attention
            core. The gates are unaffected: they scale the head outputs.
        temperature: T of the hard-concrete distribution (default 0.33).
        stretch: (low, high) stretch interval, low < 0 and high > 1
            (default (-0.1, 1.1)).
        eps: noise is drawn from U(eps, 1 - eps) and P(open) is clipped to
            [eps, 1 - eps] (default 1e-6).
        l0_coef: the official ``ConcreteGate`` ``l0_penalty`` coefficient
            (1.0 in ``MultiHeadAttnConcrete``).

    Attributes:
        log_alpha: [H] gate log-parameters, initialised U(-sqrt(3/H), sqrt(3/H))
            (the official Glorot-uniform on shape (1, H, 1, 1)).
        kind: "gated" (a class attribute).
        last_gates: [H] detached gates used by the latest forward, or None.

    ``aux_loss()`` after a training-mode forward is that forward's
    ``l0_penalty()`` (0-d, with gradient to ``log_alpha``), the term a
    training loop adds to its loss (models sum it over layers); a 0-d zero
    after an eval-mode forward.

    Raises:
        ValueError: invalid sizes, dropout, temperature, stretch, eps or l0_coef.
    """

    kind = "gated"
    head_independence = (
        "as multi-head attention: each head reaches the output only through its own columns of out_proj, "
        "and its gate log_alpha goes with it"
    )

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        temperature: float = 0.33,
        stretch: Sequence[float] = (-0.1, 1.1),
        eps: float = 1e-6,
        l0_coef: float = 1.0,
        **options,
    ) -> None:
        super().__init__(embed_dim, num_heads, **options)
        self.temperature = _positive_float("temperature", temperature)
        if (
            isinstance(stretch, (str, bytes))
            or not isinstance(stretch, Sequence)
            or len(stretch) != 2
            or not all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in stretch)
            or not (math.isfinite(stretch[0]) and math.isfinite(stretch[1]))
            or not (stretch[0] < 0 and stretch[1] > 1)
        ):
            raise ValueError(f"stretch must be (low, high) with low < 0 and high > 1, got stretch={stretch!r}")
        self.stretch = (float(stretch[0]), float(stretch[1]))
        self.eps = _positive_float("eps", eps)
        if self.eps >= 0.5:
            raise ValueError(f"eps must be in (0, 0.5), got eps={eps!r}")
        if isinstance(l0_coef, bool) or not isinstance(l0_coef, numbers.Real) or not (
            math.isfinite(l0_coef) and l0_coef >= 0
        ):
            raise ValueError(f"l0_coef must be a finite float >= 0, got l0_coef={l0_coef!r}")
        self.l0_coef = float(l0_coef)
        self.init_options.update(temperature=self.temperature, stretch=self.stretch, eps=self.eps, l0_coef=self.l0_coef)
        self.log_alpha = nn.Parameter(torch.empty(self.num_heads, **self.factory))
        self._aux_loss: torch.Tensor | None = None
        self.last_gates: torch.Tensor | None = None
        self.reset_gates()

    # ------------------------------------------------------------------ gates
    def reset_gates(self) -> None:
        """log_alpha ~ U(-sqrt(3/H), sqrt(3/H)) from torch's global generator."""
        bound = math.sqrt(3.0 / self.num_heads)
        with torch.no_grad():
            self.log_alpha.uniform_(-bound, bound)

    def _gate_dtype(self) -> torch.dtype:
        return torch.promote_types(self.log_alpha.dtype, torch.float32)  # fp16/bf16 gates in fp32

    def eval_gates(self) -> torch.Tensor:
        """Deterministic gates [H] = clip(sigmoid(log_alpha) (high - low) + low, 0, 1),
        differentiable in ``log_alpha``."""
        return hard_concrete.eval_gates(self.log_alpha.to(self._gate_dtype()), self.stretch)

    def sample_gates(self, num_samples: int | None = None) -> torch.Tensor:
        """Training-time gates, [H] (or [num_samples, H]), differentiable in ``log_alpha``.

        Draws u = eps + (1 - 2 eps) torch.rand(...) from the global generator,
        then g = clip(sigmoid((ln u - ln(1 - u) + log_alpha) / T) (high - low) + low, 0, 1).
        """
        shape = (self.num_heads,) if num_samples is None else (int(num_samples), self.num_heads)
        return hard_concrete.sample_gates(
            self.log_alpha.to(self._gate_dtype()), shape, temperature=self.temperature, limits=self.stretch,
            eps=self.eps,
        )  # fmt: skip

    def gates(self) -> torch.Tensor:
        """The gates a forward uses now: sampled in training, deterministic in eval."""
        return self.sample_gates() if self.training else self.eval_gates()

    def gate_values(self) -> torch.Tensor:
        """Deterministic (eval-mode) gate values [H], detached."""
        return self.eval_gates().detach()

    def head_state(self, heads: list[int], kv_heads: list[int]) -> dict[str, torch.Tensor]:
        """As ``MultiHeadAttention.head_state``, with the kept heads' gates ``log_alpha``."""
        state = super().head_state(heads, kv_heads)
        state["log_alpha"] = state["log_alpha"][torch.tensor(heads, dtype=torch.long, device=self.log_alpha.device)]
        return state

    def closed_heads(self) -> list[int]:
        """Heads whose eval gate is exactly 0: they contribute nothing and can be removed."""
        return [h for h, g in enumerate(self.gate_values().tolist()) if g == 0.0]

    def open_heads(self) -> list[int]:
        """Heads whose eval gate is non-zero."""
        return [h for h, g in enumerate(self.gate_values().tolist()) if g != 0.0]

    def open_probabilities(self) -> torch.Tensor:
        """P(g_h != 0) [H] = clip(sigmoid(log_alpha - T ln(-low / high)), eps, 1 - eps)."""
        return hard_concrete.open_probabilities(
            self.log_alpha.to(self._gate_dtype()), temperature=self.temperature, limits=self.stretch, eps=self.eps
        )

    def l0_penalty(self) -> torch.Tensor:
        """l0_coef * sum_h P(g_h != 0): the differentiable expected number of open heads
        (``ConcreteGate.get_penalty``), a scalar tensor."""
        return self.l0_coef * self.open_probabilities().sum()

    # ------------------------------------------------------------------ forward
    def to_heads(self, query, key=None, value=None):
        """As :meth:`MultiHeadAttention.project`, plus this call's gates [H] in
        ``extra["gates"]``: in training one ``torch.rand(H)`` draw, before any
        attention dropout; deterministic in eval.

        The forward (``AttentionLayer.forward``) is that of
        :class:`MultiHeadAttention` (arguments, masks, cache, rope/qk_norm on
        q [B, H, T, D] and k [B, G, S, D] before the cache write). The gate
        multiplies each head's output after attention dropout and before
        ``out_proj``; ``return_weights`` and observers get the gated weights
        g_h · softmax probabilities (each row sums to g_h, or 0 when fully
        masked). In training each call samples new gates (so cached decoding
        equals recomputation only in eval mode) and records ``aux_loss()``.
        """
        q, k, v = self.project(query, key, value)
        return q, k, v, {"gates": self.gates()}

    def core(self, q, k, v, extra, **call):
        """The attention core, then head h's output and weights scaled by g_h."""
        out, weights = super().core(q, k, v, extra, **call)
        g = extra["gates"]
        self.last_gates = g.detach()
        self._aux_loss = self.l0_penalty() if self.training else None
        g = g.to(out.dtype)[:, None, None]  # (H,) -> (H, 1, 1), broadcast over (B, H, T, D)
        out = out * g  # (B, H, T, D): head h scaled by g_h
        if weights is not None:
            weights = weights * g  # (B, H, T, S): the weights that mix the values
        return out, weights

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

        As :meth:`MultiHeadAttention.cost`: core = 2·B·H·P·(D + D) with P visible
        (query, key) pairs; projections = 2·B·(T·C·H·D + S·kdim·G·D + S·vdim·G·D
        + T·H·D·C). The gate's B·H·T·D multiplications are elementwise and not
        counted, nor are rope and qk_norm; ``parameters`` (= sum of
        ``p.numel()``) includes the H gate log-parameters and, with
        ``qk_norm``, its 2·D gains; the cache
        holds 2·G·D elements per token.
        """
        return super().cost(T, S, batch=batch, causal=causal, bytes_per_element=bytes_per_element)

    def aux_loss(self) -> torch.Tensor:
        """The L0 penalty of the last training-mode forward (0-d, gradient to
        ``log_alpha``); a 0-d zero on the device and dtype of ``out_proj.weight``
        after an eval-mode forward or before any forward."""
        if self._aux_loss is None:
            w = self.out_proj.weight
            return torch.zeros((), device=w.device, dtype=w.dtype)
        return self._aux_loss

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, temperature={self.temperature}, stretch={self.stretch}, "
            f"l0_coef={self.l0_coef}"
        )

    @classmethod
    def from_attention(cls, module: MultiHeadAttention, **options) -> GatedHeadAttention:
        """Gates on a trained :class:`MultiHeadAttention` (the paper starts from a
        trained baseline): same sizes, a copy of its weights, fresh ``log_alpha``.

        ``options`` are the gate options (temperature, stretch, eps, l0_coef);
        ``rope`` and ``qk_norm`` default to the module's own (its qk_norm
        gains are copied) and may be overridden here.
        """
        if not isinstance(module, MultiHeadAttention):
            raise TypeError(f"module must be a MultiHeadAttention, got {type(module).__name__}")
        ref = module.out_proj.weight
        options.setdefault("rope", False if module.rope is None else dict(module.rope))
        options.setdefault("qk_norm", module.qk_norm is not None)
        m = cls(
            module.embed_dim, module.num_heads, num_kv_heads=module.num_kv_heads, head_dim=module.head_dim,
            kdim=module.kdim, vdim=module.vdim, qkv_bias=module.projection_weights()["q"][1] is not None,
            out_bias=module.out_proj.bias is not None, dropout=module.dropout, device=ref.device, dtype=ref.dtype,
            **options,
        )  # fmt: skip
        state = {**module.state_dict(), "log_alpha": m.log_alpha.detach().clone()}
        if m.qk_norm is None:  # qk_norm=False asked for a module that has one: drop its gains
            state = {n: t for n, t in state.items() if not n.startswith("qk_norm.")}
        elif module.qk_norm is None:  # qk_norm=True on a module without one: fresh gains (ones)
            state.update({f"qk_norm.{n}": t.detach().clone() for n, t in m.qk_norm.state_dict().items()})
        m.load_state_dict(state)
        return m.train(module.training)

    # ------------------------------------------------------------------ official layout
    @classmethod
    def from_voita_state_dict(
        cls, state_dict: dict[str, object], *, num_heads: int, **options
    ) -> GatedHeadAttention:
        """Build from one official ``MultiHeadAttnConcrete`` scope (combined format).

        Expects TensorFlow (in, out) matrices ``mem_conv/W`` [C, 3C] (columns
        [Q | K | V], head-major), ``mem_conv/b`` [3C], ``out_conv/W`` [C, C],
        ``out_conv/b`` [C] and ``gate/log_a`` [1, H, 1, 1] (NumPy arrays or
        tensors); every W is transposed to PyTorch's (out, in). The module's
        forward then computes the official self-attention (a bool mask here
        replaces the official additive -1e9 offset, which agrees wherever a
        row has a visible key). ``options`` go to the constructor.

        Raises:
            ValueError: a missing name or a shape that does not fit.
        """
        need = ("mem_conv/W", "mem_conv/b", "out_conv/W", "out_conv/b", "gate/log_a")
        missing = [n for n in need if n not in state_dict]
        if missing:
            raise ValueError(f"missing official parameters {missing}; expected {list(need)}")
        t = {n: torch.as_tensor(state_dict[n]) for n in need}
        C = t["out_conv/W"].shape[1]
        shapes = {n: tuple(x.shape) for n, x in t.items()}
        want = {"mem_conv/W": (C, 3 * C), "mem_conv/b": (3 * C,), "out_conv/W": (C, C), "out_conv/b": (C,),
                "gate/log_a": (1, num_heads, 1, 1)}  # fmt: skip
        if shapes != want:
            raise ValueError(f"official parameter shapes {shapes} do not fit embed_dim={C}, num_heads={num_heads}: "
                             f"expected {want}")  # fmt: skip
        dtype = options.pop("dtype", t["mem_conv/W"].dtype)
        m = cls(C, num_heads, dtype=dtype, **options)
        with torch.no_grad():
            m.qkv_proj.weight.copy_(t["mem_conv/W"].T)
            m.qkv_proj.bias.copy_(t["mem_conv/b"])
            m.out_proj.weight.copy_(t["out_conv/W"].T)
            m.out_proj.bias.copy_(t["out_conv/b"])
            m.log_alpha.copy_(t["gate/log_a"].reshape(num_heads))
        return m


def concrete_penalty(model: nn.Module, concrete_coef: float = 1.0) -> torch.Tensor:
    """The paper's regulariser: concrete_coef * mean over gated layers of ``l0_penalty()``.

    Add it to the mean token cross-entropy (``ConcreteProblem``); the official
    scripts use concrete_coef = 0.1. Returns a zero scalar if ``model`` has
    no :class:`GatedHeadAttention`.
    """
    layers = [m for m in model.modules() if isinstance(m, GatedHeadAttention)]
    if not layers:
        return torch.zeros(())
    return concrete_coef * torch.stack([m.l0_penalty() for m in layers]).mean()


@register_attention("gated", GatedHeadAttention)
def _gated(*, embed_dim: int, num_heads: int, **options) -> GatedHeadAttention:
    # its options are its class's (build_attention refuses any other, listing them)
    return GatedHeadAttention(embed_dim, num_heads, **options)
