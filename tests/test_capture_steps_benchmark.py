"""benchmarks/capture_steps.py at a tiny size, timing nothing worth reading: every
step runs, the rebuild of another source tree is loaded beside this one's, and
the report names each step with its page faults."""

from pathlib import Path

from benchmarks import capture_steps  # the repository root is on pytest's pythonpath

SRC = Path(__file__).resolve().parent.parent / "src"


def test_every_step_is_reported_and_another_trees_rebuild_is_timed_beside_it(capsys):
    capture_steps.main(["--seq", "16", "--rounds", "1", "--warmup", "0", "--threads", "1", "--before", str(SRC)])
    out = capsys.readouterr().out
    assert "minor page faults per call: forward" in out
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:] == ["forward", "captured", "kernel", "rebuild", "rebuild (before)",
                        "touch fresh [1, 12, 16, 16]", "fill touched [1, 12, 16, 16]"]  # fmt: skip


def test_the_rebuild_of_another_tree_is_its_own_function():
    """--before loads that tree's weights.py as a module of its own, not this one's."""
    from multihead.functional.weights import rebuild_weights

    other = capture_steps._rebuild_from(str(SRC))
    assert other is not rebuild_weights
    assert Path(other.__code__.co_filename).resolve() == (SRC / "multihead" / "functional" / "weights.py").resolve()
