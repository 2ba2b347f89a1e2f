"""Mask and packing kernels: row gather/scatter (unpad/pad) and per-token position/sequence ids.

Rows are addressed with scalar int64 bases (an index times a row stride can pass 2**31) and
int32 vector offsets inside a row, whose stride is 1: no lane is multiplied by a runtime stride,
so these kernels need no 64-bit lane variant (coreattn/tune/offsets.py finds no i32 stride
product in them). Row and token counts are runtime ints that never
specialize, so a new packed batch never recompiles. Each program strides over its rows or
token blocks, so the grid can be capped (a persistent grid, as Ascend prefers). Every address a
loop forms is clamped inside its tensor, masked lane or not (kernels/attn_common.py says why).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from coreattn.kernels.configs.targets import launch_options, target_of
from coreattn.kernels.device import on_device
from coreattn.kernels.launch import launch

MAX_PROGRAMS = 65535
ROW_BLOCK = 1024  # elements of a row moved per step; rows are usually H*D wide
TOKEN_BLOCK = 1024
# Interpreter: tiny blocks and grid, so tests cross block edges and the strided loops
_INTERPRETER_PROGRAMS = 3
_INTERPRETER_ROW_BLOCK = 4
_INTERPRETER_TOKEN_BLOCK = 8


def _launch_sizes(device: torch.device) -> tuple[int, int, int]:
    """(max programs, row block, token block) for the target."""
    if target_of(device) == "interpreter":
        return _INTERPRETER_PROGRAMS, _INTERPRETER_ROW_BLOCK, _INTERPRETER_TOKEN_BLOCK
    return MAX_PROGRAMS, ROW_BLOCK, TOKEN_BLOCK


@triton.jit(do_not_specialize=["n_rows", "row_len", "stride_src", "stride_dst"])
def _copy_rows_kernel(src_ptr, dst_ptr, idx_ptr, n_rows, row_len, stride_src, stride_dst,
                      GATHER: tl.constexpr, BLOCK_D: tl.constexpr):
    """GATHER: dst[r] = src[idx[r]]; otherwise (scatter) dst[idx[r]] = src[r]; r < n_rows."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_D)
    for r in range(pid, n_rows, nprog):
        j = tl.load(idx_ptr + tl.minimum(r, n_rows - 1)).to(tl.int64)  # r < n_rows; clamped for any r
        if GATHER:
            src_row = src_ptr + j * stride_src
            dst_row = dst_ptr + tl.cast(r, tl.int64) * stride_dst
        else:
            src_row = src_ptr + tl.cast(r, tl.int64) * stride_src
            dst_row = dst_ptr + j * stride_dst
        for d0 in range(0, row_len, BLOCK_D):
            cols = d0 + offs
            m = cols < row_len
            at = tl.minimum(cols, row_len - 1)  # inside the row for every lane, masked or not
            vals = tl.load(src_row + at, mask=m)
            tl.store(dst_row + at, vals, mask=m)


@triton.jit(do_not_specialize=["batch", "total", "n_steps"])
def _token_ids_kernel(cu_ptr, pos_ptr, seq_ptr, batch, total, n_steps,
                      WRITE_POS: tl.constexpr, WRITE_SEQ: tl.constexpr, BLOCK_T: tl.constexpr):
    """For each token t < total: seq = max b in [0, batch] with cu[b] <= t, pos = t - cu[seq]."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_T)
    for t0 in range(pid * BLOCK_T, total, nprog * BLOCK_T):
        t = tl.minimum(t0 + offs, total - 1)  # [T] int32 (from int32 cu_seqlens), inside the outputs
        ok = t0 + offs < total
        lo = tl.zeros([BLOCK_T], dtype=tl.int32)
        hi = lo + batch
        # binary search, invariant cu[lo] <= t; mid stays in [0, batch] even for malformed cu
        for _ in range(n_steps):
            mid = (lo + hi + 1) // 2
            go = tl.load(cu_ptr + mid) <= t
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid - 1)
        if WRITE_POS:
            start = tl.load(cu_ptr + lo)
            tl.store(pos_ptr + t, (t - start).to(pos_ptr.dtype.element_ty), mask=ok)
        if WRITE_SEQ:
            tl.store(seq_ptr + t, lo.to(seq_ptr.dtype.element_ty), mask=ok)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [N, row_len] with unit stride inside a row; bool is moved as uint8."""
    rows = t.reshape(t.shape[0], math.prod(t.shape[1:]))
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows.view(torch.uint8) if rows.dtype == torch.bool else rows


@on_device
def _copy_rows(src: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, gather: bool) -> torch.Tensor:
    src_rows, out_rows = _as_rows(src), _as_rows(out)  # out is fresh and contiguous: a view
    indices = indices.contiguous()  # the kernel reads index r at offset r
    n, row_len = indices.numel(), src_rows.shape[1]
    if n == 0 or row_len == 0:
        return out
    programs, block_d, _ = _launch_sizes(src.device)
    launch(
        target_of(src.device), _copy_rows_kernel, (min(n, programs),),
        src_rows, out_rows, indices, n, row_len, src_rows.stride(0), out_rows.stride(0),
        GATHER=gather, BLOCK_D=min(block_d, triton.next_power_of_2(row_len)),
        **launch_options(target_of(src.device)),
    )
    return out


def gather_rows(src: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """out[i] = src[indices[i]] for src [N, ...] and int32/int64 indices [n] -> [n, ...].

    Indices are assumed in [0, N) (checked by the caller)."""
    out = torch.empty((indices.numel(),) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
    return _copy_rows(src, indices, out, gather=True)


def scatter_rows(src: torch.Tensor, indices: torch.Tensor, n_out: int) -> torch.Tensor:
    """out[indices[i]] = src[i], zeros elsewhere: src [n, ...] -> [n_out, ...].

    Indices are assumed unique and in [0, n_out) (checked by the caller)."""
    out = torch.zeros((n_out,) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
    return _copy_rows(src, indices, out, gather=False)


@on_device
def token_ids(cu_seqlens: torch.Tensor, total: int, pos_dtype: torch.dtype | None,
              seq_dtype: torch.dtype | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-token position within its sequence and sequence index for int32 cu_seqlens [B+1].

    A dtype of None skips that output. Tokens at or past cu_seqlens[-1] (a padded tail) get
    sequence index B and positions counting from cu_seqlens[-1]."""
    device = cu_seqlens.device
    cu_seqlens = cu_seqlens.contiguous()  # the kernel reads entry b at offset b
    batch = cu_seqlens.numel() - 1
    pos = torch.empty(total, dtype=pos_dtype, device=device) if pos_dtype is not None else None
    seq = torch.empty(total, dtype=seq_dtype, device=device) if seq_dtype is not None else None
    if total == 0 or (pos is None and seq is None):
        return pos, seq
    programs, _, block_t = _launch_sizes(device)
    grid = (min(triton.cdiv(total, block_t), programs),)
    dummy = pos if pos is not None else seq
    launch(
        target_of(device), _token_ids_kernel, grid,
        cu_seqlens, pos if pos is not None else dummy, seq if seq is not None else dummy,
        batch, total, int(batch).bit_length(),
        WRITE_POS=pos is not None, WRITE_SEQ=seq is not None, BLOCK_T=block_t,
        **launch_options(target_of(device)),
    )
    return pos, seq
