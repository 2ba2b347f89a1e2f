"""Lengths, cu_seqlens, spans and per-token ids: the conversions between a padded batch and packed sequences.

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

import math
from typing import NamedTuple

import torch

from coreattn.kernels.masks import token_ids
from coreattn.layers.masks import checks, padding
from coreattn.layers.masks.checks import check_cu_seqlens, check_int, check_keep_mask, check_seqlens, keep_bool


class KeepSpans(NamedTuple):
    """Each sample's contiguous run of kept tokens: positions [start, start + length)."""

    start: torch.Tensor  # [B] int32
    length: torch.Tensor  # [B] int32



class AlignedSeqlens(NamedTuple):
    """Lengths padded for Megatron sequence/context parallelism (PackedSeqParams' fields)."""

    seqlens: torch.Tensor  # [B] int32, the real lengths
    seqlens_padded: torch.Tensor  # [B] int32, each a multiple of ``multiple``
    cu_seqlens: torch.Tensor  # [B+1] int32, cumulative real lengths
    cu_seqlens_padded: torch.Tensor  # [B+1] int32, cumulative padded lengths
    multiple: int




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
    keep = keep_bool(keep_mask)
    batch, seqlen = keep.shape
    length = keep.sum(dim=1, dtype=torch.int32)
    if seqlen == 0:
        start = torch.zeros(batch, dtype=torch.int32, device=keep.device)
        return KeepSpans(start, length)
    pos = torch.arange(seqlen, device=keep.device)
    start = torch.where(keep, pos, seqlen).amin(dim=1)
    start = torch.where(length > 0, start, 0).to(torch.int32)
    if check or checks.reads_values(keep):
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
    return keep_bool(keep_mask).sum(dim=1, dtype=torch.int32)



def token_count(cu_seqlens: torch.Tensor, total: int | None) -> int:
    if total is None:
        return int(cu_seqlens[-1])
    total = check_int("total", total)
    if checks.reads_values(cu_seqlens) and int(cu_seqlens[-1]) > total:
        raise ValueError(f"total = {total} is smaller than cu_seqlens[-1] = {int(cu_seqlens[-1])}")
    return total



def _token_ids(cu_seqlens, total, pos_dtype, seq_dtype):
    check_cu_seqlens("cu_seqlens", cu_seqlens)
    total = token_count(cu_seqlens, total)
    cu = cu_seqlens.to(torch.int32)
    if padding.use_triton(cu.device):
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

