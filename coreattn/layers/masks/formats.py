"""Dense mask formats: a [B, S] keep mask from Megatron's 4D masks and back, and Ascend's compressed causal mask.

A keep mask is True (or 1) where a token takes part; a Megatron mask is True where attention is
masked out. Nothing here reads device values unless documented.
"""

from __future__ import annotations

import functools

import torch

from coreattn.layers.masks import checks
from coreattn.layers.masks.checks import check_keep_mask, check_mask_values, check_tensor, keep_bool

NPU_COMPRESSED_MASK_SIZE = 2048



CONVENTIONS = ("megatron", "keep")



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
    if checks.reads_values(keep) and keep.numel() > 0 and not bool(keep.any()):
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
    drop = ~keep_bool(keep_mask)
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

