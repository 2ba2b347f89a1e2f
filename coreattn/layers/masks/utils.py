"""Attention-mask and packing utilities, vectorized and free of host syncs where possible.

Conventions, spelled out in every name:
- a *keep mask* is True (or 1) where a token takes part (the HF ``attention_mask`` [B, S]);
- a *Megatron mask* is True where attention is masked out (Megatron-Core, TE, Ascend
  ``npu_fusion_attention``'s ``atten_mask``).
Every function that takes a mask accepts bool and integer (0/1) masks. cu_seqlens are int32
[B+1] starting at 0 (flash-attn's varlen ABI).

Host syncs: nothing here reads device values unless documented. Checks that need values run
when the tensors are on the CPU (free) or when COREATTN_VALIDATE=1 (a sync on a device).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from coreattn.kernels.masks import token_ids
from coreattn.layers.masks.checks import (
    check_cu_seqlens, check_int, check_keep_mask, check_mask_values, check_seqlens, check_tensor, reads_values,
)
from coreattn.layers.masks.padding import PadFunction, UnpadFunction, use_triton

NPU_COMPRESSED_MASK_SIZE = 2048
CONVENTIONS = ("megatron", "keep")


class KeepSpans(NamedTuple):
    """Each sample's contiguous run of kept tokens: positions [start, start + length)."""

    start: torch.Tensor  # [B] int32
    length: torch.Tensor  # [B] int32


class Unpadded(NamedTuple):
    """Result of ``unpad``: flash-attn's varlen inputs."""

    x_packed: torch.Tensor  # [total, ...]
    indices: torch.Tensor  # [total] int64, flat indices into the [B*S] rows of x
    cu_seqlens: torch.Tensor  # [B+1] int32
    max_seqlen: int


class AlignedSeqlens(NamedTuple):
    """Lengths padded for Megatron sequence/context parallelism (PackedSeqParams' fields)."""

    seqlens: torch.Tensor  # [B] int32, the real lengths
    seqlens_padded: torch.Tensor  # [B] int32, each a multiple of ``multiple``
    cu_seqlens: torch.Tensor  # [B+1] int32, cumulative real lengths
    cu_seqlens_padded: torch.Tensor  # [B+1] int32, cumulative padded lengths
    multiple: int


def _keep_bool(keep_mask: torch.Tensor) -> torch.Tensor:
    return keep_mask if keep_mask.dtype == torch.bool else keep_mask != 0


def padding_mask_from_seqlens(seqlens: torch.Tensor, max_len: int, *, left_padding: bool = False) -> torch.Tensor:
    """Keep mask [B, max_len] bool, True on each sample's first ``seqlens[b]`` positions.

    Replaces ``for i, n in enumerate(seqlens): mask[i, :n] = True`` with one broadcast compare on
    ``seqlens``' device; no host sync. ``left_padding=True`` puts the kept tokens at the end of
    each row instead. seqlens: 1D integer tensor; lengths must lie in [0, max_len] (checked when
    seqlens is on the CPU or COREATTN_VALIDATE=1).
    """
    max_len = check_int("max_len", max_len)
    check_seqlens("seqlens", seqlens, max_len)
    if not isinstance(left_padding, bool):
        raise TypeError(f"left_padding must be a bool, got {type(left_padding).__name__}")
    lens = seqlens.long()  # uint8/int8 lengths would wrap in `max_len - lens`
    pos = torch.arange(max_len, device=seqlens.device)  # [S]
    if left_padding:
        return pos[None, :] >= (max_len - lens)[:, None]
    return pos[None, :] < lens[:, None]


def cu_seqlens_from_seqlens(seqlens: torch.Tensor) -> torch.Tensor:
    """int32 cu_seqlens [B+1] = [0, cumsum(seqlens)] for 1D integer seqlens [B]; no host sync."""
    check_seqlens("seqlens", seqlens)
    cu = torch.zeros(seqlens.numel() + 1, dtype=torch.int32, device=seqlens.device)
    torch.cumsum(seqlens, dim=0, dtype=torch.int32, out=cu[1:])
    return cu


def seqlens_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int32 lengths [B] = cu_seqlens[1:] - cu_seqlens[:-1]; no host sync."""
    check_cu_seqlens("cu_seqlens", cu_seqlens)
    return (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)


def _holes(keep: torch.Tensor, start: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """[B] bool: the kept tokens of a row are not one contiguous run."""
    pos = torch.arange(keep.shape[1], device=keep.device)
    last = torch.where(keep, pos, -1).amax(dim=1)
    return (length > 0) & (last - start + 1 != length)


def _raise_on_holes(name: str, holes: torch.Tensor) -> None:
    if bool(holes.any()):
        rows = holes.nonzero().flatten().tolist()
        raise ValueError(f"{name} has holes (kept tokens that are not one contiguous run) in rows {rows[:8]}; "
                         "only right- or left-padded masks have a span")


def spans_from_keep_mask(keep_mask: torch.Tensor, *, check: bool = False) -> KeepSpans:
    """Each sample's contiguous span of kept tokens (right or left padding) as int32 start and length.

    keep_mask: [B, S] keep mask (True/1 = token takes part), bool or integer. An empty row gets
    start 0, length 0. A row with holes (kept tokens that are not one run, e.g. 1 0 1) has no
    span: on the CPU that raises ValueError; on a device the check needs the values, so by default
    nothing syncs and such a row comes back as start = first kept position, length = number of
    kept tokens (which then does not describe the row). ``check=True`` (or COREATTN_VALIDATE=1)
    syncs and raises instead.
    """
    check_keep_mask("keep_mask", keep_mask)
    keep = _keep_bool(keep_mask)
    batch, seqlen = keep.shape
    length = keep.sum(dim=1, dtype=torch.int32)
    if seqlen == 0:
        start = torch.zeros(batch, dtype=torch.int32, device=keep.device)
        return KeepSpans(start, length)
    pos = torch.arange(seqlen, device=keep.device)
    start = torch.where(keep, pos, seqlen).amin(dim=1)
    start = torch.where(length > 0, start, 0).to(torch.int32)
    if check or reads_values(keep):
        _raise_on_holes("keep_mask", _holes(keep, start, length))
    return KeepSpans(start, length)


def seqlens_from_padding_mask(keep_mask: torch.Tensor, *, contiguous: bool = False) -> torch.Tensor:
    """int32 lengths [B]: the number of kept tokens per row of a [B, S] keep mask (bool or 0/1 int).

    Right and left padding give the same lengths. No host sync by default. ``contiguous=True``
    asks for contiguous spans (what a caller that slices ``x[b, :len]`` or uses spans assumes):
    rows whose kept tokens are not one run (holes) then raise ValueError, which reads the mask (a
    host sync on a device).
    """
    check_keep_mask("keep_mask", keep_mask)
    if contiguous:
        return spans_from_keep_mask(keep_mask, check=True).length
    return _keep_bool(keep_mask).sum(dim=1, dtype=torch.int32)


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
    keep = _keep_bool(keep_mask)
    batch, seqlen = keep.shape
    seqlens = keep.sum(dim=1, dtype=torch.int32)  # [B]
    flat = keep.reshape(-1)  # [B*S]
    if total is not None:
        total = check_int("total", total)
    if max_seqlen is not None:
        max_seqlen = check_int("max_seqlen", max_seqlen)
    if total is None or max_seqlen is None or reads_values(flat):
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
    if reads_values(indices) and indices.numel() > 0:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= n_rows:
            raise ValueError(f"indices must lie in [0, batch*seqlen = {n_rows}), got [{lo}, {hi}]")
        if bool((torch.bincount(indices, minlength=n_rows) > 1).any()):  # O(n) where unique would sort
            raise ValueError("indices must be unique")
    if not use_triton(x_packed.device):
        indices = indices.long()  # the torch path indexes with int64
    rows = PadFunction.apply(x_packed, indices, n_rows)
    return rows.reshape((batch, seqlen) + tuple(x_packed.shape[1:]))


def _token_count(cu_seqlens: torch.Tensor, total: int | None) -> int:
    if total is None:
        return int(cu_seqlens[-1])
    total = check_int("total", total)
    if reads_values(cu_seqlens) and int(cu_seqlens[-1]) > total:
        raise ValueError(f"total = {total} is smaller than cu_seqlens[-1] = {int(cu_seqlens[-1])}")
    return total


def _token_ids(cu_seqlens, total, pos_dtype, seq_dtype):
    check_cu_seqlens("cu_seqlens", cu_seqlens)
    total = _token_count(cu_seqlens, total)
    cu = cu_seqlens.to(torch.int32)
    if use_triton(cu.device):
        return token_ids(cu, total, pos_dtype, seq_dtype)
    t = torch.arange(total, dtype=torch.int32, device=cu.device)
    seq = torch.searchsorted(cu, t, right=True, out_int32=True) - 1  # [total], in [0, B]
    pos = (t - cu[seq]).to(pos_dtype) if pos_dtype is not None else None
    return pos, seq.to(seq_dtype) if seq_dtype is not None else None


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int | None = None, *,
                                 dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Per-token position within its sequence, [total]: 0..len-1 for each packed sequence (RoPE ids).

    cu_seqlens: [B+1] integer, starting at 0. ``total`` (a Python int >= cu_seqlens[-1]) sizes the
    output; without it, reading cu_seqlens[-1] is a host sync on a device. Tokens past
    cu_seqlens[-1] (a padded tail) count 0, 1, ... as one more sequence. Triton kernel on CUDA.
    """
    return _token_ids(cu_seqlens, total, dtype, None)[0]


def sequence_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int | None = None, *,
                                 dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Per-token sequence index b in [0, B), [total] (Mamba/Megatron ``seq_idx``).

    Same arguments and sync rule as ``position_ids_from_cu_seqlens``; tokens past
    cu_seqlens[-1] get index B. Triton kernel on CUDA.
    """
    return _token_ids(cu_seqlens, total, None, dtype)[1]


def align_seqlens(seqlens: torch.Tensor, tp_size: int = 1, cp_size: int = 1) -> AlignedSeqlens:
    """Pad each length up to a multiple of lcm(tp_size, 2*cp_size) if cp_size > 1, else tp_size.

    That is what Megatron needs: sequence parallelism splits tokens over tp ranks, context
    parallelism splits each sequence into 2*cp chunks. Empty sequences stay empty. Returns
    ``AlignedSeqlens(seqlens, seqlens_padded, cu_seqlens, cu_seqlens_padded, multiple)``, the
    tensors int32 on seqlens' device (for PackedSeqParams' cu_seqlens_q and cu_seqlens_q_padded).
    No host sync.
    """
    tp_size = check_int("tp_size", tp_size, minimum=1)
    cp_size = check_int("cp_size", cp_size, minimum=1)
    check_seqlens("seqlens", seqlens)
    multiple = math.lcm(tp_size, 2 * cp_size) if cp_size > 1 else tp_size
    lens = seqlens.to(torch.int32)
    padded = (lens + (multiple - 1)) // multiple * multiple
    return AlignedSeqlens(lens, padded, cu_seqlens_from_seqlens(lens), cu_seqlens_from_seqlens(padded), multiple)


def _zigzag_positions(cu_seqlens_padded: torch.Tensor, cp_size: int, ranks: torch.Tensor, n_local: int) -> torch.Tensor:
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
    total = _token_count(cu_seqlens_padded, total)
    if reads_values(cu_seqlens_padded):
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
    return _zigzag_positions(cu_seqlens_padded, cp_size, ranks, total // cp_size)[0]


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


def keep_mask_from_4d(mask: torch.Tensor, convention: str) -> torch.Tensor:
    """Recover the [B, S] keep mask (bool) from a 4D attention mask, bool or 0/1 integer.

    mask: ``[B, 1, S, S]`` (read on its diagonal: token i is kept iff it may attend to itself,
    true for padding, padding+causal and HF-style key-padding masks; not for masks whose fully
    masked padding rows were unmasked again, as transformers' SDPA path does for left padding),
    ``[B, 1, 1, S]`` (a key padding mask, read as-is), or an already 2D mask, always read as
    ``[B, S]`` (a 2D ``[S, S]`` attention mask is not a keep mask). convention, required:
    ``"megatron"`` (True/1 = masked out, Megatron/TE/Ascend) or ``"keep"`` (True/1 = attends).
    No host sync on a device. On the CPU (or with COREATTN_VALIDATE=1) an integer mask with
    values other than 0/1, or a result with no kept token at all (usually the wrong convention),
    raises ValueError.
    """
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    check_tensor("mask", mask, (2, 4))
    check_mask_values("mask", mask)
    if mask.dim() == 4:
        if mask.shape[1] != 1:
            raise ValueError(f"mask must be [B, 1, S, S] or [B, 1, 1, S], got shape {tuple(mask.shape)} "
                             "(dim 1 must be 1)")
        if mask.shape[2] == 1:
            rows = mask[:, 0, 0, :]  # [B, S]
        elif mask.shape[2] == mask.shape[3]:
            rows = mask[:, 0].diagonal(dim1=-2, dim2=-1)  # [B, S]
        else:
            raise ValueError(f"mask must be [B, 1, S, S] or [B, 1, 1, S], got shape {tuple(mask.shape)}")
    else:
        rows = mask
    keep = (rows == 0) if convention == "megatron" else (rows != 0)
    if reads_values(keep) and keep.numel() > 0 and not bool(keep.any()):
        raise ValueError(f"mask keeps no token at all under convention={convention!r}; "
                         "check the convention (megatron: True = masked out; keep: True = attends)")
    return keep


def megatron_mask_from_keep_mask(keep_mask: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Dense Megatron mask [B, 1, S, S] bool (True = masked out) from a [B, S] keep mask.

    Entry (i, j) is False iff tokens i and j are both kept (and j <= i when ``causal``, top-left
    aligned). Rows of padded queries are fully masked. This allocates O(B*S^2) bytes (128 MiB at
    B=8, S=4096): build it only for a kernel that truly needs a dense mask; varlen kernels take
    cu_seqlens, and Ascend's causal modes take ``npu_compressed_causal_mask``. No host sync.
    """
    check_keep_mask("keep_mask", keep_mask)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    drop = ~_keep_bool(keep_mask)
    # built as "i dropped or j dropped (or j > i)", in place: one [B, 1, S, S] allocation
    masked = drop[:, None, :, None] | drop[:, None, None, :]
    if causal:
        seqlen = drop.shape[1]
        masked |= torch.ones(seqlen, seqlen, dtype=torch.bool, device=drop.device).triu_(1)
    return masked


@functools.lru_cache(maxsize=None)
def _npu_compressed_causal_mask(device: torch.device) -> torch.Tensor:
    n = NPU_COMPRESSED_MASK_SIZE
    return torch.triu(torch.ones(n, n, dtype=torch.bool, device=device), diagonal=1)


def npu_compressed_causal_mask(device) -> torch.Tensor:
    """The 2048x2048 bool ``triu(ones, diagonal=1)`` mask (True = masked out) that Ascend's
    ``npu_fusion_attention`` takes with sparse_mode 2, 3 or 4, cached per device.

    The same tensor is returned on every call for a device: do not modify it in place.
    """
    # a tensor's device always carries an index: "npu" and "npu:0" share one cached mask, and an
    # index-less device means the current one at this call, not at the first
    return _npu_compressed_causal_mask(torch.empty(0, device=device).device)
