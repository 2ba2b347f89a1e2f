"""AttnFunction: autograd over one backend's forward and backward.

Every backend that coreattn differentiates itself implements the same pair (an ``AttnImpl``):

- ``fwd(q, k, v, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params, rng_state, softmax_offset,
  return_max_logit) -> (out, lse, max_logit or None)``: lse float32 includes the softmax offset's
  sink term; max_logit float32 [Hq] when asked for;
- ``bwd(dout, q, k, v, out, lse, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params, rng_state,
  softmax_offset) -> (dq, dk, dv)`` from the saved out and lse.

Backends: Triton (the kernels' launchers) and torch (coreattn/layers/torch_backend.py). The
softmax offset's gradient is the same torch reduction for both (``softmax_offset_grad``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from coreattn.kernels import varlen_attn_bwd, varlen_attn_fwd
from coreattn.kernels.packing import Packing
from coreattn.layers import dropout
from coreattn.layers.checks import VarlenParams
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
    return varlen_attn_bwd(dout, q, k, v, out, lse, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params.softmax_scale,
                           params.window_left, params.window_right, params.bottom_right,
                           dropout_p=params.dropout_p, rng_state=rng_state)


TRITON = AttnImpl("triton", _triton_fwd, _triton_bwd)
TORCH = AttnImpl("torch", attn_torch_fwd, attn_torch_bwd)


def _rows_last(x: torch.Tensor, pack: Packing) -> torch.Tensor:
    """A per-row [.., H] tensor in q's layout ([T, H], [B, S, H] or [S, B, H]) in lse's layout
    ([H, T] or [B, H, S])."""
    if pack.fmt == "thd":
        return x.transpose(0, 1)
    if pack.fmt == "sbhd":
        x = x.transpose(0, 1)
    return x.transpose(1, 2)


def softmax_offset_grad(softmax_offset: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                        q_pack: Packing) -> torch.Tensor:
    """d softmax_offset[h] = -sum over rows of p_sink * delta, with p_sink = exp(offset[h] - lse) and
    delta = rowsum(dO * O); rows never computed (lse = -inf) contribute nothing. A deterministic
    torch reduction (no atomics)."""
    work = torch.float64 if out.dtype == torch.float64 else torch.float32
    delta = _rows_last((dout.to(work) * out.to(work)).sum(-1), q_pack)  # lse's layout
    heads = softmax_offset.numel()
    offset = softmax_offset.detach().to(work).view((heads, 1) if q_pack.fmt == "thd" else (1, heads, 1))
    lse = lse.to(work)
    p_sink = torch.where(torch.isfinite(lse), torch.exp(offset - lse), torch.zeros_like(lse))
    grad = -(p_sink * delta)
    grad = grad.sum(-1) if q_pack.fmt == "thd" else grad.sum((0, 2))
    return grad.to(softmax_offset.dtype)


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
        dq = dk = dv = d_offset = None
        if any(ctx.needs_input_grad[:3]):
            dq, dk, dv = ctx.impl.bwd(dout, q, k, v, out, lse, ctx.q_pack, ctx.k_pack, ctx.max_seqlen_q,
                                      ctx.max_seqlen_k, ctx.params, rng_state, softmax_offset)
        if ctx.needs_input_grad[3]:
            d_offset = softmax_offset_grad(softmax_offset, lse, out, dout, ctx.q_pack)
        return dq, dk, dv, d_offset, None, None, None, None, None, None, None, None


def attn_torch(q, k, v, q_pack: Packing, k_pack: Packing, params: VarlenParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch backend as a differentiable function of q, k, v: (out, lse); dropout draws its RNG
    state from the device's generator."""
    state = dropout.rng_state(q.device) if params.dropout_p > 0 else None
    out, lse, _ = AttnFunction.apply(q, k, v, None, TORCH, q_pack, k_pack, 0, 0, params, state, False)
    return out, lse
