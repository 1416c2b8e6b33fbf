"""Small random Hugging Face GPT-2 models and their multihead copies (nothing
is downloaded; callers skip their module when transformers is missing)."""

from __future__ import annotations

import torch

from multihead.convert.hf_gpt2 import gpt_from_hf_state_dict
from multihead.models.gpt import GPT, GPTConfig

__all__ = ["SMALL_HF", "hf_model", "ours_from"]

SMALL_HF = dict(
    n_layer=2,
    n_head=4,
    n_embd=64,
    vocab_size=97,
    n_positions=64,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)


def hf_model(seed: int = 0, **overrides):
    """A random small ``GPT2LMHeadModel`` in eval mode, biases and LayerNorms
    perturbed so every parameter matters for parity."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**{**SMALL_HF, **overrides}, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def ours_from(hf) -> GPT:
    """The multihead ``GPT`` (eval mode) holding ``hf``'s weights."""
    return gpt_from_hf_state_dict(hf.state_dict(), GPTConfig.from_hf_config(hf.config)).eval()
