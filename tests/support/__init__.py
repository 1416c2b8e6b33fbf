"""Helpers shared by test files (importable as ``support``: pytest's
``pythonpath`` setting puts ``tests/`` on the path)."""
