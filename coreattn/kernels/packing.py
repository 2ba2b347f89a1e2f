"""How sequences sit in a q/k/v tensor: packed (thd, cu_seqlens) or padded (bshd/sbhd, spans).

The kernels address token i of sequence b at ``b * stride_b + (start_b + i) * stride_t``:
- thd: ``[T, H, D]``, stride_b = 0, start_b = cu_seqlens[b], length = cu_seqlens[b+1] - start_b;
- bshd ``[B, S, H, D]`` / sbhd ``[S, B, H, D]``: start_b/length_b from per-sample span tensors.
Padded layouts are used in place (no transposes or copies).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FORMATS = ("thd", "bshd", "sbhd")


class Packing(NamedTuple):
    fmt: str  # "thd" | "bshd" | "sbhd"
    seq: torch.Tensor  # thd: cu_seqlens int32 [B+1]; padded: span starts int32 [B]
    lens: torch.Tensor  # padded: span lengths int32 [B]; thd: cu_seqlens again (unused)

    @property
    def padded(self) -> bool:
        return self.fmt != "thd"

    @property
    def batch(self) -> int:
        return self.seq.numel() - 1 if self.fmt == "thd" else self.seq.numel()


def packed(cu_seqlens: torch.Tensor) -> Packing:
    return Packing("thd", cu_seqlens, cu_seqlens)


def seq_strides(x: torch.Tensor, fmt: str) -> tuple[int, int, int]:
    """(stride_b, stride_t, stride_h) of x in the given format."""
    if fmt == "thd":
        return 0, x.stride(0), x.stride(1)
    if fmt == "bshd":
        return x.stride(0), x.stride(1), x.stride(2)
    return x.stride(1), x.stride(0), x.stride(2)


def seq_len_dim(x: torch.Tensor, fmt: str) -> int:
    """T for thd (all tokens), S for padded layouts."""
    return x.shape[1] if fmt == "bshd" else x.shape[0]


def new_like(x: torch.Tensor, pack: Packing, dim: int, dtype=None) -> torch.Tensor:
    """A contiguous output with x's layout and last dim ``dim``; zeros for padded layouts
    (positions outside the spans are never written by the kernels)."""
    shape = tuple(x.shape[:-1]) + (dim,)
    alloc = torch.zeros if pack.padded else torch.empty
    return alloc(shape, dtype=dtype or x.dtype, device=x.device)


def new_rowstat(x: torch.Tensor, pack: Packing, fill: float | None = None) -> torch.Tensor:
    """fp32 per-row statistic (lse, delta): thd -> [H, T]; padded -> [B, H, S]."""
    heads = x.shape[-2]
    if pack.fmt == "thd":
        shape = (heads, x.shape[0])
    else:
        shape = (pack.batch, heads, seq_len_dim(x, pack.fmt))
    if fill is None and not pack.padded:
        return torch.empty(shape, dtype=torch.float32, device=x.device)
    return torch.full(shape, float("-inf") if fill is None else fill, dtype=torch.float32, device=x.device)


def rowstat_strides(stat: torch.Tensor, pack: Packing) -> tuple[int, int]:
    """(stride_b, stride_h) of a row statistic; its token stride is 1."""
    if pack.fmt == "thd":
        return 0, stat.stride(0)
    return stat.stride(0), stat.stride(1)
