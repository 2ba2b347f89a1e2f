"""Which global tokens a context-parallel rank holds (Megatron's zig-zag), and sharding by them.

Each sequence, padded to a multiple of 2*cp, is cut into 2*cp chunks; rank r holds chunks r and
2*cp-1-r. These are public through ``coreattn.masks``; ``zigzag_positions`` also gives the
exchanges (attention.py, layout.py) the positions of every rank at once. Vectorized, no loop over
sequences; nothing reads device values unless documented.
"""

from __future__ import annotations

import torch

from coreattn.layers.masks import checks
from coreattn.layers.masks.checks import check_cu_seqlens, check_int, check_tensor
from coreattn.layers.masks.lengths import token_count


def zigzag_positions(cu_seqlens_padded: torch.Tensor, cp_size: int, ranks: torch.Tensor, n_local: int) -> torch.Tensor:
    """[R, n_local] int64: the global (padded) token positions that each rank in ``ranks`` holds, in
    its local order (Megatron/TE zig-zag). Vectorized; no host sync; assumes checked inputs."""
    cu = cu_seqlens_padded.long()
    local_cu = cu // cp_size  # [B+1]: sequence b's local tokens are [local_cu[b], local_cu[b+1])
    t = torch.arange(n_local, device=cu.device)
    # right=True skips empty sequences; the clamp only guards unchecked inputs from reading past B
    b = (torch.searchsorted(local_cu, t, right=True) - 1).clamp(0, max(cu.numel() - 2, 0))  # [n_local]
    offset = t - local_cu[b]
    chunk = (cu[b + 1] - cu[b]) // (2 * cp_size)
    second = offset >= chunk  # the local token belongs to the second (mirrored) chunk
    within = offset - torch.where(second, chunk, 0)
    r = ranks.long().to(cu.device)[:, None]  # [R, 1]
    j = torch.where(second, 2 * cp_size - 1 - r, r)  # [R, n_local] global chunk index
    return cu[b] + j * chunk + within



def _check_cp_rank(cp_size, cp_rank) -> tuple[int, int]:
    cp_size = check_int("cp_size", cp_size, minimum=1)
    cp_rank = check_int("cp_rank", cp_rank)
    if cp_rank >= cp_size:
        raise ValueError(f"cp_rank = {cp_rank} must be < cp_size = {cp_size}")
    return cp_size, cp_rank



def cp_partition_indices(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int, *,
                         total: int | None = None) -> torch.Tensor:
    """Global token positions that context-parallel rank ``cp_rank`` holds, in its local order (thd).

    Megatron/TE layout: each sequence b (padded length L_b, a multiple of 2*cp_size) is cut into
    2*cp_size chunks of L_b / (2*cp_size) tokens; rank r holds chunks r and 2*cp_size-1-r, in that
    order, sequence after sequence, so its tokens of sequence b sit at local offsets
    ``cu_seqlens_padded[b] / cp_size`` onwards (TE's ``thd_get_partitioned_indices``).
    ``x_local = x_global.index_select(0, idx)`` (``cp_shard``) prepares a rank's input.

    cu_seqlens_padded: integer [B+1], global, starting at 0. ``total`` is cu_seqlens_padded[-1]
    (the global padded token count); without it, reading it is a host sync on a device.
    Returns int64 [total / cp_size]. Vectorized, no loop over sequences. Lengths that are not
    multiples of 2*cp_size raise ValueError on the CPU (or with COREATTN_VALIDATE=1).
    """
    check_cu_seqlens("cu_seqlens_padded", cu_seqlens_padded)
    cp_size, cp_rank = _check_cp_rank(cp_size, cp_rank)
    total = token_count(cu_seqlens_padded, total)
    if checks.reads_values(cu_seqlens_padded):
        if int(cu_seqlens_padded[-1]) != total:
            raise ValueError(f"total = {total} but cu_seqlens_padded[-1] = {int(cu_seqlens_padded[-1])}")
        if cp_size > 1:
            lens = cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]
            bad = (lens % (2 * cp_size)) != 0
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                raise ValueError(f"cu_seqlens_padded: sequence {i} has length {int(lens[i])}, not a multiple of "
                                 f"2 * cp_size = {2 * cp_size}")
    if total % cp_size:
        raise ValueError(f"total = {total} tokens do not split over cp_size = {cp_size} ranks")
    if cp_size == 1:
        return torch.arange(total, device=cu_seqlens_padded.device)
    ranks = torch.full((1,), cp_rank, device=cu_seqlens_padded.device)  # a fill, not a host copy
    return zigzag_positions(cu_seqlens_padded, cp_size, ranks, total // cp_size)[0]



def cp_partition_indices_sbhd(seqlen: int, cp_size: int, cp_rank: int, *,
                              device: torch.device | str | None = None) -> torch.Tensor:
    """Positions along the sequence dim that rank ``cp_rank`` holds when every sample has length
    ``seqlen`` (sbhd/bshd, Megatron's ``get_batch_on_this_cp_rank``): chunks r and 2*cp_size-1-r
    of 2*cp_size. Returns int64 [seqlen / cp_size]; seqlen must be a multiple of 2*cp_size."""
    seqlen = check_int("seqlen", seqlen)
    cp_size, cp_rank = _check_cp_rank(cp_size, cp_rank)
    if cp_size == 1:
        return torch.arange(seqlen, device=device)
    if seqlen % (2 * cp_size):
        raise ValueError(f"seqlen = {seqlen} must be a multiple of 2 * cp_size = {2 * cp_size}")
    chunk = seqlen // (2 * cp_size)
    pos = torch.arange(chunk, device=device)
    return torch.cat([cp_rank * chunk + pos, (2 * cp_size - 1 - cp_rank) * chunk + pos])



def cp_shard(x: torch.Tensor, indices: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """This rank's part of a global tensor: ``x.index_select(dim, indices)`` (differentiable), with
    indices from ``cp_partition_indices`` (thd: dim 0) or ``cp_partition_indices_sbhd`` (sbhd: dim 0,
    bshd: dim 1)."""
    check_tensor("indices", indices, (1,))
    return x.index_select(dim, indices.long())



def cp_unshard(shards, indices, dim: int = 0, *, size: int | None = None) -> torch.Tensor:
    """Inverse of ``cp_shard`` over all ranks: the global tensor from every rank's shard and indices
    (lists in rank order). ``size`` is the global length along ``dim`` (default: the largest index
    + 1, a host sync on a device). Positions no rank holds are zeros. Differentiable."""
    shards, indices = list(shards), list(indices)
    if not shards or len(shards) != len(indices):
        raise ValueError(f"need one index tensor per shard, got {len(shards)} shards and {len(indices)} index tensors")
    src = torch.cat(shards, dim=dim)
    idx = torch.cat([i.long() for i in indices])
    if idx.numel() != src.shape[dim]:
        raise ValueError(f"the indices cover {idx.numel()} positions but the shards have {src.shape[dim]}")
    if size is None:
        size = int(idx.max()) + 1 if idx.numel() else 0
    size = check_int("size", size)
    shape = list(src.shape)
    shape[dim] = size
    return src.new_zeros(shape).index_copy(dim, idx, src)

