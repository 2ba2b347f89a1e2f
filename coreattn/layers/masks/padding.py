"""``unpad`` / ``pad``: flash-attn's varlen inputs from a padded batch and back, differentiable.

UnpadFunction and PadFunction are their autograd over row gather/scatter.

On CUDA the Triton launchers move the rows; elsewhere a vectorized torch path does (index_select
and index_put_), which is also the float64 gradcheck reference. Gather and scatter are each
other's backward; indices are unique, so both directions are deterministic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from coreattn.kernels.masks import gather_rows, scatter_rows
from coreattn.layers.masks import checks
from coreattn.layers.masks.checks import check_int, check_keep_mask, check_tensor, keep_bool


def use_triton(device: torch.device) -> bool:
    """The Triton gather/scatter runs on CUDA; CPU (and other devices) use torch ops."""
    return device.type == "cuda"


def gather(src: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """src [N, ...], indices [n] -> [n, ...]."""
    if use_triton(src.device):
        return gather_rows(src, indices)
    return src.index_select(0, indices)


def scatter(src: torch.Tensor, indices: torch.Tensor, n_out: int) -> torch.Tensor:
    """src [n, ...] -> [n_out, ...] with rows at indices, zeros elsewhere."""
    if use_triton(src.device):
        return scatter_rows(src, indices, n_out)
    out = torch.zeros((n_out,) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
    # index_put_ rather than index_copy_: same result for unique indices, about 2x faster on CPU
    return out.index_put_((indices,), src)


class UnpadFunction(torch.autograd.Function):
    """x_rows [B*S, ...] -> x_packed [total, ...] = x_rows[indices]."""

    @staticmethod
    def forward(ctx, x_rows: torch.Tensor, indices: torch.Tensor):
        ctx.save_for_backward(indices)
        ctx.n_rows = x_rows.shape[0]
        return gather(x_rows, indices)

    @staticmethod
    def backward(ctx, grad_packed):
        (indices,) = ctx.saved_tensors
        return scatter(grad_packed, indices, ctx.n_rows), None


class PadFunction(torch.autograd.Function):
    """x_packed [total, ...] -> x_rows [n_rows, ...], zeros where no index points."""

    @staticmethod
    def forward(ctx, x_packed: torch.Tensor, indices: torch.Tensor, n_rows: int):
        ctx.save_for_backward(indices)
        return scatter(x_packed, indices, n_rows)

    @staticmethod
    def backward(ctx, grad_rows):
        (indices,) = ctx.saved_tensors
        return gather(grad_rows, indices), None, None


class Unpadded(NamedTuple):
    """Result of ``unpad``: flash-attn's varlen inputs."""

    x_packed: torch.Tensor  # [total, ...]
    indices: torch.Tensor  # [total] int64, flat indices into the [B*S] rows of x
    cu_seqlens: torch.Tensor  # [B+1] int32
    max_seqlen: int



def unpad(x: torch.Tensor, keep_mask: torch.Tensor, *, total: int | None = None,
          max_seqlen: int | None = None) -> Unpadded:
    """Pack the kept tokens of x [B, S, ...] into x_packed [total, ...] (differentiable).

    keep_mask: [B, S] keep mask (True/1 = token takes part), bool or 0/1 integer; holes are fine
    (each row's kept tokens are packed in order). Returns ``Unpadded(x_packed, indices,
    cu_seqlens, max_seqlen)``: indices are int64 flat indices into the B*S rows (for ``pad``),
    cu_seqlens int32 [B+1], max_seqlen a Python int (flash-attn's ABI).

    The output shape needs the token count, and max_seqlen must be a host int: pass ``total``
    (= keep_mask.sum()) and ``max_seqlen`` (>= the longest row) when you know them and nothing
    syncs; leaving either None costs one host sync on a device. A wrong ``total`` or too small
    ``max_seqlen`` raises on the CPU (or with COREATTN_VALIDATE=1); on a device they are not
    checked, and a wrong ``total`` gives wrong rows. On CUDA the rows move with a Triton gather
    kernel, elsewhere with index_select.
    """
    check_tensor("x", x, tuple(range(2, 9)))
    check_keep_mask("keep_mask", keep_mask)
    if tuple(x.shape[:2]) != tuple(keep_mask.shape):
        raise ValueError(f"x has batch and sequence dims {tuple(x.shape[:2])} but keep_mask has shape "
                         f"{tuple(keep_mask.shape)}")
    if keep_mask.device != x.device:
        raise ValueError(f"keep_mask is on {keep_mask.device} but x is on {x.device}")
    keep = keep_bool(keep_mask)
    batch, seqlen = keep.shape
    seqlens = keep.sum(dim=1, dtype=torch.int32)  # [B]
    flat = keep.reshape(-1)  # [B*S]
    if total is not None:
        total = check_int("total", total)
    if max_seqlen is not None:
        max_seqlen = check_int("max_seqlen", max_seqlen)
    if total is None or max_seqlen is None or checks.reads_values(flat):
        # one host sync (free on the CPU) for both counts
        kept, longest = torch.stack([seqlens.sum(), seqlens.amax() if batch > 0 else seqlens.sum()]).tolist()
        if total is None:
            total = kept
        elif total != kept:
            raise ValueError(f"total = {total} but keep_mask keeps {kept} tokens")
        if max_seqlen is None:
            max_seqlen = longest
        elif longest > max_seqlen:
            raise ValueError(f"max_seqlen = {max_seqlen} is smaller than the longest row ({longest})")
    # indices without nonzero (which syncs): each kept token goes to slot cumsum-1, the rest to a
    # discarded slot `total`
    slot = torch.cumsum(flat, dim=0) - 1  # [B*S] int64
    slot = torch.where(flat & (slot < total), slot, total)
    buf = torch.zeros(total + 1, dtype=torch.int64, device=x.device)
    buf.scatter_(0, slot, torch.arange(flat.numel(), device=x.device))
    indices = buf[:total]
    cu_seqlens = torch.zeros(batch + 1, dtype=torch.int32, device=x.device)
    torch.cumsum(seqlens, dim=0, dtype=torch.int32, out=cu_seqlens[1:])
    x_packed = UnpadFunction.apply(x.reshape((batch * seqlen,) + tuple(x.shape[2:])), indices)
    return Unpadded(x_packed, indices, cu_seqlens, max_seqlen)



def pad(x_packed: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of ``unpad``: x_packed [total, ...] -> [batch, seqlen, ...], zeros where padded.

    indices: integer [total], unique flat indices into the batch*seqlen rows (``unpad``'s
    output). Differentiable; no host sync. Index ranges and uniqueness are checked on the CPU
    or with COREATTN_VALIDATE=1. On CUDA the rows move with a Triton scatter kernel.
    """
    check_tensor("x_packed", x_packed, tuple(range(1, 8)))
    check_tensor("indices", indices, (1,))
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must be int32 or int64, got {indices.dtype}")
    batch = check_int("batch", batch)
    seqlen = check_int("seqlen", seqlen)
    if indices.numel() != x_packed.shape[0]:
        raise ValueError(f"indices has {indices.numel()} entries but x_packed has {x_packed.shape[0]} rows")
    if indices.device != x_packed.device:
        raise ValueError(f"indices is on {indices.device} but x_packed is on {x_packed.device}")
    n_rows = batch * seqlen
    if checks.reads_values(indices) and indices.numel() > 0:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= n_rows:
            raise ValueError(f"indices must lie in [0, batch*seqlen = {n_rows}), got [{lo}, {hi}]")
        if bool((torch.bincount(indices, minlength=n_rows) > 1).any()):  # O(n) where unique would sort
            raise ValueError("indices must be unique")
    if not use_triton(x_packed.device):
        indices = indices.long()  # the torch path indexes with int64
    rows = PadFunction.apply(x_packed, indices, n_rows)
    return rows.reshape((batch, seqlen) + tuple(x_packed.shape[1:]))

