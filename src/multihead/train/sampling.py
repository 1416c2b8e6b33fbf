"""``--sample-every N``: a short greedy continuation printed while training.

Every N steps (and after the last) the model continues the first
``PROMPT_TOKENS`` tokens of the validation split by ``SAMPLE_TOKENS`` tokens,
greedily (argmax), in eval mode, and the loop prints one line::

    sample at step 400: 'ROMEO:\\nWhat' -> ' is the matter?\\n\\nROMEO:\\nI will not'

Greedy decoding draws no random numbers, and the generators are put back as
they were anyway, so a run with samples computes the very steps of one
without (every rank decodes the same tokens: a sharded model needs all of
them in each forward).
"""

from __future__ import annotations

import numpy as np
import torch

from ..models.generation import generate

__all__ = ["PROMPT_TOKENS", "SAMPLE_TOKENS", "sample_line"]

PROMPT_TOKENS = 8
SAMPLE_TOKENS = 48


def sample_line(model, tokenizer, val_tokens: np.ndarray, step: int, device: torch.device) -> str:
    """``sample at step N: 'prompt' -> 'continuation'`` (the texts as Python literals,
    so the line stays one line); the model is left in training mode."""
    prompt = [int(t) for t in val_tokens[: min(PROMPT_TOKENS, model.config.context_length - 1)]]
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    model.eval()
    try:
        with torch.no_grad():
            ids = generate(model, torch.tensor([prompt], device=device), SAMPLE_TOKENS, temperature=0.0)
    finally:
        model.train()
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
    new = ids[0, len(prompt) :].tolist()
    return f"sample at step {step}: {tokenizer.decode(prompt)!r} -> {tokenizer.decode(new)!r}"
