"""``multihead.textbook`` exports every public name of its three book modules, each defined there."""

from __future__ import annotations

import importlib

import multihead.textbook as textbook

BOOK_MODULES = ("multihead.textbook.raschka", "multihead.textbook.annotated", "multihead.textbook.tutorial")


def test_package_exports_every_public_name_of_the_book_modules():
    names = set()
    for module_name in BOOK_MODULES:
        names |= set(importlib.import_module(module_name).__all__)
    assert set(textbook.__all__) == names
    for name in textbook.__all__:
        assert getattr(textbook, name).__module__.startswith("multihead.textbook."), name
