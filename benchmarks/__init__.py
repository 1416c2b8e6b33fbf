"""Benchmarks for multihead: declarative cases, alternating timer, runner.

Run from the repository root (no install needed)::

    python -m benchmarks.run --list
    python -m benchmarks.run mha_vs_torch --quick

See ``benchmarks/README.md`` and ``docs/benchmarks.md``.
"""
