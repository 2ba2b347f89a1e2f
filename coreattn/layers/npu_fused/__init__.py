"""The ``npu_fused`` backend: Ascend's ``torch_npu.npu_fusion_attention`` behind coreattn's arguments.

Owns: ``attention.py`` (how packed, padded and masked calls map onto the op's layouts,
sparse modes and host lists), ``sparse.py`` (top-k sparse attention on ``npu_sparse_flash_attention``
and its ``_grad``) and ``indexer.py`` (the DSA indexer's top-k on ``npu_lightning_indexer`` and its
sparse loss on ``npu_sparse_lightning_indexer_grad_kl_loss``): each with the documented limits a
call must fit. torch_npu is imported on first use (``coreattn.kernels.npu``).

May import: torch, ``coreattn.kernels`` (packing, Ascend detection), ``coreattn.layers.checks``,
``coreattn.layers.masks``, the torch backend and the attention ops (``coreattn.layers.function``, for what the op cannot express); nothing
from context parallelism or adapters.
"""

from coreattn.layers.npu_fused.attention import attn_npu_dense_mask, attn_npu_fused

__all__ = ["attn_npu_fused", "attn_npu_dense_mask"]
