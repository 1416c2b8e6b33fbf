"""Whether eager code may read a device value back to choose a branch.

Some steps have a cheap common case that eager code takes after one look at
the data (are q, k and v finite? does every query row see a key? does a
float mask hold -inf?). On the CPU that look is a read of memory the CPU
just wrote. On a GPU it is a host synchronisation: the host waits until the
device has run every queued kernel, so the kernels after it are queued
late and the device idles while they are. Inside ``torch.compile`` a
data-dependent branch would break the graph. In both cases the code takes
the branch-free form instead, which gives the same numbers.

One read stays on a GPU: choosing the fused kernel for a float mask with
float16/bfloat16 inputs range-checks the mask, since the kernel's cast
would turn values beyond the half-precision range into infinities
(``sdpa_backend.sdpa_not_supported``; a bool mask needs no check).
"""

from __future__ import annotations

import torch

__all__ = ["sync_free"]


def sync_free(device: torch.device) -> bool:
    """True inside ``torch.compile`` and on any device but the CPU: decide
    without reading data back to the host."""
    return torch.compiler.is_compiling() or device.type != "cpu"
