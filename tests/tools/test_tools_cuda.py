"""The tools on a model moved to CUDA give the CPU's results: ``capture`` (some
heads, rows and layers; causal GQA with left padding, so rows that see no key;
a NaN at a padded token), ``run_with_cache``, ``head_effects`` and
``causal_head_scores`` ``causal_head_scores``, ``head_importance``, ``to_gqa`` and ``recover`` on a
tiny float32 GPT, each against the same call on the CPU within float32's
tolerance (docs/testing.md), scaled by magnitude.
(``to_mla`` on CUDA: tests/tools/test_convert_mla.py.)"""

from __future__ import annotations

import copy

import pytest
import torch

from multihead import MultiHeadAttention
from multihead.models.gpt import GPT, GPTConfig
from multihead.tools import capture, causal_head_scores, head_effects, head_importance, logit_difference, run_with_cache
from multihead.tools.convert_heads import to_gqa
from multihead.tools.recovery import recover

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
V = 50


def _gpt() -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=V, context_length=16, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       attention="gqa")  # fmt: skip
    return GPT(config).eval()


def _ids(B: int = 2, T: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def assert_close_to_cpu(got: torch.Tensor, want: torch.Tensor, msg: str = "") -> None:
    """float32 within torch.testing's defaults scaled by max(1, max |want|); NaN where want is NaN."""
    got, want = got.detach().cpu(), want.detach().cpu()
    fin = want[torch.isfinite(want)]
    scale = max(1.0, float(fin.abs().max())) if fin.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5 * scale, equal_nan=True, msg=msg or None)


def _captures(model, ids, mask, **selection):
    with torch.no_grad(), capture(model, scores=True, **selection) as record:
        logits = model(ids, attention_mask=mask)
    return logits, record


def check_capture_of_a_padded_gqa_gpt(device: str) -> None:
    model, ids = _gpt(), _ids()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # item 0: three pads on the left, whose query rows see no key
    selection = {"heads": [1, 3], "rows": [0, 2, -1], "layers": [1]}
    want_logits, want = _captures(model, ids, mask)
    _, want_part = _captures(model, ids, mask, **selection)
    gpu = copy.deepcopy(model).to(device)
    logits, full = _captures(gpu, ids.to(device), mask.to(device))
    _, part = _captures(gpu, ids.to(device), mask.to(device), **selection)
    assert_close_to_cpu(logits[mask.bool().to(device)], want_logits[mask.bool()])
    assert [e.name for e in full.layers] == [e.name for e in want.layers]
    for got, ref in zip(full.layers + part.layers, want.layers + want_part.layers):
        assert (got.layer, got.heads, got.rows) == (ref.layer, ref.heads, ref.rows)
        assert got.weights.shape == ref.weights.shape
        assert_close_to_cpu(got.weights, ref.weights, f"weights of layer {got.layer}")
        assert torch.equal(torch.isneginf(got.scores.cpu()), torch.isneginf(ref.scores))
        assert_close_to_cpu(got.scores.masked_fill(torch.isinf(got.scores), 0), ref.scores.masked_fill(
            torch.isinf(ref.scores), 0), f"scores of layer {got.layer}")  # fmt: skip
    for entry in full.layers:  # the explicit softmax of the captured scores (rows that see nothing: 0)
        assert_close_to_cpu(entry.weights, torch.softmax(entry.scores.cpu(), dim=-1).nan_to_num(0.0))
    pads = full.layers[0].weights[0, :, :3].cpu()  # (H, 3, S): the pads' rows see nothing
    assert torch.equal(pads, torch.zeros_like(pads))
    # the selection is that part of the full record, on the GPU too
    whole = full.layers[1].weights[:, [1, 3]][:, :, [0, 2, 7]]
    assert_close_to_cpu(part.layers[0].weights, whole)
    assert torch.equal(full.attention_mask.cpu().bool(), mask.bool())


def test_cuda_capture_of_a_padded_gqa_gpt_equals_the_cpu_one():
    check_capture_of_a_padded_gqa_gpt("cuda")


def check_capture_with_a_nan_at_a_padded_token(device: str) -> None:
    """A NaN input at a padded key changes no captured weight; a NaN at a real
    token makes the rows that see it NaN (and no other), as on the CPU."""
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    x = torch.randn(2, 6, 32)
    x[0, 4:] = float("nan")  # item 0: padded positions 4, 5
    x[1, 2, 5] = float("nan")  # item 1: a real token, seen by rows 2 .. 5
    key_mask = torch.arange(6) < torch.tensor([[4], [6]])  # (B, S), True = a real token

    def run(layer, x, key_mask, backend="auto"):
        with torch.no_grad(), capture(layer, heads=[0, 3], rows=[1, 3, 5]) as record:
            layer(x, key_mask=key_mask, is_causal=True, backend=backend)
        return record.layers[0].weights

    want = run(m, x, key_mask)
    gpu = copy.deepcopy(m).to(device)
    got = run(gpu, x.to(device), key_mask.to(device))
    assert_close_to_cpu(got, run(gpu, x.to(device), key_mask.to(device), backend="math"))  # the math path there
    assert bool(torch.isfinite(want[0, :, :2]).all()) and bool(torch.isnan(want[0, :, 2]).all())  # row 5 is a pad
    assert bool(torch.isfinite(want[1, :, 0]).all()) and bool(torch.isnan(want[1, :, 1:]).all())
    assert_close_to_cpu(got, want)


def test_cuda_capture_with_a_nan_at_a_padded_token_equals_the_cpu_one():
    check_capture_with_a_nan_at_a_padded_token("cuda")


def check_run_with_cache(device: str) -> None:
    model, ids = _gpt(), _ids()
    names = ("q", "k", "v", "pattern", "z", "attn_out", "resid_pre", "resid_post")
    want_out, want = run_with_cache(model, ids, names=names)
    out, got = run_with_cache(copy.deepcopy(model).to(device), ids.to(device), names=names)
    assert_close_to_cpu(out, want_out)
    assert got.keys() == want.keys() and len(got) == 2 * len(names)
    for key in want.keys():
        assert got[key].device.type == torch.device(device).type, key
        assert_close_to_cpu(got[key], want[key], key)
    _, part = run_with_cache(copy.deepcopy(model).to(device), ids.to(device), names=("pattern", "k"), layers=[1],
                             heads=[2])  # fmt: skip
    assert_close_to_cpu(part["layers.1.pattern"], want["layers.1.pattern"][:, [2]])


def test_cuda_run_with_cache_equals_the_cpu_one():
    check_run_with_cache("cuda")


def check_head_effects(device: str) -> None:
    model = _gpt()
    clean, corrupted = _ids(seed=2), _ids(seed=3)
    metric = logit_difference(answer_id=[4, 9], wrong_id=[7, 1])
    gpu = copy.deepcopy(model).to(device)
    for method in ("patch", "zero"):
        want = head_effects(model, clean, corrupted, metric=metric, method=method, batch_size=4)
        got = head_effects(gpu, clean.to(device), corrupted.to(device), metric=metric, method=method, batch_size=4)
        assert got.clean == pytest.approx(want.clean, rel=1e-5, abs=1e-5)
        assert got.corrupted == pytest.approx(want.corrupted, rel=1e-5, abs=1e-5)
        scale = max(1.0, float(want.effects.abs().max()))
        torch.testing.assert_close(got.effects, want.effects, rtol=1e-5, atol=1e-5 * scale, msg=method)


def test_cuda_head_effects_equal_the_cpu_ones():
    check_head_effects("cuda")


def check_causal_head_scores(device: str) -> None:
    model = _gpt()
    want = causal_head_scores(model, vocab_size=V, length=6, batch=3)
    got = causal_head_scores(copy.deepcopy(model).to(device), vocab_size=V, length=6, batch=3)
    assert set(got.scores) == set(want.scores) and got.layer_names == want.layer_names
    for role, table in want.scores.items():
        assert_close_to_cpu(got.scores[role], table, role)


def test_cuda_causal_head_scores_equal_the_cpu_ones():
    check_causal_head_scores("cuda")


def _loss(model, batch):
    logits = model(batch)  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())


def check_head_importance(device: str) -> None:
    model, batches = _gpt(), [_ids(seed=4), _ids(seed=5)]
    gpu = copy.deepcopy(model).to(device)
    on = [b.to(device) for b in batches]
    for method in ("gradient", "ablation"):
        # an ablation score is a difference of two float32 losses: its rounding scales with the loss,
        # and dividing by a row's norm (0.003 here) would scale it up again, so it is compared raw
        normalize = None if method == "ablation" else "layer"
        want = head_importance(model, batches, _loss, method=method, normalize=normalize)
        got = head_importance(gpu, on, _loss, method=method, normalize=normalize)
        assert got.device.type == "cpu" and got.shape == want.shape == (2, 4)
        atol = 1e-5 * max(1.0, abs(_loss(model, batches[0]).item())) if method == "ablation" else 1e-6
        torch.testing.assert_close(got, want, rtol=1e-4, atol=atol, msg=method)


def test_cuda_head_importance_equals_the_cpu_one():
    check_head_importance("cuda")


def check_to_gqa(device: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, context_length=16, embed_dim=32, num_layers=2, num_heads=4)).eval()
    want = to_gqa(model, 2)
    got = to_gqa(copy.deepcopy(model).to(device), 2)
    assert next(got.parameters()).device.type == torch.device(device).type
    for name, tensor in want.state_dict().items():
        assert_close_to_cpu(got.state_dict()[name], tensor, name)
    with torch.no_grad():
        assert_close_to_cpu(got(_ids().to(device)), want(_ids()))


def test_cuda_to_gqa_equals_the_cpu_conversion():
    check_to_gqa("cuda")


def check_recover(device: str) -> None:
    """Three steps without dropout follow the CPU's losses; with dropout, the caller's
    generator of the device is left as it was and a second run with the seed repeats the first
    (to rounding: CUDA backward kernels may add in another order between runs)."""
    teacher = _gpt()
    batches = [_ids(seed=6), _ids(seed=7)]
    student = to_gqa(teacher, 1)
    want = recover(copy.deepcopy(student), teacher, batches, lambda m, b: m(b), steps=3, lr=1e-3, progress=False)
    on = [b.to(device) for b in batches]
    gpu_teacher = copy.deepcopy(teacher).to(device)
    got = recover(copy.deepcopy(student).to(device), gpu_teacher, on, lambda m, b: m(b), steps=3, lr=1e-3,
                  progress=False)  # fmt: skip
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
    dropped = to_gqa(_gpt_with_dropout(), 1).to(device)
    rng = torch.cuda.get_rng_state(device) if device == "cuda" else torch.get_rng_state()
    runs = [recover(copy.deepcopy(dropped), gpu_teacher, on, lambda m, b: m(b), steps=2, progress=False, seed=3)
            for _ in range(2)]  # fmt: skip
    assert runs[1] == pytest.approx(runs[0], rel=1e-5)
    after = torch.cuda.get_rng_state(device) if device == "cuda" else torch.get_rng_state()
    assert torch.equal(after, rng)


def _gpt_with_dropout() -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=V, context_length=16, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       attention="gqa", dropout=0.2)  # fmt: skip
    return GPT(config)


def test_cuda_recover_follows_the_cpu_and_keeps_the_callers_generator():
    check_recover("cuda")
