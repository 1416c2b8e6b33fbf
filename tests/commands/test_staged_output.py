"""``staged_output.write_folder``: an output folder appears whole or not at all."""

from __future__ import annotations

import pytest

from multihead.commands.staged_output import Interrupted, write_folder

NAMES = ("config.json", "model.safetensors", "report.json", "tokenizer.json")


def staged(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.rglob(".*.tmp"))


def test_a_new_folder_appears_whole(tmp_path):
    out = tmp_path / "a" / "b" / "out"

    def write(folder):
        assert folder.parent == out.parent and not out.exists()  # staged beside the target
        (folder / "config.json").write_text("{}")
        (folder / "report.json").write_text("{}")

    write_folder(out, write, NAMES)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "report.json"] and staged(tmp_path) == []


def test_an_existing_folder_gets_this_run_s_files_only(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name, text in (("config.json", "old"), ("tokenizer.json", "old"), ("notes.txt", "mine")):
        (out / name).write_text(text)

    def write(folder):
        assert folder.parent == out  # staged inside the existing folder: its own file system and permissions
        (folder / "config.json").write_text("new")

    write_folder(out, write, NAMES)
    # the earlier run's tokenizer.json would not belong to the new model; the user's own file stays
    assert {p.name: p.read_text() for p in out.iterdir()} == {"config.json": "new", "notes.txt": "mine"}


@pytest.mark.parametrize("error", [Interrupted(2), RuntimeError("disk trouble")], ids=["interrupt", "error"])
def test_a_failed_write_leaves_nothing(error, tmp_path):
    out = tmp_path / "new" / "out"

    def write(folder):
        (folder / "model.safetensors").write_bytes(b"half")
        raise error

    with pytest.raises(type(error)):
        write_folder(out, write, NAMES)
    assert list(tmp_path.iterdir()) == []  # no folder, no staging, not even the parent it made


def test_a_killed_writer_s_staging_is_cleared_by_the_next_write(tmp_path):
    pid = 2**22 + 12345  # above Linux's limit: no such process
    for dead in (tmp_path / f".out.{pid}.{'0' * 32}.tmp", tmp_path / "old" / f".output.{pid}.{'0' * 32}.tmp"):
        dead.mkdir(parents=True)
        (dead / "model.safetensors").write_bytes(b"part")
    for name in ("out", "old"):  # a new folder, staged beside it; an existing one, inside it
        write_folder(tmp_path / name, lambda f: (f / "config.json").write_text("{}"), NAMES)
        assert (tmp_path / name / "config.json").is_file()
    assert staged(tmp_path) == []
