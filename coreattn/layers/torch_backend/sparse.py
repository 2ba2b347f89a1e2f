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

The query tokens are walked in segments (``sparse_plan.py``): **range blocks** of full rows (the
row's visible keys are its whole bounds, as on sequences shorter than the top-k) read one
contiguous slice of k in place and take one product per block, and **gather chunks** of the other
rows gather each token's named keys, as many slots per row as the chunk's longest row holds (the
prepared rows are compact). Where coreattn may not read values (a device), every row is gathered
in full (``sparse_blocks.py`` says why gathered rows do not share their keys' union).

Memory: each segment's work fits a byte budget (``CHUNK_BYTES``: 8 MiB on CPU, where a chunk then
stays in the last-level cache between its gather and its products, 256 MiB on other devices; or
the ``COREATTN_SPARSE_TORCH_CHUNK_BYTES`` environment variable): a gather chunk gathers its tokens'
keys (``[C, Hkv, W, Dqk]``, and values unless absorbed) and holds ``[C, Hq, W]`` scores, a range
block holds ``[C, Hq, J]`` scores over its J keys; nothing is S x S and nothing gathers the whole
sequence's ``[T, K, D]``. The forward keeps nothing but out
and lse; the backward recomputes each chunk's scores from lse (P = exp(S - lse), dS = P (dP -
delta), delta = rowsum(dO * O)), writes the chunk's dQ rows, and adds the chunk's per-slot dK/dV
rows into float32 (float64) accumulators ``[rows, Hkv, D]``: with ``index_add_`` on CPU
(sequential, deterministic) and ``index_put_(accumulate=True)`` elsewhere (sort-based,
deterministic, on CUDA); a range block adds its dK/dV into its contiguous slice of them (one
product each, no per-slot scatter). k and v are copied once per call into ``[rows + 1, Hkv, D]`` sources in
their own dtype (each chunk's gather is converted to the work dtype) whose last row is zeros: a slot a token cannot see reads that row (and adds its
zero gradient there), so a NaN or inf in a key the token must not see never reaches it, and
gathers need no masking pass. Total: O(T * H * D + T * K) plus one chunk.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from coreattn.layers.torch_backend import sparse_blocks
from coreattn.layers.torch_backend.sparse_plan import Segment, plan

# working set of one chunk of query tokens (gathers, scores, partial gradients), per device type
CHUNK_BYTES = {"cpu": 8 << 20}
DEFAULT_CHUNK_BYTES = 256 << 20
ENV_CHUNK_BYTES = "COREATTN_SPARSE_TORCH_CHUNK_BYTES"


def chunk_bytes(device: torch.device) -> int:
    value = os.environ.get(ENV_CHUNK_BYTES, "").strip()
    return max(1, int(value)) if value else CHUNK_BYTES.get(device.type, DEFAULT_CHUNK_BYTES)


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
    """Query tokens ``[n0, n1)``: where they sit in the ``[B, S]`` views, and which rows their slots read."""

    where: tuple  # index into a [B, S, ...] view: (0, slice) for one sample, else (b [C], s [C])
    valid: torch.Tensor  # [C, Hidx, 1, K] bool: named, inside [key_lo, key_hi) and the sample's rows
    rows: torch.Tensor  # [C * Hkv * K] int64: row of each (token, kv head, slot) in a _source (the zero row if not valid)


def _chunk(seg: Segment, batch: int, seqlen_q: int, seqlen_k: int, heads_kv: int, topk, key_lo, key_hi) -> _Chunk:
    """A gather chunk's tokens and the rows of their first ``seg.width`` slots (the prepared rows are
    compact: the slots past a row's count hold -1)."""
    n0, n1 = seg.n0, seg.n1
    device = topk.device
    if batch == 1:
        where, sample = (0, slice(n0, n1)), 0
    else:
        n = torch.arange(n0, n1, device=device)
        where = (n // seqlen_q, n % seqlen_q)
        sample = where[0][:, None, None]
    idx = topk[n0:n1, :, :seg.width].to(torch.int64)  # [C, Hidx, W]
    lo = key_lo[n0:n1].to(torch.int64).clamp(min=0)[:, None, None]
    hi = key_hi[n0:n1].to(torch.int64).clamp(max=seqlen_k)[:, None, None]
    valid = (idx >= lo) & (idx < hi)
    row = torch.where(valid, sample * seqlen_k + idx, batch * seqlen_k)  # the last row is zeros
    head = torch.arange(heads_kv, device=device)[None, :, None]
    rows = (row * heads_kv + head).reshape(-1)  # [C, Hkv, K] flattened (Hidx 1: the shared row for every head)
    return _Chunk(where, valid[:, :, None, :], rows)


def _source(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``[(B * S + 1) * H, D]``: x's rows (sample-major) in x's dtype, then H zero rows, which the
    slots that see nothing read: one copy of x per call instead of masking every gathered chunk
    (in x's dtype: a bf16 latent key of 8k x 576 is 9 MiB here, not 18 in float32)."""
    x_bs = _by_sample(x, fmt)
    batch, seqlen, heads, dim = x_bs.shape
    src = torch.empty(batch * seqlen + 1, heads, dim, dtype=x.dtype, device=x.device)
    src[:-1].view(batch, seqlen, heads, dim).copy_(x_bs)
    src[-1].zero_()
    return src.view(-1, dim)


def _gather(src: torch.Tensor, c: _Chunk, heads_kv: int, width: int, work: torch.dtype) -> torch.Tensor:
    """The chunk's keys (or values) ``[C, Hkv, W, D]`` in the work dtype: one row per (token, kv head, slot)."""
    return src.index_select(0, c.rows).view(c.valid.shape[0], heads_kv, width, src.shape[-1]).to(work)


def bytes_per_token(q, k, v, hidx: int, topk_k: int, backward: bool) -> int:
    """A chunk's working memory per query token: gathered keys (values), scores and their
    products, per-slot partial gradients, indices."""
    hq, hkv, dqk = q.shape[-2], k.shape[-2], q.shape[-1]
    work = torch.empty((), dtype=_work_dtype(q)).element_size()
    dv_sep = 0 if v is None else v.shape[-1]
    gathered = hkv * topk_k * (dqk + dv_sep)  # keys (and values) of every slot
    scores = hq * topk_k * (6 if backward else 2)  # s, p (+ [s; dp], ds, [ds; p])
    partial = hkv * topk_k * (dqk + dv_sep) if backward else 0  # per-slot dK (dV)
    narrow = gathered * k.element_size() if k.element_size() != work else 0  # the gather before its conversion
    return work * (gathered + scores + partial) + narrow + 8 * hkv * topk_k + 24 * hidx * topk_k


def _chunk_tokens(q, k, v, hidx: int, topk_k: int, backward: bool) -> int:
    """How many query tokens one chunk holds within ``chunk_bytes``."""
    return max(1, chunk_bytes(q.device) // max(1, bytes_per_token(q, k, v, hidx, topk_k, backward)))


def _segments(q, k, v, topk, key_lo, key_hi, seqlen_q: int, seqlen_k: int, backward: bool) -> list[Segment]:
    """The plan (``sparse_plan.plan``) within this call's budgets: a gather chunk visits as many
    (row, slot) pairs as a chunk of K-slot rows would; a range block holds as many (row, key) scores."""
    hidx, n_slots = topk.shape[1], topk.shape[-1]
    per_slot = max(1, bytes_per_token(q, k, v, hidx, 1, backward))
    budget = chunk_bytes(q.device)
    step = _chunk_tokens(q, k, v, hidx, n_slots, backward)
    per_key = sparse_blocks.bytes_per_key(q, k, v, backward)
    return plan(topk, key_lo, key_hi, seqlen_q, seqlen_k, range_elements=max(1, budget // per_key),
                max_range_rows=sparse_blocks.MAX_ROWS, gather_slots=max(1, budget // per_slot), gather_step=step)


def _shape(q, fmt):
    batch = 1 if fmt == "thd" else (q.shape[0] if fmt == "bshd" else q.shape[1])
    return batch, _by_sample(q, fmt).shape[1]


def _range(seg: Segment, seqlen_q: int, seqlen_k: int, key_lo, key_hi):
    """(where, KeySet) of a range block."""
    b = seg.b
    keys = sparse_blocks.range_keys(key_lo, key_hi, seg.n0, seg.n1, b * seqlen_k, seg.k0, seg.k1)
    return (b, slice(seg.n0 - b * seqlen_q, seg.n1 - b * seqlen_q)), keys


def sparse_attn_torch_fwd(q, k, v, topk, key_lo, key_hi, fmt: str, softmax_scale: float, *, v_dim: int | None = None,
                          out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """(out, lse) of top-k sparse attention; ``out`` / ``lse`` may be given to be written in place."""
    v_dim = v.shape[-1] if v is not None else v_dim
    batch, seqlen_q = _shape(q, fmt)
    seqlen_k = _by_sample(k, fmt).shape[1]
    hq, hkv, dqk = q.shape[-2], k.shape[-2], q.shape[-1]
    group = hq // hkv
    work = _work_dtype(q)
    out = q.new_empty(tuple(q.shape[:-1]) + (v_dim,)) if out is None else out
    lse = new_lse(q, fmt) if lse is None else lse
    q_bs, out_bs, lse_bs = _by_sample(q, fmt), _by_sample(out, fmt), _lse_by_sample(lse, fmt)
    k_bs, v_bs = _by_sample(k, fmt), None if v is None else _by_sample(v, fmt)
    k_src = v_src = None

    def write(where, o, l):
        out_bs[where] = o.to(out.dtype)
        lse_bs[where] = l.to(lse.dtype)

    for seg in _segments(q, k, v, topk, key_lo, key_hi, seqlen_q, seqlen_k, backward=False):
        if seg.is_range:
            where, keys = _range(seg, seqlen_q, seqlen_k, key_lo, key_hi)
            b = seg.b
            write(where, *sparse_blocks.block_fwd(q_bs[where], k_bs[b], None if v is None else v_bs[b], keys,
                                                  softmax_scale, v_dim, work))
            continue
        if k_src is None:  # the zero-row copies only where a segment gathers
            k_src = _source(k, fmt)
            v_src = None if v is None else _source(v, fmt)
        c = _chunk(seg, batch, seqlen_q, seqlen_k, hkv, topk, key_lo, key_hi)
        qc = q_bs[c.where].to(work).view(-1, hkv, group, dqk)  # [C, Hkv, G, Dqk]
        kc = _gather(k_src, c, hkv, seg.width, work)  # [C, Hkv, W, Dqk]
        vc = kc[..., :v_dim] if v_src is None else _gather(v_src, c, hkv, seg.width, work)
        s = torch.matmul(qc, kc.transpose(-1, -2)).mul_(softmax_scale)  # [C, Hkv, G, W]
        s = s.masked_fill_(~c.valid, float("-inf"))
        m = s.amax(-1, keepdim=True) if seg.width else s.new_zeros(s.shape[:-1] + (1,))
        m = m.masked_fill_(torch.isneginf(m), 0.0)
        p = torch.exp(s.sub_(m))
        denom = p.sum(-1, keepdim=True)
        o = torch.matmul(p, vc).div_(torch.where(denom == 0, 1.0, denom))  # [C, Hkv, G, Dv]
        write(c.where, o.reshape(-1, hq, v_dim), (m + torch.log(denom)).reshape(-1, hq))
    return out, lse


def _accumulate(acc: torch.Tensor, c: _Chunk, part: torch.Tensor) -> None:
    """Adds per-slot rows ``part [C, Hkv, K, D]`` into ``acc`` (a _source-shaped accumulator) at the
    slots' rows, in (token, head, slot) order; slots that see nothing add zeros into the zero row."""
    part = part.reshape(-1, part.shape[-1])
    if acc.device.type == "cpu":
        acc.index_add_(0, c.rows, part)  # sequential on CPU: deterministic
    else:
        acc.index_put_((c.rows,), part, accumulate=True)  # sort-based on CUDA: deterministic


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
    group = hq // hkv
    work = _work_dtype(q)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    q_bs, dq_bs = _by_sample(q, fmt), _by_sample(dq, fmt)
    dout_bs, out_bs, lse_bs = _by_sample(dout, fmt), _by_sample(out, fmt), _lse_by_sample(lse, fmt)
    k_bs, v_bs = _by_sample(k, fmt), None if v is None else _by_sample(v, fmt)
    # accumulators shaped like _source's copies: [(B * Sk + 1) * Hkv, D], the last Hkv rows the zero row's
    dk_acc = torch.zeros((batch * seqlen_k + 1) * hkv, dqk, dtype=work, device=k.device)
    dv_acc = None if v is None else torch.zeros((batch * seqlen_k + 1) * hkv, v.shape[-1], dtype=work, device=v.device)
    dk_rows = dk_acc.view(-1, hkv, dqk)
    dv_rows = None if dv_acc is None else dv_acc.view(-1, hkv, v_dim)
    k_src = v_src = None

    def block(where, k_rows, v_rows, keys):
        dq_bs[where] = sparse_blocks.block_bwd(dout_bs[where], q_bs[where], out_bs[where], lse_bs[where], k_rows,
                                               v_rows, keys, dk_rows, dv_rows, softmax_scale, v_dim,
                                               work).to(dq.dtype)

    for seg in _segments(q, k, v, topk, key_lo, key_hi, seqlen_q, seqlen_k, backward=True):
        if seg.is_range:
            where, keys = _range(seg, seqlen_q, seqlen_k, key_lo, key_hi)
            block(where, k_bs[seg.b], None if v is None else v_bs[seg.b], keys)
            continue
        if k_src is None:
            k_src = _source(k, fmt)
            v_src = None if v is None else _source(v, fmt)
        c = _chunk(seg, batch, seqlen_q, seqlen_k, hkv, topk, key_lo, key_hi)
        qc = q_bs[c.where].to(work).view(-1, hkv, group, dqk)  # [C, Hkv, G, Dqk]
        do = dout_bs[c.where].to(work).view(-1, hkv, group, v_dim)  # [C, Hkv, G, Dv]
        delta = (do * out_bs[c.where].to(work).view(-1, hkv, group, v_dim)).sum(-1, keepdim=True)
        kc = _gather(k_src, c, hkv, seg.width, work)  # [C, Hkv, W, Dqk]
        if v_src is None:  # absorbed: V is kc's first columns, so one product gives S and dP: [q; dO] kc^T
            qdo = torch.cat([qc, torch.nn.functional.pad(do, (0, dqk - v_dim))], dim=2)  # [C, Hkv, 2G, Dqk]
            s, dp = torch.matmul(qdo, kc.transpose(-1, -2)).split(group, dim=2)
        else:
            vc = _gather(v_src, c, hkv, seg.width, work)
            s, dp = torch.matmul(qc, kc.transpose(-1, -2)), torch.matmul(do, vc.transpose(-1, -2))
        row_lse = lse_bs[c.where].to(work).view(-1, hkv, group, 1)
        # a row that sees nothing has lse -inf: +inf makes its P exactly 0
        row_lse = row_lse.masked_fill(torch.isneginf(row_lse), float("inf"))
        p = torch.exp((s * softmax_scale).masked_fill_(~c.valid, float("-inf")).sub_(row_lse))  # [C, Hkv, G, W]
        ds = (dp - delta).mul_(p).mul_(softmax_scale)
        dq_bs[c.where] = torch.matmul(ds, kc).reshape(-1, hq, dqk).to(dq.dtype)
        if v_src is None:  # dK = dS^T q + [P^T dO, 0] in one product
            _accumulate(dk_acc, c, torch.matmul(torch.cat([ds, p], dim=2).transpose(-1, -2), qdo))
        else:
            _accumulate(dk_acc, c, torch.matmul(ds.transpose(-1, -2), qc))
            _accumulate(dv_acc, c, torch.matmul(p.transpose(-1, -2), do))
    dk = _finish(dk_acc, k, fmt, batch, seqlen_k)
    dv = None if v is None else _finish(dv_acc, v, fmt, batch, seqlen_k)
    return dq, dk, dv
