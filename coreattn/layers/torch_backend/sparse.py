"""Top-k sparse attention (DeepSeek Sparse Attention) in torch ops: the torch backend of the sparse pair.

``sparse_attn_torch_fwd`` / ``sparse_attn_torch_bwd`` take what the Triton launchers
``coreattn.kernels.sparse_fwd.sparse_attn_fwd`` / ``sparse_bwd.sparse_attn_bwd`` take, on the same
prepared inputs, and return the same results:

- q ``[.., Hq, Dqk]``, k ``[.., Hkv, Dqk]``, v ``[.., Hkv, Dv]`` or None (absorbed MLA: V is the
  first ``v_dim`` columns of k) in layout ``fmt``: ``"thd"`` (packed, one sample), ``"bshd"`` or
  ``"sbhd"`` (a padded batch); query token n is ``b * S + s`` (thd: the row);
- ``topk`` int32 ``[N, Hidx, K]`` as ``prepare_topk`` leaves it (-1 = unused; Hidx 1 = shared by
  every head, else one row per kv head), ``key_lo`` / ``key_hi`` int32 ``[N]``: token n sees key
  position j (a row of its sample: thd, of the packed stream) iff ``topk`` names j and
  ``key_lo[n] <= j < key_hi[n]`` (bounds are clipped to the sample's rows here);
- out in q's layout and dtype (last dim Dv), lse natural-log float32 (float64 for float64 inputs)
  ``[Hq, T]`` (thd) or ``[B, Hq, S]``; a token with no visible key gets out 0 and lse -inf, and
  every gradient through it is 0, never NaN.

Memory: the work runs over chunks of C query tokens, C from a byte budget (``CHUNK_BYTES``, or the
``COREATTN_SPARSE_TORCH_CHUNK_BYTES`` environment variable): a chunk gathers its tokens' keys
(``[C, Hkv, K, Dqk]``, and values unless absorbed) and holds ``[C, Hq, K]`` scores; nothing is
S x S and nothing gathers the whole sequence's ``[T, K, D]``. The forward keeps nothing but out
and lse; the backward recomputes each chunk's scores from lse (P = exp(S - lse), dS = P (dP -
delta), delta = rowsum(dO * O)), writes the chunk's dQ rows, and adds the chunk's per-slot dK/dV
rows into float32 (float64) accumulators ``[rows, Hkv, D]``: with ``index_add_`` on CPU
(sequential, deterministic) and ``index_put_(accumulate=True)`` elsewhere (sort-based,
deterministic, on CUDA). Unused slots add into a spare row. Total: O(T * H * D + T * K) plus one
chunk. Gathered rows of invisible slots are zeroed, so a NaN or inf in a key the token must not
see never reaches its output.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

CHUNK_BYTES = 64 << 20  # working set of one chunk of query tokens (gathers, scores, partial gradients)
ENV_CHUNK_BYTES = "COREATTN_SPARSE_TORCH_CHUNK_BYTES"


def chunk_bytes() -> int:
    value = os.environ.get(ENV_CHUNK_BYTES, "").strip()
    return max(1, int(value)) if value else CHUNK_BYTES


def _work_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _by_sample(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``[B, S, ...]`` view of a tensor in ``fmt`` (thd: one sample)."""
    if fmt == "thd":
        return x.unsqueeze(0)
    return x if fmt == "bshd" else x.transpose(0, 1)


def _lse_by_sample(lse: torch.Tensor, fmt: str) -> torch.Tensor:
    """``[B, S, Hq]`` view of lse (thd ``[Hq, T]``, padded ``[B, Hq, S]``)."""
    return lse.t().unsqueeze(0) if fmt == "thd" else lse.transpose(1, 2)


def new_lse(q: torch.Tensor, fmt: str) -> torch.Tensor:
    heads = q.shape[-2]
    if fmt == "thd":
        shape = (heads, q.shape[0])
    else:
        batch, seqlen = (q.shape[0], q.shape[1]) if fmt == "bshd" else (q.shape[1], q.shape[0])
        shape = (batch, heads, seqlen)
    return q.new_empty(shape, dtype=_work_dtype(q))


class _Chunk(NamedTuple):
    """Query tokens ``[n0, n1)``: where they sit in the ``[B, S]`` views, and their visible slots."""

    n0: int
    n1: int
    where: tuple  # index into a [B, S, ...] view: (0, slice) for one sample, else (b [C], s [C])
    sample: torch.Tensor  # [C, 1] int64: each token's sample b
    slot: torch.Tensor  # [C, Hidx, K] int64: the named key position, 0 where not visible
    valid: torch.Tensor  # [C, Hidx, K] bool: named, inside [key_lo, key_hi) and the sample's rows


def _chunk(n0: int, n1: int, batch: int, seqlen_q: int, seqlen_k: int, topk, key_lo, key_hi) -> _Chunk:
    device = topk.device
    if batch == 1:
        where = (0, slice(n0, n1))
        sample = torch.zeros(n1 - n0, 1, dtype=torch.int64, device=device)
    else:
        n = torch.arange(n0, n1, device=device)
        where = (n // seqlen_q, n % seqlen_q)
        sample = where[0][:, None]
    idx = topk[n0:n1].to(torch.int64)
    lo = key_lo[n0:n1].to(torch.int64).clamp(min=0)[:, None, None]
    hi = key_hi[n0:n1].to(torch.int64).clamp(max=seqlen_k)[:, None, None]
    valid = (idx >= lo) & (idx < hi)
    return _Chunk(n0, n1, where, sample, torch.where(valid, idx, 0), valid)


def _gather(x_bs: torch.Tensor, c: _Chunk, work: torch.dtype) -> torch.Tensor:
    """The chunk's rows of keys (or values) ``[C, Hkv, K, D]`` in the work dtype, zero where not visible."""
    heads, hidx = x_bs.shape[2], c.slot.shape[1]
    if hidx == 1:  # one index row shared by every kv head
        rows = x_bs[c.sample, c.slot[:, 0]].permute(0, 2, 1, 3)  # [C, K, Hkv, D] -> [C, Hkv, K, D]
    else:
        head = torch.arange(heads, device=x_bs.device)[None, :, None]
        rows = x_bs[c.sample[:, :, None], c.slot, head]  # [C, Hkv, K, D]
    return rows.to(work).masked_fill_(~c.valid[..., None], 0)  # rows is a fresh gather


def _chunk_tokens(q, k, v, v_dim: int, hidx: int, topk_k: int, backward: bool) -> int:
    """How many query tokens one chunk holds within ``chunk_bytes()``."""
    hq, hkv, dqk = q.shape[-2], k.shape[-2], q.shape[-1]
    work = torch.empty((), dtype=_work_dtype(q)).element_size()
    dv_sep = 0 if v is None else v.shape[-1]
    gathered = hkv * topk_k * (dqk + dv_sep)  # keys (and values) of every slot
    scores = hq * topk_k * (4 if backward else 2)  # s, p (+ dp, ds)
    partial = hkv * topk_k * (dqk + dv_sep + v_dim) if backward else 0  # per-slot dK (dV)
    per_token = work * (gathered + scores + partial) + k.element_size() * gathered + 32 * hidx * topk_k
    return max(1, chunk_bytes() // max(1, per_token))


def _shape(q, fmt):
    batch = 1 if fmt == "thd" else (q.shape[0] if fmt == "bshd" else q.shape[1])
    return batch, _by_sample(q, fmt).shape[1]


def _scores(qc, kc, c: _Chunk, softmax_scale: float) -> torch.Tensor:
    """``[C, Hkv, G, K]`` scaled scores, -inf on invisible slots."""
    s = torch.matmul(qc, kc.transpose(-1, -2)).mul_(softmax_scale)
    return s.masked_fill_(~c.valid[:, :, None, :], float("-inf"))


def sparse_attn_torch_fwd(q, k, v, topk, key_lo, key_hi, fmt: str, softmax_scale: float, *, v_dim: int | None = None,
                          out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """(out, lse) of top-k sparse attention; ``out`` / ``lse`` may be given to be written in place."""
    v_dim = v.shape[-1] if v is not None else v_dim
    batch, seqlen_q = _shape(q, fmt)
    seqlen_k = _by_sample(k, fmt).shape[1]
    hq, hkv = q.shape[-2], k.shape[-2]
    group, topk_k = hq // hkv, topk.shape[-1]
    work = _work_dtype(q)
    out = q.new_empty(tuple(q.shape[:-1]) + (v_dim,)) if out is None else out
    lse = new_lse(q, fmt) if lse is None else lse
    q_bs, k_bs, out_bs, lse_bs = _by_sample(q, fmt), _by_sample(k, fmt), _by_sample(out, fmt), _lse_by_sample(lse, fmt)
    v_bs = None if v is None else _by_sample(v, fmt)
    tokens = topk.shape[0]
    if seqlen_k == 0 or topk_k == 0:  # no key to see
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    step = _chunk_tokens(q, k, v, v_dim, topk.shape[1], topk_k, backward=False)
    for n0 in range(0, tokens, step):
        c = _chunk(n0, min(n0 + step, tokens), batch, seqlen_q, seqlen_k, topk, key_lo, key_hi)
        qc = q_bs[c.where].to(work).view(-1, hkv, group, q.shape[-1])  # [C, Hkv, G, Dqk]
        kc = _gather(k_bs, c, work)  # [C, Hkv, K, Dqk]
        vc = kc[..., :v_dim] if v_bs is None else _gather(v_bs, c, work)
        s = _scores(qc, kc, c, softmax_scale)  # [C, Hkv, G, K]
        m = s.amax(-1, keepdim=True)
        m = m.masked_fill_(torch.isneginf(m), 0.0)
        p = torch.exp(s.sub_(m))
        denom = p.sum(-1, keepdim=True)
        o = torch.matmul(p, vc).div_(torch.where(denom == 0, 1.0, denom))  # [C, Hkv, G, Dv]
        out_bs[c.where] = o.reshape(-1, hq, v_dim).to(out.dtype)
        lse_bs[c.where] = (m + torch.log(denom)).reshape(-1, hq).to(lse.dtype)
    return out, lse


def _accumulate(acc: torch.Tensor, c: _Chunk, seqlen_k: int, part: torch.Tensor) -> None:
    """Adds per-slot rows ``part [C, Hkv, K, D]`` into ``acc [(B * Sk + 1) * Hkv, D]`` at the slots' key
    rows (the last key row takes the invisible slots), in (token, head, slot) order."""
    heads = part.shape[1]
    spare = acc.shape[0] // heads - 1
    rows = torch.where(c.valid, c.sample[:, :, None] * seqlen_k + c.slot, spare)  # [C, Hidx, K]
    head = torch.arange(heads, device=acc.device)[None, :, None]
    index = (rows * heads + head).reshape(-1)  # [C * Hkv * K] (Hidx 1: the shared row for each head)
    part = part.reshape(-1, part.shape[-1])
    if acc.device.type == "cpu":
        acc.index_add_(0, index, part)  # sequential on CPU: deterministic
    else:
        acc.index_put_((index,), part, accumulate=True)  # sort-based on CUDA: deterministic


def _finish(acc: torch.Tensor, like: torch.Tensor, fmt: str, batch: int, seqlen_k: int) -> torch.Tensor:
    """The accumulator's real rows in ``like``'s layout and dtype."""
    heads, dim = like.shape[-2], like.shape[-1]
    grad = acc.view(-1, heads, dim)[:batch * seqlen_k].view(batch, seqlen_k, heads, dim)
    grad = grad[0] if fmt == "thd" else (grad if fmt == "bshd" else grad.transpose(0, 1))
    return grad.to(like.dtype)


def sparse_attn_torch_bwd(dout, q, k, v, out, lse, topk, key_lo, key_hi, fmt: str, softmax_scale: float, *,
                          v_dim: int | None = None, atomic: bool = False):
    """(dq, dk, dv or None) from the forward's out and lse; absorbed (v None): dV is folded into dk's
    first ``v_dim`` columns. ``atomic`` is the launcher's option and changes nothing here (this
    backward is always deterministic)."""
    v_dim = v.shape[-1] if v is not None else v_dim
    batch, seqlen_q = _shape(q, fmt)
    seqlen_k = _by_sample(k, fmt).shape[1]
    hq, hkv, dqk = q.shape[-2], k.shape[-2], q.shape[-1]
    group, topk_k = hq // hkv, topk.shape[-1]
    work = _work_dtype(q)
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dk_acc = torch.zeros((batch * seqlen_k + 1) * hkv, dqk, dtype=work, device=k.device)
    dv_acc = None if v is None else torch.zeros((batch * seqlen_k + 1) * hkv, v_dim, dtype=work, device=k.device)
    if seqlen_k > 0 and topk_k > 0:
        q_bs, k_bs, dq_bs = _by_sample(q, fmt), _by_sample(k, fmt), _by_sample(dq, fmt)
        v_bs = None if v is None else _by_sample(v, fmt)
        dout_bs, out_bs, lse_bs = _by_sample(dout, fmt), _by_sample(out, fmt), _lse_by_sample(lse, fmt)
        step = _chunk_tokens(q, k, v, v_dim, topk.shape[1], topk_k, backward=True)
        tokens = topk.shape[0]
        for n0 in range(0, tokens, step):
            c = _chunk(n0, min(n0 + step, tokens), batch, seqlen_q, seqlen_k, topk, key_lo, key_hi)
            qc = q_bs[c.where].to(work).view(-1, hkv, group, dqk)  # [C, Hkv, G, Dqk]
            kc = _gather(k_bs, c, work)
            vc = kc[..., :v_dim] if v_bs is None else _gather(v_bs, c, work)
            row_lse = lse_bs[c.where].to(work).view(-1, hkv, group, 1)
            # a row that sees nothing has lse -inf: +inf makes its P exactly 0
            row_lse = row_lse.masked_fill(torch.isneginf(row_lse), float("inf"))
            p = torch.exp(_scores(qc, kc, c, softmax_scale).sub_(row_lse))  # [C, Hkv, G, K]
            do = dout_bs[c.where].to(work).view(-1, hkv, group, v_dim)
            delta = (do * out_bs[c.where].to(work).view(-1, hkv, group, v_dim)).sum(-1, keepdim=True)
            ds = torch.matmul(do, vc.transpose(-1, -2)).sub_(delta).mul_(p).mul_(softmax_scale)
            dq_bs[c.where] = torch.matmul(ds, kc).reshape(-1, hq, dqk).to(dq.dtype)
            dk_part = torch.matmul(ds.transpose(-1, -2), qc)  # [C, Hkv, K, Dqk]
            dv_part = torch.matmul(p.transpose(-1, -2), do)  # [C, Hkv, K, Dv]
            if dv_acc is None:
                dk_part[..., :v_dim] += dv_part
            else:
                _accumulate(dv_acc, c, seqlen_k, dv_part)
            _accumulate(dk_acc, c, seqlen_k, dk_part)
    dk = _finish(dk_acc, k, fmt, batch, seqlen_k)
    dv = None if v is None else _finish(dv_acc, v, fmt, batch, seqlen_k)
    return dq, dk, dv
