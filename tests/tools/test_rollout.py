"""Attention rollout and flow against hand-worked graphs, a plain-Python loop and networkx's max-flow."""

from __future__ import annotations

import pytest
import torch

from multihead.tools import MAX_FLOW_TOKENS, AttentionRecord, LayerAttention, attention_flow, attention_rollout

# Two layers, one head, two tokens, rows summing to 1: worked by hand below.
A1 = [[0.5, 0.5], [1.0, 0.0]]
A2 = [[0.25, 0.75], [0.5, 0.5]]


def hf_attentions(L: int, H: int, T: int, B: int = 1, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A model's output_attentions: L tensors [B, H, T, T] whose rows sum to 1."""
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(B, H, T, T, generator=g) * 2).softmax(-1) for _ in range(L))


def fused_by_hand(w: torch.Tensor, fusion: str, residual: bool) -> list[list[float]]:
    """One layer's [H, T, T] fused and (with the residual) (W + I) row-normalised, in plain Python."""
    H, T, _ = w.shape
    pick = {"mean": lambda xs: sum(xs) / len(xs), "max": max, "min": min}[fusion]
    out = [[pick([float(w[h, i, j]) for h in range(H)]) for j in range(T)] for i in range(T)]
    if residual:
        out = [[v + (1.0 if i == j else 0.0) for j, v in enumerate(row)] for i, row in enumerate(out)]
        out = [[v / sum(row) for v in row] for row in out]
    return out


def test_two_layers_worked_by_hand():
    layers = (torch.tensor(A1)[None, None], torch.tensor(A2)[None, None])
    # rollout = A2 @ A1: row 0 = .25 * [.5, .5] + .75 * [1, 0]; row 1 = .5 * [.5, .5] + .5 * [1, 0]
    rollout = attention_rollout(layers, add_residual=False)
    torch.testing.assert_close(rollout, torch.tensor([[0.875, 0.125], [0.75, 0.25]], dtype=torch.float64))
    # flow from top token i to input j: each path i -> k -> j carries min(A2[i][k], A1[k][j]) (paths share no edge)
    # top 0: to input 0 min(.25, .5) + min(.75, 1) = 1, to input 1 min(.25, .5) + min(.75, 0) = .25 -> [.8, .2]
    # top 1: to input 0 min(.5, .5) + min(.5, 1) = 1, to input 1 min(.5, .5) + 0 = .5 -> [2/3, 1/3]
    flow = attention_flow(layers, add_residual=False)
    torch.testing.assert_close(flow, torch.tensor([[0.8, 0.2], [2 / 3, 1 / 3]], dtype=torch.float64))


def test_a_shared_edge_limits_the_flow():
    """Three layers where two paths share the edge into the input: the flow is that edge's capacity."""
    layer1 = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # each token of layer 1 reads its own input
    layer2 = torch.tensor([[1.0, 0.0], [1.0, 0.0]])  # both tokens of layer 2 read only token 0 of layer 1
    layer3 = torch.tensor([[0.5, 0.5], [0.5, 0.5]])  # the top reads both tokens of layer 2
    layers = tuple(x[None, None] for x in (layer1, layer2, layer3))
    flow = attention_flow(layers, add_residual=False)
    # top 0 -> (2,0) .5 and (2,1) .5 -> both into (1,0) with capacity 1 each -> (0,0) capacity 1: flow 1 to input 0,
    # nothing reaches input 1; rollout agrees here
    torch.testing.assert_close(flow, torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64))
    narrow = (layer1 * 0.4 + torch.tensor([[0.0, 0.6], [0.0, 0.6]]))[None, None]  # (1,0) -> (0,0) only .4
    flow = attention_flow((narrow, *layers[1:]), add_residual=False)
    # everything must pass (1,0): .4 reaches input 0, .6 input 1, whatever the top sends
    torch.testing.assert_close(flow, torch.tensor([[0.4, 0.6], [0.4, 0.6]], dtype=torch.float64))


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("residual", [True, False])
def test_rollout_equals_a_plain_loop(fusion, residual):
    attentions = hf_attentions(L=3, H=4, T=5, B=2)
    got = attention_rollout(attentions, add_residual=residual, head_fusion=fusion, batch=1)
    layers = [fused_by_hand(w[1], fusion, residual) for w in attentions]
    T = 5
    want = layers[0]
    for a in layers[1:]:  # want = a @ want, written out
        want = [[sum(a[i][k] * want[k][j] for k in range(T)) for j in range(T)] for i in range(T)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-9)
    if residual or fusion == "mean":
        torch.testing.assert_close(got.sum(-1), torch.ones(T, dtype=torch.float64))


@pytest.mark.parametrize("L,T", [(1, 3), (3, 4), (4, 6)])
def test_flow_equals_networkx_max_flow(L, T):
    nx = pytest.importorskip("networkx")
    attentions = hf_attentions(L=L, H=3, T=T, seed=L)
    got = attention_flow(attentions)
    graph = nx.DiGraph()
    for layer, w in enumerate(attentions, start=1):
        a = fused_by_hand(w[0], "mean", True)
        for i in range(T):
            for j in range(T):
                graph.add_edge((layer, i), (layer - 1, j), capacity=a[i][j])
    raw = [[nx.maximum_flow_value(graph, (L, i), (0, j)) for j in range(T)] for i in range(T)]
    want = torch.tensor([[v / sum(row) for v in row] for row in raw], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_an_attention_record_works_as_the_tuple_does():
    attentions = hf_attentions(L=2, H=2, T=4)
    record = AttentionRecord([LayerAttention(i, f"l{i}", "mha", w) for i, w in enumerate(attentions)])
    torch.testing.assert_close(attention_rollout(record), attention_rollout(attentions))
    torch.testing.assert_close(attention_flow(record), attention_flow(list(attentions)))


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_flow_refuses_too_many_tokens_in_one_line():
    T = MAX_FLOW_TOKENS + 1
    attentions = (torch.full((1, 1, T, T), 1.0 / T),)
    with pytest.raises(ValueError) as excinfo:
        attention_flow(attentions)
    assert f"at most {MAX_FLOW_TOKENS} tokens" in one_line(excinfo) and f"T={T}" in one_line(excinfo)
    assert attention_rollout(attentions).shape == (T, T)  # rollout has no limit


@pytest.mark.parametrize(
    "call,error,words",
    [
        (lambda: attention_rollout(hf_attentions(2, 2, 3), head_fusion="median"), ValueError, "head_fusion"),
        (lambda: attention_rollout(hf_attentions(2, 2, 3), add_residual=1), TypeError, "add_residual"),
        (lambda: attention_rollout((torch.rand(1, 2, 3, 5).softmax(-1),)), ValueError, "S=5"),
        (lambda: attention_flow((torch.tensor([[[[1.5, -0.5], [0.5, 0.5]]]]),)), ValueError, "negative"),
        (lambda: attention_rollout((torch.rand(1, 2, 3, 3), torch.rand(1, 2, 4, 4))), ValueError, "attentions[1]"),
        (lambda: attention_rollout(hf_attentions(2, 2, 3), batch=1), ValueError, "batch=1"),
    ],
)
def test_mistakes_are_one_line(call, error, words):
    with pytest.raises(error) as excinfo:
        call()
    assert words in one_line(excinfo)
