"""Autograd Functions, the public functional API and the torch reference backend."""

from coreattn.layers.context_parallel import cp_attn
from coreattn.layers.padded_attn import padded_attn
from coreattn.layers.varlen_attn import flash_attn_varlen_func, varlen_attn

__all__ = ["varlen_attn", "flash_attn_varlen_func", "padded_attn", "cp_attn"]
