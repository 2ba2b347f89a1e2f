"""The blocked path's additive bias (a ``TableBias``, coreattn/kernels/attn_common.py), tile by tile.

For query i, key j and q head h, with d = i + shift - j, the bias is ``sum_r coef[i, h, r] *
table[h or 0, r, d - lo]`` inside the table's ``extent`` and its end entries (``clamp``) or 0
outside. Within one step's tile of a query block (rows i0 + m) and a key block (keys j0 + n) the
distances are ``d0 + w`` with ``w = m - n + bk - 1`` in ``[0, bq + bk - 1)`` and ``d0 = i0 + shift -
j0 - bk + 1``: the tile's bias is ``Y[m, m - n + bk - 1]`` with ``Y = coef @ table[:, d0 + w]``, one
small matmul ([bq, R] x [R, W]) and one gather per block, never an [S, T] tensor. The backward
reads dY back from dS with the transposed gather (each (m, w) holds at most one pair), so both
gradients are matmuls and index sums in a fixed order: dcoef = dY @ table window^T, and the table's
(``index_add_`` on CPU, ``index_put_`` with accumulate elsewhere: deterministic) from
coef^T @ dY. Memory: about two score tiles per step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from coreattn.kernels.attn_common import TableBias


class Window(NamedTuple):
    """One step's table window: ``table`` [A, Ht, R, W] (zeros outside an unclamped table), the table
    entry ``at`` [A, W] each window column reads (clamped into the table) and whether the column's
    distance lies in the table, ``inside`` [A, W]."""

    table: torch.Tensor
    at: torch.Tensor
    inside: torch.Tensor


def window(bias: TableBias, first_q: torch.Tensor, first_k: torch.Tensor, shift: torch.Tensor, bq: int, bk: int,
            work: torch.dtype) -> Window:
    """The table columns of the distances d0 + w, w in [0, bq + bk - 1), for each of A tiles."""
    extent = bias.table.shape[-1]
    d0 = first_q + shift - first_k - (bk - 1)  # [A]
    at = d0[:, None] + torch.arange(bq + bk - 1, device=d0.device)[None, :] - bias.lo  # [A, W]
    inside = (at >= 0) & (at < extent)
    at = at.clamp(0, extent - 1)
    table = bias.table.to(work)[:, :, at].permute(2, 0, 1, 3)  # [Ht, R, A, W] -> [A, Ht, R, W]
    if not bias.clamp:
        table = table * inside[:, None, None, :].to(work)
    return Window(table, at, inside)


def _skew(bq: int, bk: int, device) -> torch.Tensor:
    """[bq, bk] window column of each pair: w = m - n + bk - 1."""
    return torch.arange(bq, device=device)[:, None] - torch.arange(bk, device=device)[None, :] + (bk - 1)


def tile_bias(bias: TableBias, coef: torch.Tensor | None, win: Window, heads: int, bq: int, bk: int) -> torch.Tensor:
    """[A, Hq, bq, bk]: the bias of A tiles; ``coef`` the query blocks' coefficients [A, bq, Hq, R]
    (None: no coefficients)."""
    table = win.table.expand(-1, heads, -1, -1)  # [A, Hq, R, W]
    if coef is None:
        y = table[:, :, 0, None, :].expand(-1, -1, bq, -1)  # [A, Hq, bq, W]
    else:
        y = torch.einsum("amhr,ahrw->ahmw", coef, table)
    idx = _skew(bq, bk, y.device).expand(y.shape[0], heads, bq, bk)
    return y.gather(-1, idx)


def tile_bias_grad(bias: TableBias, coef: torch.Tensor | None, win: Window, ds: torch.Tensor,
                   d_table: torch.Tensor) -> torch.Tensor | None:
    """Adds A tiles' share of the table's gradient, from ds = dL/d(logit) [A, Hq, bq, bk], into ``d_table``
    (the table's shape); returns the coefficients' [A, bq, Hq, R] (None without coefficients)."""
    a, heads, bq, bk = ds.shape
    w = bq + bk - 1
    n = torch.arange(bq, device=ds.device)[:, None] - torch.arange(w, device=ds.device)[None, :] + (bk - 1)  # [bq, W]
    valid = (n >= 0) & (n < bk)
    dy = ds.gather(-1, n.clamp(0, bk - 1).expand(a, heads, bq, w)) * valid.to(ds.dtype)  # [A, Hq, bq, W]
    table = win.table.expand(-1, heads, -1, -1)  # [A, Hq, R, W]
    d_coef = None
    if coef is None:
        dwin = dy.sum(2, keepdim=True)  # [A, Hq, 1, W]
    else:
        d_coef = torch.einsum("ahmw,ahrw->amhr", dy, table)
        dwin = torch.einsum("ahmw,amhr->ahrw", dy, coef)
    heads_t, rank, extent = d_table.shape
    if heads_t == 1:
        dwin = dwin.sum(1, keepdim=True)  # one table for every head
    # flat entries (h, r, at): windows overlap and clamped columns repeat, so add in index order
    at = win.at[:, None, None, :] + extent * torch.arange(rank, device=ds.device)[None, None, :, None]
    at = at + (extent * rank) * torch.arange(heads_t, device=ds.device)[None, :, None, None]  # [A, Ht, R, W]
    if not bias.clamp:  # columns outside the table carry no gradient
        dwin = dwin * win.inside[:, None, None, :].to(dwin.dtype)
    flat = d_table.view(-1)
    at, vals = at.expand_as(dwin).reshape(-1), dwin.reshape(-1).to(d_table.dtype)
    if flat.device.type == "cpu":
        flat.index_add_(0, at, vals)
    else:  # index_add_ uses atomics on GPUs; index_put_ accumulates deterministically
        flat.index_put_((at,), vals, accumulate=True)
    return d_coef

