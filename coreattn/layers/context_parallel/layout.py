"""Megatron's zig-zag context-parallel layout as per-sequence tensors, shared by the exchanges.

Each sequence b, padded to L_b (a multiple of 2*cp), is cut into 2*cp chunks of c_b = L_b / (2*cp)
tokens; rank r holds chunks r and 2*cp-1-r, in that order (thd: sequence after sequence, from
local row ``cu_seqlens_padded[b] / cp``; sbhd: rows [0, c) and [c, 2c) of every sample). Real
tokens sit at the start of each padded sequence, so the real tokens of chunk j are its first
``clamp(real_b - j*c_b, 0, c_b)`` and, on every rank, the real local tokens of a sequence are a
prefix of its 2*c_b local rows (chunk r precedes chunk 2*cp-1-r globally).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from coreattn.layers.context_parallel.indices import zigzag_positions


class CPLayout(NamedTuple):
    fmt: str  # "thd" | "sbhd"
    cp_size: int
    cp_rank: int
    n_local: int  # local tokens (thd) or local sequence length (sbhd)
    chunk: torch.Tensor  # [B] int64: c_b
    real: torch.Tensor  # [B] int64: real tokens of sequence b
    local_start: torch.Tensor  # [B] int64: first local row of sequence b (sbhd: 0)
    global_start: torch.Tensor  # [B] int64: first row of sequence b in the global layout (sbhd: 0)
    gid_start: torch.Tensor  # [B] int64: dropout token id of sequence b's first token (sbhd: b * S)
    max_seqlen: int  # bound on every padded sequence length (sizes nothing in the kernels)
    positions: torch.Tensor  # cu_seqlens_padded (thd) or [0, S] (sbhd): for _zigzag_positions

    @property
    def batch(self) -> int:
        return self.chunk.numel()

    @property
    def max_chunk(self) -> int:
        return -(-self.max_seqlen // (2 * self.cp_size))

    def chunk_real(self, j: int) -> torch.Tensor:
        """[B] int64: real tokens of global chunk j of each sequence."""
        return (self.real - j * self.chunk).clamp(min=0).minimum(self.chunk)


def make_layout(fmt: str, cp_size: int, cp_rank: int, n_local: int, *, real: torch.Tensor,
                cu_seqlens_padded: torch.Tensor | None = None, batch: int = 1, max_seqlen: int = 0) -> CPLayout:
    """thd: ``cu_seqlens_padded`` global int32 [B+1], ``real`` [B]; sbhd: ``batch`` samples of
    n_local * cp_size positions, ``real`` [B]. Inputs already checked; no host sync."""
    real = real.long()
    if fmt == "thd":
        pad = cu_seqlens_padded.long()
        start = pad[:-1]
        chunk = (pad[1:] - start) // (2 * cp_size)
        return CPLayout(fmt, cp_size, cp_rank, n_local, chunk, real, start // cp_size, start, start, max_seqlen,
                        cu_seqlens_padded)
    seqlen = n_local * cp_size
    device = real.device
    chunk = torch.full((batch,), seqlen // (2 * cp_size), dtype=torch.long, device=device)
    zero = torch.zeros_like(chunk)
    sample_ids = torch.arange(batch, dtype=torch.long, device=device) * seqlen
    positions = torch.full((2,), seqlen, dtype=torch.int32, device=device)  # [0, S]: one sequence
    positions[0] = 0
    return CPLayout(fmt, cp_size, cp_rank, n_local, chunk, real, zero, zero, sample_ids, seqlen, positions)


def global_orders(layout: CPLayout, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gather_order, scatter_order), int64 [group_size * n_local], between an all-to-all group's
    rank-major buffer and the layout that group holds together.

    The group is ``group_size`` consecutive cp ranks, those of ``layout.cp_rank`` (Megatron's
    hierarchical cp: cp rank = p2p rank * a2a size + a2a rank). Together they hold chunks
    [R*a, R*a + a) and their mirrors, i.e. the zig-zag layout at cp / a for rank R = cp_rank // a:
    super-chunk R, then super-chunk 2*(cp/a)-1-R (Transformer Engine's reorder before attention).
    ``group_size`` None or cp: the whole group, whose layout is the global order. The buffer read at
    ``gather_order`` is in that layout's local order; its rows read at ``scatter_order`` are rank-major."""
    cp = layout.cp_size
    size = cp if group_size is None else group_size
    first = layout.cp_rank // size * size
    device = layout.positions.device
    ranks = torch.arange(first, first + size, device=device)
    held = zigzag_positions(layout.positions, cp, ranks, layout.n_local).reshape(-1)  # buffer row -> global
    if size == cp:  # the global order: invert by a scatter
        gather_order = torch.empty_like(held).scatter_(0, held, torch.arange(held.numel(), device=device))
        return gather_order, held
    outer = torch.full((1,), first // size, device=device)
    target = zigzag_positions(layout.positions, cp // size, outer, layout.n_local * size)[0]  # row -> global
    ordered, rows = held.sort()
    gather_order = rows.index_select(0, torch.searchsorted(ordered, target))
    scatter_order = torch.empty_like(gather_order).scatter_(
        0, gather_order, torch.arange(gather_order.numel(), device=device))
    return gather_order, scatter_order


def group_layout(layout: CPLayout, group_size: int) -> CPLayout:
    """The zig-zag layout at cp / group_size that ``group_size`` consecutive cp ranks hold together
    (see ``global_orders``): rank cp_rank // group_size, n_local * group_size local rows."""
    if layout.fmt == "thd":
        kw = dict(cu_seqlens_padded=layout.positions, max_seqlen=layout.max_seqlen)
    else:
        kw = dict(batch=layout.batch)
    return make_layout(layout.fmt, layout.cp_size // group_size, layout.cp_rank // group_size,
                       layout.n_local * group_size, real=layout.real, **kw)
