"""Runs checked attention arguments on the selected backend (shared by the public functions)."""

from __future__ import annotations

import torch

from coreattn.adapters.backends import Backend, select_backend
from coreattn.kernels.packing import Packing
from coreattn.layers.checks import KERNEL_DTYPES, VarlenParams
from coreattn.layers.function import VarlenAttnFunction
from coreattn.layers.torch_backend import attn_torch


def run_attention(q, k, v, q_pack: Packing, k_pack: Packing, max_seqlen_q: int, max_seqlen_k: int,
                  params: VarlenParams, deterministic: bool, backend) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse); lse is never differentiable, so callers may backpropagate through out alone.
    The npu_fused backend returns no lse (None); see coreattn.layers.npu_backend."""
    chosen = select_backend(q.device, backend)
    if chosen is Backend.TORCH:
        out, lse = attn_torch(q, k, v, q_pack, k_pack, params)
        return out, lse.detach()
    if chosen is Backend.NPU_FUSED:
        from coreattn.layers.npu_backend import attn_npu_fused

        return attn_npu_fused(q, k, v, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params)
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; the Triton backend supports float16, bfloat16, float32")
    return VarlenAttnFunction.apply(q, k, v, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params, deterministic)
