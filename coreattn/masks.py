"""Public mask and packing utilities (keep masks: True = token takes part; Megatron masks: True = masked out).

See coreattn.layers.masks for the conventions and the host-sync rules; the context-parallel index
utilities come from coreattn.layers.context_parallel.indices.
"""

from coreattn.layers.context_parallel.indices import cp_partition_indices, cp_partition_indices_sbhd, cp_shard, cp_unshard
from coreattn.layers.masks import (
    AlignedSeqlens,
    KeepSpans,
    Unpadded,
    align_seqlens,
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
