"""The torch backend's block mode: prepared block rows read as the token rows they stand for.

In the sparse op's block mode an index entry names a block of B contiguous keys; the prepared rows
(``coreattn.kernels.sparse_blocks``) hold the key row each named block starts at, ``[N, Hidx, K]``.
``BlockRows`` wraps them so that the torch backend's planner and both of its paths index them as
they index token rows (``rows[n0:n1]``, ``rows[n0:n1, h:h + 1]``, ``rows[n, h]`` with index tensors,
``rows.shape``): each indexed row comes back with its K blocks expanded to their K x B key rows
(``start + 0 .. start + B - 1``; -1 for an unused entry), in int64, for the rows asked for only. The
whole ``[N, Hidx, K x B]`` never exists: the planner and the paths take a chunk of tokens at a time
under their byte budgets. Keys of a named block outside the token's bounds are masked there as any
entry is; blocks do not overlap, so no key is named twice.
"""

from __future__ import annotations

import torch


class BlockRows:
    """Prepared block rows ``starts`` ``[N, Hidx, K]`` (int32, -1 unused) of ``block_size`` keys each, as
    token rows ``[N, Hidx, K * block_size]`` (see the module docstring)."""

    def __init__(self, starts: torch.Tensor, block_size: int):
        self.starts, self.block_size = starts, block_size
        n, heads, n_slots = starts.shape
        self.shape = torch.Size((n, heads, n_slots * block_size))
        self.device, self.dtype = starts.device, torch.int64

    def __getitem__(self, key) -> torch.Tensor:
        start = self.starts[key].to(torch.int64)  # [..., K]
        keys = start[..., None] + torch.arange(self.block_size, device=start.device)  # [..., K, B]
        return torch.where(start[..., None] >= 0, keys, -1).flatten(-2)
