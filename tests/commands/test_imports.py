"""``--import MODULE``: the user's own module is imported before anything is built, from the
current folder first; a module that cannot be imported is one line and exit status 2; compare's
runs import it in their own processes."""

from __future__ import annotations

import json
import os
import sys

import pytest
from support.cli import quietly

import multihead.models.gpt as gpt_module
from multihead.commands.imports import import_modules
from multihead.errors import UsageError

MARKER = "import sys\nsys.multihead_test_events.append('imported {name}')\n"


@pytest.fixture
def events(tmp_path, monkeypatch):
    """Run in tmp_path; record module imports and model builds in order, in ``sys.multihead_test_events``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # --import puts the current folder first
    seen: list[str] = []
    monkeypatch.setattr(sys, "multihead_test_events", seen, raising=False)
    init = gpt_module.GPT.__init__

    def recorded(self, *args, **kwargs):
        seen.append("built")
        init(self, *args, **kwargs)

    monkeypatch.setattr(gpt_module.GPT, "__init__", recorded)
    names = ["marker_a", "marker_b", "broken_marker"]
    for name in names[:2]:
        (tmp_path / f"{name}.py").write_text(MARKER.format(name=name))
    (tmp_path / "broken_marker.py").write_text("raise RuntimeError('the module itself fails')\n")
    yield seen
    for name in names:
        sys.modules.pop(name, None)


def test_generate_imports_the_modules_first_in_order(events):
    rc, out, err = quietly("generate", "--import", "marker_a", "--import", "marker_b", "--preset", "tiny",
                           "--max-new-tokens", "2")  # fmt: skip
    assert rc == 0, err
    assert events[:3] == ["imported marker_a", "imported marker_b", "built"]


def test_train_imports_the_module_before_the_model_is_built(events, tmp_path):
    rc, _, err = quietly("train", "--import", "marker_a", "--preset", "tiny", "--attention", "flash",
                         "--out", str(tmp_path / "run"))  # fmt: skip
    assert rc == 2 and events == ["imported marker_a"], err
    assert "unknown attention kind" in err and "'flash'" in err and "--import MODULE" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["generate", "inspect", "train", "prune", "convert", "compare"])
def test_a_missing_module_is_one_line_before_anything_is_built(command, events, tmp_path):
    required = {"prune": ["--method", "gradient", "--keep", "0.5", "--model", "minilm-l6", "--out", "o"],
                "convert": ["--to", "gqa", "--num-kv-heads", "1", "--checkpoint", "c", "--out", "o"]}  # fmt: skip
    rc, out, err = quietly(command, "--import", "marker_a", "--import", "no_such_module_xyz", *required.get(command, []))
    assert rc == 2 and out == "" and "Traceback" not in err, err
    assert err == (f"multihead {command}: error: --import no_such_module_xyz: ModuleNotFoundError: "
                   "No module named 'no_such_module_xyz'\n")  # fmt: skip
    assert events == ["imported marker_a"]
    assert sorted(os.listdir(tmp_path)) == ["broken_marker.py", "marker_a.py", "marker_b.py"]


def test_a_module_that_fails_names_itself_and_its_error(events):
    rc, _, err = quietly("generate", "--import", "broken_marker")
    assert rc == 2 and err == "multihead generate: error: --import broken_marker: RuntimeError: the module itself fails\n"
    assert events == []


def test_import_modules_refuses_what_is_not_a_module_name():
    with pytest.raises(UsageError, match="--import 'a b': not a module name"):
        import_modules(["a b"])
    assert import_modules([]) == []
    assert import_modules(["json"]) == [json]


def test_compare_runs_import_the_modules_in_their_own_processes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    pids = tmp_path / "pids.txt"
    monkeypatch.setenv("MULTIHEAD_TEST_PIDS", str(pids))
    (tmp_path / "pid_marker.py").write_text(
        "import os\nwith open(os.environ['MULTIHEAD_TEST_PIDS'], 'a') as f:\n    f.write(f'{os.getpid()}\\n')\n"
    )
    data = tmp_path / "text.txt"
    data.write_text("to be or not to be that is the question\n" * 300)
    try:
        rc, out, err = quietly("compare", "--quick", "--import", "pid_marker", "--attention", "mha", "--seeds", "0",
                               "--data", str(data), "--out", str(tmp_path / "cmp"))  # fmt: skip
    finally:
        sys.modules.pop("pid_marker", None)
    assert rc == 0, err
    seen = pids.read_text().split()
    assert seen[0] == str(os.getpid()) and len(seen) == 2 and seen[1] != seen[0]  # this process, then the run's
