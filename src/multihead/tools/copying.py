"""The copying score of every head: the sign of its OV circuit from tokens to their own logits.

The OV circuit of head h (Elhage et al. 2021, "A Mathematical Framework for
Transformer Circuits", section "Copying / Primitive in-context learning";
Olsson et al. 2022 use it to show induction heads copy) is the [V, V] map
from the token a head attends to onto the logits it adds, read directly from
the token embeddings to the unembedding (column vectors; e_t the embedding of
token t, Linear weights as [out, in])::

    M_h = W_U · N_f · W_O^h · W_V^g · N_l · W_E^T          [V, V]

    W_E [V, C]   token embedding       W_V^g [D, C]  value rows of h's
    W_U [V, C]   unembedding                         key/value head g
    N_l [C, C]   the layer's norm      W_O^h [C, D]  output columns of h
    N_f [C, C]   the final norm

M_h[s, t] is the logit the head adds to token s when it attends to token t
with weight 1. A copying head raises the attended token's own logit, so M_h
has mostly positive eigenvalues; the score is

    copying_h = Σ_i λ_i / Σ_i |λ_i|        over the eigenvalues λ_i of P·M_h

in [-1, 1] (Σ λ_i = trace M_h is real: complex eigenvalues come in conjugate
pairs). 1: every eigenvalue is positive (the identity copies perfectly); -1:
every one negative (the head lowers what it reads). Its chance level is 0:
the eigenvalues of random weights spread evenly about the imaginary axis.
The logits are read centred over the V' tokens the score covers,
P·M_h with P = I - 11ᵀ/V': the softmax ignores a logit added to every
token alike, so a head that writes the same shift whatever it attends to
copies nothing. This matters in practice: token embeddings share a large
common direction (early in training above all), and without P that one
direction decides the sign of the whole score (every head near +1 or -1).
P·M_h, M_h·P and P·M_h·P share their nonzero eigenvalues, so centring the
attended tokens as well changes nothing. The nonzero eigenvalues of P·M_h
are those of the [D, D] matrix W_V^g N_l W_E^T P W_U N_f W_O^h (AB and BA
share them), which is what is computed, in float64, over the tokens the
random sequences are drawn from.
A head whose circuit has no eigenvalue mass (it writes nothing the
unembedding reads) scores 0: it copies nothing.

A norm enters by its linear part: LayerNorm as diag(γ)·(I - 11ᵀ/C) (centre,
then scale), RMSNorm as diag(γ), nn.Identity as I; its division by each
token's spread (a positive factor per token) and every bias (a constant
offset of the logits, the same for every attended token) are left out.

The layout must be one the score knows, else the score is absent (NaN, with
the reason): a multihead ``GPT`` (``token_embedding``, ``blocks[i].ln_1``,
``blocks[i].attn``, ``ln_f``, ``lm_head``; any model with those names) whose
layers are plain ``MultiHeadAttention`` (mha, gqa, mqa: head h reads value
head h // (H/G)), or a Hugging Face GPT-2, Llama, Mistral, Qwen2 or Qwen3
run through ``multihead.hf`` (their RMSNorms scale by their weight). Kinds
that mix heads (dcmha, talking heads, MoH, ...), gate them, or split them in
two (differential) have no per-head OV circuit of this form.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["copying_scores"]

_NO_LAYOUT = (
    "the model has no token embedding and unembedding the score knows "
    "(a multihead GPT, a Hugging Face GPT-2, Llama, Mistral, Qwen2 or Qwen3)"
)
_NO_UNEMBEDDING = "{} has no unembedding (no lm_head, and its token embedding is not tied to one)"
# Hugging Face RMSNorms that scale by their weight as it is (Gemma's scales by 1 + weight: not here)
_HF_RMS_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
_HF_LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3"}


def copying_scores(
    model: nn.Module, names: list[str], width: int, allowed: torch.Tensor
) -> tuple[torch.Tensor | None, list[str]]:
    """The copying score of each head of the attention modules ``names``.

    Args:
        model: a multihead GPT (or a model with its attribute names) or a
            Hugging Face GPT-2 on ``multihead.hf``.
        names: the attention modules' names, in the order of the table's rows.
        width: the table's number of columns (the most heads of any layer).
        allowed: [V'] the token ids the circuit is read over.

    Returns:
        ([L, width] float scores, NaN where a layer's heads have none) or
        None when no layer has one; and the reasons for what is missing.
    """
    layout = _gpt_layout(model) or _hf_gpt2_layout(model) or _hf_llama_layout(model) or _NO_LAYOUT
    if isinstance(layout, str):
        return None, [f"copying: {layout}"]
    embed, unembed, final, layers = layout
    K = _gram(embed, unembed, allowed) @ final  # (C, C): W_E^T W_U N_f
    table, notes = torch.full((len(names), width), float("nan")), []
    for row, name in enumerate(names):
        found = layers.get(name)
        if isinstance(found, str) or found is None:
            notes.append(f"copying: layer {row} ({name}): {found or 'not a layer of the known layout'}")
            continue
        norm, heads = found
        NK = norm @ K  # (C, C)
        for h, (Wv, Wo) in enumerate(heads):
            table[row, h] = _score(Wv @ NK @ Wo)  # (D, C) @ (C, C) @ (C, D) -> (D, D)
    if torch.isnan(table).all():
        return None, notes
    return table, notes


def _w(t: torch.Tensor) -> torch.Tensor:
    """A weight as float64 on the CPU (where the circuits are formed, whatever the model's device)."""
    return t.detach().to("cpu", torch.float64)


def _gram(embed: torch.Tensor, unembed: torch.Tensor, allowed: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """W_E^T P W_U [C, C] over the ``allowed`` rows (P = I - 11ᵀ/V' centres the logits), accumulated a
    few thousand rows at a time (a 50k-token vocabulary in float64 would otherwise take two copies of 300 MB)."""
    C = embed.shape[1]
    total = torch.zeros(C, C, dtype=torch.float64)
    sum_e, sum_u = torch.zeros(C, dtype=torch.float64), torch.zeros(C, dtype=torch.float64)
    allowed = allowed.to(embed.device)
    for lo in range(0, len(allowed), chunk):
        rows = allowed[lo : lo + chunk]
        e, u = _w(embed[rows]), _w(unembed[rows])
        total += e.T @ u  # (C, r) @ (r, C)
        sum_e += e.sum(0)
        sum_u += u.sum(0)
    return total - torch.outer(sum_e, sum_u) / len(allowed)  # W_E^T (I - 11ᵀ/V') W_U: logits centred


def _score(N: torch.Tensor) -> float:
    """Σλ / Σ|λ| of the eigenvalues of ``N`` [D, D]; 0 when they are all zero."""
    lam = torch.linalg.eigvals(N)
    mass = float(lam.abs().sum())
    if mass <= 1e-12 * max(1.0, float(N.abs().max())):
        return 0.0
    return float(lam.real.sum()) / mass


def _norm_matrix(norm: nn.Module, C: int) -> torch.Tensor | str:
    """The linear part [C, C] of a pre-attention or final norm, or why it has none."""
    if isinstance(norm, nn.Identity):
        return torch.eye(C, dtype=torch.float64)
    gain = getattr(norm, "weight", None)
    gain = torch.ones(C, dtype=torch.float64) if gain is None else _w(gain)
    if isinstance(norm, nn.LayerNorm):
        return torch.diag(gain) @ (torch.eye(C, dtype=torch.float64) - 1.0 / C)
    if isinstance(norm, nn.RMSNorm) or type(norm).__name__ in _HF_RMS_NORMS:
        return torch.diag(gain)
    return f"its norm {type(norm).__name__} is not LayerNorm, RMSNorm or Identity"


def _heads_of_mha(attn: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]] | str:
    """(W_V^g [D, C], W_O^h [C, D]) per head of a plain multihead MHA/GQA/MQA layer, or why not."""
    from ..modules.kinds.mha import MultiHeadAttention

    if type(attn) is not MultiHeadAttention:
        kind = getattr(attn, "kind", type(attn).__name__)
        return f"kind {kind!r} has no per-head OV circuit (only mha, gqa, mqa)"
    projections = [getattr(attn, n) for n in ("qkv_proj", "v_proj", "out_proj") if hasattr(attn, n)]
    if not all(type(p) is nn.Linear for p in projections):  # weight-only int8/bf16 layers: no float weight
        return "its projections are not plain Linear layers"
    H, G, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    Wv = _w(attn.projection_weights()["v"][0])  # (G*D, C)
    Wo = _w(attn.out_proj.weight)  # (C, H*D)
    per = H // G
    return [(Wv[(h // per) * D : (h // per + 1) * D], Wo[:, h * D : (h + 1) * D]) for h in range(H)]


def _gpt_layout(model: nn.Module):
    """(W_E, W_U, N_f, {attention name: (N_l, heads) or why not}) of a multihead GPT layout, None when
    the model is not one, or why it cannot be read (the ``_hf_*`` layouts answer the same way)."""
    names = ("token_embedding", "blocks", "ln_f", "lm_head")
    if not all(hasattr(model, n) for n in names) or not isinstance(model.token_embedding, nn.Embedding):
        return None
    if not isinstance(model.lm_head, nn.Linear):
        return None
    C = model.token_embedding.weight.shape[1]
    final = _norm_matrix(model.ln_f, C)
    if isinstance(final, str):
        return f"the final {final[4:]}"
    names = {id(m): n for n, m in model.named_modules()}
    layers = {}
    for block in model.blocks:
        if not (hasattr(block, "ln_1") and hasattr(block, "attn")):
            return None
        norm, heads = _norm_matrix(block.ln_1, C), _heads_of_mha(block.attn)
        layers[names[id(block.attn)]] = (
            norm if isinstance(norm, str) else heads if isinstance(heads, str) else (norm, heads)
        )
    return model.token_embedding.weight, model.lm_head.weight, final, layers


def _hf_gpt2_layout(model: nn.Module):
    """The same for a Hugging Face GPT-2 (``GPT2Model`` or ``GPT2LMHeadModel``), or None.

    Conv1D weights are [in, out]: value columns 2C..3C of ``c_attn``, rows
    h·D..(h+1)·D of ``c_proj``. The unembedding is ``lm_head``, or the tied
    token embedding of a bare ``GPT2Model``.
    """
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "gpt2":
        return None
    base = model.base_model
    out = model.get_output_embeddings()
    if out is None and not getattr(config, "tie_word_embeddings", True):
        return _NO_UNEMBEDDING.format(type(model).__name__)
    unembed = base.wte.weight if out is None else out.weight
    C = base.wte.weight.shape[1]
    final = _norm_matrix(base.ln_f, C)
    names = {id(m): n for n, m in model.named_modules()}
    layers = {}
    for block in base.h:
        attn = block.attn
        H, D = attn.num_heads, attn.head_dim
        Wv = _w(attn.c_attn.weight)[:, 2 * C : 3 * C].T  # (C, 3C) -> (H*D, C)
        Wo = _w(attn.c_proj.weight).T  # (H*D, C) -> (C, H*D)
        heads = [(Wv[h * D : (h + 1) * D], Wo[:, h * D : (h + 1) * D]) for h in range(H)]
        norm = _norm_matrix(block.ln_1, C)
        layers[names[id(attn)]] = norm if isinstance(norm, str) else (norm, heads)
    return base.wte.weight, unembed, final, layers


def _hf_llama_layout(model: nn.Module):
    """The same for a Hugging Face Llama, Mistral, Qwen2 or Qwen3 (``*Model`` or ``*ForCausalLM``), or None.

    ``v_proj`` [G·D, C] and ``o_proj`` [C, H·D] are Linear weights; query
    head h reads value head h // (H/G), as transformers' ``repeat_kv``.
    """
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in _HF_LLAMA_LIKE:
        return None
    base = model.base_model
    out = model.get_output_embeddings()
    if out is None and not getattr(config, "tie_word_embeddings", False):
        return _NO_UNEMBEDDING.format(type(model).__name__)
    embed = base.embed_tokens.weight
    C = embed.shape[1]
    final = _norm_matrix(base.norm, C)
    if isinstance(final, str):
        return f"the final {final[4:]}"
    names = {id(m): n for n, m in model.named_modules()}
    layers = {}
    for block in base.layers:
        attn = block.self_attn
        D, per = attn.head_dim, attn.num_key_value_groups
        Wv, Wo = _w(attn.v_proj.weight), _w(attn.o_proj.weight)  # (G*D, C), (C, H*D)
        H = Wo.shape[1] // D
        heads = [(Wv[(h // per) * D : (h // per + 1) * D], Wo[:, h * D : (h + 1) * D]) for h in range(H)]
        norm = _norm_matrix(block.input_layernorm, C)
        layers[names[id(attn)]] = norm if isinstance(norm, str) else (norm, heads)
    return embed, embed if out is None else out.weight, final, layers
