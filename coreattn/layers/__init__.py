"""The attention ops and everything built on them: the public functions, the backends, context parallelism, the masks.

The root holds the public functions of dense attention (``varlen_attn.py``: ``varlen_attn``,
``flash_attn_varlen_func``; ``padded_attn.py``), the argument checks (``checks.py``, sparse
attention's included), the attention custom ops with their autograd (``function.py``), which backend
runs a call (``backends.py``: the registry per device; ``dispatch.py``: the call into it) and
Megatron-Core's dense core attention (``core_attention.py``). Subpackages, one per concern:
``dsa/`` (DeepSeek Sparse Attention: top-k sparse attention, the lightning indexer, Megatron's
DSAttention on coreattn), ``torch_backend/`` (attention in torch ops, CPU and any device),
``npu_fused/`` (Ascend's fused op), ``context_parallel/`` (``cp_attn`` and its exchanges),
``masks/`` (the utilities behind ``coreattn.masks``), ``bias/`` (the relative-position biases
the dense attention functions take, computed in registers). Each subpackage's docstring says what
it may import.

May import: torch, ``coreattn.kernels`` and megatron-core (``core_attention.py`` and
``dsa/core_dsa_attention.py`` only, on first use of ``CoreAttention`` / ``CoreDSAttention``); nothing
from ``coreattn.adapters`` or ``coreattn.selfcheck``.
"""

from coreattn.layers.context_parallel import cp_attn
from coreattn.layers.padded_attn import padded_attn
from coreattn.layers.dsa import sparse_padded_attn, sparse_varlen_attn
from coreattn.layers.varlen_attn import flash_attn_varlen_func, varlen_attn

__all__ = ["varlen_attn", "flash_attn_varlen_func", "padded_attn", "cp_attn", "sparse_varlen_attn", "sparse_padded_attn",
           "CoreAttention", "CoreDSAttention"]


def __getattr__(name):
    # CoreAttention and CoreDSAttention subclass Megatron's modules: import megatron-core only when asked for.
    if name == "CoreAttention":
        from coreattn.layers.core_attention import CoreAttention

        return CoreAttention
    if name == "CoreDSAttention":
        from coreattn.layers.dsa.core_dsa_attention import CoreDSAttention

        return CoreDSAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
