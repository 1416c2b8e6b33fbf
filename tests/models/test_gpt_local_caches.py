"""A GPT with local and global layers decodes over a window cache per local
block: the caches ``make_kv_caches`` builds, a prefill longer than the window
then steps, generation (greedy tokens and logits of full caches and of no
cache; padding; past the context; compiled steps; ``multihead generate``),
a failed call rolled back, and streaming over the same model."""

from __future__ import annotations

import pytest
import torch
from support.paths import assert_paths_agree

from multihead import KVCache, WindowKVCache
from multihead.cli import main
from multihead.commands.generate import decode_tokens
from multihead.models import GPT, GPTConfig
from multihead.models.checkpoint import save_checkpoint

LOCAL_GLOBAL = [{"window": 4}, {"window": 4}, {}]  # blocks 0, 1 local, 2 global


def _model(positions="rope", **overrides):
    torch.manual_seed(0)
    config = dict(vocab_size=61, context_length=24, embed_dim=32, num_layers=3, num_heads=4, positions=positions,
                  layer_attention_options=LOCAL_GLOBAL)  # fmt: skip
    return GPT(GPTConfig(**{**config, **overrides})).eval()


def _full_caches(model):
    """Every block's own full-length cache: what ``make_kv_caches`` built before windows were bounded."""
    return lambda B, n: [block.attn.make_kv_cache(B, n) for block in model.blocks]


def _ids(B, T, seed=1):
    return torch.randint(0, 61, (B, T), generator=torch.Generator().manual_seed(seed))


def test_make_kv_caches_bounds_the_local_blocks_only():
    model = _model(attention="gqa", num_kv_heads=2)
    caches = model.make_kv_caches(3, 20)
    assert [type(c) for c in caches] == [WindowKVCache, WindowKVCache, KVCache]
    assert caches[2].k.shape == (3, 2, 20, 8)
    with torch.no_grad():
        model(_ids(3, 9), kv_caches=caches)
        model(_ids(3, 1), kv_caches=caches)
    for c in caches[:2]:
        assert c.length == 10 and c.k.numel() == c.v.numel() == 3 * 2 * 4 * 8  # B G window D
    assert caches[2].length == 10


@pytest.mark.parametrize("positions", ["rope", "alibi", "learned"])
def test_a_prefill_longer_than_the_window_then_steps_equal_the_full_forward(positions):
    model = _model(positions)
    idx = _ids(2, 16)
    caches = model.make_kv_caches(2, 16)
    with torch.no_grad():
        want = model(idx)
        got = [model(idx[:, :9], kv_caches=caches)] + [model(idx[:, t : t + 1], kv_caches=caches) for t in range(9, 16)]
    assert_paths_agree(torch.cat(got, 1), want)


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_generation_equals_full_caches_and_no_cache(positions, monkeypatch):
    """Greedy tokens identical, logits to tolerance; 30 new tokens run past the context of 24
    (the window slides: the caches are reset and prefilled again)."""
    model = _model(positions)
    prompt = _ids(2, 7)
    with torch.no_grad():
        got, got_logits = model.generate(prompt, 30, temperature=0, return_logits=True)
        none, none_logits = model.generate(prompt, 30, temperature=0, return_logits=True, use_cache=False)
        monkeypatch.setattr(model, "make_kv_caches", _full_caches(model))
        full, full_logits = model.generate(prompt, 30, temperature=0, return_logits=True)
    assert torch.equal(got, full) and torch.equal(got, none)
    assert_paths_agree(got_logits, full_logits)
    assert_paths_agree(got_logits, none_logits)


def test_padded_generation_equals_full_caches(monkeypatch):
    """Left padding (row 0: 6 pads, more than the window): the key mask over every position
    is cut to the keys each local block keeps."""
    model = _model()
    prompt = _ids(3, 9)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :6] = 0
    mask[2, :1] = 0
    with torch.no_grad():
        got, got_logits = model.generate(prompt, 10, temperature=0, attention_mask=mask, return_logits=True)
        none, none_logits = model.generate(prompt, 10, temperature=0, attention_mask=mask, return_logits=True,
                                           use_cache=False)  # fmt: skip
        monkeypatch.setattr(model, "make_kv_caches", _full_caches(model))
        full, full_logits = model.generate(prompt, 10, temperature=0, attention_mask=mask, return_logits=True)
    assert torch.equal(got, full) and torch.equal(got, none)
    assert_paths_agree(got_logits, full_logits)
    assert_paths_agree(got_logits, none_logits)
    for row in range(3):  # each row alone, unpadded: the same continuation
        alone = model.generate(prompt[row : row + 1, mask[row].bool()], 10, temperature=0)
        assert torch.equal(alone[0, -10:], got[row, -10:])


@pytest.mark.slow
def test_generate_with_compiled_steps_over_window_caches(monkeypatch):
    """``generate(compile_steps=True)``: the one-token steps through torch.compile(fullgraph=True)
    (dynamo's graphs run eagerly here; ``tests/models/test_compile_gpt.py`` runs inductor) give
    the eager tokens and logits. A local block's cache stops changing shape once it holds
    its window, so the steps compile a few times, not once per step."""
    from functools import partial

    from torch._dynamo.testing import CompileCounter

    model = _model()
    prompt = _ids(2, 2)
    counter = CompileCounter()
    with torch.no_grad():
        want, want_logits = model.generate(prompt, 10, temperature=0, return_logits=True)
        torch._dynamo.reset()
        monkeypatch.setattr(torch, "compile", partial(torch.compile, backend=counter))
        got, got_logits = model.generate(prompt, 10, temperature=0, return_logits=True, compile_steps=True)
    torch._dynamo.reset()
    assert torch.equal(got, want)
    assert_paths_agree(got_logits, want_logits)
    assert 1 <= counter.frame_count <= 4, counter.frame_count


def test_a_failure_inside_a_later_block_rolls_the_window_caches_back():
    """A cache of the wrong head layout fails when block 2 writes to it; blocks 0 and 1
    (local) had replaced their kept keys by then and get them back."""
    model = _model()
    caches, reference = model.make_kv_caches(2, 12), model.make_kv_caches(2, 12)
    prompt = _ids(2, 6)
    with torch.no_grad():
        model(prompt, kv_caches=caches)
        model(prompt, kv_caches=reference)
    good = caches[2]
    caches[2] = KVCache(2, 1, 12, model.config.head_dim)
    caches[2].length = 6
    kept = [(c.k.clone(), c.v.clone()) for c in caches[:2]]
    nxt = torch.tensor([[5], [9]])
    with pytest.raises(ValueError, match=r"cache holds k \(B=2, G=1, D=8\)"):
        model(nxt, kv_caches=caches)
    assert [c.length for c in caches] == [6, 6, 6]
    for c, (k, v) in zip(caches, kept):
        assert torch.equal(c.k, k) and torch.equal(c.v, v)
    caches[2] = good
    with torch.no_grad():
        assert_paths_agree(model(nxt, kv_caches=caches), model(nxt, kv_caches=reference))


def test_streaming_still_bounds_every_block_of_a_local_global_model():
    model = _model()
    prompt = _ids(1, 5)
    with torch.no_grad():
        out = model.generate(prompt, 30, temperature=0, streaming=(2, 8))
    assert out.shape == (1, 35)
    assert all(c.k.shape[2] == 2 + 8 - 1 + 5 for c in model.make_streaming_caches(1, sink_tokens=2, window=8,
                                                                                  max_step=5))  # fmt: skip


def test_multihead_generate_with_a_local_global_checkpoint(capsys, tmp_path, monkeypatch):
    """The command's greedy text is the one full caches give."""
    model = _model(vocab_size=256, context_length=64)
    save_checkpoint(model, tmp_path / "m.safetensors")
    args = ["generate", "--checkpoint", str(tmp_path / "m.safetensors"), "--prompt", "local and global",
            "--temperature", "0", "--max-new-tokens", "12"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    prompt = torch.tensor([list(b"local and global")])
    monkeypatch.setattr(model, "make_kv_caches", _full_caches(model))
    with torch.no_grad():
        want = model.generate(prompt, 12, temperature=0)
    assert out == decode_tokens(want[0].tolist()) + "\n"
