"""benchmarks/induction_data.py: the lines of the induction runs of docs/heads.md."""

from collections import defaultdict

import pytest

from benchmarks import induction_data  # the repository root is on pytest's pythonpath


def _lines(path):
    return path.read_text(encoding="utf-8").splitlines()


def test_each_line_is_a_string_its_separator_and_its_repeat(tmp_path):
    out = tmp_path / "ind.txt"
    induction_data.main([str(out), "--lines", "300", "--min-len", "3", "--max-len", "9", "--alphabet", "5"])
    lines = _lines(out)
    assert len(lines) == 300
    lengths = set()
    for line in lines:
        first, second = line.split("|")
        assert first == second
        assert set(first) <= set("abcde")
        lengths.add(len(first))
    assert lengths == set(range(3, 10))  # every length of the range occurs in 300 lines
    again = tmp_path / "again.txt"
    induction_data.main([str(again), "--lines", "300", "--min-len", "3", "--max-len", "9", "--alphabet", "5"])
    assert again.read_text() == out.read_text()
    induction_data.main([str(again), "--lines", "300", "--min-len", "3", "--max-len", "9", "--alphabet", "5",
                         "--seed", "1"])  # fmt: skip
    assert again.read_text() != out.read_text()


def _successors(lines):
    seen = defaultdict(set)
    for line in lines:
        s = line.split("|")[0]
        for i in range(2, len(s)):
            seen[s[i - 2 : i]].add(s[i])
    return seen


def test_successors_limits_what_follows_each_pair(tmp_path):
    args = ["--lines", "2000", "--min-len", "10", "--max-len", "20", "--alphabet", "8"]
    table = tmp_path / "table.txt"
    induction_data.main([str(table), *args, "--successors", "2"])
    uniform = tmp_path / "uniform.txt"
    induction_data.main([str(uniform), *args])
    assert max(len(v) for v in _successors(_lines(table)).values()) <= 2
    assert max(len(v) for v in _successors(_lines(uniform)).values()) == 8
    for line in _lines(table):
        first, second = line.split("|")
        assert first == second


@pytest.mark.parametrize(
    "args, message",
    [
        (["--min-len", "9", "--max-len", "3"], "min_len=9, max_len=3"),
        (["--alphabet", "63"], "alphabet=63"),
        (["--lines", "0"], "lines=0"),
        (["--alphabet", "4", "--successors", "5"], "successors=5"),
    ],
)
def test_mistakes_are_one_line_and_write_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "ind.txt"
    with pytest.raises(SystemExit) as exc:
        induction_data.main([str(out), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
