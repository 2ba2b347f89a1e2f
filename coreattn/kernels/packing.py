"""How sequences sit in a q/k/v tensor, as the attention kernels read it.

The kernels address token i of sequence b at ``b * stride_b + (start_b + i) * stride_t``:
- cu_seqlens mode (thd only): ``[T, H, D]``, start_b = cu[b], length_b = cu[b+1] - cu[b];
- span mode: start_b/length_b from two int32 ``[B]`` tensors, on a padded batch
  (bshd ``[B, S, H, D]`` or sbhd ``[S, B, H, D]``, used in place) or on a packed thd tensor
  (stride_b = 0; e.g. only the first ``length_b`` keys of each sequence are used).
Optionally, padded batches carry ``[B, S]`` keep masks (uint8, 1 = the token takes part) read
in registers at the same positions: masks with holes need no unpad copy and no S×S tensor.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FORMATS = ("thd", "bshd", "sbhd")


class Packing(NamedTuple):
    fmt: str  # "thd" | "bshd" | "sbhd"
    seq: torch.Tensor  # cu_seqlens int32 [B+1] (lens None) or span starts int32 [B]
    lens: torch.Tensor | None = None  # span lengths int32 [B]; None: cu_seqlens mode
    keep: torch.Tensor | None = None  # [B, S] uint8 keep mask at raw positions (padded layouts)
    gid: torch.Tensor | None = None  # int32 [B]: dropout token id of each span's first token (None: default_gid)

    @property
    def spans(self) -> bool:
        return self.lens is not None

    @property
    def batch(self) -> int:
        return self.seq.numel() if self.spans else self.seq.numel() - 1


def default_gid(pack: Packing, seqlen_total: int) -> torch.Tensor:
    """Dropout token ids of each sequence's first token when ``pack.gid`` is None (see
    coreattn/kernels/dropout.py): packed thd, the token's row; padded, ``b * S + position``."""
    start = pack.seq if pack.spans else pack.seq[:-1]
    if pack.fmt == "thd":
        return start
    rows = torch.arange(pack.batch, dtype=torch.int32, device=start.device) * seqlen_total
    return rows + start


def packed(cu_seqlens: torch.Tensor) -> Packing:
    return Packing("thd", cu_seqlens)


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
    """A contiguous output with x's layout and last dim ``dim``; zeros in span mode (positions
    outside the spans are never written by the kernels)."""
    shape = tuple(x.shape[:-1]) + (dim,)
    alloc = torch.zeros if pack.spans else torch.empty
    return alloc(shape, dtype=dtype or x.dtype, device=x.device)


def new_rowstat(x: torch.Tensor, pack: Packing, fill: float | None = None) -> torch.Tensor:
    """fp32 per-row statistic (lse, delta): thd -> [H, T]; padded -> [B, H, S]. Positions outside
    spans hold ``fill`` (default -inf, the lse of a row that sees nothing)."""
    heads = x.shape[-2]
    if pack.fmt == "thd":
        shape = (heads, x.shape[0])
    else:
        shape = (pack.batch, heads, seq_len_dim(x, pack.fmt))
    if fill is None and not pack.spans:
        return torch.empty(shape, dtype=torch.float32, device=x.device)
    return torch.full(shape, float("-inf") if fill is None else fill, dtype=torch.float32, device=x.device)


def rowstat_strides(stat: torch.Tensor, pack: Packing) -> tuple[int, int]:
    """(stride_b, stride_h) of a row statistic; its token stride is 1."""
    if pack.fmt == "thd":
        return 0, stat.stride(0)
    return stat.stride(0), stat.stride(1)


def stand_in(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x, or where its dim ``dim`` is empty (a side without tokens: T = 0, or S = 0 padded), zeros
    with one entry there. The kernels' loops over an empty sequence address row 0 of its sample
    (kernels/attn_common.py ``_first_row``): they run zero times, but a pipelined load may be issued
    anyway, so that row must exist. Its values are never used (every lane is masked off) and the
    lengths the kernels get stay the real ones."""
    if x.shape[dim] > 0:
        return x
    shape = list(x.shape)
    shape[dim] = 1
    return x.new_zeros(shape)


def side_stand_ins(pack: Packing, *tensors: torch.Tensor) -> tuple:
    """(pack, *tensors) of one side (q/k/v-like tensors in ``pack.fmt``), each through ``stand_in``
    on its token dim, the keep mask ``[B, S]`` too."""
    dim = 1 if pack.fmt == "bshd" else 0
    keep = stand_in(pack.keep, 1) if pack.keep is not None else None
    return (pack._replace(keep=keep), *(stand_in(x, dim) for x in tensors))


def keep_args(pack: Packing) -> tuple[torch.Tensor, int, int]:
    """(pointer, stride_b, stride_s) for the kernels; a dummy pointer when there is no mask."""
    if pack.keep is None:
        return pack.seq, 0, 0
    return pack.keep, pack.keep.stride(0), pack.keep.stride(1)


def kernel_flags(q_pack: Packing, k_pack: Packing) -> dict:
    if q_pack.spans != k_pack.spans:
        raise ValueError("q and k must both use cu_seqlens or both use spans")
    return dict(HAS_Q_KEEP=q_pack.keep is not None, HAS_K_KEEP=k_pack.keep is not None)
