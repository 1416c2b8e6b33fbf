"""The former module paths under ``multihead.modules`` give the very objects of ``multihead.textbook``."""

from __future__ import annotations

import importlib

import pytest

import multihead.textbook as textbook

OLD_TO_NEW = {
    "multihead.modules.textbook": "multihead.textbook.raschka",
    "multihead.modules.annotated": "multihead.textbook.annotated",
    "multihead.modules.tutorial_heads": "multihead.textbook.tutorial",
}


@pytest.mark.parametrize("old_name, new_name", sorted(OLD_TO_NEW.items()))
def test_old_path_exports_the_same_objects(old_name, new_name):
    old = importlib.import_module(old_name)
    new = importlib.import_module(new_name)
    assert set(new.__all__) <= set(old.__all__)
    for name in old.__all__:
        assert getattr(old, name) is getattr(new, name), f"{old_name}.{name} is not {new_name}.{name}"


def test_package_exports_every_moved_public_name():
    moved = set()
    for new_name in OLD_TO_NEW.values():
        moved |= set(importlib.import_module(new_name).__all__)
    assert set(textbook.__all__) == moved
    for name in textbook.__all__:
        assert getattr(textbook, name).__module__.startswith("multihead.textbook."), name
