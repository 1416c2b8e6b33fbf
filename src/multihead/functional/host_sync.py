"""Whether code may read a device value back to choose a branch.

Some steps have a cheap common case that eager code takes after one look at
the data (are q, k and v finite? does every query row see a key? does a
float mask hold -inf?). Inside ``torch.compile`` a data-dependent branch
would break the graph, so compiled code takes the branch-free form of each
step instead, which gives the same numbers.

Eager code looks, on a GPU too. There a look is a host synchronisation,
but an eager layer is bound by the host anyway: on an H100 the one-sync
``MultiHeadAttention`` forward (B=8, T=1024, bfloat16) took 0.86 ms against
1.19 ms for the branch-free form, and one decode query's attention 0.39 ms
against 0.68 ms, since the branch-free form launches more small kernels
than the sync costs (``benchmarks/cuda_syncs.py``, docs/benchmarks.md).
The fast GPU paths are compiled ones (``generate(compile_steps=True)`` with
CUDA graphs), which are sync-free by construction.
"""

from __future__ import annotations

import torch

__all__ = ["sync_free"]


def sync_free() -> bool:
    """True inside ``torch.compile``: decide without reading data back to the host."""
    return torch.compiler.is_compiling()
