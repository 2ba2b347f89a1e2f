"""VarlenAttnFunction: autograd over the Triton launchers (forward and backward), packed or padded."""

from __future__ import annotations

import torch

from coreattn.kernels import varlen_attn_bwd, varlen_attn_fwd
from coreattn.kernels.packing import Packing
from coreattn.layers.checks import VarlenParams


class VarlenAttnFunction(torch.autograd.Function):
    """Saves only what flash attention saves: q, k, v, out, lse and cu_seqlens (O(T*H*D))."""

    @staticmethod
    def forward(ctx, q, k, v, q_pack: Packing, k_pack: Packing, max_seqlen_q: int, max_seqlen_k: int,
                params: VarlenParams, deterministic: bool):
        out, lse = varlen_attn_fwd(q, k, v, q_pack, k_pack, max_seqlen_q, params.softmax_scale,
                                   params.window_left, params.window_right, params.bottom_right)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.q_pack, ctx.k_pack = q_pack, k_pack  # small int32 descriptors (cu_seqlens or spans)
        ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
        ctx.params, ctx.deterministic = params, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        # lse is non-differentiable: its incoming gradient (None or zeros) is ignored
        q, k, v, out, lse = ctx.saved_tensors
        p = ctx.params
        dq, dk, dv = varlen_attn_bwd(dout, q, k, v, out, lse, ctx.q_pack, ctx.k_pack,
                                     ctx.max_seqlen_q, ctx.max_seqlen_k, p.softmax_scale,
                                     p.window_left, p.window_right, p.bottom_right)
        return dq, dk, dv, None, None, None, None, None, None
