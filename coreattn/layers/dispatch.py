"""Runs checked attention arguments on the selected backend (shared by the public functions)."""

from __future__ import annotations

import torch

from coreattn.adapters.backends import Backend, select_backend
from coreattn.kernels.packing import Packing
from coreattn.layers import dropout
from coreattn.layers.checks import KERNEL_DTYPES, VarlenParams
from coreattn.layers.function import TORCH, TRITON, AttnFunction, attn_torch  # noqa: F401 (re-exported)


def run_attention(q, k, v, q_pack: Packing, k_pack: Packing, max_seqlen_q: int, max_seqlen_k: int,
                  params: VarlenParams, deterministic: bool, backend, *, softmax_offset: torch.Tensor | None = None,
                  return_max_logit: bool = False, rng_state: torch.Tensor | None = None,
                  generator: torch.Generator | None = None):
    """(out, lse, max_logit). lse and max_logit are never differentiable, so callers may
    backpropagate through out (and softmax_offset) alone; max_logit is None unless asked for. With
    dropout, the RNG state is drawn here from the device's generator (or ``generator``) unless
    given. The npu_fused backend returns no lse (None) and draws its dropout mask with the op's
    own RNG; see coreattn.layers.npu_backend."""
    chosen = select_backend(q.device, backend)
    if chosen is Backend.NPU_FUSED:
        from coreattn.layers.npu_backend import attn_npu_fused

        if softmax_offset is not None or return_max_logit:
            raise NotImplementedError("softmax_offset and return_max_logit are not supported by the npu_fused "
                                      "backend (npu_fusion_attention has no sink logits and returns no max logit); "
                                      "use backend='triton' or 'torch'")
        out, lse = attn_npu_fused(q, k, v, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params)
        return out, lse, None
    if params.dropout_p > 0 and rng_state is None:
        rng_state = dropout.rng_state(q.device, generator)
    if chosen is Backend.TORCH:
        impl = TORCH
    else:
        if q.dtype not in KERNEL_DTYPES:
            raise TypeError(f"q has dtype {q.dtype}; the Triton backend supports float16, bfloat16, float32")
        impl = TRITON
    return AttnFunction.apply(q, k, v, softmax_offset, impl, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params,
                              rng_state, return_max_logit)



def public_result(out, lse, max_logit, return_lse: bool, return_max_logit: bool):
    """What the public functions return: ``out``, then lse if asked for, then max_logit if asked for
    (``(out, lse, max_logit)`` with both; Transformer Engine's ``(out, max_logit)`` without lse)."""
    extra = ((lse,) if return_lse else ()) + ((max_logit,) if return_max_logit else ())
    return (out, *extra) if extra else out
