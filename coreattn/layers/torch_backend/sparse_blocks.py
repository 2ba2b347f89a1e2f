"""Range blocks of the torch backend's sparse attention: full rows as dense products over a slice of k.

A range block (``sparse_plan.py``) is query tokens of one sample whose rows are full: token n sees
exactly the keys ``[key_lo[n], key_hi[n])``, and the rows' ranges touch, so together they are one
contiguous slice ``k[b, k0:k1]`` (J keys) with ``visible`` ``[C, J]`` saying which of them each
token sees. The block reads the slice in place and runs dense attention over it with that mask: q
heads of a kv head stacked in the rows (``[Hkv, C * G, D] @ [Hkv, D, J]``: absorbed MLA's one
latent head makes it one product), the softmax over J keys, then P @ V. The backward recomputes P
from the saved lse and adds dK (and dV) into the accumulators' slice of those rows, one product
each: no gather and no per-slot scatter. Values and gradients equal the per-token gather's for the
same rows (the same keys, the same softmax), up to summation order.

Every key of the slice is one some row of the block sees: a NaN or inf in a key no token sees
(padding, another sequence) never reaches the block; one in a key a token sees poisons that
token, as anywhere, and, through the block's products (0 x NaN), the block's other rows.

Gathered rows do not run as blocks over the union of their keys: measured on CPU (fp32, one thread,
absorbed 576/512, T = 2,048, top-k 256, bench/sparse.py's index rule), blocks of 4 tokens over their
union took 1.6x (16 heads) and 1.3x (4 heads) the time of the per-token gather, forward and backward
(the union of 4 neighbours' keys is 2.3x a row there, and its unique, mask and scatter-add cost more
than the larger products save).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MAX_ROWS = 256  # query tokens per range block at most


class KeySet(NamedTuple):
    """A block's keys: ``rows`` the slice of its sample's ``[Sk, Hkv, D]`` to read, ``visible`` bool
    ``[C, J]``, ``acc_rows`` the same keys' slice of the flat ``[B * Sk + 1, Hkv, D]`` accumulators."""

    rows: slice
    visible: torch.Tensor
    acc_rows: slice


def bytes_per_key(q: torch.Tensor, k: torch.Tensor, v, backward: bool) -> int:
    """A block's working memory per (query token, key): its q heads' scores and the products made of
    them (s, p; the backward's dp, ds)."""
    work = 8 if q.dtype == torch.float64 else 4
    return work * q.shape[-2] * (6 if backward else 2)


def range_keys(key_lo: torch.Tensor, key_hi: torch.Tensor, n0: int, n1: int, row0: int, k0: int,
               k1: int) -> KeySet:
    """A range block's keys: positions [k0, k1) of the sample whose flat rows start at ``row0``."""
    cols = torch.arange(k0, k1, device=key_lo.device)
    lo, hi = key_lo[n0:n1, None].to(torch.int64), key_hi[n0:n1, None].to(torch.int64)
    return KeySet(slice(k0, k1), (cols[None, :] >= lo) & (cols[None, :] < hi), slice(row0 + k0, row0 + k1))


def _heads_first(x: torch.Tensor, hkv: int, work: torch.dtype) -> torch.Tensor:
    """[C, Hq, D] -> [Hkv, C * G, D] (the G q heads of a kv head stacked in the rows)."""
    c, hq, d = x.shape
    return x.to(work).view(c, hkv, hq // hkv, d).transpose(0, 1).reshape(hkv, -1, d)


def _heads_back(x: torch.Tensor, c: int) -> torch.Tensor:
    """[Hkv, C * G, D] -> [C, Hq, D]."""
    hkv, rows, d = x.shape
    return x.view(hkv, c, rows // c, d).transpose(0, 1).reshape(c, -1, d)


def _keys(k_rows: torch.Tensor, v_rows, keys: KeySet, v_dim: int, work: torch.dtype):
    """The block's keys [J, Hkv, Dqk] and values [J, Hkv, Dv] (absorbed: k's first v_dim columns), read
    in place from its sample's ``[Sk, Hkv, D]``."""
    kb = k_rows[keys.rows].to(work)
    vb = kb[..., :v_dim] if v_rows is None else v_rows[keys.rows].to(work)
    return kb, vb


def _scores(qh, kb, visible, scale: float, hkv: int) -> torch.Tensor:
    """[Hkv, C, G, J] masked scores of the block."""
    s = torch.matmul(qh, kb.permute(1, 2, 0)).mul_(scale)  # [Hkv, C * G, J]
    s = s.view(hkv, visible.shape[0], qh.shape[1] // max(visible.shape[0], 1), visible.shape[1])
    return s.masked_fill_(~visible[None, :, None, :], float("-inf"))


def block_fwd(q_rows, k_rows, v_rows, keys: KeySet, scale: float, v_dim: int,
              work: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [C, Hq, Dv], lse [C, Hq]) in the work dtype of the block's query rows ``q_rows`` [C, Hq, Dqk];
    a token that sees no key gets out 0 and lse -inf."""
    c, hkv = q_rows.shape[0], k_rows.shape[-2]
    kb, vb = _keys(k_rows, v_rows, keys, v_dim, work)
    s = _scores(_heads_first(q_rows, hkv, work), kb, keys.visible, scale, hkv)  # [Hkv, C, G, J]
    m = s.amax(-1, keepdim=True) if s.shape[-1] else s.new_zeros(s.shape[:-1] + (1,))
    m = m.masked_fill_(torch.isneginf(m), 0.0)
    p = torch.exp(s.sub_(m))
    denom = p.sum(-1, keepdim=True)
    o = torch.matmul(p.view(hkv, p.shape[1] * p.shape[2], p.shape[-1]),
                     vb.transpose(0, 1))  # [Hkv, C * G, Dv]
    o = o.view(p.shape[:-1] + (v_dim,)).div_(torch.where(denom == 0, 1.0, denom))
    lse = (m + torch.log(denom)).view(hkv, -1, 1)
    return _heads_back(o.view(hkv, -1, v_dim), c), _heads_back(lse, c).squeeze(-1)


def block_bwd(dout_rows, q_rows, out_rows, lse_rows, k_rows, v_rows, keys: KeySet, dk_acc, dv_acc, scale: float,
              v_dim: int, work: torch.dtype) -> torch.Tensor:
    """The block's dq [C, Hq, Dqk] (work dtype); adds its dK (dV) into the accumulators' key rows
    (``dk_acc`` / ``dv_acc``: ``[rows, Hkv, D]``, like ``k_rows``; absorbed: dV goes into dk's first
    v_dim columns, ``dv_acc`` None). ``lse_rows`` [C, Hq] from the forward (-inf: sees nothing)."""
    c, hkv = q_rows.shape[0], k_rows.shape[-2]
    kb, vb = _keys(k_rows, v_rows, keys, v_dim, work)
    sees = keys.visible.any(-1)[:, None, None]  # a token that sees nothing here adds nothing (its q may be padding)
    qh = _heads_first(torch.where(sees, q_rows, 0), hkv, work)  # [Hkv, C * G, Dqk]
    doh = _heads_first(torch.where(sees, dout_rows, 0), hkv, work)  # [Hkv, C * G, Dv]
    delta = (doh * _heads_first(out_rows, hkv, work)).sum(-1, keepdim=True)
    lse = _heads_first(lse_rows.unsqueeze(-1), hkv, work)  # [Hkv, C * G, 1]
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # a row that sees nothing: P exactly 0
    s = _scores(qh, kb, keys.visible, scale, hkv)
    p = torch.exp(s.view(qh.shape[:2] + s.shape[-1:]).sub_(lse))  # [Hkv, C * G, J]; masked keys: exp(-inf) = 0
    dp = torch.matmul(doh, vb.permute(1, 2, 0))  # [Hkv, C * G, J]
    ds = dp.sub_(delta).mul_(p).mul_(scale)
    dk = torch.matmul(ds.transpose(1, 2), qh).transpose(0, 1)  # [J, Hkv, Dqk]
    dv = torch.matmul(p.transpose(1, 2), doh).transpose(0, 1)  # [J, Hkv, Dv]
    if dv_acc is None:  # absorbed: V is k's first v_dim columns
        dk[..., :v_dim] += dv
    else:
        dv_acc[keys.acc_rows] += dv
    dk_acc[keys.acc_rows] += dk
    return _heads_back(torch.matmul(ds, kb.transpose(0, 1)), c)
