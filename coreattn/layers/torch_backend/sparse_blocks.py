"""The torch backend's block path for sparse attention: consecutive tokens over one key list, one product.

A block (``sparse_plan.Block``) is tokens ``[n0, n1)`` of one sample and one index head whose keys
lie in the global rows ``[r0, r1)``. Its key list is that range (a slice of the key source, no
gather) or the union of the keys its tokens name (one gather for all of them). Its query rows
``[Hu, tokens * G, D]`` take one product against the list's keys ``[Hu, keys, D]`` and each token
masks the keys it does not name: a contiguous token (one that names every key of its range, as a
token seeing its whole causal range does) compares with its range, any other gets a membership
mask from its indices. The backward is the same product per block, dQ written once per token, dK
(dV) of the list's keys added as one dense product (a slice add for a range, ``index_add_`` over
the union's rows), in the plan's order: deterministic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from coreattn.layers.torch_backend.sparse_inputs import SparseProblem
from coreattn.layers.torch_backend.sparse_plan import Block, BlockCost, UnitStats, clipped_bounds, sample_rows
from coreattn.layers.torch_backend.sparse_units import accumulate


def block_cost(p: SparseProblem) -> BlockCost:
    """A block's working memory: per (token, key) pair the backward's [S; dP] (P, dS in place) for
    the unit's query heads in the work dtype, and the mask; per key of a range its keys (values)
    converted to the work dtype (nothing for a range already in it: a view; its gradients are added
    into the accumulators in place); per key of a union its gathered copy too and its gradients; per
    token its indices' int64 temporaries while they become a mask."""
    elt = torch.empty((), dtype=p.work).element_size()
    per_key = p.hu * (p.dqk + (0 if p.absorbed else p.v_dim))
    narrow = p.k_src.dtype != p.work
    return BlockCost(pair=2 * p.hu * p.group * elt + 2, range_key=per_key * elt * narrow,
                     union_key=per_key * (elt * (1 + narrow) + p.k_src.element_size()), token=24 * p.topk_k)


def _place(p: SparseProblem, blk: Block) -> tuple[int, slice]:
    """(sample, positions) of the block's tokens in ``[B, S, ...]`` views."""
    b, s0 = divmod(blk.n0, p.seqlen_q)
    return b, slice(s0, s0 + blk.n1 - blk.n0)


def _source_rows(p: SparseProblem, blk: Block) -> torch.Tensor:
    """int64 rows of the flattened key source: the union's keys for the block's kv heads ``[U * Hu]``."""
    heads = torch.arange(blk.head * p.hu, (blk.head + 1) * p.hu, device=blk.union.device)
    return (blk.union[:, None] * p.hkv + heads[None, :]).reshape(-1)


def _keys(p: SparseProblem, src: torch.Tensor, blk: Block) -> torch.Tensor:
    """The list's keys (or values) ``[Hu, keys, D]`` in the work dtype."""
    if blk.union is None:
        x = src[blk.r0:blk.r1, p.kv_heads(blk.head)]  # [R, Hu, D], a view
    else:
        x = src.view(-1, src.shape[-1]).index_select(0, _source_rows(p, blk)).view(-1, p.hu, src.shape[-1])
    return x.to(p.work).transpose(0, 1)


def _mask(p: SparseProblem, blk: Block, stats: UnitStats) -> torch.Tensor:
    """bool ``[tokens, keys]``: which keys of the list each token sees."""
    width = blk.r1 - blk.r0 if blk.union is None else blk.union.shape[0]
    device = p.topk.device
    if blk.contiguous:
        r = torch.arange(blk.r0, blk.r1, device=device)[None, :]
        return (r >= stats.first[blk.n0:blk.n1, blk.head, None]) & (r < stats.end[blk.n0:blk.n1, blk.head, None])
    idx = p.topk[blk.n0:blk.n1, blk.head:blk.head + 1].to(torch.int64)  # [C, 1, K]
    lo, hi = clipped_bounds(p.key_lo, p.key_hi, blk.n0, blk.n1, p.seqlen_k)
    valid = (idx >= lo) & (idx < hi)
    col = (idx + sample_rows(blk.n0, blk.n1, p.seqlen_q, p.seqlen_k, device) - blk.r0).clamp_(0, blk.r1 - blk.r0)
    if blk.union is not None:  # range offset -> position in the union
        pos = torch.full((blk.r1 - blk.r0 + 1,), width, dtype=torch.int64, device=device)
        pos[blk.union - blk.r0] = torch.arange(width, device=device)
        col = pos[col]
    col = torch.where(valid, col, width)[:, 0]  # [C, K]; width: a dropped column
    seen = torch.zeros(blk.n1 - blk.n0, width + 1, dtype=torch.bool, device=device)
    return seen.scatter_(1, col, True)[:, :width]


def _heads_first(x: torch.Tensor, p: SparseProblem) -> torch.Tensor:
    """``[tokens, Hu * G, D]`` rows -> ``[Hu, tokens * G, D]`` in the work dtype."""
    tokens, dim = x.shape[0], x.shape[-1]
    return x.to(p.work).view(tokens, p.hu, p.group, dim).transpose(0, 1).reshape(p.hu, tokens * p.group, dim)


def _tokens_first(x: torch.Tensor, p: SparseProblem, tokens: int) -> torch.Tensor:
    """``[Hu, tokens * G, ...]`` -> ``[tokens, Hu * G, ...]``."""
    rest = x.shape[2:]
    return x.view(p.hu, tokens, p.group, *rest).transpose(0, 1).reshape(tokens, p.hu * p.group, *rest)


def block_fwd(p: SparseProblem, blk: Block, stats: UnitStats, out_bs: torch.Tensor, lse_bs: torch.Tensor) -> None:
    """Writes the block's out and lse rows."""
    b, pos = _place(p, blk)
    heads, tokens = p.q_heads(blk.head), blk.n1 - blk.n0
    qb = _heads_first(p.q_bs[b, pos, heads], p)  # [Hu, tokens * G, Dqk]
    kb = _keys(p, p.k_src, blk)  # [Hu, keys, Dqk]
    vb = kb[..., :p.v_dim] if p.absorbed else _keys(p, p.v_src, blk)
    hidden = ~_mask(p, blk, stats)[None, :, None, :]  # [1, tokens, 1, keys]
    s = torch.matmul(qb, kb.transpose(1, 2)).mul_(p.scale).view(p.hu, tokens, p.group, -1)
    s = s.masked_fill_(hidden, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = m.masked_fill_(torch.isneginf(m), 0.0)
    pr = s.sub_(m).exp_()  # in place: a block holds one [Hu, tokens * G, keys] buffer
    denom = pr.sum(-1, keepdim=True)
    o = torch.matmul(pr.view(p.hu, tokens * p.group, -1), vb)  # [Hu, tokens * G, Dv]
    o = o.view(p.hu, tokens, p.group, -1).div_(torch.where(denom == 0, 1.0, denom))
    out_bs[b, pos, heads] = _tokens_first(o.view(p.hu, tokens * p.group, -1), p, tokens).to(out_bs.dtype)
    lse = (m + torch.log(denom)).view(p.hu, tokens * p.group)
    lse_bs[b, pos, heads] = _tokens_first(lse, p, tokens).to(lse_bs.dtype)


def _grad_into(acc: torch.Tensor, p: SparseProblem, blk: Block, products) -> None:
    """Adds ``sum(a @ b for a, b in products)`` (``[Hu, keys, D]``: the list's keys' gradients) into
    the accumulator: in place into a range's rows, through one temporary for a union."""
    if blk.union is None:
        rows = acc[blk.r0:blk.r1, p.kv_heads(blk.head)].transpose(0, 1)  # [Hu, R, D], a view
        for a, b in products:
            rows.baddbmm_(a, b)
        return
    part = torch.matmul(*products[0])
    for a, b in products[1:]:
        part.baddbmm_(a, b)
    accumulate(acc, _source_rows(p, blk), part.transpose(0, 1))


def block_bwd(p: SparseProblem, blk: Block, stats: UnitStats, dout_bs, out_bs, lse_bs, dq_bs, dk_acc,
              dv_acc) -> None:
    """Writes the block's dq rows and adds its keys' dK (dV)."""
    b, pos = _place(p, blk)
    heads, tokens = p.q_heads(blk.head), blk.n1 - blk.n0
    rows = tokens * p.group
    qb = _heads_first(p.q_bs[b, pos, heads], p)  # [Hu, tokens * G, Dqk]
    do = _heads_first(dout_bs[b, pos, heads], p)  # [Hu, tokens * G, Dv]
    delta = (do * _heads_first(out_bs[b, pos, heads], p)).sum(-1, keepdim=True)
    kb = _keys(p, p.k_src, blk)  # [Hu, keys, Dqk]
    if p.absorbed:  # V is kb's first columns, so one product gives S and dP: [q; dO] kb^T
        do = F.pad(do, (0, p.dqk - p.v_dim))
        s, dp = torch.matmul(torch.cat([qb, do], dim=1), kb.transpose(1, 2)).split(rows, dim=1)
    else:
        vb = _keys(p, p.v_src, blk)
        s, dp = torch.matmul(qb, kb.transpose(1, 2)), torch.matmul(do, vb.transpose(1, 2))
    lse = _heads_first(lse_bs[b, pos, heads].unsqueeze(-1), p)  # [Hu, tokens * G, 1]
    # a row that sees nothing has lse -inf: +inf makes its P exactly 0
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
    hidden = ~_mask(p, blk, stats)[None, :, None, :]
    # in place: P over S's buffer, dS over dP's (a block holds two [Hu, tokens * G, keys] buffers)
    s.mul_(p.scale).view(p.hu, tokens, p.group, -1).masked_fill_(hidden, float("-inf"))
    pr = s.sub_(lse).exp_()  # [Hu, tokens * G, keys]
    ds = dp.sub_(delta).mul_(pr).mul_(p.scale)
    dq_bs[b, pos, heads] = _tokens_first(torch.matmul(ds, kb), p, tokens).to(dq_bs.dtype)
    if p.absorbed:  # dK = dS^T q + [P^T dO, 0]: dV lands in dK's first Dv columns (dO zero-padded)
        _grad_into(dk_acc, p, blk, [(ds.transpose(1, 2), qb), (pr.transpose(1, 2), do)])
    else:
        _grad_into(dk_acc, p, blk, [(ds.transpose(1, 2), qb)])
        _grad_into(dv_acc, p, blk, [(pr.transpose(1, 2), do)])
