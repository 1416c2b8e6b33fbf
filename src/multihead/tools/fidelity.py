"""How close a pruned model stays to the original, and which heads to prune first.

    order = pruning_order(scores)            # [L, H] scores -> (layer, head), lowest first
    table = head_table(order, 20)            # the first 20 as {layer: [head, ...]}
    table = keep_heads(scores, keep=36)      # the lowest L*H - 36, at least one head left per layer
    cos, nn10 = fidelity(reference, pruned)  # embeddings [N, C] of the same N inputs

Fidelity of sentence embeddings: the mean cosine between each input's
pruned and original embedding, and the top-k neighbour agreement: for each
row i, the share of its k nearest rows (by cosine, i itself excluded) under
the original embeddings that are also among its k nearest under the pruned
ones, averaged over rows. Both are computed in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["pruning_order", "head_table", "keep_heads", "neighbour_agreement", "fidelity"]


def pruning_order(scores: torch.Tensor) -> list[tuple[int, int]]:
    """[L, H] scores -> (layer, head) from the lowest score up (ties: lower index first).

    NaN entries (no such head: a pruned layer's missing heads, as
    ``head_importance`` gives them) are left out.
    """
    H = scores.shape[1]
    order = torch.argsort(scores.flatten(), stable=True)  # (L, H) -> (L * H,)
    missing = scores.flatten().isnan()
    return [(int(i) // H, int(i) % H) for i in order if not missing[i]]


def head_table(order: list[tuple[int, int]], count: int) -> dict[int, list[int]]:
    """The first ``count`` heads of ``order`` as ``{layer: [head, ...]}``."""
    table: dict[int, list[int]] = {}
    for layer, head in order[:count]:
        table.setdefault(layer, []).append(head)
    return table


def keep_heads(scores: torch.Tensor, keep: int) -> dict[int, list[int]]:
    """The heads to remove so that ``keep`` heads stay, at least one in every layer.

    Heads go lowest score first over all layers at once (``pruning_order``);
    a head whose removal would leave its layer empty is skipped, so a layer's
    best head always stays.

    Args:
        scores: [L, H] importance scores (higher = keep longer); NaN marks
            a head a layer does not have (pruned before).
        keep: heads to keep overall, in [L, N], N the heads the table has.

    Returns:
        ``{layer: [head, ...]}`` of the L * H - keep heads to remove (layers
        that lose none are absent), heads in pruning order.

    Raises:
        ValueError: ``keep`` outside [L, N].
    """
    L, H = scores.shape
    if isinstance(keep, bool) or not isinstance(keep, int):
        raise TypeError(f"keep must be an int, got {type(keep).__name__}")
    left = (~scores.isnan()).sum(dim=1).tolist()  # heads per layer
    total = sum(left)
    if not L <= keep <= total:
        raise ValueError(f"keep={keep} heads: must be in [{L}, {total}] for {L} layers of {left} heads")
    table: dict[int, list[int]] = {}
    remove = total - keep
    for layer, head in pruning_order(scores):
        if remove == 0:
            break
        if left[layer] == 1:
            continue
        left[layer] -= 1
        table.setdefault(layer, []).append(head)
        remove -= 1
    return table


def neighbour_agreement(reference: torch.Tensor, pruned: torch.Tensor, k: int = 10) -> float:
    """Mean over rows i of |top-k(i) under ``pruned`` & top-k(i) under ``reference``| / k.

    Neighbours by cosine among the N rows [N, C], row i itself excluded.
    """
    N = reference.shape[0]
    if not 0 < k < N:
        raise ValueError(f"k={k} must be in [1, {N - 1}] for {N} rows")

    def neighbours(emb: torch.Tensor) -> torch.Tensor:  # (N, C) -> (N, N) bool, k True per row
        unit = F.normalize(emb.double(), dim=1)
        sims = (unit @ unit.T).fill_diagonal_(float("-inf"))  # (N, N)
        picked = torch.zeros(N, N, dtype=torch.bool)
        return picked.scatter_(1, sims.topk(k, dim=1).indices.cpu(), True)

    return float((neighbours(reference.cpu()) & neighbours(pruned.cpu())).sum(dim=1).double().mean() / k)


def fidelity(reference: torch.Tensor, pruned: torch.Tensor, k: int = 10) -> tuple[float, float]:
    """(mean cosine to the reference, top-k neighbour agreement) of [N, C] embeddings."""
    cos = F.cosine_similarity(pruned.double(), reference.double(), dim=1).mean()
    return float(cos), neighbour_agreement(reference, pruned, k)
