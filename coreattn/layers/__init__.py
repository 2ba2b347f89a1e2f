"""Autograd Functions, the public functional API, the torch reference backend and the Megatron module."""

from coreattn.layers.context_parallel import cp_attn
from coreattn.layers.padded_attn import padded_attn
from coreattn.layers.varlen_attn import flash_attn_varlen_func, varlen_attn

__all__ = ["varlen_attn", "flash_attn_varlen_func", "padded_attn", "cp_attn", "CoreAttention"]


def __getattr__(name):
    # CoreAttention subclasses Megatron's MegatronModule: import megatron-core only when asked for.
    if name == "CoreAttention":
        from coreattn.layers.core_attention import CoreAttention

        return CoreAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
