"""UnpadFunction and PadFunction: autograd over row gather/scatter.

On CUDA the Triton launchers move the rows; elsewhere a vectorized torch path does (index_select
and index_put_), which is also the float64 gradcheck reference. Gather and scatter are each
other's backward; indices are unique, so both directions are deterministic.
"""

from __future__ import annotations

import torch

from coreattn.kernels.masks import gather_rows, scatter_rows


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
