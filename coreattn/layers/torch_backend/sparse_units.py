"""The torch backend's per-unit sparse attention: each unit gathers its own keys, chunk by chunk.

A chunk is a list of units (``SparseProblem``'s token x index head) and a width W: each unit's
keys (entries inside its bounds) are moved to the front of its row, in their ascending order, and
the row cut to W slots (W at least every count in the chunk: the plan's largest count on CPU,
``min(K, Sk)`` elsewhere), so unused slots past the counts cost nothing. A unit's keys
``[Hu, W, D]`` are gathered from the key source (masked slots read its zero row) and multiplied
with its ``[Hu, G, D]`` query rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from coreattn.layers.torch_backend.sparse_inputs import SparseProblem


def unit_bytes(p: SparseProblem, width: int, backward: bool, k_elt: int) -> int:
    """One unit's working memory at ``width`` slots: gathered keys (values), scores and their
    products, per-slot partial gradients, its row of indices and their compaction."""
    work = torch.empty((), dtype=p.work).element_size()
    dv_sep = 0 if p.absorbed else p.v_dim
    gathered = p.hu * width * (p.dqk + dv_sep)
    scores = p.hu * p.group * width * (4 if backward else 2)  # S (P), and [S; dP] (P, dS) with their temporaries
    partial = gathered if backward else 0
    narrow = gathered * k_elt if k_elt != work else 0  # the gather before its conversion
    return work * (gathered + scores + partial) + narrow + 8 * p.hu * width + 40 * p.topk_k


def _keys(p: SparseProblem, units: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid ``[C, W]`` bool, int64 ``[C * Hu * W]`` rows of the flattened key source) of a chunk."""
    n, h = units // p.hidx, units % p.hidx
    idx = p.topk[n, h].to(torch.int64)  # [C, K]
    lo = p.key_lo[n].to(torch.int64).clamp(min=0)[:, None]
    hi = p.key_hi[n].to(torch.int64).clamp(max=p.seqlen_k)[:, None]
    valid = (idx >= lo) & (idx < hi)
    if width < idx.shape[1]:  # valid entries to the front, in order; the rest to a dropped column
        dest = torch.where(valid, valid.cumsum(-1) - 1, width).clamp_(max=width)
        front = torch.full((idx.shape[0], width + 1), -1, dtype=torch.int64, device=idx.device)
        idx = front.scatter_(1, dest, idx.masked_fill(~valid, -1))[:, :width]
        valid = idx >= 0
    row = torch.where(valid, idx + p.sample_base(units)[:, None], p.zero_row)  # [C, W]
    head = (h * p.hu)[:, None, None] + torch.arange(p.hu, device=units.device)[None, :, None]
    return valid, (row[:, None, :] * p.hkv + head).reshape(-1)


def _gather(src: torch.Tensor, rows: torch.Tensor, p: SparseProblem, width: int) -> torch.Tensor:
    """``[C, Hu, W, D]`` in the work dtype."""
    return src.view(-1, src.shape[-1]).index_select(0, rows).view(-1, p.hu, width, src.shape[-1]).to(p.work)


def units_fwd(p: SparseProblem, units: torch.Tensor, width: int, out_bs: torch.Tensor, lse_bs: torch.Tensor) -> None:
    """Writes the chunk's out and lse rows."""
    valid, rows = _keys(p, units, width)
    b, s, h = p.where(units)
    qc = p.unit_view(p.q_bs)[b, s, h].to(p.work).view(-1, p.hu, p.group, p.dqk)  # [C, Hu, G, Dqk]
    kc = _gather(p.k_src, rows, p, width)  # [C, Hu, W, Dqk]
    vc = kc[..., :p.v_dim] if p.absorbed else _gather(p.v_src, rows, p, width)
    sc = torch.matmul(qc, kc.transpose(-1, -2)).mul_(p.scale)  # [C, Hu, G, W]
    sc = sc.masked_fill_(~valid[:, None, None, :], float("-inf"))
    m = sc.amax(-1, keepdim=True)
    m = m.masked_fill_(torch.isneginf(m), 0.0)
    pr = sc.sub_(m).exp_()
    denom = pr.sum(-1, keepdim=True)
    o = torch.matmul(pr, vc).div_(torch.where(denom == 0, 1.0, denom))  # [C, Hu, G, Dv]
    p.unit_view(out_bs)[b, s, h] = o.reshape(-1, p.hu * p.group, p.v_dim).to(out_bs.dtype)
    p.unit_view(lse_bs)[b, s, h] = (m + torch.log(denom)).reshape(-1, p.hu * p.group).to(lse_bs.dtype)


def accumulate(acc: torch.Tensor, rows: torch.Tensor, part: torch.Tensor) -> None:
    """Adds rows ``part [.., D]`` into ``acc`` (a key-source-shaped accumulator) at the flattened
    source rows ``rows``, in their order."""
    flat, part = acc.view(-1, acc.shape[-1]), part.reshape(-1, part.shape[-1])
    if acc.device.type == "cpu":
        flat.index_add_(0, rows, part)  # sequential on CPU: deterministic
    else:
        flat.index_put_((rows,), part, accumulate=True)  # sort-based on CUDA: deterministic


def units_bwd(p: SparseProblem, units: torch.Tensor, width: int, dout_bs, out_bs, lse_bs, dq_bs, dk_acc,
              dv_acc) -> None:
    """Writes the chunk's dq rows and adds its per-slot dK (dV) rows."""
    valid, rows = _keys(p, units, width)
    b, s, h = p.where(units)
    g, dqk, dv = p.group, p.dqk, p.v_dim
    qc = p.unit_view(p.q_bs)[b, s, h].to(p.work).view(-1, p.hu, g, dqk)  # [C, Hu, G, Dqk]
    do = p.unit_view(dout_bs)[b, s, h].to(p.work).view(-1, p.hu, g, dv)  # [C, Hu, G, Dv]
    delta = (do * p.unit_view(out_bs)[b, s, h].to(p.work).view(-1, p.hu, g, dv)).sum(-1, keepdim=True)
    kc = _gather(p.k_src, rows, p, width)  # [C, Hu, W, Dqk]
    if p.absorbed:  # V is kc's first columns, so one product gives S and dP: [q; dO] kc^T
        do = F.pad(do, (0, dqk - dv))
        sc, dp = torch.matmul(torch.cat([qc, do], dim=2), kc.transpose(-1, -2)).split(g, dim=2)
    else:
        vc = _gather(p.v_src, rows, p, width)
        sc, dp = torch.matmul(qc, kc.transpose(-1, -2)), torch.matmul(do, vc.transpose(-1, -2))
    row_lse = p.unit_view(lse_bs)[b, s, h].to(p.work).view(-1, p.hu, g, 1)
    # a row that sees nothing has lse -inf: +inf makes its P exactly 0
    row_lse = row_lse.masked_fill(torch.isneginf(row_lse), float("inf"))
    # in place: P over S's buffer, dS over dP's
    pr = sc.mul_(p.scale).masked_fill_(~valid[:, None, None, :], float("-inf")).sub_(row_lse).exp_()
    ds = dp.sub_(delta).mul_(pr).mul_(p.scale)  # [C, Hu, G, W]
    p.unit_view(dq_bs)[b, s, h] = torch.matmul(ds, kc).reshape(-1, p.hu * g, dqk).to(dq_bs.dtype)
    dk = torch.matmul(ds.transpose(-1, -2), qc)  # [C, Hu, W, Dqk]
    if p.absorbed:  # dV = P^T dO lands in dK's first Dv columns (dO zero-padded)
        dk.flatten(0, 1).baddbmm_(pr.transpose(-1, -2).flatten(0, 1), do.flatten(0, 1))
        accumulate(dk_acc, rows, dk)
    else:
        accumulate(dk_acc, rows, dk)
        accumulate(dv_acc, rows, torch.matmul(pr.transpose(-1, -2), do))
