"""Data shipped with the package: published numbers the demos compare against."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

__all__ = ["load_textbook_oracle"]


def load_textbook_oracle() -> dict[str, Any]:
    """Raschka's chapter-3 attention tensors (seeds, weights, outputs).

    The file holds the book's printed classes re-run with torch 2.13.0 on
    CPU at full precision; its ``about`` field describes every entry.
    """
    text = resources.files(__package__).joinpath("textbook_ch03.json").read_text(encoding="utf-8")
    return json.loads(text)
