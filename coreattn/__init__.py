"""coreattn: Triton varlen flash attention for LLM training (Dv may differ from Dqk).

Layers, imports flowing downward: ``kernels/`` (Triton kernels and launchers) <- ``layers/`` (the
attention ops, public functions, backends, context parallelism, masks, the Megatron module) <-
``adapters/`` (Megatron-Core and transformers glue). ``selfcheck/`` runs the correctness cases on
the local device. Each package's docstring says what it owns and may import.
"""

from coreattn import masks
from coreattn.layers.backends import Backend
from coreattn.layers.bias import BucketedRelativeBias, LowRankRelativeBias
from coreattn.layers.context_parallel import cp_attn
from coreattn.layers.dsa.indexer import (hadamard_transform, indexer_loss, indexer_topk, indexer_topk_and_loss,
                                     rotate_activation)
from coreattn.layers.padded_attn import padded_attn
from coreattn.layers.dsa.sparse_attn import sparse_padded_attn, sparse_varlen_attn
from coreattn.layers.varlen_attn import flash_attn_varlen_func, varlen_attn

__version__ = "0.1.0"

__all__ = ["Backend", "masks", "LowRankRelativeBias", "BucketedRelativeBias", "varlen_attn", "flash_attn_varlen_func", "padded_attn", "cp_attn", "sparse_varlen_attn",
           "sparse_padded_attn", "indexer_topk", "indexer_loss", "indexer_topk_and_loss", "hadamard_transform",
           "rotate_activation", "__version__"]
