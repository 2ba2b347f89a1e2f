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


def global_orders(layout: CPLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(gather_order, scatter_order), int64 [cp * n_local]: a rank-major buffer (every rank's local
    rows, rank after rank) read at ``gather_order`` is in global order; global rows read at
    ``scatter_order`` are rank-major."""
    ranks = torch.arange(layout.cp_size, device=layout.positions.device)
    scatter_order = zigzag_positions(layout.positions, layout.cp_size, ranks, layout.n_local).reshape(-1)
    gather_order = torch.empty_like(scatter_order).scatter_(
        0, scatter_order, torch.arange(scatter_order.numel(), device=scatter_order.device))
    return gather_order, scatter_order
