"""The mask and packing utilities behind ``coreattn.masks``, vectorized and free of host syncs where possible.

Owns: ``lengths.py`` (lengths, cu_seqlens, spans, per-token position and sequence ids, lengths
aligned for Megatron's parallelism), ``padding.py`` (differentiable ``unpad`` / ``pad``, Triton
gather/scatter on CUDA), ``formats.py`` (keep masks from Megatron's 4D masks and back, Ascend's
compressed causal mask), ``checks.py`` (their argument and value checks: values are read on CPU
tensors, or on a device with COREATTN_VALIDATE=1). The context-parallel index utilities that
``coreattn.masks`` also exports live with context parallelism (``coreattn.layers.context_parallel.indices``).

May import: torch, ``coreattn.kernels`` (the mask kernels) and ``coreattn.layers.checks``; nothing
from the backends, context parallelism or adapters, so every one of them may use it.
"""

from coreattn.layers.masks.formats import keep_mask_from_4d, megatron_mask_from_keep_mask, npu_compressed_causal_mask
from coreattn.layers.masks.lengths import (AlignedSeqlens, KeepSpans, align_seqlens, cu_seqlens_from_seqlens,
                                           padding_mask_from_seqlens, position_ids_from_cu_seqlens,
                                           seqlens_from_cu_seqlens, seqlens_from_padding_mask,
                                           sequence_ids_from_cu_seqlens, spans_from_keep_mask)
from coreattn.layers.masks.padding import Unpadded, pad, unpad

__all__ = [
    "AlignedSeqlens",
    "KeepSpans",
    "Unpadded",
    "align_seqlens",
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
