"""Checks on the files a command (or a library writer such as ``hf.export_hf``) reads
and the folders it writes, made before any work.

Every check raises ``ValueError`` naming the flag and the path, so the CLI
prints one line and exits with status 2 before a model is loaded and before
anything is written. Nothing is created by a check: whether a folder can be
written is probed by making and removing an empty temporary folder in the
nearest folder that exists::

    --out a/b/c     a/ exists, b/ does not   ->  probe a/ (c and b would be made there)
    --out file/x    file is not a folder     ->  refused: no folder can be made under a file
    --out /proc/x   /proc refuses new entries ->  refused with the system's reason
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

__all__ = ["output_folder", "input_file"]


def _exists(path: Path) -> bool:
    try:
        path.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def _probe(flag: str, given: str, folder: Path) -> None:
    """Make and remove an empty folder inside ``folder``; ValueError if the system refuses."""
    try:
        made = tempfile.mkdtemp(prefix=".multihead-probe-", dir=folder)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ValueError(f"{flag} {given}: cannot write in {folder} ({reason})") from None
    os.rmdir(made)


def output_folder(
    flag: str, path: str | os.PathLike, files: Iterable[str] = (), *, shown: str | None = None
) -> Path:
    """Check that ``path`` is, or can be made into, a folder this process can write.

    Args:
        flag: the option's name for messages, e.g. ``"--out"``.
        path: the folder.
        files: names that will be written inside it; where one exists it
            must be a regular file (it is replaced).
        shown: the value the user gave, for messages (default ``path``).

    Returns:
        ``path`` as a Path (not created).

    Raises:
        ValueError: ``path`` is a file, lies under a file, or its nearest
            existing folder refuses new entries (no permission, read-only,
            a virtual file system such as /proc).
    """
    folder = Path(os.fspath(path))
    given = os.fspath(path) if shown is None else shown
    if not os.fspath(path):
        raise ValueError(f"{flag} is empty: give a folder")
    try:
        if _exists(folder):
            if not folder.is_dir():
                raise ValueError(f"{flag} {given}: {'' if str(folder) == given else f'{folder} '}exists and is not a folder")
            for name in files:
                target = folder / name
                if _exists(target) and not target.is_file():
                    raise ValueError(f"{flag} {given}: {target} exists and is not a file, so it cannot be replaced")
            _probe(flag, given, folder)
            return folder
        parent = Path(os.path.abspath(folder)).parent
        while not _exists(parent):
            parent = parent.parent
        if not parent.is_dir():
            raise ValueError(f"{flag} {given}: {parent} is not a folder, so no folder can be made under it")
        _probe(flag, given, parent)
    except PermissionError as e:  # a folder on the way that may not even be looked into
        raise ValueError(f"{flag} {given}: cannot look into {e.filename or given} (permission denied)") from None
    return folder


def input_file(flag: str, path: str | os.PathLike, what: str) -> Path:
    """Check that ``path`` is an existing, readable regular file.

    Args:
        flag: the option's name for messages, e.g. ``"--tokenizer"``.
        path: the file.
        what: what the file should be, for the message (``"a tokenizer.json"``).

    Raises:
        ValueError: no such file, a folder, or not readable.
    """
    given = os.fspath(path)
    file = Path(given)
    if not _exists(file):
        raise ValueError(f"{flag} {given}: no such file (expected {what})")
    if not file.is_file():
        raise ValueError(f"{flag} {given}: not a file (expected {what})")
    if not os.access(file, os.R_OK):
        raise ValueError(f"{flag} {given}: not readable (permission denied)")
    return file
