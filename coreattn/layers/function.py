"""AttnFunction: autograd over one backend's forward and backward.

Every backend that coreattn differentiates itself implements the same pair (an ``AttnImpl``):

- ``fwd(q, k, v, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params, rng_state, softmax_offset,
  return_max_logit) -> (out, lse, max_logit or None)``: lse float32 includes the softmax offset's
  sink term; max_logit float32 [Hq] when asked for;
- ``bwd(dout, q, k, v, out, lse, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params, rng_state,
  softmax_offset) -> (dq, dk, dv, d_offset)`` from the saved out and lse; d_offset is None without a
  softmax offset. Additive over key sets that share one lse (a context-parallel ring sums them).

Backends: Triton (the kernels' launchers) and torch (coreattn/layers/torch_backend.py). The
softmax offset's gradient is the same torch reduction for both (``softmax_offset_grad``) over
per-row sums of P * dP that each backend accumulates in fp32 (float64 for float64 inputs).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from coreattn.kernels import varlen_attn_bwd, varlen_attn_fwd
from coreattn.kernels.packing import Packing, new_rowstat
from coreattn.layers import dropout
from coreattn.layers.checks import VarlenParams
from coreattn.layers.softmax_offset import softmax_offset_grad
from coreattn.layers.torch_backend import attn_torch_bwd, attn_torch_fwd


class AttnImpl(NamedTuple):
    name: str
    fwd: Callable
    bwd: Callable


def _triton_fwd(q, k, v, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params: VarlenParams, rng_state,
                softmax_offset, return_max_logit):
    res = varlen_attn_fwd(q, k, v, q_pack, k_pack, max_seqlen_q, params.softmax_scale, params.window_left,
                          params.window_right, params.bottom_right, dropout_p=params.dropout_p, rng_state=rng_state,
                          softmax_offset=softmax_offset, return_max_logit=return_max_logit)
    return res if return_max_logit else (*res, None)


def _triton_bwd(dout, q, k, v, out, lse, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params: VarlenParams,
                rng_state, softmax_offset):
    rowsum = None if softmax_offset is None else new_rowstat(q, q_pack, fill=0.0)
    dq, dk, dv = varlen_attn_bwd(dout, q, k, v, out, lse, q_pack, k_pack, max_seqlen_q, max_seqlen_k,
                                 params.softmax_scale, params.window_left, params.window_right, params.bottom_right,
                                 dropout_p=params.dropout_p, rng_state=rng_state, sink_rowsum=rowsum)
    d_offset = None if softmax_offset is None else softmax_offset_grad(softmax_offset, lse, rowsum, q_pack)
    return dq, dk, dv, d_offset


TRITON = AttnImpl("triton", _triton_fwd, _triton_bwd)
TORCH = AttnImpl("torch", attn_torch_fwd, attn_torch_bwd)


class AttnFunction(torch.autograd.Function):
    """Saves only what flash attention saves: q, k, v, out, lse (O(T*H*D)), plus the dropout RNG
    state and the softmax offset when given."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_offset, impl: AttnImpl, q_pack: Packing, k_pack: Packing, max_seqlen_q: int,
                max_seqlen_k: int, params: VarlenParams, rng_state, return_max_logit: bool):
        out, lse, max_logit = impl.fwd(q, k, v, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params, rng_state,
                                       softmax_offset, return_max_logit)
        ctx.save_for_backward(q, k, v, out, lse, softmax_offset, rng_state)
        ctx.impl, ctx.q_pack, ctx.k_pack = impl, q_pack, k_pack  # small int32 descriptors
        ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.params = max_seqlen_q, max_seqlen_k, params
        ctx.mark_non_differentiable(*(t for t in (lse, max_logit) if t is not None))
        return out, lse, max_logit

    @staticmethod
    def backward(ctx, dout, dlse, dmax_logit):
        # lse and max_logit are non-differentiable: their incoming gradients are ignored
        q, k, v, out, lse, softmax_offset, rng_state = ctx.saved_tensors
        dq, dk, dv, d_offset = ctx.impl.bwd(dout, q, k, v, out, lse, ctx.q_pack, ctx.k_pack, ctx.max_seqlen_q,
                                            ctx.max_seqlen_k, ctx.params, rng_state, softmax_offset)
        return dq, dk, dv, d_offset, None, None, None, None, None, None, None, None


def attn_torch(q, k, v, q_pack: Packing, k_pack: Packing, params: VarlenParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch backend as a differentiable function of q, k, v: (out, lse); dropout draws its RNG
    state from the device's generator."""
    state = dropout.rng_state(q.device) if params.dropout_p > 0 else None
    out, lse, _ = AttnFunction.apply(q, k, v, None, TORCH, q_pack, k_pack, 0, 0, params, state, False)
    return out, lse
