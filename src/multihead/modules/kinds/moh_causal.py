"""Causal attention of gathered query rows with the fused causal kernel.

MoH's sparse path gathers, for each routed head, the query rows that chose
it. A gathered row keeps its original position t and may see keys
j <= t + offset, a staircase that the kernel's ``is_causal`` (row index i
sees key i) does not describe once rows are left out. Instead of an explicit
mask over every key, the positions are cut into blocks of L and each row's
keys are split at its block's start::

    block c = positions [cL, (c+1)L)          keys:  0 ........ cL+off | cL+off .. (c+1)L+off
    prefix:   the block's chosen rows [B, E, M_c, D]   all visible: no mask, only chosen rows
    diagonal: "causal"  every row of the block [B, E·nb, L, D], the kernel's is_causal (CUDA)
              "masked"  the chosen rows [B, E, M_c, D] with a (M_c, L) bias (CPU)
              "joined"  no split: the chosen rows x keys 0 .. (c+1)L+off, the last L masked
    merged:   o = Σ_part exp(lse_part - lse) · o_part,  lse = logaddexp over the parts

so the prefix (most of the work for long sequences) costs only the chosen
rows and no (rows, S) mask is built. On CPU the causal kernel saves little
on blocks this small and the bias is cheap, so "masked" is the default
there; on CUDA the causal kernel skips the hidden half of each diagonal
block (docs/benchmarks.md has the CPU measurements of all three). The
log-sum-exp comes from torch's flash kernel (CPU) or memory-efficient
kernel (CUDA) ops, which return it; the backward is the kernels' own
backward with the merged output and log-sum-exp (a part's probabilities
are exp(scores - merged lse)), so gradients are exact.

Shapes: q [B, E, T, D] (the routed heads' queries), k, v [B, E, S, D] (one
key/value head per query head), rows [B, E, N, D] gathered at ``tok``
[B, E, N] (positions, block by block: ``sizes[c]`` rows of block c, each
block's list distinct). ``kernels_for`` says whether a device/dtype has
such a kernel; the caller falls back to an explicit mask otherwise.
"""

from __future__ import annotations

import math

import torch

__all__ = ["BLOCK", "DIAGONALS", "block_causal_rows", "block_plan", "kernels_for"]

DIAGONALS = ("causal", "masked", "joined")
BLOCK = 256  # positions per block (measured on CPU: 256 a few % faster than 128 and 64 at T = 512 and 2048)


class _CPUKernel:
    """torch's CPU flash kernel: (out, lse) forward and its backward; ``bias`` in q's dtype."""

    diagonal = "masked"  # measured: its causal kernel on small blocks costs more than the masked rows

    @staticmethod
    def forward(q, k, v, causal, scale, bias=None):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
        return out, lse, None

    @staticmethod
    def backward(grad, q, k, v, out, lse, state, causal, scale, bias=None):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
        )


class _CUDAKernel:
    """torch's memory-efficient CUDA kernel (float32, float16, bfloat16); its lse is padded to 32 rows."""

    diagonal = "causal"

    @staticmethod
    def forward(q, k, v, causal, scale, bias=None):
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, _aligned(bias), True, 0.0, causal, scale=scale
        )
        return out, lse, (seed, offset)

    @staticmethod
    def backward(grad, q, k, v, out, lse, state, causal, scale, bias=None):
        seed, offset = state
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad.contiguous(), q, k, v, _aligned(bias), out.contiguous(), lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
        )
        return dq, dk, dv


def _aligned(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias in rows of a multiple of 16 elements (the efficient kernel's alignment), same values."""
    if bias is None or bias.shape[-1] % 16 == 0:
        return bias
    width = bias.shape[-1]
    return torch.nn.functional.pad(bias, (0, 16 - width % 16))[..., :width]


def kernels_for(q: torch.Tensor):
    """The kernel pair serving q's device and dtype, or None (then use an explicit mask)."""
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return _CPUKernel
    if q.device.type == "cuda" and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return _CUDAKernel
    return None


def block_plan(chosen: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Rows to gather, block by block.

    Args:
        chosen: [B, T, E] bool, the (token, routed head) pairs; L: block length.

    Returns:
        tok [B, E, N] positions (block c: its chosen positions in order, then
        unchosen positions of the same block as padding up to ``sizes[c]``,
        the most rows any (batch row, head) chose there), valid [B, E, N]
        (False on padding), sizes (one entry per block, N = sum).
    """
    B, T, E = chosen.shape
    nb = -(-T // L)
    pad = nb * L - T
    ch = torch.nn.functional.pad(chosen, (0, 0, 0, pad)) if pad else chosen  # (B, nb·L, E)
    ch = ch.view(B, nb, L, E)
    counts = ch.sum(2)  # (B, nb, E)
    if torch.compiler.is_compiling():  # no host sync: every row of a block (padding rows are zeroed)
        sizes = [min(L, T - c * L) for c in range(nb)]
    else:
        sizes = [int(n) for n in counts.amax(dim=(0, 2)).tolist()]  # one host sync for every block
    # sort key: 0 chosen, 1 unchosen, 2 past T (the short last block); a block's padding rows are
    # its unchosen positions, and it always has enough of them below T (sizes[c] <= its real positions)
    rank = (~ch).to(torch.uint8)
    if pad:
        rank.view(B, nb * L, E)[:, T:] = 2
    order = torch.argsort(rank, dim=2, stable=True)  # (B, nb, L, E): chosen first, in position order
    toks, valid = [], []
    base = torch.arange(nb, device=chosen.device).view(1, nb, 1, 1) * L
    pos = (order + base).permute(0, 3, 1, 2)  # (B, E, nb, L)
    ranks = torch.arange(L, device=chosen.device)
    cnt = counts.transpose(1, 2)  # (B, E, nb)
    for c, n in enumerate(sizes):
        toks.append(pos[:, :, c, :n])
        valid.append(ranks[:n] < cnt[:, :, c : c + 1])
    return torch.cat(toks, dim=2), torch.cat(valid, dim=2), sizes


def _blocks(x: torch.Tensor, lo: int, T: int, nb: int, L: int) -> torch.Tensor:
    """x[:, :, lo:lo+T] zero-padded to nb·L and cut into blocks: [B, E, S, D] -> [B, E·nb, L, D]."""
    B, E, _, D = x.shape
    part = x[:, :, lo : lo + T]
    if nb * L != T:
        part = torch.nn.functional.pad(part, (0, 0, 0, nb * L - T))
    return part.reshape(B, E * nb, L, D)


def _merge(out, lse, o, lp):
    """Merge a part (o [..., n, D], lp [..., n]) into the running (out, lse), both float:
    out' = w·out + (1 - w)·o with w = exp(lse - lse') = sigmoid(lse - lp)."""
    w = torch.sigmoid(lse - lp).unsqueeze(-1)
    return torch.lerp(o.to(out.dtype), out, w), torch.logaddexp(lse, lp)


class _BlockCausal(torch.autograd.Function):
    """Forward: every piece's (out, lse), merged per row; backward: each piece's kernel
    backward with the merged output and lse (exact: a piece's probabilities are
    exp(scores - merged lse))."""

    @staticmethod
    def forward(ctx, rows, q, k, v, tok, sizes, L, offset, scale, kern, diagonal):
        B, E, T, D = q.shape
        nb, Dv = len(sizes), v.shape[-1]
        out = rows.new_zeros(B, E, rows.shape[2], Dv, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        lse = torch.full(out.shape[:3], float("-inf"), dtype=out.dtype, device=out.device)
        pieces, dense, start = [], None, 0  # piece: (rows slice, key range, bias, its lse, kernel state)
        first = [True] * nb  # block c has no result yet
        if diagonal == "masked":  # every block's diagonal bias at once: key cL + j visible to t iff cL + j <= t
            starts = torch.repeat_interleave(
                torch.arange(nb, device=q.device) * L, torch.tensor(sizes, device=q.device), output_size=tok.shape[2]
            )  # (N,): the first position of each row's block
            hidden = torch.arange(L, device=q.device) > (tok - starts).unsqueeze(-1)  # (B, E, N, L)
            diag_bias = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(hidden, -math.inf)
        if diagonal == "causal":  # every row of every block, the kernel's causal triangle
            qd, kd, vd = _blocks(q, 0, T, nb, L), _blocks(k, offset, T, nb, L), _blocks(v, offset, T, nb, L)
            od, ld, sd = kern.forward(qd, kd, vd, True, scale)  # (B, E·nb, L, Dv), (B, E·nb, >= L)
            at = tok.unsqueeze(-1).expand(*tok.shape, Dv)
            out = od.reshape(B, E, nb * L, Dv).gather(2, at).to(out.dtype)  # (B, E, N, Dv)
            lse = ld[..., :L].reshape(B, E, nb * L).gather(2, tok).to(out.dtype)  # (B, E, N)
            dense = (qd, kd, vd, od, ld, sd)
            first = [False] * nb
        for c, n in enumerate(sizes):
            sl, lo = slice(start, start + n), offset + c * L
            start += n
            if not n:
                continue
            hi = min(lo + L, offset + T)
            if diagonal == "joined":  # one call: every key up to the block's end, the diagonal masked
                ranges = [(0, hi)]
            elif diagonal == "masked":  # the diagonal block, masked, then the prefix (all visible)
                ranges = [(lo, hi)] + ([(0, lo)] if lo > 0 else [])
            else:
                ranges = [(0, lo)] if lo > 0 else []
            for a, b in ranges:
                bias = None
                if diagonal == "masked" and a == lo:
                    bias = diag_bias[:, :, sl, : b - a]
                elif b > lo:  # key a + j is visible to the row at t iff a + j <= t + offset
                    hidden = torch.arange(a, b, device=q.device) > (tok[:, :, sl] + offset).unsqueeze(-1)
                    bias = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(hidden, -math.inf)
                o, lp, st = kern.forward(rows[:, :, sl], k[:, :, a:b], v[:, :, a:b], False, scale, bias)
                if first[c]:
                    out[:, :, sl], lse[:, :, sl] = o, lp[..., :n]
                    first[c] = False
                else:
                    out[:, :, sl], lse[:, :, sl] = _merge(out[:, :, sl], lse[:, :, sl], o, lp[..., :n])
                pieces.append((sl, a, b, bias, lp, st))
        out = out.to(q.dtype)
        ctx.save_for_backward(rows, k, v, tok, out, lse)
        ctx.meta = (sizes, L, offset, scale, kern, pieces, dense, T)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        rows, k, v, tok, out, lse = ctx.saved_tensors
        sizes, L, offset, scale, kern, pieces, dense, T = ctx.meta
        B, E, N, Dv = g.shape
        g = g.contiguous()
        dq, dk, dv, drows = None, torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(rows)
        if dense is not None:
            qd, kd, vd, od, ld, sd = dense
            nb, D = len(sizes), qd.shape[-1]
            Tp = nb * L
            at = tok.unsqueeze(-1).expand(B, E, N, Dv)
            # rows that were not gathered get no gradient (their output was not used)
            gd = g.new_zeros(B, E, Tp, Dv).scatter(2, at, g).view(B, E * nb, L, Dv)
            od_m = od.reshape(B, E, Tp, Dv).scatter(2, at, out).view(od.shape)
            ld_m = ld.clone()
            ld_m[..., :L] = ld[..., :L].reshape(B, E, Tp).scatter(2, tok, lse.to(ld.dtype)).view(B, E * nb, L)
            dqd, dkd, dvd = kern.backward(gd, qd, kd, vd, od_m, ld_m, sd, True, scale)
            dq = dqd.reshape(B, E, Tp, D)[:, :, :T]
            dk[:, :, offset : offset + T] += dkd.reshape(B, E, Tp, D)[:, :, :T]
            dv[:, :, offset : offset + T] += dvd.reshape(B, E, Tp, Dv)[:, :, :T]
        for sl, a, b, bias, lp, st in pieces:
            n = sl.stop - sl.start
            lp_m = lp.clone()
            lp_m[..., :n] = lse[:, :, sl].to(lp.dtype)
            dr, dkc, dvc = kern.backward(
                g[:, :, sl], rows[:, :, sl], k[:, :, a:b], v[:, :, a:b], out[:, :, sl], lp_m, st, False, scale, bias
            )
            drows[:, :, sl] += dr
            dk[:, :, a:b] += dkc
            dv[:, :, a:b] += dvc
        return drows, dq, dk, dv, None, None, None, None, None, None, None


def block_causal_rows(
    rows: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tok: torch.Tensor,
    sizes: list[int],
    L: int,
    offset: int,
    scale: float | None = None,
    diagonal: str | None = None,
) -> torch.Tensor:
    """Causal attention [B, E, N, Dv] of the gathered rows (row at position t sees keys j <= t + offset).

    Args:
        rows: [B, E, N, D] = q gathered at ``tok``; q: [B, E, T, D] every
            query row (the diagonal blocks run on them); k, v: [B, E, S, D]
            with S >= T + offset; tok, sizes, L: from :func:`block_plan`.
        scale: score multiplier (default 1 / sqrt(D)).
        diagonal: "causal" (every row of a block, the kernel's causal
            triangle), "masked" (the gathered rows with a bias over their
            block's L keys) or "joined" (one call per block over every key up
            to the block's end, its last L keys masked: no merge); default:
            the device's (CPU "masked", CUDA "causal").
    """
    kern = kernels_for(q)
    if kern is None:
        raise ValueError(f"no causal kernel with log-sum-exp for {q.device.type} {q.dtype}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    diagonal = kern.diagonal if diagonal is None else diagonal
    if diagonal not in DIAGONALS:
        raise ValueError(f"diagonal must be one of {DIAGONALS}, got diagonal={diagonal!r}")
    return _BlockCausal.apply(rows, q, k, v, tok, list(sizes), int(L), int(offset), scale, kern, diagonal)
