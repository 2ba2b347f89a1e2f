"""The torch backend's fast path on CPU: PyTorch's fused flash-attention kernel, one sequence at a time.

``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` is the kernel behind
``F.scaled_dot_product_attention`` on CPU for 4D inputs: blocked online softmax in C++, O(S)
memory, the logsumexp returned, GQA without repeated K/V, float64 at float64 precision. Its
backward (``..._for_cpu_backward``) takes out and logsumexp from the caller and computes
P = exp(S - lse), delta = rowsum(dO * O): flash attention's formulas, so partial results merged
through lse (a split key range below, a softmax offset's sink, context parallelism) differentiate
exactly. What it lacks is mapped here:

- q/k and v head dims must match: the smaller side is zero-padded per sequence (zero columns
  change no score and no output); the output and gradients are sliced back;
- its causal mask is top-left aligned (query i sees keys j <= i). A sequence whose visible keys
  are ``j <= i + c`` (bottom-right alignment, a right window, keep-mask offsets) runs as: c <= -Lq
  nothing; c < 0 the first -c queries see nothing and the rest are top-left causal; c = 0 one
  causal call; 0 < c < Lk - 1 two calls, keys [0, c) for every query plus keys [c, Lk) causal,
  merged through their lse; otherwise every key is visible (one full call);
- a softmax offset (sink) folds into out and lse afterwards: lse' = logaddexp(lse, sink), out'
  = out * exp(lse - lse'); the backward takes out' and lse' unchanged;
- empty sequences are never passed to it (it fails on them): their rows keep zeros and lse -inf;
- fp16/bf16 rows are passed in float32 (a per-sequence copy), as the rest of the backend computes.

Keep masks without holes become sub-spans (their offsets shift c); left windows, keep masks with
holes, dropout and max logits go to the blocked path (coreattn/layers/torch_backend/blocked.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from coreattn.kernels.packing import Packing, seq_len_dim
from coreattn.layers.checks import VarlenParams
from coreattn.layers.torch_backend.spans import Spans


class Part(NamedTuple):
    k_offset: int  # first key of the part, within the sequence's keys
    k_len: int
    causal: bool  # top-left causal against the sequence's queries


class SeqCall(NamedTuple):
    """The fused calls of one sequence: rows [q_start, q_start + q_len) see the keys of ``parts``."""

    batch: int  # sample b (padded layouts)
    q_start: int
    q_len: int
    k_start: int
    parts: tuple[Part, ...]


def _fwd_op():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@functools.lru_cache(maxsize=None)
def _native_gqa() -> bool:
    """Whether this torch's fused CPU kernel takes fewer K/V heads than Q heads (recent ones do)."""
    try:
        q, kv = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)
        return _fwd_op()(q, kv, kv)[0].shape == q.shape
    except (RuntimeError, TypeError):
        return False


def available(q: torch.Tensor, k: torch.Tensor) -> bool:
    """The fused kernel exists for q's device and takes these heads."""
    return (q.device.type == "cpu" and _fwd_op() is not None
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
            and (q.shape[-2] == k.shape[-2] or _native_gqa()))


def _parts(n_q: int, n_k: int, c: int | None) -> tuple[int, tuple[Part, ...]]:
    """(queries skipped at the start, parts) for visibility j <= i + c (None: every key)."""
    if c is None or c >= n_k - 1:
        return 0, (Part(0, n_k, False),)
    if c < 0:
        return min(-c, n_q), (Part(0, n_k, True),)
    if c == 0:
        return 0, (Part(0, n_k, True),)
    return 0, (Part(0, c, False), Part(c, n_k - c, True))


def plan(spans: Spans, params: VarlenParams) -> list[SeqCall] | None:
    """The calls of every sequence, or None when the fused kernel cannot express the call: keep
    masks with holes, or a left window that some query reaches."""
    if spans.q.holes or spans.k.holes:
        return None
    q, k = spans.q, spans.k
    rows = zip(q.start.tolist(), q.length.tolist(), q.kept_start.tolist(), q.kept_len.tolist(),
               k.start.tolist(), k.length.tolist(), k.kept_start.tolist(), k.kept_len.tolist())
    calls = []
    for b, (qs, ql, qks, qkl, ks, kl, kks, kkl) in enumerate(rows):
        shift = kl - ql if params.bottom_right else 0
        # query i (span position) sees key j when i + shift - left <= j <= i + shift + right
        if params.window_left >= 0 and ql > 0 and ql - 1 + shift - params.window_left > 0:
            return None
        if qkl == 0 or kkl == 0:
            continue
        c = None
        if params.window_right >= 0:
            # in kept coordinates i' = i - (qks - qs), j' = j - (kks - ks)
            c = shift + params.window_right + (qks - qs) - (kks - ks)
        skip, parts = _parts(qkl, kkl, c)
        if skip < qkl:
            calls.append(SeqCall(b, qks + skip, qkl - skip, kks, parts))
    return calls


def _rows(x: torch.Tensor, fmt: str, b: int, start: int, n: int) -> torch.Tensor:
    """Rows [start, start + n) of sequence b: [n, H, D] (a view)."""
    if fmt == "thd":
        return x[start:start + n]
    if fmt == "bshd":
        return x[b, start:start + n]
    return x[start:start + n, b]


def _stat_rows(stat: torch.Tensor, fmt: str, b: int, start: int, n: int) -> torch.Tensor:
    """The same rows of a row statistic ([H, T] thd, [B, H, S] padded): [H, n] (a view)."""
    return stat[:, start:start + n] if fmt == "thd" else stat[b, :, start:start + n]


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """fp16/bf16 rows go to the kernel in float32: its reduced-precision path takes a fast exp whose
    lse misses the flash-attention criterion, and the torch backend computes in float32 anyway."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _bhsd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """[n, H, d] rows -> the kernel's [1, H, n, dim] (a view; a copy when upcast or zero-padded to dim)."""
    x = x.to(_work_dtype(x))
    if x.shape[-1] < dim:
        x = F.pad(x, (0, dim - x.shape[-1]))
    return x.unsqueeze(0).transpose(1, 2)


def _merge(o1, l1, o2, l2):
    """Two partial results over disjoint key sets -> one, in lse's dtype (every row sees keys in both)."""
    lse = torch.logaddexp(l1, l2)
    return o1.to(lse.dtype) * torch.exp(l1 - lse)[..., None] + o2.to(lse.dtype) * torch.exp(l2 - lse)[..., None], lse


def _whole(q: torch.Tensor, k: torch.Tensor, fmt: str, calls: list[SeqCall]) -> bool:
    """One kernel call over every row of a packed q and k: its outputs are the results, no copy."""
    if fmt != "thd" or len(calls) != 1 or len(calls[0].parts) != 1:
        return False
    c = calls[0]
    return c.q_start == 0 and c.q_len == q.shape[0] and c.k_start == 0 and c.parts[0].k_len == k.shape[0]


def _as_rows(x: torch.Tensor, dim: int, like: torch.Tensor) -> torch.Tensor:
    """The kernel's [1, H, n, D] -> [n, H, dim] in like's dtype, contiguous (a view when it already is)."""
    return x[0, :, :, :dim].transpose(0, 1).to(like.dtype).contiguous()


def _new_lse(q: torch.Tensor, pack: Packing) -> torch.Tensor:
    """lse filled with -inf: [Hq, T] (thd) or [B, Hq, S] (padded); float64 for float64 inputs."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    shape = (q.shape[-2], q.shape[0]) if pack.fmt == "thd" else (pack.batch, q.shape[-2], seq_len_dim(q, pack.fmt))
    return torch.full(shape, float("-inf"), dtype=dtype, device=q.device)


def fused_fwd(q, k, v, q_pack: Packing, calls: list[SeqCall], params: VarlenParams):
    """(out, lse) sequence by sequence: out in q's layout and dtype with last dim Dv (zeros where no
    key is seen), lse in its layout (-inf there); a softmax offset is folded in by ``fold_sink``."""
    op = _fwd_op()
    fmt = q_pack.fmt
    dim = max(q.shape[-1], v.shape[-1])
    dim_v = v.shape[-1]
    scale = params.softmax_scale
    whole = _whole(q, k, fmt, calls)
    if not whole:
        out = q.new_zeros(q.shape[:-1] + (dim_v,))
        lse = _new_lse(q, q_pack)
    for c in calls:
        qb = _bhsd(_rows(q, fmt, c.batch, c.q_start, c.q_len), dim)
        res = []
        for part in c.parts:
            start = c.k_start + part.k_offset
            kb = _bhsd(_rows(k, fmt, c.batch, start, part.k_len), dim)
            vb = _bhsd(_rows(v, fmt, c.batch, start, part.k_len), dim)
            res.append(op(qb, kb, vb, 0.0, part.causal, scale=scale))
        o, l = res[0] if len(res) == 1 else _merge(*res[0], *res[1])
        if whole:
            return _as_rows(o, dim_v, q), l[0].contiguous()
        _rows(out, fmt, c.batch, c.q_start, c.q_len).copy_(o[0, :, :, :dim_v].transpose(0, 1))
        _stat_rows(lse, fmt, c.batch, c.q_start, c.q_len).copy_(l[0])
    return out, lse


def fused_bwd(dout, q, k, v, out, lse, fmt: str, calls: list[SeqCall], params: VarlenParams):
    """(dq, dk, dv) in the layouts of q, k, v, from the saved out and lse; key spans that overlap
    add up their sequences' gradients."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    dim = max(q.shape[-1], v.shape[-1])
    dim_qk, dim_v = q.shape[-1], v.shape[-1]
    scale = params.softmax_scale
    whole = _whole(q, k, fmt, calls)
    if not whole:
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for c in calls:
        qb = _bhsd(_rows(q, fmt, c.batch, c.q_start, c.q_len), dim)
        dob = _bhsd(_rows(dout, fmt, c.batch, c.q_start, c.q_len), dim)
        ob = _bhsd(_rows(out, fmt, c.batch, c.q_start, c.q_len), dim)
        lb = _stat_rows(lse, fmt, c.batch, c.q_start, c.q_len)
        # rows the caller's lse marks as seeing nothing (-inf) get P = exp(S - inf) = 0
        lb = torch.where(torch.isneginf(lb), torch.full_like(lb, float("inf")), lb)[None].contiguous()
        for part in c.parts:
            start = c.k_start + part.k_offset
            kb = _bhsd(_rows(k, fmt, c.batch, start, part.k_len), dim)
            vb = _bhsd(_rows(v, fmt, c.batch, start, part.k_len), dim)
            gq, gk, gv = op(dob, qb, kb, vb, ob, lb, 0.0, part.causal, scale=scale)
            if whole:
                return _as_rows(gq, dim_qk, q), _as_rows(gk, dim_qk, k), _as_rows(gv, dim_v, v)
            _rows(dq, fmt, c.batch, c.q_start, c.q_len).add_(gq[0, :, :, :dim_qk].transpose(0, 1))
            _rows(dk, fmt, c.batch, start, part.k_len).add_(gk[0, :, :, :dim_qk].transpose(0, 1))
            _rows(dv, fmt, c.batch, start, part.k_len).add_(gv[0, :, :, :dim_v].transpose(0, 1))
    return dq, dk, dv


def _inside(spans: Spans, fmt: str, n_rows: int) -> torch.Tensor:
    """Host bool mask of the rows inside some q span: [T] (thd) or [B, S] (padded)."""
    start, length = spans.q.start, spans.q.length
    if fmt != "thd":
        pos = torch.arange(n_rows)[None, :]
        return (pos >= start[:, None]) & (pos < (start + length)[:, None])
    edges = torch.zeros(n_rows + 1, dtype=torch.long)
    edges.index_add_(0, start, torch.ones_like(start)).index_add_(0, start + length, -torch.ones_like(start))
    return edges.cumsum(0)[:n_rows] > 0


def fold_sink(out: torch.Tensor, lse: torch.Tensor, fmt: str, spans: Spans, offset: torch.Tensor) -> None:
    """A softmax offset's sink logit (``[Hq]``, or per row in lse's layout) joins every row inside a q span (even a row that sees no key,
    whose lse becomes the sink): lse' = logaddexp(lse, sink), out' = out * exp(lse - lse')."""
    n_rows = lse.shape[-1]
    inside = _inside(spans, fmt, n_rows).to(lse.device)  # [T] / [B, S]
    # [Hq, 1], broadcast on [Hq, T] and [B, Hq, S]; or one per row, in lse's layout
    sink = offset.to(lse.dtype)[:, None] if offset.dim() == 1 else offset.to(lse.dtype)
    inside = inside[None, :] if fmt == "thd" else inside[:, None, :]
    new = torch.where(inside, torch.logaddexp(lse, sink), lse)
    factor = torch.where(inside & (new > float("-inf")), torch.exp(lse - new), torch.ones_like(lse))
    if fmt == "thd":
        factor = factor.transpose(0, 1)  # [T, Hq]
    else:
        factor = factor.transpose(1, 2)  # [B, S, Hq]
        factor = factor if fmt == "bshd" else factor.transpose(0, 1)
    out.mul_(factor[..., None].to(out.dtype))
    lse.copy_(new)
