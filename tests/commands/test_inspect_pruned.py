"""``multihead inspect`` on a pruned GPT: every head it had shown, removed ones as "pruned"."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.cli import quietly

from multihead.models.checkpoint import load_checkpoint
from multihead.tools.head_slots import HeadSlots
from multihead.tools.heads import mask_heads

TINY = ["--preset", "tiny", "--context-length", "32", "--batch-size", "4", "--eval-batches", "2", "--warmup", "1",
        "--threads", "1", "--max-steps", "2", "--eval-every", "2", "--checkpoint-every", "2"]  # fmt: skip
TEXT = "to be or not to be that is the question whether tis nobler in the mind to suffer\n" * 200
PROMPT = "to be or not to be"


@pytest.fixture(scope="module")
def pruned(tmp_path_factory) -> Path:
    """A tiny byte-level run, half its heads removed by ``multihead prune`` (with report.json)."""
    folder = tmp_path_factory.mktemp("pruned")
    (folder / "text.txt").write_text(TEXT)
    rc, _, err = quietly("train", "--data", str(folder / "text.txt"), *TINY, "--out", str(folder / "run"))
    assert rc == 0, err
    rc, _, err = quietly("prune", "--checkpoint", str(folder / "run"), "--method", "ablation", "--keep", "0.5",
                         "--calibration-lines", "16", "--out", str(folder / "half"))  # fmt: skip
    assert rc == 0, err
    return folder / "half"


def role_table(stdout: str) -> str:
    """The printed table of every head's roles on the text (after the causal roles, which a GPT gets first)."""
    return next(block for block in stdout.split("\n\n") if block.startswith("layer"))


def inspected(checkpoint: Path, out: Path, *flags: str) -> tuple[str, dict, str]:
    rc, stdout, err = quietly("inspect", PROMPT, "--checkpoint", str(checkpoint), *flags, "--verbose", "--out", str(out))
    assert rc == 0, err
    return stdout, json.loads((out / "heads.json").read_text()), (out / "heads.html").read_text()


def test_removed_heads_are_shown_where_they_were(pruned, tmp_path):
    report = json.loads((pruned / "report.json").read_text())
    config = load_checkpoint(pruned).config
    H, L = config.num_heads, config.num_layers
    removed = {int(layer): heads for layer, heads in report["removed"].items()}
    gone = sum(map(len, removed.values()))
    assert 0 < gone < L * H and config.layer_heads == report["layer_heads"]
    stdout, data, page = inspected(pruned, tmp_path / "o")
    title = f"{L} layers, {L * H - gone} of {L * H} heads kept ({gone} pruned)"
    assert f"GPT checkpoint half: {title} on" in stdout.splitlines()[0]
    assert title in page and "x 4 heads" not in stdout
    assert data["num_heads"] == H
    assert data["pruned"] == [{"layer": i, "head": h} for i in range(L) for h in sorted(removed.get(i, []))]
    for i, entry in enumerate(data["layers"]):
        kept = [h for h in range(H) if h not in removed.get(i, [])]  # prune_heads keeps the rest in order
        assert entry["original_heads"] == kept and len(entry["weights"]) == len(kept)
    for role in data["roles"]:
        assert role["original_head"] == data["layers"][role["layer"]]["original_heads"][role["head"]]
    # the printed table: one "pruned" row per removed head, with its index before pruning in "was"
    table = role_table(stdout).splitlines()
    assert table[0].split()[:4] == ["layer", "head", "was", "roles"]
    rows = [line.split() for line in table[1:]]
    assert len(rows) == L * H
    assert sorted((int(r[0]), int(r[2])) for r in rows if r[3] == "pruned") == sorted(
        (i, h) for i, heads in removed.items() for h in heads
    )
    assert [(int(r[0]), int(r[2])) for r in rows] == [(i, h) for i in range(L) for h in range(H)]  # slot order


def test_importance_of_kept_heads_and_none_for_pruned(pruned, tmp_path):
    stdout, data, page = inspected(pruned, tmp_path / "o", "--importance")
    model = load_checkpoint(pruned).eval()
    ids = torch.tensor([list(PROMPT.encode())])  # (1, T): a byte checkpoint

    def lm_loss(net) -> float:
        with torch.no_grad():
            return float(F.cross_entropy(net(ids[:, :-1]).flatten(0, 1).double(), ids[0, 1:]))

    base = lm_loss(model)
    kept = sum(config_heads for config_heads in model.config.layer_heads)
    assert len(data["roles"]) == kept
    for role in data["roles"]:  # the ablation score, recomputed here with mask_heads
        score = role["scores"]["importance"]
        assert score is not None and math.isfinite(score), role
        with mask_heads(model, {role["layer"]: [role["head"]]}):
            want = lm_loss(model) - base
        assert score == pytest.approx(want, rel=1e-4, abs=1e-6), role
    rows = [line.split() for line in role_table(stdout).splitlines()[1:]]
    pruned_rows = [r for r in rows if r[3] == "pruned"]
    assert len(pruned_rows) == len(data["pruned"]) and all(r[-1] == "pruned" for r in pruned_rows)
    assert all(r[-1] != "pruned" and math.isfinite(float(r[-1])) for r in rows if r[3] != "pruned")
    embedded = json.loads(page.split('id="mh-data">')[1].split("</script>")[0])
    assert embedded["slots"]["original"] is True
    assert sum(s["head"] is None for layer in embedded["slots"]["layers"] for s in layer) == len(data["pruned"])


def test_without_report_the_removed_heads_follow_the_kept_ones(pruned, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(pruned / name, bare / name)
    config = load_checkpoint(bare).config
    stdout, data, _ = inspected(bare, tmp_path / "o")
    assert data["pruned"] == [
        {"layer": i, "head": None} for i, h in enumerate(config.layer_heads) for _ in range(config.num_heads - h)
    ]
    assert all(entry["original_heads"] == [None] * len(entry["weights"]) for entry in data["layers"])
    table = role_table(stdout).splitlines()
    assert table[0].split()[:3] == ["layer", "head", "roles"]  # no "was": the former indices are unknown
    for i, h in enumerate(config.layer_heads):  # each layer: its kept heads 0..h-1, then the removed ones
        layer_rows = [line.split() for line in table[1:] if line.split()[0] == str(i)]
        assert [r[1] for r in layer_rows] == [*map(str, range(h)), *["-"] * (config.num_heads - h)]
    (bare / "report.json").write_text(json.dumps({"layer_heads": [1] * config.num_layers, "removed": {}}))
    stdout, data, _ = inspected(bare, tmp_path / "o2")
    assert "does not describe this checkpoint" in stdout and all(p["head"] is None for p in data["pruned"])


def test_slots_from_counts_refuse_a_report_that_does_not_match():
    slots = HeadSlots.from_counts(4, [2, 4], {0: [1, 3]})
    assert slots.layers == {0: (0, None, 1, None), 1: (0, 1, 2, 3)} and slots.original_index(0, 1) == 2
    assert slots.summary([0, 1]) == "2 layers, 6 of 8 heads kept (2 pruned)"
    with pytest.raises(ValueError, match=r"layer 0: removed heads \[1\] do not leave 2 of 4"):
        HeadSlots.from_counts(4, [2, 4], {0: [1]})
    with pytest.raises(ValueError, match=r"exceeds num_heads=4 in layers \[1\]"):
        HeadSlots.from_counts(4, [2, 5])


@pytest.mark.skipif(
    not Path("/usr/bin/chromium").exists(), reason="needs Debian's chromium: apt-get install -y chromium"
)
def test_page_greys_the_removed_heads(pruned, tmp_path):
    from playwright.sync_api import sync_playwright

    _, data, _ = inspected(pruned, tmp_path / "o", "--importance")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--headless", "--no-sandbox"])
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto((tmp_path / "o" / "heads.html").as_uri())
            page.wait_for_selector("body[data-ready=true]")
            cells = page.eval_on_selector_all(".mv-pruned", "cs => cs.map(c => [+c.dataset.layer, +c.dataset.slot])")
            rows = page.eval_on_selector_all(
                "#role-table tr.rt-pruned td:last-child", "ts => ts.map(t => t.textContent)"
            )
            kept = page.eval_on_selector_all(".mv-cell .mv-importance", "xs => xs.length")
            summary = page.text_content("#summary")
        finally:
            browser.close()
    assert errors == []
    assert cells == [[p["layer"], p["head"]] for p in data["pruned"]]
    assert rows == ["pruned"] * len(data["pruned"]) and kept == len(data["roles"])
    assert "heads kept" in summary and f"({len(data['pruned'])} pruned)" in summary


def test_a_report_without_layer_heads_is_named_without_none(tmp_path):
    from types import SimpleNamespace

    from multihead.commands.inspect import _pruned_slots

    config = SimpleNamespace(num_heads=4, layer_heads=[2, 4])
    (tmp_path / "report.json").write_text('{"removed": {"0": [1, 3]}}')
    slots, notes = _pruned_slots(config, tmp_path / "report.json")
    assert slots is not None and len(notes) == 1
    assert "it lists no layer_heads" in notes[0] and "None" not in notes[0]
    (tmp_path / "report.json").write_text('{"layer_heads": [3, 4], "removed": {}}')
    _, notes = _pruned_slots(config, tmp_path / "report.json")
    assert "its layer_heads [3, 4] are not the checkpoint's [2, 4]" in notes[0]
