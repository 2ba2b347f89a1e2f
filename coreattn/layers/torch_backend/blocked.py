"""The torch backend's general path: flash attention's blocked online softmax in torch ops.

Every sequence is cut into query blocks of ``bq`` rows and key blocks of ``bk`` rows (gathered
once into block-major copies: O(T * H * D)). A query block visits, one step at a time, the key
blocks its causal/window band can reach; step t runs the t-th key block of every query block
that has one, for the whole batch at once (the query blocks are sorted by their step count, so
the active ones are a prefix). A step's scores are ``[A, Hkv, G * bq, bk]`` for A active blocks,
the G query heads of a K/V head stacked in the rows (GQA without repeating K or V), and A is
capped so that one step's tiles hold at most ``TILE_ELEMENTS`` scores: memory is
O(T * H * D + TILE_ELEMENTS), never a per-head S x S tensor. The Python work is one loop over
steps (the longest band in blocks), whatever the batch size.

The forward keeps the running max, sum and output per row (online softmax), applies dropout to
each tile with the keep mask of coreattn/kernels/dropout.py on the tile's token ids, tracks max
logits, and folds in a softmax offset's sink at the end. The backward recomputes each tile from
the saved lse: P = exp(S - lse), dS = P * (dP - delta) with delta = rowsum(dO * O); dQ adds up
per query block, dK/dV per key block in step order (index_add_ on CPU, deterministic;
index_put_ with accumulate elsewhere). Visibility per tile comes from positions: span lengths,
the causal/window band in either alignment, and ``[B, S]`` keep masks (holes allowed).
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

import torch
from einops import rearrange

from coreattn.kernels.packing import Packing, default_gid, seq_len_dim
from coreattn.kernels import dropout
from coreattn.layers.checks import VarlenParams
from coreattn.kernels.softmax_offset import softmax_offset_grad
from coreattn.layers.torch_backend.bias import tile_bias, tile_bias_grad
from coreattn.layers.torch_backend.bias import window as bias_window
from coreattn.layers.torch_backend.spans import Spans

BLOCK_Q = 128  # query rows per block (fewer when every sequence is shorter)
BLOCK_K = 128  # key rows per block
TILE_ELEMENTS = 1 << 23  # scores in one step's batch of tiles (32 MiB in fp32)
_MIN_BLOCK = 16


def _block(limit: int, longest: int) -> int:
    """The block size: ``limit``, or the next power of two >= the longest sequence when smaller."""
    size = _MIN_BLOCK
    while size < min(limit, longest):
        size *= 2
    return min(size, max(limit, 1))


class _Side(NamedTuple):
    """The blocks of one side (q or k), on the device: sequence, layout position and validity per row."""

    seq: torch.Tensor  # [N] int64: sequence of each block
    first: torch.Tensor  # [N] int64: first row of the block, within its sequence
    pos: torch.Tensor  # [N, blk] int64: position in the layout (clamped where invalid)
    row: torch.Tensor  # [N, blk] int64: the row in the layout's flattened token dims (thd T, bshd B*S, sbhd S*B)
    ok: torch.Tensor  # [N, blk] bool: inside the span
    kept: torch.Tensor  # [N, blk] bool: inside the span and kept by the keep mask (if any)


class Tiles(NamedTuple):
    bq: int
    bk: int
    q: _Side  # query blocks, sorted by step count (descending)
    k: _Side  # key blocks, sequence after sequence
    k_first: torch.Tensor  # [Nq] int64: key block visited at step 0 (global block index)
    shift: torch.Tensor  # [Nq] int64: the alignment shift of the block's sequence (Lk - Lq or 0)
    active: list[int]  # per step: how many (leading) query blocks visit a key block

    def steps(self, per_tile: int) -> Iterator[tuple[int, int, int]]:
        """(step, first block, end block) chunks of at most TILE_ELEMENTS scores."""
        per_chunk = max(1, TILE_ELEMENTS // max(1, per_tile))
        for t, n in enumerate(self.active):
            for c0 in range(0, n, per_chunk):
                yield t, c0, min(n, c0 + per_chunk)


def _blocks_of(start: torch.Tensor, length: torch.Tensor, blk: int):
    """Host (seq [N], first row [N], local rows [N, blk]) of every block of every span."""
    n_blocks = (length + blk - 1) // blk
    seq = torch.repeat_interleave(torch.arange(length.numel()), n_blocks)
    base = torch.repeat_interleave(n_blocks.cumsum(0) - n_blocks, n_blocks)
    first = (torch.arange(seq.numel()) - base) * blk
    return seq, first, first[:, None] + torch.arange(blk)[None, :], n_blocks


def _side(pack: Packing, x: torch.Tensor, start, length, seq, first, local, device) -> _Side:
    ok = local < length[seq][:, None]
    n_rows = seq_len_dim(x, pack.fmt)
    pos = (start[seq][:, None] + local).clamp(0, max(n_rows - 1, 0))
    if pack.fmt == "thd":
        row = pos
    elif pack.fmt == "bshd":
        row = seq[:, None] * n_rows + pos
    else:
        row = pos * x.shape[1] + seq[:, None]
    seq, first, pos, row, ok = (t.to(device) for t in (seq, first, pos, row, ok))
    kept = ok if pack.keep is None else ok & (pack.keep[seq[:, None], pos] != 0)
    return _Side(seq, first, pos, row, ok, kept)


def tiles(q: torch.Tensor, k: torch.Tensor, q_pack: Packing, k_pack: Packing, spans: Spans,
          params: VarlenParams) -> Tiles:
    """The block schedule of a call (planned on the host from the spans, used on q's device)."""
    qs, ks = spans.q, spans.k
    bq = _block(BLOCK_Q, int(qs.length.max()) if qs.length.numel() else 1)
    bk = _block(BLOCK_K, int(ks.length.max()) if ks.length.numel() else 1)
    q_seq, q_first, q_local, _ = _blocks_of(qs.start, qs.length, bq)
    k_seq, k_first, k_local, k_blocks = _blocks_of(ks.start, ks.length, bk)
    len_q, len_k = qs.length[q_seq], ks.length[q_seq]
    shift = len_k - len_q if params.bottom_right else torch.zeros_like(len_q)
    # keys visible to some row of the block: [lo, hi); the band is monotone in the row
    last = torch.minimum(q_first + bq, len_q) - 1
    lo = (q_first + shift - params.window_left).clamp(min=0) if params.window_left >= 0 else torch.zeros_like(len_q)
    hi = torch.minimum(len_k, last + shift + params.window_right + 1) if params.window_right >= 0 else len_k
    lo_blk = torch.div(lo, bk, rounding_mode="floor")
    steps = (torch.div(hi + bk - 1, bk, rounding_mode="floor") - lo_blk).clamp(min=0)
    order = torch.sort(steps, descending=True, stable=True).indices
    steps = steps[order]
    n_steps = int(steps[0]) if steps.numel() else 0
    active = (steps[None, :] > torch.arange(n_steps)[:, None]).sum(1).tolist() if n_steps else []
    k_base = k_blocks.cumsum(0) - k_blocks
    device = q.device
    q_side = _side(q_pack, q, qs.start, qs.length, q_seq[order], q_first[order], q_local[order], device)
    k_side = _side(k_pack, k, ks.start, ks.length, k_seq, k_first, k_local, device)
    k_first_blk = (k_base[q_seq] + lo_blk)[order].to(device)
    return Tiles(bq, bk, q_side, k_side, k_first_blk, shift[order].to(device), active)


def _flat(x: torch.Tensor, fmt: str) -> torch.Tensor | None:
    """x's token dims as one row dim [R, H, D] (a view), or None where the strides do not allow it."""
    if fmt == "thd":
        return x
    if x.stride(0) != x.shape[1] * x.stride(1) and x.shape[0] > 1:
        return None
    return x.flatten(0, 1)


def _gather(x: torch.Tensor, fmt: str, side: _Side, work: torch.dtype) -> torch.Tensor:
    """x in its layout -> [N, blk, H, D] in ``work``, zeros at invalid rows."""
    flat = _flat(x, fmt)
    if flat is not None:
        g = flat.index_select(0, side.row.flatten()).view(side.row.shape + x.shape[-2:])
    elif fmt == "bshd":
        g = x[side.seq[:, None], side.pos]
    else:
        g = x[side.pos, side.seq[:, None]]
    return g.to(work).masked_fill_(~side.ok[:, :, None, None], 0)


def _q_blocks(x: torch.Tensor, fmt: str, side: _Side, hkv: int, work: torch.dtype) -> torch.Tensor:
    """[N, bq, Hq, D] rows -> [N, Hkv, G * bq, D]: a K/V head's G query heads stacked in the rows."""
    return rearrange(_gather(x, fmt, side, work), "n b (kv g) d -> n kv (g b) d", kv=hkv)


def _k_blocks(x: torch.Tensor, fmt: str, side: _Side, work: torch.dtype) -> torch.Tensor:
    return _gather(x, fmt, side, work).transpose(1, 2).contiguous()  # [N, Hkv, bk, D]


def _q_rows(blocks: torch.Tensor, bq: int) -> torch.Tensor:
    """[N, Hkv, G * bq, X] -> [N, bq, Hq, X] (the inverse of _q_blocks' arrangement)."""
    return rearrange(blocks, "n kv (g b) x -> n b (kv g) x", b=bq)


def _add_rows(out: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """out[rows[i]] += values[i], in index order (deterministic; repeated rows add up)."""
    if out.device.type == "cpu":
        out.index_add_(0, rows, values)
    else:  # index_add_ uses atomics on GPUs; index_put_ accumulates deterministically
        out.index_put_((rows,), values, accumulate=True)


def _scatter(rows: torch.Tensor, fmt: str, side: _Side, like: torch.Tensor) -> torch.Tensor:
    """[N, blk, H, X] rows -> zeros shaped like ``like`` (last dim X, its dtype) holding them, summed
    where spans overlap (key spans may: each sequence's gradient adds up)."""
    n_rows = like.shape[0] if fmt == "thd" else like.shape[0] * like.shape[1]
    out = torch.zeros((n_rows,) + rows.shape[-2:], dtype=rows.dtype, device=rows.device)
    _add_rows(out, side.row[side.ok], rows[side.ok])
    return out.view(like.shape[:-1] + rows.shape[-1:]).to(like.dtype)


def _lse_to_layout(rows: torch.Tensor, fmt: str, side: _Side, q: torch.Tensor,
                   fill: float = float("-inf")) -> torch.Tensor:
    """[N, bq, Hq] -> lse's layout, [Hq, T] (thd) or [B, Hq, S] (padded), ``fill`` outside the spans."""
    n_rows = q.shape[0] if fmt == "thd" else q.shape[0] * q.shape[1]
    full = torch.full((n_rows, q.shape[-2]), fill, dtype=rows.dtype, device=q.device)
    full.index_copy_(0, side.row[side.ok], rows[side.ok])
    if fmt == "thd":
        return full.transpose(0, 1).contiguous()
    full = full.view(q.shape[0], q.shape[1], -1)  # [B, S, Hq] or [S, B, Hq]
    return (full.transpose(1, 2) if fmt == "bshd" else full.permute(1, 2, 0)).contiguous()


def _lse_rows(lse: torch.Tensor, fmt: str, side: _Side) -> torch.Tensor:
    """lse in its layout -> [N, bq, Hq] at the blocks' rows."""
    if fmt == "thd":
        flat = lse.transpose(0, 1)  # [T, Hq]
    else:
        flat = (lse.transpose(1, 2) if fmt == "bshd" else lse.permute(2, 0, 1)).reshape(-1, lse.shape[1])
    return flat.index_select(0, side.row.flatten()).view(side.row.shape + (lse.shape[-2],))


def _visible(tl: Tiles, c0: int, c1: int, t: int, kid: torch.Tensor, params: VarlenParams) -> torch.Tensor:
    """[A, bq, bk] bool for the query blocks [c0, c1) at step t (key blocks ``kid``)."""
    i = tl.q.first[c0:c1, None] + torch.arange(tl.bq, device=kid.device)[None, :]  # [A, bq] rows
    j = tl.k.first[kid, None] + torch.arange(tl.bk, device=kid.device)[None, :]  # [A, bk] keys
    vis = tl.q.kept[c0:c1, :, None] & tl.k.kept[kid, None, :]
    diag = (i + tl.shift[c0:c1, None])[:, :, None]  # the row's aligned diagonal
    if params.window_left >= 0:
        vis = vis & (j[:, None, :] >= diag - params.window_left)
    if params.window_right >= 0:
        vis = vis & (j[:, None, :] <= diag + params.window_right)
    return vis


def _token_ids(pack: Packing, x: torch.Tensor) -> torch.Tensor:
    """Dropout token id of each sequence's first token, int64 [B] (coreattn/kernels/dropout.py)."""
    gid = pack.gid if pack.gid is not None else default_gid(pack, seq_len_dim(x, pack.fmt))
    return gid.long()


def _drop_scale(tl: Tiles, c0: int, c1: int, kid: torch.Tensor, hkv: int, g: int, params: VarlenParams,
                rng_state, ids_q: torch.Tensor, ids_k: torch.Tensor, work) -> torch.Tensor:
    """keep / (1 - p) for the tiles, [A, Hkv, G * bq, bk], from the shared keep mask on token ids."""
    dev = kid.device
    qi = ids_q[tl.q.seq[c0:c1], None] + tl.q.first[c0:c1, None] + torch.arange(tl.bq, device=dev)  # [A, bq]
    kj = ids_k[tl.k.seq[kid], None] + tl.k.first[kid, None] + torch.arange(tl.bk, device=dev)  # [A, bk]
    heads = torch.arange(hkv * g, device=dev).view(1, hkv, g, 1, 1)
    keep = dropout.keep_mask(rng_state, params.dropout_p, heads, qi[:, None, None, :, None], kj[:, None, None, None, :])
    return keep.to(work).div_(1.0 - params.dropout_p).view(c1 - c0, hkv, g * tl.bq, tl.bk)


def _neg_inf_to_zero(m: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def _bias_coef(bias, fmt: str, tl: Tiles, work) -> torch.Tensor | None:
    """The query blocks' bias coefficients [Nq, bq, Hq, R] (None without a bias or coefficients)."""
    return None if bias is None or bias.coef is None else _gather(bias.coef, fmt, tl.q, work)


def _step_bias(bias, coef_b, tl: Tiles, c0: int, c1: int, kid, hq: int, work):
    """(window, [A', Hq, bq, bk] bias, A' tile indices or None for all) of a step's tiles
    (coreattn/layers/torch_backend/bias.py). On CPU, where reading a tensor is free, an unclamped
    table's tiles whose distances all lie outside it are left out (Inkling 2's full layers: the
    extent's band of a long sequence); on a device every tile is computed (no host read)."""
    first_q, first_k, shift = tl.q.first[c0:c1], tl.k.first[kid], tl.shift[c0:c1]
    coef = None if coef_b is None else coef_b[c0:c1]
    near = None
    if not bias.clamp and first_q.device.type == "cpu":
        extent = bias.table.shape[-1]
        d_max = first_q + (tl.bq - 1) + shift - first_k
        d_min = first_q + shift - first_k - (tl.bk - 1)
        hits = (d_max >= bias.lo) & (d_min < bias.lo + extent)
        if not bool(hits.all()):
            near = hits.nonzero().view(-1)
            first_q, first_k, shift = first_q[near], first_k[near], shift[near]
            coef = None if coef is None else coef[near]
    win = bias_window(bias, first_q, first_k, shift, tl.bq, tl.bk, work)
    return win, tile_bias(bias, coef, win, hq, tl.bq, tl.bk), near, coef


def _add_bias(s: torch.Tensor, b_t: torch.Tensor, near, hkv: int, g: int, tl: Tiles) -> None:
    """s [A, Hkv, G * bq, bk] += the tiles' bias [A', Hq, bq, bk] (A' = A, or the tiles ``near``)."""
    a = s.shape[0]
    view = s.view(a, hkv, g, tl.bq, tl.bk)
    b_t = b_t.view(-1, hkv, g, tl.bq, tl.bk)
    if near is None:
        view.add_(b_t)
    else:
        view.index_add_(0, near, b_t)


def blocked_fwd(q, k, v, q_pack: Packing, k_pack: Packing, spans: Spans, params: VarlenParams, rng_state,
                softmax_offset, return_max_logit: bool, bias=None):
    """(out, lse, max_logit or None) as attn_torch_fwd returns them; ``bias`` a TableBias or None."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    hq, hkv = q.shape[-2], k.shape[-2]
    g = hq // hkv
    tl = tiles(q, k, q_pack, k_pack, spans, params)
    qb = _q_blocks(q, q_pack.fmt, tl.q, hkv, work)  # [Nq, Hkv, G*bq, Dqk]
    kb = _k_blocks(k, k_pack.fmt, tl.k, work)  # [Nk, Hkv, bk, Dqk]
    vb = _k_blocks(v, k_pack.fmt, tl.k, work)  # [Nk, Hkv, bk, Dv]
    n_q, rows = qb.shape[0], g * tl.bq
    m = torch.full((n_q, hkv, rows, 1), float("-inf"), dtype=work, device=q.device)  # running max
    s_sum = torch.zeros_like(m)  # running sum of exp(S - m)
    acc = torch.zeros((n_q, hkv, rows, v.shape[-1]), dtype=work, device=q.device)
    max_logit = torch.full((hkv, g), float("-inf"), dtype=work, device=q.device) if return_max_logit else None
    if params.dropout_p > 0:
        ids_q, ids_k = _token_ids(q_pack, q), _token_ids(k_pack, k)
    coef_b = _bias_coef(bias, q_pack.fmt, tl, work)
    for t, c0, c1 in tl.steps(hq * tl.bq * tl.bk * (3 if bias is not None else 1)):
        kid = tl.k_first[c0:c1] + t
        s = torch.matmul(qb[c0:c1], kb.index_select(0, kid).transpose(-1, -2)).mul_(params.softmax_scale)
        if bias is not None:
            _, b_t, near, _ = _step_bias(bias, coef_b, tl, c0, c1, kid, hq, work)
            _add_bias(s, b_t, near, hkv, g, tl)
            del b_t
        vis = _visible(tl, c0, c1, t, kid, params)
        s.view(c1 - c0, hkv, g, tl.bq, tl.bk).masked_fill_(~vis[:, None, None], float("-inf"))
        if max_logit is not None:
            max_logit = torch.maximum(max_logit, s.view(c1 - c0, hkv, g, -1).amax(dim=(0, 3)))
        m_old = m[c0:c1]
        m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))
        m_use = _neg_inf_to_zero(m_new)  # rows that saw nothing yet: exp(-inf - 0) = 0
        alpha = torch.exp(m_old - m_use)
        p = s.sub_(m_use).exp_()
        s_sum[c0:c1].mul_(alpha).add_(p.sum(-1, keepdim=True))
        if params.dropout_p > 0:
            p.mul_(_drop_scale(tl, c0, c1, kid, hkv, g, params, rng_state, ids_q, ids_k, work))
        acc[c0:c1].mul_(alpha).add_(torch.matmul(p, vb.index_select(0, kid)))
        m_old.copy_(m_new)
    if softmax_offset is not None:
        if softmax_offset.dim() == 1:
            sink = softmax_offset.to(work).view(1, hkv, g, 1).expand(1, hkv, g, tl.bq).reshape(1, hkv, rows, 1)
        else:  # one per row, in lse's layout
            sink = rearrange(_lse_rows(softmax_offset, q_pack.fmt, tl.q).to(work), "n b (kv g) -> n kv (g b) 1", kv=hkv)
        m_fin = torch.maximum(m, sink)
        m_use = _neg_inf_to_zero(m_fin)
        alpha = torch.exp(m - m_use)
        s_sum = s_sum * alpha + torch.exp(sink - m_use)
        acc.mul_(alpha)
        m = m_fin
    lse = _neg_inf_to_zero(m) + torch.log(s_sum)  # s_sum = 0: no key, no sink -> -inf
    acc.div_(torch.where(s_sum == 0, torch.ones_like(s_sum), s_sum))
    out = _scatter(_q_rows(acc, tl.bq), q_pack.fmt, tl.q, q[..., :1].expand(*q.shape[:-1], v.shape[-1]))
    lse = _lse_to_layout(_q_rows(lse, tl.bq)[..., 0], q_pack.fmt, tl.q, q)
    return out, lse, None if max_logit is None else max_logit.reshape(hq)


def blocked_bwd(dout, q, k, v, out, lse, q_pack: Packing, k_pack: Packing, spans: Spans, params: VarlenParams,
                rng_state, softmax_offset=None, bias=None):
    """(dq, dk, dv, d_offset) from the saved out and lse, as attn_torch_bwd returns them; the softmax
    offset's gradient from rowsum(P * dP) accumulated over the key blocks. With ``bias`` (a
    TableBias): (dq, dk, dv, d_offset, d_table, d_coef), the bias's gradients in its tensors'
    shapes (d_coef None without coefficients)."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    hq, hkv = q.shape[-2], k.shape[-2]
    g = hq // hkv
    tl = tiles(q, k, q_pack, k_pack, spans, params)
    fmt_q, fmt_k = q_pack.fmt, k_pack.fmt
    qb = _q_blocks(q, fmt_q, tl.q, hkv, work)  # [Nq, Hkv, G*bq, Dqk]
    kb = _k_blocks(k, fmt_k, tl.k, work)  # [Nk, Hkv, bk, Dqk]
    vb = _k_blocks(v, fmt_k, tl.k, work)  # [Nk, Hkv, bk, Dv]
    dob = _q_blocks(dout, fmt_q, tl.q, hkv, work)  # [Nq, Hkv, G*bq, Dv]
    delta = (dob * _q_blocks(out, fmt_q, tl.q, hkv, work)).sum(-1, keepdim=True)  # [Nq, Hkv, G*bq, 1]
    lse_b = _lse_rows(lse, fmt_q, tl.q).to(work)  # [Nq, bq, Hq]
    lse_b = rearrange(lse_b, "n b (kv g) -> n kv (g b) 1", kv=hkv)
    # rows that saw nothing (lse -inf) get P = exp(S - inf) = 0
    lse_b = torch.where(torch.isneginf(lse_b), torch.full_like(lse_b, float("inf")), lse_b)
    dqb = torch.zeros_like(qb)
    dkb, dvb = torch.zeros_like(kb), torch.zeros_like(vb)
    rowsum = torch.zeros_like(delta) if softmax_offset is not None else None  # rowsum(P * dP)
    if params.dropout_p > 0:
        ids_q, ids_k = _token_ids(q_pack, q), _token_ids(k_pack, k)
    coef_b = _bias_coef(bias, fmt_q, tl, work)
    if bias is not None:
        d_table = torch.zeros_like(bias.table, dtype=work)
        d_coef_b = None if coef_b is None else torch.zeros_like(coef_b)
    per_tile = hq * tl.bq * tl.bk * (4 if bias is not None else 1)

    def probabilities(t, c0, c1):
        """(key blocks, bias window, P, dP with dropout's keep / (1 - p), P with it) of a step."""
        kid = tl.k_first[c0:c1] + t
        s = torch.matmul(qb[c0:c1], kb.index_select(0, kid).transpose(-1, -2)).mul_(params.softmax_scale)
        step = None  # BIAS: (window, tiles near the band or None, their coefficients)
        if bias is not None:
            win, b_t, near, coef = _step_bias(bias, coef_b, tl, c0, c1, kid, hq, work)
            _add_bias(s, b_t, near, hkv, g, tl)
            step = (win, near, coef)
            del b_t
        vis = _visible(tl, c0, c1, t, kid, params)
        s.view(c1 - c0, hkv, g, tl.bq, tl.bk).masked_fill_(~vis[:, None, None], float("-inf"))
        p = s.sub_(lse_b[c0:c1]).exp_()  # [A, Hkv, G*bq, bk]
        dp = torch.matmul(dob[c0:c1], vb.index_select(0, kid).transpose(-1, -2))
        p_drop = p
        if params.dropout_p > 0:
            scale = _drop_scale(tl, c0, c1, kid, hkv, g, params, rng_state, ids_q, ids_k, work)
            dp.mul_(scale)
            p_drop = p * scale
        return kid, step, p, dp, p_drop

    if bias is not None and work != q.dtype:
        # the bias's gradients sum dS over rows: with 16-bit inputs delta = rowsum(dO * O) carries O's rounding
        # into them, so a first pass takes the exact rowsum(P * dP) (two more matmuls per tile)
        exact = torch.zeros_like(delta)
        for t, c0, c1 in tl.steps(per_tile):
            _, _, p, dp, _ = probabilities(t, c0, c1)
            exact[c0:c1].add_((p * dp).sum(-1, keepdim=True))
        delta = exact
    for t, c0, c1 in tl.steps(per_tile):
        kid, step, p, dp, p_drop = probabilities(t, c0, c1)
        if rowsum is not None:
            rowsum[c0:c1].add_((p * dp).sum(-1, keepdim=True))
        ds = dp.sub_(delta[c0:c1]).mul_(p)  # dL/d(logit)
        if bias is not None:
            win, near, coef = step
            ds_t = ds.view(c1 - c0, hq, tl.bq, tl.bk)
            dc = tile_bias_grad(bias, coef, win, ds_t if near is None else ds_t.index_select(0, near), d_table)
            if dc is not None and near is not None:
                d_coef_b[c0:c1].index_add_(0, near, dc)
            elif dc is not None:
                d_coef_b[c0:c1].add_(dc)
        ds.mul_(params.softmax_scale)
        dv_t = torch.matmul(p_drop.transpose(-1, -2), dob[c0:c1])  # [A, Hkv, bk, Dv], G summed in the rows
        dk_t = torch.matmul(ds.transpose(-1, -2), qb[c0:c1])
        dqb[c0:c1].add_(torch.matmul(ds, kb.index_select(0, kid)))
        _add_rows(dvb, kid, dv_t)
        _add_rows(dkb, kid, dk_t)
    dq = _scatter(_q_rows(dqb, tl.bq), fmt_q, tl.q, q)
    dk = _scatter(dkb.transpose(1, 2), fmt_k, tl.k, k)
    dv = _scatter(dvb.transpose(1, 2), fmt_k, tl.k, v)
    d_offset = None
    if rowsum is not None:
        rows = _lse_to_layout(_q_rows(rowsum, tl.bq)[..., 0], fmt_q, tl.q, q, fill=0.0)
        d_offset = softmax_offset_grad(softmax_offset, lse, rows, q_pack)
    if bias is None:
        return dq, dk, dv, d_offset
    d_coef = None if d_coef_b is None else _scatter(d_coef_b, fmt_q, tl.q, bias.coef)
    return dq, dk, dv, d_offset, d_table.to(bias.table.dtype), d_coef
