"""``--import MODULE``: the user's own modules, imported before anything is built.

    multihead train --import mykinds --attention my_kind --out runs/mine

A module of the user's own package registers its attention kinds when it is
imported (``multihead.register_attention``); every command that builds a
model takes ``--import`` (repeatable) and imports those modules first. The
current folder is searched first, as ``python -m`` does, so a ``mykinds.py``
beside the command works without installing anything. ``multihead
compare`` hands the same names to each run's process.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Iterable
from types import ModuleType

from ..errors import UsageError

__all__ = ["add_import_argument", "import_modules"]


def add_import_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--import MODULE`` (repeatable; ``args.imports``, a list) to ``parser``."""
    parser.add_argument(
        "--import", dest="imports", action="append", default=[], metavar="MODULE",
        help="import MODULE first (repeatable): your own module that registers attention kinds; "
        "the current folder is searched first, as with python -m",
    )  # fmt: skip


def import_modules(names: Iterable[str]) -> list[ModuleType]:
    """Import each module of ``--import``, the current folder first on ``sys.path``.

    Returns:
        the modules, in the order given.

    Raises:
        UsageError: a name that is not a module name, or a module that cannot
            be imported (not found, or its import raised), naming the module
            and the error.
    """
    names = list(names)
    if names and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    modules = []
    for name in names:
        if not name or not all(part.isidentifier() for part in name.split(".")):
            raise UsageError(f"--import {name!r}: not a module name (give one such as mykinds or mypackage.kinds)")
        try:
            modules.append(importlib.import_module(name))
        except Exception as e:  # whatever the module's own code raised: it names the module here
            message = " ".join(str(e).split())
            raise UsageError(f"--import {name}: {type(e).__name__}: {message}" if message
                             else f"--import {name}: {type(e).__name__}") from e  # fmt: skip
    return modules
