"""Implementations of the ``multihead`` CLI subcommands (one module each)."""
