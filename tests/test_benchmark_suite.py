"""The benchmark suite's checks, at tiny sizes and without timing anything:
peers agree before they are timed, a peer that differs is refused, a missing
optional peer is reported, every kind is in the kinds table."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import peers, run
from benchmarks.cases import attention_peers
from benchmarks.chart import ratio_chart
from benchmarks.memory import peak_mib
from benchmarks.registry import load_cases
from benchmarks.report_extras import throughput
from benchmarks.suite import run_plan

ROOT = Path(__file__).resolve().parent.parent
TINY = {"batch": 1, "seq": 16, "embed_dim": 32, "num_heads": 4, "memory": False, "peak": False}


def _quiet(msg):
    pass


def _peers_case():
    return load_cases()["attention_peers"]


def test_quick_plan_sets_up_every_peer_and_kind_and_they_agree():
    """The quick plan at tiny sizes: every installed peer agrees with multihead
    (forward and input gradients), every registered kind runs."""
    records = run_plan("quick", out=None, dry=True, only=["attention_peers", "kinds_vs_mha", "long_context"],
                       extra=TINY, log=_quiet)  # fmt: skip
    by_case = {r["case"]: r for r in records}
    assert set(by_case) == {"attention_peers", "kinds_vs_mha", "long_context"}
    for record in records:
        for res in record["results"]:
            refused = {n: w for n, w in res["not_timed"].items() if w["status"] in ("refused", "failed")}
            assert not refused, (record["case"], res["scenario"], refused)
    small = next(r for r in by_case["attention_peers"]["results"] if r["scenario"] == "small forward, causal")
    installed = {"multihead", "sdpa_floor", "torch_mha", "hf_gpt2", "raschka", "annotated", "tutorial_split",
                 "tutorial_per_head", "numpy_reference"}  # fmt: skip
    assert installed <= set(small["order"])
    assert small["order"][0] == "multihead"
    from multihead.modules.registry import list_attention_kinds

    for res in by_case["kinds_vs_mha"]["results"]:
        assert res["order"][0] == "mha"
        assert set(res["order"]) == set(list_attention_kinds())


def _wrong_spec(kind: str) -> peers.PeerSpec:
    """multihead's layer, wrong on purpose: 1% off in its output, or the
    right output with a gradient that never reaches the input."""

    def build(layer, **kw):
        peer = peers.PEERS["multihead"].build(layer, **kw)
        right = peer.fn
        if kind == "output":
            peer.fn = lambda x: right(x) * 1.01
        else:
            peer.fn = lambda x: right(x.detach()) + 0 * x
        return peer

    return peers.PeerSpec(build)


@pytest.mark.parametrize("mode, scenario", [("output", "forward, causal"), ("gradient", "fwd+bwd, causal")])
def test_a_peer_that_differs_is_refused_and_not_timed(monkeypatch, mode, scenario):
    monkeypatch.setitem(peers.PEERS, "wrong", _wrong_spec(mode))
    overrides = {**TINY, "peers": ["multihead", "wrong", "sdpa_floor"]}
    record = run.run_case(_peers_case(), overrides=overrides, scenarios=[scenario], dry=True, log=_quiet)
    res = record["results"][0]
    assert res["order"] == ["multihead", "sdpa_floor"]
    assert res["not_timed"]["wrong"]["status"] == "refused"
    assert "differs from multihead" in res["not_timed"]["wrong"]["reason"]
    if mode == "gradient":
        assert "input gradients" in res["not_timed"]["wrong"]["reason"]
    assert "wrong" not in res["flops"]


def test_disagreement_names_the_largest_difference():
    want = torch.linspace(-1, 1, 50)
    assert peers.disagreement(want + 1e-7, want) is None
    got = want.clone()
    got[7] += 0.25
    reason = peers.disagreement(got, want)
    assert reason is not None and "max |difference| 0.25" in reason and "1 of 50 entries" in reason
    assert peers.disagreement(want[:10], want).startswith("shape (10,) != (50,)")
    assert peers.disagreement(torch.full_like(want, float("nan")), want) is not None


def test_a_missing_optional_peer_is_reported_by_the_command(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "x_transformers", None)  # import fails as if not installed
    argv = ["attention_peers", "--check", "--scenario", "forward, causal", "--out", str(tmp_path)]
    for key, value in {**TINY, "peers": ["multihead", "x_transformers", "sdpa_floor"]}.items():
        argv += ["--set", f"{key}={value!r}"]
    assert run.main(argv) == 0
    report = capsys.readouterr().out
    assert re.search(r"forward, causal: x_transformers: missing: x-transformers is not installed .*make bench-deps",
                     report)  # fmt: skip
    (saved,) = tmp_path.glob("attention_peers-*.json")
    res = json.loads(saved.read_text())["results"][0]
    assert res["order"] == ["multihead", "sdpa_floor"]
    assert res["not_timed"]["x_transformers"]["status"] == "missing"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_make_bench_deps_installs_the_pins_the_message_names():
    text = (ROOT / "Makefile").read_text()
    match = re.search(r"^BENCH_PEERS := (.*?)(?<!\\)\n", text, re.S | re.M)
    assert match is not None
    pins = match.group(1).replace("\\\n", " ").split()
    assert pins == peers.XT_PINS.split()
    assert all("==" in p for p in pins) and not any(p.startswith("torch==") for p in pins)


def test_flops_are_the_layer_cost_and_the_floor_is_time_over_flops_per_peak():
    config = {"batch": 2, "seq": 8, "embed_dim": 16, "num_heads": 4, "causal": True, "mode": "forward"}
    # by hand: 4 projections of 2*8 tokens x 16 x 16, and 2*B*H*pairs*(D+D) with 36 visible pairs of 8
    projections = 4 * 2 * (2 * 8) * 16 * 16
    core = 2 * 2 * 4 * 36 * (4 + 4)
    assert attention_peers.layer_flops(config) == projections + core
    assert attention_peers.layer_flops({**config, "mode": "train"}) == 3 * (projections + core)
    # the floor of each round is FLOPs over that round's GEMM peak: round 3's slow step has no slow GEMM beside it
    peak = {"flops": 2e9, "samples_s": [0.02, 0.04, 0.02]}  # 1e11, 5e10, 1e11 FLOP/s
    t = throughput({"a": 1e9}, {"a": [0.02, 0.04, 0.05]}, peak)["a"]
    assert t["flop_per_s"] == pytest.approx(1e9 / 0.04)
    assert t["of_peak"] == pytest.approx((1e9 / 0.04) / 1e11)
    assert t["floor_multiple"] == pytest.approx(2.0)  # per round: 2, 2, 5
    assert "of_peak" not in throughput({"a": 1e9}, {"a": [0.02]}, None)["a"]


def test_a_timed_run_reports_the_peak_beside_the_contenders_not_among_them():
    overrides = {**TINY, "peers": ["multihead", "sdpa_floor"], "peak": True, "peak_n": 256, "rounds": 2,
                 "warmup": 0}  # fmt: skip
    record = run.run_case(_peers_case(), overrides=overrides, scenarios=["forward, causal"], log=_quiet)
    res = record["results"][0]
    assert res["order"] == ["multihead", "sdpa_floor"]
    assert list(res["ratios"]) == ["sdpa_floor"]
    assert res["ratios"]["sdpa_floor"]["numerator"] == "multihead"
    assert res["peak"]["n"] == 256 and len(res["peak"]["samples_s"]) == 2
    assert set(res["throughput"]) == {"multihead", "sdpa_floor"}
    assert all(t["floor_multiple"] > 0 for t in res["throughput"].values())
    report = run.markdown_report(record)
    assert "GEMM peak in the same rounds (256 x 256 float32 products)" in report


def test_ratio_chart_is_written_in_one_piece(tmp_path):
    pr = {"median": 0.9, "q1": 0.85, "q3": 0.95, "min": 0.8, "max": 1.0, "n": 3}
    record = {
        "case": "c", "command": "python -m benchmarks.run c", "started": "2026-01-01T00:00:00",
        "machine": {"cpu_model": "cpu", "cpus_usable": 2, "torch": "2", "date": "2026-01-01T00:01:00"},
        "results": [{"scenario": "s", "baseline": "b", "load_average_before": [1.0, 1.0, 1.0],
                     "ratios": {"a": {"per_round": pr, "numerator": "a", "denominator": "b"}}}],
    }  # fmt: skip
    path = ratio_chart([record], tmp_path / "chart.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["chart.png"]
    with pytest.raises(ValueError, match="no ratios"):
        ratio_chart([{**record, "results": []}], tmp_path / "empty.png")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc/self/clear_refs")
def test_peak_memory_sees_the_score_matrix_explicit_attention_holds():
    """The Annotated Transformer's attention materialises the (B, H, T, T)
    float32 scores (4 x 1024 x 1024 x 4 bytes = 16 MiB, and as much again for
    the probabilities); multihead's flash kernel does not."""
    spec = {"batch": 1, "seq": 1024, "embed_dim": 32, "num_heads": 4, "causal": False, "mode": "forward",
            "dtype": "float32", "device": "cpu", "seed": 0, "threads": 1}  # fmt: skip
    explicit = peak_mib({**spec, "peer": "annotated"})
    flash = peak_mib({**spec, "peer": "multihead"})
    assert explicit >= 16
    assert flash < explicit / 4


def test_device_is_refused_for_a_case_that_runs_on_the_cpu_only(capsys):
    assert run.main(["mha_vs_torch", "--device", "cuda", "--check"]) == 2
    err = capsys.readouterr().err
    assert "'mha_vs_torch' runs on the CPU only and takes no --device" in err
    assert "'attention_peers'" in err and "'kinds_vs_mha'" in err and "'long_context'" in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peers_agree_in_bfloat16_and_memory_is_measured_on_the_device():
    overrides = {**TINY, "device": "cuda", "dtype": "bfloat16", "peers": ["multihead", "sdpa_floor", "torch_mha"],
                 "cuda_peers": ["sdpa_flash", "sdpa_efficient"]}  # fmt: skip
    for scenario in ("forward, causal", "fwd+bwd, causal"):
        res = run.run_case(_peers_case(), overrides=overrides, scenarios=[scenario], dry=True, log=_quiet)["results"][0]
        assert not [n for n, w in res["not_timed"].items() if w["status"] == "refused"], res["not_timed"]
        assert {"multihead", "sdpa_floor", "sdpa_flash"} <= set(res["order"])
    spec = {"batch": 1, "seq": 1024, "embed_dim": 64, "num_heads": 4, "causal": False, "mode": "forward",
            "dtype": "bfloat16", "device": "cuda", "seed": 0, "threads": 1}  # fmt: skip
    explicit = peak_mib({**spec, "peer": "annotated"})  # (1, 4, 1024, 1024) bf16 scores: 8 MiB
    assert explicit >= 8
    assert peak_mib({**spec, "peer": "multihead"}) < explicit / 2
