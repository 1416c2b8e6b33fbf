"""Token files and training batches: round trips, determinism per (seed, step),
rank and micro-batch slices that tile the global batch, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multihead.train.batches import HEADER_BYTES, Batches, read_tokens, val_batches, write_tokens


def token_array(n=5000, vocab=256, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=n).astype(np.uint16)


def test_write_read_round_trip_uint16(tmp_path):
    ids = [0, 1, 255, 65535, 7, 7, 42]
    path = write_tokens(ids, tmp_path / "train.bin")
    assert path == tmp_path / "train.bin"
    assert [p.name for p in tmp_path.iterdir()] == ["train.bin"]  # no staging leftovers
    assert path.stat().st_size == HEADER_BYTES + 2 * len(ids)
    got = read_tokens(path)
    assert got.dtype == np.dtype("<u2")
    assert got.tolist() == ids
    with pytest.raises(ValueError, match="read-only"):
        got[0] = 3


def test_write_read_round_trip_uint32(tmp_path):
    ids = np.array([0, 65536, 2**32 - 1, 5], dtype=np.int64)
    got = read_tokens(write_tokens(ids, tmp_path / "big.bin"))
    assert got.dtype == np.dtype("<u4")
    assert got.tolist() == ids.tolist()
    # replacing a file keeps only the new contents
    got = read_tokens(write_tokens([3, 4], tmp_path / "big.bin"))
    assert got.tolist() == [3, 4] and got.dtype == np.dtype("<u2")


def test_write_tokens_errors(tmp_path):
    with pytest.raises(ValueError, match="no token ids to write"):
        write_tokens([], tmp_path / "a.bin")
    with pytest.raises(ValueError, match="min -1, max 5"):
        write_tokens([5, -1], tmp_path / "a.bin")
    with pytest.raises(ValueError, match=f"max {2**32}"):
        write_tokens(np.array([0, 2**32], dtype=np.int64), tmp_path / "a.bin")
    with pytest.raises(TypeError, match="must be integers, got dtype float64"):
        write_tokens(np.array([1.0, 2.0]), tmp_path / "a.bin")
    with pytest.raises(ValueError, match=r"must be 1-D, got shape \(2, 2\)"):
        write_tokens(np.zeros((2, 2), dtype=np.int64), tmp_path / "a.bin")
    assert not (tmp_path / "a.bin").exists()


def test_read_tokens_refuses_bad_files(tmp_path):
    good = write_tokens(list(range(100)), tmp_path / "good.bin").read_bytes()
    (tmp_path / "short.bin").write_bytes(good[:-1])
    with pytest.raises(ValueError, match="header says 100 tokens of 2 bytes .232 bytes in all., the file has 231"):
        read_tokens(tmp_path / "short.bin")
    (tmp_path / "flat.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    with pytest.raises(ValueError, match="flat.bin: not a multihead token file"):
        read_tokens(tmp_path / "flat.bin")
    (tmp_path / "size.bin").write_bytes(good[:12] + (3).to_bytes(4, "little") + good[16:])
    with pytest.raises(ValueError, match="3 bytes per token"):
        read_tokens(tmp_path / "size.bin")
    with pytest.raises(OSError):
        read_tokens(tmp_path / "missing.bin")


def windows_by_slicing(tokens: np.ndarray, offsets: np.ndarray, T: int):
    """Independent construction of (x, y) with Python slices."""
    x = torch.tensor(np.stack([tokens[o : o + T] for o in offsets]).astype(np.int64))
    y = torch.tensor(np.stack([tokens[o + 1 : o + T + 1] for o in offsets]).astype(np.int64))
    return x, y


def test_batch_contents_are_windows_and_y_is_x_shifted():
    tokens = token_array()
    batches = Batches(tokens, batch_size=6, context_length=17, seed=3)
    x, y = batches.get(5)
    assert x.shape == y.shape == (6, 17) and x.dtype == y.dtype == torch.int64
    offsets = batches.offsets(5)
    assert offsets.dtype == np.int64 and offsets.shape == (6,)
    want_x, want_y = windows_by_slicing(tokens, offsets, 17)
    assert torch.equal(x, want_x) and torch.equal(y, want_y)  # integer copies: exact
    assert torch.equal(y[:, :-1], x[:, 1:])


def test_offsets_reach_both_ends_and_stay_in_range():
    T, n = 8, 20
    tokens = np.arange(n, dtype=np.uint16)
    batches = Batches(tokens, batch_size=16, context_length=T, seed=0)
    seen = np.concatenate([batches.offsets(s) for s in range(50)])
    assert seen.min() == 0 and seen.max() == n - T - 1  # the last token can be a target
    x, y = batches.get(0)
    assert int(y.max()) <= n - 1
    # exactly T + 1 tokens: one window, always at 0
    one = Batches(np.arange(T + 1), batch_size=3, context_length=T, seed=1)
    x, y = one.get(7)
    assert torch.equal(x, torch.arange(T).repeat(3, 1)) and torch.equal(y, torch.arange(1, T + 1).repeat(3, 1))


def test_deterministic_per_seed_and_step():
    tokens = token_array()
    a = Batches(tokens, batch_size=8, context_length=16, seed=11)
    b = Batches(tokens.copy(), batch_size=8, context_length=16, seed=11)
    # same operations on the same data: bitwise equal, in any order of steps
    for step in (9, 0, 3, 10_000):
        assert torch.equal(a.get(step)[0], b.get(step)[0])
    assert not np.array_equal(a.offsets(0), a.offsets(1))
    assert not np.array_equal(a.offsets(0), Batches(tokens, batch_size=8, context_length=16, seed=12).offsets(0))


def test_memmap_batches_equal_in_memory_batches(tmp_path):
    tokens = token_array(vocab=60000)
    on_disk = read_tokens(write_tokens(tokens, tmp_path / "t.bin"))
    a = Batches(tokens, batch_size=4, context_length=32, seed=5)
    b = Batches(on_disk, batch_size=4, context_length=32, seed=5)
    for step in range(3):
        assert all(torch.equal(u, v) for u, v in zip(a.get(step), b.get(step)))


@pytest.mark.parametrize("world_size,grad_accum", [(1, 1), (1, 4), (2, 1), (2, 2), (4, 3), (12, 1)])
def test_rank_and_micro_slices_tile_the_global_batch(world_size, grad_accum):
    tokens = token_array()
    batches = Batches(tokens, batch_size=3 * world_size * grad_accum, context_length=9, seed=2)
    step = 4
    full_x, full_y = batches.get(step)
    parts = [
        batches.get(step, micro=m, grad_accum=grad_accum, rank=r, world_size=world_size)
        for r in range(world_size)
        for m in range(grad_accum)
    ]
    b = batches.batch_size // (world_size * grad_accum)
    assert all(x.shape == (b, 9) for x, _ in parts)
    assert torch.equal(torch.cat([x for x, _ in parts]), full_x)
    assert torch.equal(torch.cat([y for _, y in parts]), full_y)


def test_batches_errors():
    tokens = token_array(n=100)
    with pytest.raises(
        ValueError, match="batch larger than the data: context_length=100 needs at least 101 tokens, the data has 100"
    ):
        Batches(tokens, batch_size=2, context_length=100, seed=0)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        Batches(tokens, batch_size=0, context_length=8, seed=0)
    with pytest.raises(TypeError, match="context_length must be an int, got True"):
        Batches(tokens, batch_size=2, context_length=True, seed=0)
    with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
        Batches(tokens, batch_size=2, context_length=8, seed=-1)
    with pytest.raises(ValueError, match=r"1-D integer array, got shape \(10, 10\)"):
        Batches(tokens.reshape(10, 10), batch_size=2, context_length=8, seed=0)
    batches = Batches(tokens, batch_size=6, context_length=8, seed=0)
    with pytest.raises(ValueError, match="batch_size=6 is not divisible by world_size \\* grad_accum = 2 \\* 2 = 4"):
        batches.get(0, grad_accum=2, world_size=2)
    with pytest.raises(ValueError, match="rank=3 is out of range for world_size=3"):
        batches.get(0, rank=3, world_size=3)
    with pytest.raises(ValueError, match="micro=2 is out of range for grad_accum=2"):
        batches.get(0, micro=2, grad_accum=2)
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        batches.get(-1)


def test_val_batches_are_fixed():
    tokens = token_array()
    first = val_batches(tokens, batch_size=3, context_length=10, num_batches=4)
    again = val_batches(tokens, batch_size=3, context_length=10, num_batches=4)
    assert len(first) == 4
    for (x1, y1), (x2, y2) in zip(first, again):
        assert x1.shape == (3, 10) and torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(first[0][0], first[1][0])
    other = val_batches(tokens, batch_size=3, context_length=10, num_batches=1, seed=99)
    assert not torch.equal(other[0][0], first[0][0])
    with pytest.raises(ValueError, match="num_batches must be >= 1, got 0"):
        val_batches(tokens, batch_size=3, context_length=10, num_batches=0)
