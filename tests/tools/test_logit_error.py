"""tools.logit_error: the numbers it reports against a direct computation."""

from __future__ import annotations

import copy

import pytest
import torch

from multihead.models import GPT, GPTConfig, quantize_weights
from multihead.tools.logit_error import logit_error


def tiny(seed=0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_preset("tiny", context_length=32)).eval()


def test_a_model_against_itself_has_no_error():
    model = tiny()
    idx = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    err = logit_error(model, copy.deepcopy(model), idx, new_tokens=6)
    assert err.max_abs == 0.0 and err.relative == 0.0 and err.argmax_agreement == 1.0
    assert err.greedy_equal == 6 and err.new_tokens == 6 and err.positions == 11


def test_the_reported_error_is_the_logits_difference():
    """catches: comparing other positions, a norm other than Frobenius, the wrong reference."""
    model = tiny()
    other = quantize_weights(model, "int8")
    idx = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    err = logit_error(model, other, idx, new_tokens=4)
    with torch.no_grad():
        seq = model.generate(idx, 4, temperature=0)
        ref, out = model(seq).double(), other(seq).double()
    torch.testing.assert_close(err.max_abs, float((out - ref).abs().max()), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(err.relative, float((out - ref).norm() / ref.norm()), rtol=1e-5, atol=1e-12)
    assert err.argmax_agreement == float((out.argmax(-1) == ref.argmax(-1)).double().mean())
    assert 0 < err.max_abs and "greedy" in err.line()


def test_greedy_equal_counts_tokens_before_the_first_difference():
    """A model whose LM head prefers another token than the reference's second one, after the
    first new token, differs from step 2 on."""
    model = tiny()
    idx = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    want = model.generate(idx, 5, temperature=0)
    forced = (int(want[0, 6]) + 1) % 256  # never the reference's token at step 2
    other = copy.deepcopy(model)

    class PreferAnother(torch.nn.Module):
        def __init__(self, head):
            super().__init__()
            self.head, self.calls = head, 0

        def forward(self, x):
            logits = self.head(x)
            if self.calls:  # every call after the first (the prefill) ...
                logits[..., forced] = logits.max() + 1  # ... picks the forced token
            self.calls += 1
            return logits

    other.lm_head = PreferAnother(other.lm_head)
    err = logit_error(model, other, idx, new_tokens=5)
    assert err.greedy_equal == 1 and err.new_tokens == 5


def test_models_of_other_vocabularies_are_refused():
    torch.manual_seed(0)
    small = GPT(GPTConfig.from_preset("tiny", vocab_size=100)).eval()
    with pytest.raises(ValueError, match="different vocabularies: 256 and 100"):
        logit_error(tiny(), small, torch.zeros(1, 3, dtype=torch.long))
