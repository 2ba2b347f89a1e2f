"""The sparse (top-k) attention custom operators: forward and backward over one backend's pair, with autograd.

Each backend implements the pair of the Triton launchers (``coreattn/kernels/sparse_fwd.py``,
``sparse_bwd.py``; the torch backend in ``coreattn/layers/torch_backend/sparse.py``; npu_fused, torch_npu's
operators, in ``coreattn/layers/npu_fused/sparse.py``) on prepared
inputs: ``topk`` int32 ``[N, Hidx, K]`` from ``coreattn.kernels.sparse_index.prepare_topk`` (rows
ascending, unused entries, repeats and entries past topk_length -1) and the per-token key bounds ``key_lo``/``key_hi``
int32 ``[N]``:

- ``fwd(q, k, v, topk, key_lo, key_hi, fmt, softmax_scale, *, v_dim) -> (out, lse)``;
- ``bwd(dout, q, k, v, out, lse, topk, key_lo, key_hi, fmt, softmax_scale, *, v_dim) -> (dq, dk, dv or None)``.

Exposed as PyTorch custom operators, so ``torch.compile`` traces a call as one opaque node and
eager runs the same code:

- ``coreattn::sparse_attn_fwd(q, k, v?, topk_indices [N, Hidx, K], topk_length? [N], fmt, seq_q,
  len_q?, seq_k, len_k?, bound_lo? [N], bound_hi? [N], causal, bottom_right, softmax_scale, v_dim,
  backend, validate) -> (out, lse, topk, key_lo, key_hi)``: prepares the indices, derives the key
  bounds (``key_bounds`` below) and runs the backend's forward; the prepared indices and bounds
  are returned (not differentiable) so the backward reuses them;
- ``coreattn::sparse_attn_bwd(dout, q, k, v?, out, lse, topk, key_lo, key_hi, fmt, softmax_scale,
  v_dim, backend) -> (dq, dk, dv)``, dv an empty ``[0]`` placeholder when v is None (absorbed: dV
  is folded into dk).

Block mode (``block_size`` > 0): an entry names a block of ``block_size`` keys (block c of a token's
sequence: key positions ``[c * B, (c + 1) * B)`` from the sequence's first key, thd, or from position 0
of the sample, padded). The forward turns each entry into the key row its block starts at
(``coreattn.kernels.sparse_blocks.block_starts``) before ``prepare_topk``, so the prepared indices stay
``[N, Hidx, K]`` (never one entry per key), and each backend runs its block mode on them (the Triton
launchers and the torch backend's ``blocks=``; npu_fused has none).

The layout tensors are those of ``coreattn.layers.function``: thd ``seq_*`` = cu_seqlens int32
``[B+1]`` (``len_*`` None); bshd/sbhd ``seq_*``/``len_*`` the int32 ``[B]`` span starts and lengths.
Nothing reads a device tensor's values: the bounds come from torch ops on the device, and the
value checks of the public functions run here on CPU tensors (or with ``COREATTN_VALIDATE=1``).
The backward saves q, k, v, out, lse, the prepared indices and the bounds (O(T * H * D + T * K))
and recomputes the scores.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch

from coreattn.kernels import npu
from coreattn.kernels.configs.sparse import triton_refusal
from coreattn.layers.backends import Backend, select_sparse_backend
from coreattn.kernels.sparse_bwd import sparse_attn_bwd as launch_sparse_bwd
from coreattn.kernels.sparse_blocks import BlockLayout, block_starts
from coreattn.kernels.sparse_fwd import sparse_attn_fwd as launch_sparse_fwd
from coreattn.kernels.sparse_index import prepare_topk
from coreattn.layers.checks import KERNEL_DTYPES, check_layout_values
from coreattn.layers.npu_fused.sparse import sparse_attn_npu_bwd, sparse_attn_npu_fwd, sparse_grad_unfit, sparse_unfit
from coreattn.layers.torch_backend.sparse import new_lse, sparse_attn_torch_bwd, sparse_attn_torch_fwd


class SparseImpl(NamedTuple):
    name: str
    fwd: Callable
    bwd: Callable


TRITON = SparseImpl("triton", launch_sparse_fwd, launch_sparse_bwd)
TORCH = SparseImpl("torch", sparse_attn_torch_fwd, sparse_attn_torch_bwd)
NPU_FUSED = SparseImpl("npu_fused", sparse_attn_npu_fwd, sparse_attn_npu_bwd)


def _impl(q: torch.Tensor, backend: str, k: torch.Tensor, v: torch.Tensor | None, topk: torch.Tensor,
          v_dim: int, fmt: str, backward: bool = False, block_size: int = 0) -> SparseImpl:
    """The backend for q's device (``backend``: an override name, "" for the default), chosen when the
    op runs, forward and ``backward`` each (npu_fused where the call fits torch_npu's operator for that
    direction: ``npu_sparse_flash_attention`` or its grad; either direction takes the other's lse; never
    for block-sparse rows; Triton where the call fits its launch tables, every mode alike: the same answer
    forward and backward)."""
    def unfit():
        if block_size:
            return "npu_sparse_flash_attention has no block-sparse mode (block_size)"
        if backward:
            return sparse_grad_unfit(q, k, v, topk, v_dim, fmt)
        return sparse_unfit(q, k, v, topk, v_dim)

    chosen = select_sparse_backend(q.device, backend or None, unfit=unfit,
                                   triton_unfit=lambda: triton_refusal(q.device, q.dtype, q.shape[-1], v_dim),
                                   backward=backward)
    if chosen is Backend.NPU_FUSED:
        return NPU_FUSED
    if chosen is Backend.TORCH:
        return TORCH
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; the Triton backend supports float16, bfloat16, float32")
    return TRITON


def _run(impl: SparseImpl, choose: Callable[[], SparseImpl], backward: bool, *args, **kwargs):
    """``impl``'s forward (or backward); where torch_npu's operator turns out to have no kernel on this
    device (its first call says so: remembered, coreattn.kernels.npu.run_npu_op), the backend chosen
    again (``choose``: the operator now passed over, the reason logged) runs it, unless the caller
    named npu_fused (then the error stands)."""
    try:
        return (impl.bwd if backward else impl.fwd)(*args, **kwargs)
    except npu.NpuOpUnavailable:
        again = choose()
        if again is impl:
            raise
        return (again.bwd if backward else again.fwd)(*args, **kwargs)


class _Positions(NamedTuple):
    """Per query token n (int64 [N]): its position i in its sequence, the sequence's first key row k0,
    its query and key lengths, and whether n lies inside its sequence."""

    i: torch.Tensor
    k0: torch.Tensor
    lq: torch.Tensor
    lk: torch.Tensor
    inside: torch.Tensor


def _positions(fmt: str, seq_q, len_q, seq_k, len_k, tokens: int, seqlen_q: int,
               rows: tuple[int, int] | None = None) -> _Positions:
    """``_Positions`` of the query tokens [0, tokens), or of tokens [n0, n1) (``rows``)."""
    device = seq_q.device
    n0, n1 = rows if rows is not None else (0, tokens)
    if fmt == "thd":
        n = torch.arange(n0, n1, dtype=seq_q.dtype, device=device)
        b = (torch.searchsorted(seq_q, n, right=True) - 1).clamp(0, seq_q.numel() - 2)
        q0, lq = seq_q[b], seq_q[b + 1] - seq_q[b]
        k0, lk = seq_k[b], seq_k[b + 1] - seq_k[b]
    else:
        n = torch.arange(n0, n1, dtype=torch.int64, device=device)
        b, pos = n // max(seqlen_q, 1), n % max(seqlen_q, 1)
        q0, lq, k0, lk = seq_q[b], len_q[b], seq_k[b], len_k[b]
        n = pos
    i = (n - q0).to(torch.int64)
    lq = lq.to(torch.int64)
    return _Positions(i, k0.to(torch.int64), lq, lk.to(torch.int64), (i >= 0) & (i < lq))


def key_bounds(fmt: str, seq_q: torch.Tensor, len_q: torch.Tensor | None, seq_k: torch.Tensor,
               len_k: torch.Tensor | None, tokens: int, seqlen_q: int, causal: bool, bottom_right: bool,
               bound_lo: torch.Tensor | None = None,
               bound_hi: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ``[N]`` key bounds per query token, in torch ops on the layout's device (no host read).

    Token n of sequence b at position i in it (thd: row n of cu_seqlens_q's sequence b; padded:
    n = b * S + s, i = s - q_start[b]) sees the key positions ``[k0, k0 + Lk)`` of its sequence
    (thd: rows of the packed stream, k0 = cu_seqlens_k[b]; padded: k0 = k_start[b]); causal keeps
    relative positions ``j <= i + Lk - Lq`` (bottom-right) or ``j <= i`` (top-left). Given bounds
    are intersected with these. A token outside every sequence sees nothing (lo = hi)."""
    at = _positions(fmt, seq_q, len_q, seq_k, len_k, tokens, seqlen_q)
    lo, hi = at.k0, at.k0 + at.lk
    if causal:
        shift = at.lk - at.lq if bottom_right else 0
        hi = at.k0 + torch.minimum((at.i + 1 + shift).clamp(min=0), at.lk)
    if bound_lo is not None:
        lo = torch.maximum(lo, bound_lo.to(torch.int64))
        hi = torch.minimum(hi, bound_hi.to(torch.int64))
    hi = torch.where(at.inside, torch.maximum(hi, lo), lo)
    return lo.to(torch.int32), hi.to(torch.int32)


def window_entries(fmt: str, seq_q, len_q, seq_k, len_k, tokens: int, seqlen_q: int, left: int, right: int,
                   bottom_right: bool, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """int32 ``[N, left + right + 1]``: the key positions of each token's window, relative positions
    ``i + shift - left .. i + shift + right`` of its sequence (shift = Lk - Lq bottom-right, 0 top-left),
    -1 where that leaves the sequence (thd: rows of the packed stream; padded: positions in the sample).
    ``rows`` (n0, n1): those tokens' rows only, ``[n1 - n0, W]``."""
    at = _positions(fmt, seq_q, len_q, seq_k, len_k, tokens, seqlen_q, rows)
    shift = at.lk - at.lq if bottom_right else torch.zeros_like(at.lk)
    rel = (at.i + shift)[:, None] + torch.arange(-left, right + 1, device=at.i.device)  # [N, W]
    ok = (rel >= 0) & (rel < at.lk[:, None]) & at.inside[:, None]
    return torch.where(ok, at.k0[:, None] + rel, -1).to(torch.int32)


def _block_layout(block_size: int, fmt: str, seq_k: torch.Tensor) -> BlockLayout | None:
    """The launchers' block mode (None: token entries); thd blocks start at each sequence's first key row."""
    return BlockLayout(block_size, seq_k if fmt == "thd" else None) if block_size > 0 else None


def _as_block_starts(topk_indices, fmt, seq_q, len_q, seq_k, len_k, seqlen_q, block_size):
    """Block entries as the key rows their blocks start at (thd: from the sequence's first key row; padded:
    from position 0 of the sample), ``[N, Hidx, K]`` int64."""
    origin = torch.zeros(topk_indices.shape[0], dtype=torch.int64, device=topk_indices.device)
    if fmt == "thd":
        origin = _positions(fmt, seq_q, len_q, seq_k, len_k, topk_indices.shape[0], seqlen_q).k0
    return block_starts(topk_indices, origin, block_size)


def _tokens(x: torch.Tensor, fmt: str) -> int:
    """Query tokens N (thd T, padded B * S) and the layout's sequence length (thd T, padded S)."""
    return x.shape[1] if fmt == "bshd" else x.shape[0]


def _window(fmt, seq_q, len_q, seq_k, len_k, tokens, seqlen_q, left, right, bottom_right) -> dict:
    """``prepare_topk``'s arguments that append each token's window (``window_entries``) to its rows, a
    chunk of tokens at a time (no [N, Hidx, K + W] copy of the indices), or none (left < 0: no window)."""
    if left < 0:
        return {}
    entries = functools.partial(window_entries, fmt, seq_q, len_q, seq_k, len_k, tokens, seqlen_q, left, right,
                                bottom_right)
    return dict(extra=lambda n0, n1: entries(rows=(n0, n1)), extra_width=left + right + 1)


def _by_sample(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """out or dout as a [B, S, Hq, Dv] view (thd: one sample)."""
    return x.unsqueeze(0) if fmt == "thd" else (x if fmt == "bshd" else x.transpose(0, 1))


def _lse_by_sample(lse: torch.Tensor, fmt: str) -> torch.Tensor:
    """lse (thd [Hq, T], padded [B, Hq, S]) as a [B, S, Hq] view."""
    return lse.t().unsqueeze(0) if fmt == "thd" else lse.transpose(1, 2)


def _fold_sink(out: torch.Tensor, lse: torch.Tensor, offset: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out', lse') with the sink: lse' = logaddexp(lse, offset[h]) and out' = out * exp(lse - lse'), the
    attention over the keys and a virtual key of logit offset[h] and value 0. The backward over out' and
    lse' is then the sink-free one (P = exp(S - lse'), delta = rowsum(dO * O'))."""
    lse_bs = _lse_by_sample(lse, fmt)  # [B, S, Hq] view
    folded = torch.logaddexp(lse_bs, _offset_by_sample(offset, fmt).to(lse.dtype))
    out_bs = _by_sample(out, fmt)
    scaled = out_bs.to(lse.dtype) * torch.exp(lse_bs - folded).unsqueeze(-1)
    out_bs.copy_(scaled)
    lse_bs.copy_(folded)
    return out, lse


def _offset_by_sample(offset: torch.Tensor, fmt: str) -> torch.Tensor:
    """A sink offset broadcast on [B, S, Hq]: ``[Hq]`` as it is, one per row in lse's layout as a view."""
    return offset if offset.dim() == 1 else _lse_by_sample(offset, fmt)


def _offset_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, offset: torch.Tensor, fmt: str):
    """d offset = -p_sink * rowsum(dO * O') per row, p_sink = exp(offset - lse'), summed over the rows of
    each head for an ``[Hq]`` offset; a per-row offset (lse's layout) gets its rows' terms."""
    work = lse.dtype
    delta = (_by_sample(dout, fmt).to(work) * _by_sample(out, fmt).to(work)).sum(-1)  # [B, S, Hq]
    p_sink = torch.exp(_offset_by_sample(offset.detach(), fmt).to(work) - _lse_by_sample(lse, fmt))
    grad = -(p_sink * delta)
    if offset.dim() == 1:
        return grad.sum((0, 1)).to(offset.dtype)
    grad = grad.squeeze(0).t() if fmt == "thd" else grad.transpose(1, 2)  # back to lse's layout
    return grad.to(offset.dtype).contiguous()


@torch.library.custom_op("coreattn::sparse_attn_fwd", mutates_args=())
def sparse_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor], topk_indices: torch.Tensor,
                    topk_length: Optional[torch.Tensor], fmt: str, seq_q: torch.Tensor, len_q: Optional[torch.Tensor],
                    seq_k: torch.Tensor, len_k: Optional[torch.Tensor], bound_lo: Optional[torch.Tensor],
                    bound_hi: Optional[torch.Tensor], causal: bool, bottom_right: bool, softmax_scale: float,
                    v_dim: int, window_left: int, window_right: int, softmax_offset: Optional[torch.Tensor],
                    backend: str, validate: bool,
                    block_size: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, topk, key_lo, key_hi): the output, and the prepared indices and bounds it used
    (block mode: the key rows of the named blocks)."""
    seqlen_q, seqlen_k = _tokens(q, fmt), _tokens(k, fmt)
    if validate:  # reads cu_seqlens / spans only where coreattn may (checks.reads_values)
        check_layout_values(fmt, seq_q, len_q, None, seq_k, len_k, None, seqlen_q, seqlen_k, seqlen_q, seqlen_k)
    impl = _impl(q, backend, k, v, topk_indices, v_dim, fmt, block_size=block_size)
    indices = topk_indices
    if block_size > 0:
        indices = _as_block_starts(indices, fmt, seq_q, len_q, seq_k, len_k, seqlen_q, block_size)
    # [N, Hidx, K (+ W)]: thd's form of the token dims; a key window's entries joined a chunk at a time
    topk = prepare_topk(indices, "thd", topk_length, **_window(fmt, seq_q, len_q, seq_k, len_k, indices.shape[0],
                                                               seqlen_q, window_left, window_right, bottom_right))
    key_lo, key_hi = key_bounds(fmt, seq_q, len_q, seq_k, len_k, topk.shape[0], seqlen_q, causal, bottom_right,
                                bound_lo, bound_hi)
    blocks = _block_layout(block_size, fmt, seq_k)
    extra = {} if blocks is None else {"blocks": blocks}
    out, lse = _run(impl, lambda: _impl(q, backend, k, v, topk, v_dim, fmt, block_size=block_size), False, q, k,
                    v, topk, key_lo, key_hi, fmt, softmax_scale, v_dim=v_dim, **extra)
    if softmax_offset is not None:
        out, lse = _fold_sink(out, lse, softmax_offset, fmt)
    return out, lse, topk, key_lo, key_hi


@sparse_attn_fwd.register_fake
def _sparse_attn_fwd_fake(q, k, v, topk_indices, topk_length, fmt, seq_q, len_q, seq_k, len_k, bound_lo, bound_hi,
                          causal, bottom_right, softmax_scale, v_dim, window_left, window_right, softmax_offset,
                          backend, validate, block_size=0):
    tokens, heads_idx, topk_k = topk_indices.shape
    topk_k += window_left + window_right + 1 if window_left >= 0 else 0
    out = q.new_empty(tuple(q.shape[:-1]) + (v_dim,))
    return (out, new_lse(q, fmt), q.new_empty((tokens, heads_idx, topk_k), dtype=torch.int32),
            q.new_empty((tokens,), dtype=torch.int32), q.new_empty((tokens,), dtype=torch.int32))


@torch.library.custom_op("coreattn::sparse_attn_bwd", mutates_args=())
def sparse_attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor],
                    out: torch.Tensor, lse: torch.Tensor, topk: torch.Tensor, key_lo: torch.Tensor,
                    key_hi: torch.Tensor, softmax_offset: Optional[torch.Tensor], fmt: str, softmax_scale: float,
                    v_dim: int, backend: str, block_size: int = 0,
                    seq_k: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, d_offset) in q, k, v's and the offset's shapes and dtypes (contiguous); dv is an empty
    [0] tensor when v is None, d_offset when there is no offset. Block mode: ``block_size`` > 0 and, thd,
    ``seq_k`` the forward's cu_seqlens_k."""
    impl = _impl(q, backend, k, v, topk, v_dim, fmt, backward=True, block_size=block_size)
    blocks = _block_layout(block_size, fmt, seq_k)
    extra = {} if blocks is None else {"blocks": blocks}
    dq, dk, dv = _run(impl, lambda: _impl(q, backend, k, v, topk, v_dim, fmt, backward=True, block_size=block_size),
                      True, dout, q, k, v, out, lse, topk, key_lo, key_hi, fmt, softmax_scale, v_dim=v_dim, **extra)
    if dv is None:
        dv = q.new_empty((0,))
    d_offset = q.new_empty((0,)) if softmax_offset is None else _offset_grad(dout, out, lse, softmax_offset, fmt)
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), d_offset


@sparse_attn_bwd.register_fake
def _sparse_attn_bwd_fake(dout, q, k, v, out, lse, topk, key_lo, key_hi, softmax_offset, fmt, softmax_scale, v_dim,
                          backend, block_size=0, seq_k=None):
    return (q.new_empty(q.shape), k.new_empty(k.shape), q.new_empty((0,)) if v is None else v.new_empty(v.shape),
            q.new_empty((0,)) if softmax_offset is None else softmax_offset.new_empty(softmax_offset.shape))


_FWD_ARGS = ("q", "k", "v", "topk_indices", "topk_length", "fmt", "seq_q", "len_q", "seq_k", "len_k", "bound_lo",
             "bound_hi", "causal", "bottom_right", "softmax_scale", "v_dim", "window_left", "window_right",
             "softmax_offset", "backend", "validate", "block_size")


def _setup_context(ctx, inputs, output):
    """Saves q, k, v, out, lse, the prepared indices, the bounds and the offset; the scores are recomputed."""
    args = dict(zip(_FWD_ARGS, inputs))
    out, lse, topk, key_lo, key_hi = output
    block_size = args.get("block_size", 0)
    seq_k = args["seq_k"] if block_size and args["fmt"] == "thd" else None  # where thd's blocks start
    ctx.save_for_backward(args["q"], args["k"], args["v"], out, lse, topk, key_lo, key_hi, args["softmax_offset"],
                          seq_k)
    ctx.options = (args["fmt"], args["softmax_scale"], args["v_dim"], args["backend"], block_size)
    ctx.mark_non_differentiable(lse, topk, key_lo, key_hi)
    # no zero gradients made for the outputs without one: the prepared indices' alone would be a
    # T x K int32 tensor at the start of the backward
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, *_):
    # lse, the indices and the bounds are non-differentiable: their incoming gradients are ignored
    q, k, v, out, lse, topk, key_lo, key_hi, offset, seq_k = ctx.saved_tensors
    grads = dict.fromkeys(_FWD_ARGS)
    wants_offset = ctx.needs_input_grad[_FWD_ARGS.index("softmax_offset")]
    if dout is not None and (any(ctx.needs_input_grad[:3]) or wants_offset):
        dq, dk, dv, d_offset = sparse_attn_bwd(dout, q, k, v, out, lse, topk, key_lo, key_hi, offset, *ctx.options,
                                               seq_k)
        grads.update(q=dq, k=dk, v=None if v is None else dv, softmax_offset=d_offset if wants_offset else None)
    return tuple(grads[name] for name in _FWD_ARGS)


sparse_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


class SparseLayout(NamedTuple):
    """The op's layout arguments (see the module docstring)."""

    fmt: str
    seq_q: torch.Tensor
    len_q: torch.Tensor | None
    seq_k: torch.Tensor
    len_k: torch.Tensor | None


def sparse_attention(q, k, v, topk_indices: torch.Tensor, topk_length: torch.Tensor | None, layout: SparseLayout,
                     bounds: tuple[torch.Tensor, torch.Tensor] | None, causal: bool, bottom_right: bool,
                     softmax_scale: float, v_dim: int, backend: str = "", validate: bool = False,
                     window: tuple[int, int] = (-1, -1), softmax_offset: torch.Tensor | None = None,
                     block_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) through ``coreattn::sparse_attn_fwd``, differentiable in q, k, v and the softmax offset.
    ``topk_indices`` ``[N, Hidx, K]``, ``topk_length`` and ``bounds`` ``[N]`` (token n = b * S + s);
    ``window`` (left, right): keys added to every token's set ((-1, -1): none); ``block_size`` > 0:
    the entries name blocks of that many keys (the block mode)."""
    lo, hi = (None, None) if bounds is None else bounds
    out, lse, *_ = sparse_attn_fwd(q, k, v, topk_indices, topk_length, layout.fmt, layout.seq_q, layout.len_q,
                                   layout.seq_k, layout.len_k, lo, hi, causal, bottom_right, softmax_scale, v_dim,
                                   window[0], window[1], softmax_offset, backend, validate, block_size)
    return out, lse
