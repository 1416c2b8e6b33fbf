"""tools.machine_limits: measured numbers, cached by device, threads and torch version."""

from __future__ import annotations

import json

import pytest
import torch

from multihead.tools import machine_limits as ml


def test_measure_gives_positive_limits_and_names_the_device():
    limits = ml.measure_limits("cpu", ["float32", "bfloat16"], repeats=1, gemm_size=64, copy_bytes=1 << 20)
    assert limits.device.startswith("cpu: ") and limits.threads == torch.get_num_threads()
    assert set(limits.peak_flops) == {"float32", "bfloat16"} and min(limits.peak_flops.values()) > 0
    assert limits.bandwidth > 0 and limits.ridge("float32") == limits.peak_flops["float32"] / limits.bandwidth
    with pytest.raises(ValueError, match=r"unknown dtypes \['int8'\]"):
        ml.measure_limits("cpu", ["int8"])
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'tpu'"):
        ml.measure_limits("tpu")


def test_the_cache_is_read_kept_per_key_and_extended(tmp_path, monkeypatch):
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path))
    calls = []

    def fake(device, dtypes):
        calls.append(tuple(dtypes))
        return ml.MachineLimits(ml.device_name(device), torch.get_num_threads(), torch.__version__, "2026-01-01",
                                {d: 1e9 * len(calls) for d in dtypes}, 2e9 * len(calls))  # fmt: skip

    monkeypatch.setattr(ml, "measure_limits", fake)
    first = ml.machine_limits("cpu", ["float32"])
    again = ml.machine_limits("cpu", ["float32"])
    assert first == again and calls == [("float32",)]  # the second came from the cache
    both = ml.machine_limits("cpu", ["float32", "bfloat16"])  # a new dtype: measured, the old one kept
    assert set(both.peak_flops) == {"float32", "bfloat16"} and len(calls) == 2
    # catches: every asked dtype measured again, overwriting the cached peak and bandwidth
    assert calls[1] == ("bfloat16",) and both.peak_flops == {"float32": 1e9, "bfloat16": 2e9}
    assert both.bandwidth == first.bandwidth
    stored = json.loads((tmp_path / "machine-limits.json").read_text())
    (key,) = stored
    assert f"{torch.get_num_threads()} threads" in key and torch.__version__ in key
    ml.machine_limits("cpu", ["float32"], remeasure=True)
    assert len(calls) == 3
    (tmp_path / "machine-limits.json").write_text("not json")  # unreadable: measured again, rewritten
    ml.machine_limits("cpu", ["float32"])
    assert len(calls) == 4 and json.loads((tmp_path / "machine-limits.json").read_text())
