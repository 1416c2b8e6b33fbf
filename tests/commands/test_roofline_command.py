"""``multihead roofline``: the table, the files it writes, and its one-line refusals."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from multihead.commands import roofline
from multihead.errors import UsageError
from multihead.models.gpt import GPTConfig
from multihead.tools.machine_limits import device_name


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    roofline.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def limits(tmp_path, monkeypatch):
    """A cache holding this machine's entry, so nothing is measured."""
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    key = f"{device_name('cpu')} | {torch.get_num_threads()} threads | torch {torch.__version__}"
    entry = {"device": device_name("cpu"), "threads": torch.get_num_threads(), "torch": torch.__version__,
             "date": "2026-01-01", "peak_flops": {"float32": 100e9}, "bandwidth": 20e9}  # fmt: skip
    (tmp_path / "cache" / "machine-limits.json").write_text(json.dumps({key: entry}))


def test_table_files_and_measured_points(tmp_path, limits, capsys):
    out = tmp_path / "roof"
    assert roofline.run(_args("--preset", "tiny", "--attention", "gqa", "--attention-option", "num_kv_heads=2",
                              "--context", "32", "--device", "cpu", "--measure", "--out", str(out))) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "100.0 GFLOP/s float32 GEMM, 20.0 GB/s copy; ridge point 5.0 FLOP/byte" in printed
    assert "| prefill |" in printed and "| decode |" in printed and "measured ms" in printed
    # 2 layers x (k, v) x G=2 x D=16 x 4 bytes
    assert "KV cache: 512 bytes per token of one sequence (float32, all 2 layers)" in printed
    record = json.loads((out / "roofline.json").read_text())
    assert set(record["phases"]) == {"prefill", "decode"} and record["measured_s"]["decode"] > 0
    assert (out / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "roofline.md").read_text().splitlines()[0] == printed.splitlines()[1]


def test_the_default_context_fits_a_model_shorter_than_1024(limits, capsys):
    """catches: a default --context of 1024 that every preset below 1025 positions refused."""
    assert roofline.run(_args("--preset", "tiny", "--device", "cpu")) == 0  # tiny: context_length 128
    assert "batch 1, context 127, float32" in capsys.readouterr().out
    assert roofline.run(_args("--preset", "gpt2-small", "--device", "cpu")) == 0
    assert "batch 1, context 1023, float32" in capsys.readouterr().out  # 1024 positions: one left for the step


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "huge"], "--preset 'huge': unknown"),
        (["--preset", "tiny", "--context", "128"], "--context 128: the decode step needs 129 positions"),
        (["--preset", "tiny", "--batch", "0"], "--batch must be at least 1, got 0"),
        (["--preset", "tiny", "--attention", "gqa"], "needs num_kv_heads"),
    ],
)
def test_mistakes_are_one_line(argv, message, limits):
    with pytest.raises(UsageError, match=message):
        roofline.run(_args(*argv))


def test_a_split_prints_one_ranks_share_from_the_parallel_accounting(limits, capsys):
    from multihead.parallel.costs import rank_cost

    assert roofline.run(_args("--preset", "tiny", "--context", "32", "--device", "cpu", "--tensor-parallel", "2")) == 0
    share = rank_cost(GPTConfig.from_preset("tiny"), 2, bytes_per_element=4)
    assert (f"split over 2 processes, one rank holds {share.parameters:,} parameters and "
            f"{share.kv_cache_bytes_per_token:,} KV-cache bytes per token") in capsys.readouterr().out  # fmt: skip
    with pytest.raises(UsageError, match="degree 8 needs the head count to divide"):
        roofline.run(_args("--preset", "tiny", "--context", "32", "--tensor-parallel", "8"))
