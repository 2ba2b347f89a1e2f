"""The mask and packing utilities behind ``coreattn.masks``, vectorized and free of host syncs where possible.

Owns: ``utils.py`` (the utilities), ``padding.py`` (differentiable unpad / pad, Triton
gather/scatter on CUDA), ``checks.py`` (their argument and value checks).

May import: torch, ``coreattn.kernels`` (the mask kernels) and ``coreattn.layers.checks``;
nothing from the backends, context parallelism or adapters.
"""

from coreattn.layers.masks.utils import (
    AlignedSeqlens,
    KeepSpans,
    Unpadded,
    align_seqlens,
    cp_partition_indices,
    cp_partition_indices_sbhd,
    cp_shard,
    cp_unshard,
    cu_seqlens_from_seqlens,
    keep_mask_from_4d,
    megatron_mask_from_keep_mask,
    npu_compressed_causal_mask,
    pad,
    padding_mask_from_seqlens,
    position_ids_from_cu_seqlens,
    seqlens_from_cu_seqlens,
    seqlens_from_padding_mask,
    sequence_ids_from_cu_seqlens,
    spans_from_keep_mask,
    unpad,
)

__all__ = [
    "AlignedSeqlens",
    "KeepSpans",
    "Unpadded",
    "align_seqlens",
    "cp_partition_indices",
    "cp_partition_indices_sbhd",
    "cp_shard",
    "cp_unshard",
    "cu_seqlens_from_seqlens",
    "keep_mask_from_4d",
    "megatron_mask_from_keep_mask",
    "npu_compressed_causal_mask",
    "pad",
    "padding_mask_from_seqlens",
    "position_ids_from_cu_seqlens",
    "seqlens_from_cu_seqlens",
    "seqlens_from_padding_mask",
    "sequence_ids_from_cu_seqlens",
    "spans_from_keep_mask",
    "unpad",
]
