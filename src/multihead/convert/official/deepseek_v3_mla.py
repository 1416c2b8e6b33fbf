"""Official DeepSeek-V3 ``MLA`` weights (deepseek-ai/DeepSeek-V3, ``inference/model.py``).

    module = from_official("deepseek_v3_mla", state_dict, dim=2048, n_heads=16, q_lora_rank=0,
                           kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                           v_head_dim=128, max_seq_len=16384, original_seq_len=4096, rope_factor=40)
    y = module(x, start_pos=0, mask=mask)      # MLA.forward(x, start_pos, freqs_cis, mask)
    y = module(x_next, start_pos=T)            # one more token, from the module's cache

``official_config`` takes the fields of the official ``ModelArgs`` (the
model-wide ones, such as ``vocab_size`` or the MoE sizes, are accepted and
unused) and the global ``attn_impl`` ("absorb", the official default, or
"naive"), which picks the module's ``decode`` path; ``world_size`` must be 1
(the state dict holds every head).

Parameter map (official -> ``MultiHeadLatentAttention``; no biases)::

    wq.weight                                -> q_proj.weight          (q_lora_rank 0)
    wq_a.weight, q_norm.weight, wq_b.weight  -> q_a_proj.weight, q_a_norm.weight, q_b_proj.weight
    wkv_a.weight                             -> kv_a_proj.weight       rows [latent L | rope key R]
    kv_norm.weight                           -> kv_a_norm.weight
    wkv_b.weight                             -> kv_b_proj.weight       head blocks [k_N Dn | v Dv]
    wo.weight                                -> out_proj.weight

Rope is interleaved over the R rope channels with base ``rope_theta``; YaRN
(``factor`` = rope_factor, ``beta_fast``, ``beta_slow``, ``mscale``) is on
exactly when ``max_seq_len > original_seq_len``, as in the official code.
The official RMSNorm's eps is 1e-6. ``freqs_cis`` is not an argument: the
module computes the rotation from the configuration.
"""

from __future__ import annotations

import torch
from torch import nn

from ..._checks import positive_int
from ...modules.kinds.mla import MultiHeadLatentAttention

__all__ = ["OfficialMLA", "from_official", "to_official", "MODEL_ARGS"]

MODEL_ARGS: dict[str, object] = {  # the official ModelArgs fields and their defaults
    "max_batch_size": 8, "max_seq_len": 4096 * 4, "dtype": "bf16", "scale_fmt": None, "vocab_size": 102400,
    "dim": 2048, "inter_dim": 10944, "moe_inter_dim": 1408, "n_layers": 27, "n_dense_layers": 1, "n_heads": 16,
    "n_routed_experts": 64, "n_shared_experts": 2, "n_activated_experts": 6, "n_expert_groups": 1,
    "n_limited_groups": 1, "score_func": "softmax", "route_scale": 1.0,
    "q_lora_rank": 0, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "original_seq_len": 4096, "rope_theta": 10000.0, "rope_factor": 40, "beta_fast": 32, "beta_slow": 1,
    "mscale": 1.0,
}  # fmt: skip
_IMPL = {"absorb": "absorbed", "naive": "naive"}
_NAMES = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv_a": "kv_a_proj",
          "kv_norm": "kv_a_norm", "wkv_b": "kv_b_proj", "wo": "out_proj"}  # fmt: skip


class OfficialMLA(nn.Module):
    """The official ``MLA``'s interface around a ``MultiHeadLatentAttention``.

    ``forward(x [B, T, dim], start_pos=0, mask=None) -> [B, T, dim]`` as the
    official forward: ``mask`` is added to the scores ((T, T), the official
    causal mask of a prefill, or None: every cached key is visible), and the
    keys of each call are cached at ``start_pos`` .. ``start_pos + T - 1``.
    ``start_pos`` 0 starts a new sequence; any other value must be the
    number of cached positions.

    Attributes:
        attention: the ``MultiHeadLatentAttention`` doing the work.
        max_batch_size, max_seq_len: the official cache sizes.
        cache: the current sequence's cache (from ``attention.make_kv_cache``) or None.
    """

    def __init__(self, attention: MultiHeadLatentAttention, *, max_batch_size: int, max_seq_len: int) -> None:
        super().__init__()
        self.attention = attention
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.cache = None

    def forward(self, x: torch.Tensor, start_pos: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Raises ValueError: a batch above max_batch_size, or start_pos other than 0 or the cached length."""
        B = x.shape[0]
        if B > self.max_batch_size:
            raise ValueError(f"batch {B} > max_batch_size={self.max_batch_size}")
        if start_pos == 0 or self.cache is None:
            if start_pos != 0:
                raise ValueError(f"start_pos={start_pos} with nothing cached: start a sequence at start_pos=0")
            self.cache = self.attention.make_kv_cache(B, self.max_seq_len, dtype=x.dtype, device=x.device)
        elif start_pos != self.cache.length:
            raise ValueError(f"start_pos={start_pos} must be 0 (a new sequence) or the cached length "
                             f"{self.cache.length}")  # fmt: skip
        return self.attention(x, attn_mask=mask, kv_cache=self.cache)


def _config(official_config: dict) -> dict:
    known = {*MODEL_ARGS, "attn_impl", "world_size"}
    unknown = sorted(set(official_config) - known)
    if unknown:
        raise ValueError(f"unknown DeepSeek-V3 ModelArgs fields {unknown}; known: {sorted(known)}")
    cfg = {**MODEL_ARGS, "attn_impl": "absorb", "world_size": 1, **official_config}
    if cfg["world_size"] != 1:
        raise ValueError(f"world_size={cfg['world_size']}: give the whole state dict (world_size 1)")
    if cfg["attn_impl"] not in _IMPL:
        raise ValueError(f"attn_impl must be 'absorb' or 'naive', got attn_impl={cfg['attn_impl']!r}")
    for name in ("dim", "n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "max_seq_len", "original_seq_len", "max_batch_size"):  # fmt: skip
        positive_int(name, cfg[name])
    return cfg


def from_official(state_dict: dict[str, torch.Tensor], **official_config) -> OfficialMLA:
    """Build the multihead equivalent of an official ``MLA(ModelArgs(**official_config))``.

    Returns:
        an ``OfficialMLA`` in the state dict's dtype and on its device.

    Raises:
        ValueError: unknown config fields, world_size other than 1, an unknown
            attn_impl, or missing, unexpected or mis-shaped parameters (named).
    """
    cfg = _config(official_config)
    C, H, Rq, L = cfg["dim"], cfg["n_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]
    Dn, R, Dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q = {"wq.weight": (H * (Dn + R), C)} if not Rq else {
        "wq_a.weight": (Rq, C), "q_norm.weight": (Rq,), "wq_b.weight": (H * (Dn + R), Rq)}  # fmt: skip
    expected = {**q, "wkv_a.weight": (L + R, C), "kv_norm.weight": (L,), "wkv_b.weight": (H * (Dn + Dv), L),
                "wo.weight": (C, H * Dv)}  # fmt: skip
    unexpected, missing = sorted(set(state_dict) - set(expected)), sorted(set(expected) - set(state_dict))
    if unexpected or missing:
        raise ValueError(f"official MLA state dict: missing {missing}, unexpected {unexpected}")
    wrong = {n: tuple(state_dict[n].shape) for n, s in expected.items() if tuple(state_dict[n].shape) != s}
    if wrong:
        raise ValueError(f"official MLA parameters of the wrong shape {wrong}; expected {expected}")
    ref = state_dict["wo.weight"]
    yarn = None
    if cfg["max_seq_len"] > cfg["original_seq_len"]:
        yarn = {"factor": float(cfg["rope_factor"]), "original_seq_len": cfg["original_seq_len"],
                "beta_fast": cfg["beta_fast"], "beta_slow": cfg["beta_slow"], "mscale": cfg["mscale"]}  # fmt: skip
    m = MultiHeadLatentAttention(
        C, H, q_lora_rank=Rq, kv_lora_rank=L, qk_nope_head_dim=Dn, qk_rope_head_dim=R, v_head_dim=Dv,
        rope={"base": float(cfg["rope_theta"]), "interleaved": True}, yarn=yarn, decode=_IMPL[cfg["attn_impl"]],
        qkv_bias=False, out_bias=False, device=ref.device, dtype=ref.dtype,
    )  # fmt: skip
    m.load_state_dict({f"{_NAMES[n.split('.')[0]]}.weight": t for n, t in state_dict.items()})
    return OfficialMLA(m.eval(), max_batch_size=cfg["max_batch_size"], max_seq_len=cfg["max_seq_len"])


def to_official(module: OfficialMLA) -> dict[str, torch.Tensor]:
    """The official state dict of a module built by :func:`from_official`."""
    ours = {f"{n}.weight": f"{o}.weight" for o, n in _NAMES.items()}
    return {ours[n]: t.detach().clone() for n, t in module.attention.state_dict().items()}
