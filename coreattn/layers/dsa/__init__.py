"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): top-k sparse attention and the lightning indexer.

Owns: ``sparse_attn.py`` (the public functions ``sparse_varlen_attn``, ``sparse_padded_attn``: each
query attends only to the keys its index row names, intersected with its sequence and causality),
``sparse_function.py`` (their custom ops ``coreattn::sparse_attn_fwd`` / ``_bwd`` with autograd, the
index preparation and key bounds on the device, the backend choice when the op runs),
``indexer/`` (the indexer's top-k, its loss and the Hadamard rotation: ``indexer_topk``,
``indexer_loss``, ``indexer_topk_and_loss``, ``hadamard_transform``, ``rotate_activation``) and
``core_dsa_attention.py`` (``CoreDSAttention``: Megatron-Core's ``DSAttention`` with its sparse
attention, indexer top-k, indexer loss and rotation on coreattn; megatron-core is imported only
there, on first use). The kernels are coreattn/kernels/sparse_*.py, indexer_topk.py and
hadamard.py; the torch backends coreattn/layers/torch_backend/sparse.py, indexer_topk.py,
indexer_loss.py and hadamard.py; the npu_fused mappings onto torch_npu's DSA operators
coreattn/layers/npu_fused/sparse.py and indexer.py. See docs/dsa.md.

May import: torch, megatron-core (``core_dsa_attention.py`` only), ``coreattn.kernels``,
``coreattn.layers.dsa``, ``coreattn.layers.backends``, ``coreattn.layers.checks``,
``coreattn.layers.core_attention`` (the backend pin CoreAttention reads from the config),
``coreattn.layers.torch_backend`` and ``coreattn.layers.npu_fused``.
"""

from coreattn.layers.dsa.indexer import (hadamard_transform, indexer_loss, indexer_topk, indexer_topk_and_loss,
                                         rotate_activation)
from coreattn.layers.dsa.sparse_attn import sparse_padded_attn, sparse_varlen_attn

__all__ = ["sparse_varlen_attn", "sparse_padded_attn", "indexer_topk", "indexer_loss", "indexer_topk_and_loss",
           "hadamard_transform", "rotate_activation", "CoreDSAttention"]


def __getattr__(name):
    # CoreDSAttention subclasses Megatron's DSAttention: import megatron-core only when asked for.
    if name == "CoreDSAttention":
        from coreattn.layers.dsa.core_dsa_attention import CoreDSAttention

        return CoreDSAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
