"""Chapter 3 attention classes of Raschka, *Build a Large Language Model (From Scratch)*.

The classes keep the book's names, constructor signatures, attribute names, parameter
creation order and buffers, so that ``torch.manual_seed(s)`` right before construction
reproduces the book's printed numbers and a state_dict has the book's keys
(``W_query.weight``, ..., ``mask``).

Deviations from the book, none of which changes a number:

* User errors raise ``TypeError``/``ValueError`` naming the offending values instead of
  ``assert`` (which ``python -O`` strips) or an obscure shape error deep in ``forward``:
  ``d_out % num_heads != 0``, non-positive sizes, a dropout outside [0, 1], inputs of the
  wrong rank or last dimension, and inputs longer than ``context_length``.
* ``masked_fill`` is applied out of place (the book's ``masked_fill_`` is in place on a
  fresh tensor; the result is identical).
* ``SelfAttention_v1``/``_v2`` also accept a batched ``(b, T, d_in)`` input; the book
  only shows ``(T, d_in)``.
"""

from __future__ import annotations

import torch
from torch import nn

from .._checks import divisible, dropout_probability, positive_int

__all__ = [
    "SelfAttention_v1",
    "SelfAttention_v2",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadAttention",
]


# ----------------------------------------------------------------------------- checks
def _check_input(x: object, d_in: int, ranks: tuple[int, ...], context_length: int | None = None) -> None:
    """Validates a token tensor ``x`` of shape [..., T, d_in].

    Args:
        x: the input.
        d_in: the expected last dimension.
        ranks: the accepted numbers of dimensions.
        context_length: if given, the largest accepted T (x.shape[-2]).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in ranks:
        want = " or ".join(f"{r}-D" for r in ranks)
        raise ValueError(f"input must be {want} [..., num_tokens, d_in], got shape {tuple(x.shape)}")
    if x.shape[-1] != d_in:
        raise ValueError(f"input last dimension must be d_in={d_in}, got shape {tuple(x.shape)}")
    if context_length is not None and x.shape[-2] > context_length:
        raise ValueError(
            f"input has {x.shape[-2]} tokens but context_length={context_length}; the causal mask "
            f"only covers context_length tokens (shape {tuple(x.shape)})"
        )


def _causal_mask(context_length: int) -> torch.Tensor:
    """The book's mask buffer [context_length, context_length]: 1.0 above the diagonal (future)."""
    return torch.triu(torch.ones(context_length, context_length), diagonal=1)


# ---------------------------------------------------------------------------- classes
class SelfAttention_v1(nn.Module):  # noqa: N801 (the book's name)
    """Self-attention with raw weight matrices (book listing 3.1).

    Three ``nn.Parameter(torch.rand(d_in, d_out))`` created in the order W_query, W_key,
    W_value; y = softmax(q kᵀ / sqrt(d_out)) v with q = x @ W_query etc.

    Args:
        d_in: input embedding size.
        d_out: query/key/value size.
    """

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.d_in = positive_int("d_in", d_in)
        self.d_out = positive_int("d_out", d_out)
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attends every token to every token.

        Args:
            x: tokens [T, d_in] (the book) or [b, T, d_in].

        Returns:
            Context vectors [T, d_out] or [b, T, d_out].
        """
        _check_input(x, self.d_in, ranks=(2, 3))
        keys = x @ self.W_key  # [..., T, d_out]
        queries = x @ self.W_query  # [..., T, d_out]
        values = x @ self.W_value  # [..., T, d_out]
        attn_scores = queries @ keys.transpose(-2, -1)  # [..., T, T]
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values  # [..., T, d_out]


class SelfAttention_v2(nn.Module):  # noqa: N801 (the book's name)
    """Self-attention with ``nn.Linear`` projections (book listing 3.2).

    Layers W_query, W_key, W_value created in that order, ``bias=qkv_bias``.

    Args:
        d_in: input embedding size.
        d_out: query/key/value size.
        qkv_bias: whether the three projections have a bias.
    """

    def __init__(self, d_in: int, d_out: int, qkv_bias: bool = False):
        super().__init__()
        self.d_in = positive_int("d_in", d_in)
        self.d_out = positive_int("d_out", d_out)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attends every token to every token.

        Args:
            x: tokens [T, d_in] (the book) or [b, T, d_in].

        Returns:
            Context vectors [T, d_out] or [b, T, d_out].
        """
        _check_input(x, self.d_in, ranks=(2, 3))
        keys = self.W_key(x)  # [..., T, d_out]
        queries = self.W_query(x)  # [..., T, d_out]
        values = self.W_value(x)  # [..., T, d_out]
        attn_scores = queries @ keys.transpose(-2, -1)  # [..., T, T]
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values  # [..., T, d_out]


class CausalAttention(nn.Module):
    """Single-head causal self-attention with dropout on the weights (book listing 3.3).

    Creation order: W_query, W_key, W_value (``bias=qkv_bias``), ``dropout``, then the
    buffer ``mask`` = triu(ones(context_length, context_length), diagonal=1) (float, 1.0
    marks a future key that is hidden).

    Args:
        d_in: input embedding size.
        d_out: query/key/value size.
        context_length: the longest sequence the mask supports.
        dropout: dropout probability on the attention weights (training mode only).
        qkv_bias: whether the three projections have a bias.
    """

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float, qkv_bias: bool = False):
        super().__init__()
        self.d_in = positive_int("d_in", d_in)
        self.d_out = positive_int("d_out", d_out)
        self.context_length = positive_int("context_length", context_length)
        dropout = dropout_probability(dropout)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", _causal_mask(context_length))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Causal attention: token t sees tokens 0..t.

        Args:
            x: tokens [b, T, d_in] with T <= context_length.

        Returns:
            Context vectors [b, T, d_out].
        """
        _check_input(x, self.d_in, ranks=(3,), context_length=self.context_length)
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)  # [b, T, d_out]
        queries = self.W_query(x)  # [b, T, d_out]
        values = self.W_value(x)  # [b, T, d_out]
        attn_scores = queries @ keys.transpose(1, 2)  # [b, T, d_out] @ [b, d_out, T] -> [b, T, T]
        future = self.mask.bool()[:num_tokens, :num_tokens]  # [T, T], True = hidden
        attn_scores = attn_scores.masked_fill(future, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values  # [b, T, T] @ [b, T, d_out] -> [b, T, d_out]


class MultiHeadAttentionWrapper(nn.Module):
    """Multi-head attention as a stack of ``CausalAttention`` heads (book listing 3.4).

    ``self.heads`` is an ``nn.ModuleList`` of ``num_heads`` CausalAttention modules, head 0
    created first; the outputs are concatenated, so the result has ``num_heads * d_out``
    features (no output projection).

    Args:
        d_in: input embedding size.
        d_out: size of EACH head's output.
        context_length: the longest sequence the masks support.
        dropout: dropout probability on the attention weights (training mode only).
        num_heads: number of heads.
        qkv_bias: whether the projections have a bias.
    """

    def __init__(
        self, d_in: int, d_out: int, context_length: int, dropout: float, num_heads: int, qkv_bias: bool = False
    ):
        super().__init__()
        self.num_heads = positive_int("num_heads", num_heads)
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, d_out, context_length, dropout, qkv_bias) for _ in range(num_heads)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Runs every head and concatenates.

        Args:
            x: tokens [b, T, d_in] with T <= context_length.

        Returns:
            Context vectors [b, T, num_heads * d_out], head 0's features first.
        """
        # num_heads x [b, T, d_out] -> [b, T, num_heads * d_out]
        return torch.cat([head(x) for head in self.heads], dim=-1)


class MultiHeadAttention(nn.Module):
    """Causal multi-head attention with weight splits (book listing 3.5).

    Creation order: W_query, W_key, W_value (``nn.Linear(d_in, d_out, bias=qkv_bias)``),
    ``out_proj`` (``nn.Linear(d_out, d_out)``, always with bias), ``dropout``, then the
    buffer ``mask``. Head j uses output features j*head_dim ... (j+1)*head_dim - 1.

    Args:
        d_in: input embedding size.
        d_out: total output size, split across heads (head_dim = d_out // num_heads).
        context_length: the longest sequence the mask supports.
        dropout: dropout probability on the attention weights (training mode only).
        num_heads: number of heads; must divide d_out.
        qkv_bias: whether the query/key/value projections have a bias.

    Raises:
        ValueError: if d_out % num_heads != 0 or a size is not positive.
    """

    def __init__(
        self, d_in: int, d_out: int, context_length: int, dropout: float, num_heads: int, qkv_bias: bool = False
    ):
        super().__init__()
        self.d_in = positive_int("d_in", d_in)
        self.d_out = positive_int("d_out", d_out)
        self.num_heads = positive_int("num_heads", num_heads)
        self.context_length = positive_int("context_length", context_length)
        dropout = dropout_probability(dropout)
        divisible(d_out, num_heads, "d_out", "num_heads")
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", _causal_mask(context_length))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Causal multi-head self-attention.

        Args:
            x: tokens [b, T, d_in] with T <= context_length.

        Returns:
            Context vectors [b, T, d_out].
        """
        _check_input(x, self.d_in, ranks=(3,), context_length=self.context_length)
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)  # [b, T, d_out]
        queries = self.W_query(x)  # [b, T, d_out]
        values = self.W_value(x)  # [b, T, d_out]

        # (b, T, d_out) -> (b, T, num_heads, head_dim)
        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim)
        # (b, T, num_heads, head_dim) -> (b, num_heads, T, head_dim)
        keys = keys.transpose(1, 2)
        queries = queries.transpose(1, 2)
        values = values.transpose(1, 2)

        attn_scores = queries @ keys.transpose(2, 3)  # [b, num_heads, T, T]
        future = self.mask.bool()[:num_tokens, :num_tokens]  # [T, T], True = hidden
        attn_scores = attn_scores.masked_fill(future, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)

        # (b, num_heads, T, head_dim) -> (b, T, num_heads, head_dim)
        context_vec = (attn_weights @ values).transpose(1, 2)
        # (b, T, num_heads, head_dim) -> (b, T, d_out), heads concatenated head-major
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context_vec)  # [b, T, d_out]
