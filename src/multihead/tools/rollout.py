"""Attention rollout and attention flow (Abnar & Zuidema, 2020): how much each input token
reaches each output token through all layers.

    relevance = attention_rollout(outputs.attentions)            # [T, T]
    relevance = attention_flow(outputs.attentions)               # [T, T], T <= 32
    relevance[i, j]        # output token i (after the last layer) <- input token j

Both take what ``head_view`` takes (a model's ``output_attentions`` tuple of
L tensors [B, H, T, T], a list of tensors, or an AttentionRecord) and read
one batch item (``batch``). They need self-attention (S = T).

Each layer's heads are fused into one [T, T] matrix (``head_fusion``: the
mean, max or min over heads); with ``add_residual`` the residual connection
is counted as well: A = (W + I), each row divided by its sum (for rows that
sum to 1, 0.5 W + 0.5 I).

- Rollout multiplies the layers' matrices: R = A_L ... A_2 A_1.
- Flow treats the layers as a graph: a node per (layer l = 0..L, token),
  an edge from (l, i) down to (l - 1, j) of capacity A_l[i, j]. flow[i, j]
  is the maximum flow from output node (L, i) to input node (0, j), each row
  then divided by its sum (so rows sum to 1, as rollout's do).

Flow solves T x T maximum-flow problems over about L T^2 edges (a
Dinic max-flow in plain Python, no dependency), so it is refused above
``MAX_FLOW_TOKENS`` tokens with one line; rollout has no limit.
"""

from __future__ import annotations

from collections import deque

import torch

from .view_inputs import attention_record, layer_weights

__all__ = ["attention_rollout", "attention_flow", "MAX_FLOW_TOKENS", "HEAD_FUSIONS"]

MAX_FLOW_TOKENS = 32
HEAD_FUSIONS = ("mean", "max", "min")
_EPS = 1e-12  # residual capacity below this is spent (float capacities)


def attention_rollout(attentions, add_residual: bool = True, head_fusion: str = "mean", *, batch: int = 0) -> torch.Tensor:
    """Rollout relevance [T, T] float64 of input token j for output token i, see the module docstring.

    Raises:
        TypeError, ValueError: as ``head_view`` (ragged shapes, non-finite
            weights); an unknown head_fusion; cross attention (S != T).
    """
    return rollout_steps(_fused(attentions, add_residual, head_fusion, batch))[-1]


def attention_flow(attentions, add_residual: bool = True, head_fusion: str = "mean", *, batch: int = 0) -> torch.Tensor:
    """Flow relevance [T, T] float64 (rows sum to 1), see the module docstring.

    Raises:
        ValueError: more than ``MAX_FLOW_TOKENS`` tokens, negative weights
            (a capacity cannot be negative), and as ``attention_rollout``.
    """
    return flow(_fused(attentions, add_residual, head_fusion, batch, capacities=True))


def fused_layers(attentions, add_residual: bool, head_fusion: str, batch: int, *, capacities: bool = False):
    """Each layer's fused [T, T] float64 matrix and the record it came from (for the views)."""
    record = attention_record(attentions, batch=batch)
    if not isinstance(add_residual, bool):
        raise TypeError(f"add_residual must be True or False, got {add_residual!r}")
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"head_fusion must be one of {', '.join(HEAD_FUSIONS)}, got {head_fusion!r}")
    out = []
    for entry, w in zip(record.layers, layer_weights(record)):
        H, T, S = w.shape
        if S != T:
            raise ValueError(f"{entry.name} has T={T} queries but S={S} keys: rollout and flow need self-attention")
        if capacities and bool((w < 0).any()):
            raise ValueError(f"{entry.name} has negative weights (min {float(w.min()):.4g}): flow needs capacities >= 0")
        a = {"mean": w.mean(0), "max": w.amax(0), "min": w.amin(0)}[head_fusion]
        if add_residual:
            a = a + torch.eye(T, dtype=a.dtype)
            a = a / a.sum(-1, keepdim=True)
        out.append(a)
    if capacities and out[0].shape[0] > MAX_FLOW_TOKENS:
        raise ValueError(
            f"attention_flow takes at most {MAX_FLOW_TOKENS} tokens (T x T max-flow problems), got T={out[0].shape[0]}: "
            "use attention_rollout, or fewer tokens"
        )
    return out, record


def _fused(attentions, add_residual, head_fusion, batch, capacities=False) -> list[torch.Tensor]:
    return fused_layers(attentions, add_residual, head_fusion, batch, capacities=capacities)[0]


def rollout_steps(fused: list[torch.Tensor]) -> list[torch.Tensor]:
    """[T, T] after each layer: A_1, A_2 A_1, ..., A_L ... A_1."""
    out = [fused[0]]
    for a in fused[1:]:
        out.append(a @ out[-1])
    return out


def flow(fused: list[torch.Tensor]) -> torch.Tensor:
    """[T, T]: max-flow from each top node to each input node, rows divided by their sums."""
    L, T = len(fused), fused[0].shape[0]
    if L == 1:  # one layer: each edge is its own path
        out = fused[0].clamp_min(0).clone()
    else:
        graph = _LayeredGraph([a.tolist() for a in fused])
        out = torch.tensor([[graph.max_flow(i, j) for j in range(T)] for i in range(T)], dtype=torch.float64)
    total = out.sum(-1, keepdim=True)
    return torch.where(total > 0, out / total.clamp_min(_EPS), out)


class _LayeredGraph:
    """The residual graph of L >= 2 layers for Dinic's max-flow, built once for every (source, sink).

    Nodes: 0 the source (a top token), then (l, t) for l = L-1 .. 1 as 1 + (L-1-l)*T + t, and the
    sink (an input token) last. The source's edges (capacities A_L[source, t]) and the sink's
    (A_1[t, sink]) are set for each problem; the edges between layers L-1 .. 1 stay.
    """

    def __init__(self, caps: list):
        self.caps, L, T = caps, len(caps), len(caps[0])
        self.n = 2 + (L - 1) * T
        self.head: list[list[int]] = [[] for _ in range(self.n)]  # edge ids leaving each node
        self.to: list[int] = []
        self.base: list[float] = []  # capacities; edge e ^ 1 is e's reverse

        def node(layer: int, t: int) -> int:
            return 1 + (L - 1 - layer) * T + t

        self.source_edges = [self._add(0, node(L - 1, t), 0.0) for t in range(T)]
        for layer in range(L - 1, 1, -1):  # edges (layer, a) -> (layer - 1, b), capacity A_layer[a, b]
            rows = caps[layer - 1]
            for a in range(T):
                for b in range(T):
                    if rows[a][b] > 0:
                        self._add(node(layer, a), node(layer - 1, b), rows[a][b])
        self.sink_edges = [self._add(node(1, a), self.n - 1, 0.0) for a in range(T)]

    def _add(self, u: int, v: int, c: float) -> int:
        e = len(self.to)
        self.head[u].append(e)
        self.to.append(v)
        self.base.append(c)
        self.head[v].append(e + 1)
        self.to.append(u)
        self.base.append(0.0)
        return e

    def max_flow(self, source: int, sink: int) -> float:
        """Dinic's max-flow from top token ``source`` to input token ``sink``."""
        head, to, n = self.head, self.to, self.n
        sink_node = n - 1
        cap = self.base[:]
        for t, e in enumerate(self.source_edges):
            cap[e] = max(self.caps[-1][source][t], 0.0)
        for a, e in enumerate(self.sink_edges):
            cap[e] = max(self.caps[0][a][sink], 0.0)
        total = 0.0
        while True:
            level = [-1] * n
            level[0] = 0
            queue = deque([0])
            while queue:
                u = queue.popleft()
                for e in head[u]:
                    if cap[e] > _EPS and level[to[e]] < 0:
                        level[to[e]] = level[u] + 1
                        queue.append(to[e])
            if level[sink_node] < 0:
                return total
            cursor = [0] * n
            while True:  # augmenting paths along the level graph (iterative: no recursion limit)
                path: list[int] = []
                u = 0
                while u != sink_node:
                    edges = head[u]
                    while cursor[u] < len(edges):
                        e = edges[cursor[u]]
                        if cap[e] > _EPS and level[to[e]] == level[u] + 1:
                            break
                        cursor[u] += 1
                    else:  # a dead end: step back and skip the edge that led here
                        if u == 0:
                            break
                        level[u] = -1
                        u = to[path.pop() ^ 1]
                        cursor[u] += 1
                        continue
                    path.append(e)
                    u = to[e]
                if u != sink_node:
                    break
                sent = min(cap[e] for e in path)
                for e in path:
                    cap[e] -= sent
                    cap[e ^ 1] += sent
                total += sent
