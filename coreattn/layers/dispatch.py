"""Runs checked attention arguments on the selected backend (shared by the public functions)."""

from __future__ import annotations

import torch

from coreattn.layers.backends import Backend, parse_backend, select_backend
from coreattn.kernels.packing import Packing
from coreattn.kernels import dropout
from coreattn.layers.checks import VarlenParams, check_layout_values, keep_as_uint8
from coreattn.layers.function import (POSITION_IDS, TORCH, TRITON, attention, attn_torch,  # noqa: F401
                                      cu_seqlens_from_position_ids, rng_state as draw_rng_state)


def _npu_fused(q, k, v, q_pack: Packing, k_pack: Packing, max_seqlen_q: int, max_seqlen_k: int,
               params: VarlenParams, softmax_offset, return_max_logit: bool, validate: bool, bias=None):
    """npu_fusion_attention has its own autograd and takes host lists: it runs outside the
    coreattn ops (eager only), with the same value checks first."""
    from coreattn.layers.npu_fused.attention import attn_npu_fused

    if softmax_offset is not None or return_max_logit or bias is not None:
        raise NotImplementedError("softmax_offset, return_max_logit and bias are not supported by the npu_fused "
                                  "backend (npu_fusion_attention has no sink logits, returns no max logit and "
                                  "takes a bias only as an [S, T] pse tensor); use backend='triton' or 'torch'")
    if q_pack.fmt == POSITION_IDS:  # packed thd sequences given by position ids: read them here
        q_pack = Packing("thd", cu_seqlens_from_position_ids(q_pack.seq, q.shape[0]), gid=q_pack.gid)
        k_pack = Packing("thd", cu_seqlens_from_position_ids(k_pack.seq, k.shape[0]), gid=k_pack.gid)
    if validate:
        check_layout_values(q_pack.fmt, q_pack.seq, q_pack.lens, q_pack.keep, k_pack.seq, k_pack.lens, k_pack.keep,
                            q.shape[1] if q_pack.fmt == "bshd" else q.shape[0],
                            k.shape[1] if k_pack.fmt == "bshd" else k.shape[0], max_seqlen_q, max_seqlen_k)
    if q_pack.lens is not None and q_pack.seq.numel() != q_pack.lens.numel():  # seqused: slots of cu_seqlens
        q_pack = q_pack._replace(seq=q_pack.seq[:-1])
        k_pack = k_pack._replace(seq=k_pack.seq[:-1])
    q_pack = q_pack._replace(keep=keep_as_uint8(q_pack.keep))
    k_pack = k_pack._replace(keep=keep_as_uint8(k_pack.keep))
    out, lse = attn_npu_fused(q, k, v, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params)
    return out, lse, None


def run_attention(q, k, v, q_pack: Packing, k_pack: Packing, max_seqlen_q: int, max_seqlen_k: int,
                  params: VarlenParams, deterministic: bool, backend, *, softmax_offset: torch.Tensor | None = None,
                  return_max_logit: bool = False, rng_state: torch.Tensor | None = None,
                  generator: torch.Generator | None = None, validate: bool = False, bias=None):
    """(out, lse, max_logit). lse and max_logit are never differentiable, so callers may
    backpropagate through out (and softmax_offset) alone; max_logit is None unless asked for.

    The packings are in the op's layout (coreattn/layers/function.py: thd cu_seqlens, spans,
    cu_seqlens slots with seqused counts; keep masks bool or 0/1 int). ``validate``: run the public
    functions' value checks in the op (on CPU tensors or with COREATTN_VALIDATE=1). ``backend``: an
    override, or None for the per-device default. The npu_fused backend runs here, eagerly (its op
    takes host lists); the others run in the coreattn op, which resolves the backend again when it
    runs, so a compiled graph follows COREATTN_BACKEND as eager does. With dropout, the RNG state
    is drawn from the device's generator (or ``generator``, eager only) unless given. The npu_fused
    backend returns no lse (None) and draws its dropout mask with the op's own RNG; see
    coreattn.layers.npu_fused.attention. ``bias``: an additive bias (a TableBias, checked:
    coreattn.layers.bias.check_bias)."""
    override = None if backend is None else parse_backend(backend)
    if select_backend(q.device, override) is Backend.NPU_FUSED:
        return _npu_fused(q, k, v, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params, softmax_offset,
                          return_max_logit, validate, bias)
    if params.dropout_p > 0 and rng_state is None:
        rng_state = draw_rng_state(q) if generator is None else dropout.rng_state(q.device, generator)
    return attention(q, k, v, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params,
                     "" if override is None else override.value, rng_state=rng_state, softmax_offset=softmax_offset,
                     return_max_logit=return_max_logit, validate=validate, bias=bias)


def public_result(out, lse, max_logit, return_lse: bool, return_max_logit: bool):
    """What the public functions return: ``out``, then lse if asked for, then max_logit if asked for
    (``(out, lse, max_logit)`` with both; Transformer Engine's ``(out, max_logit)`` without lse)."""
    extra = ((lse,) if return_lse else ()) + ((max_logit,) if return_max_logit else ())
    return (out, *extra) if extra else out
