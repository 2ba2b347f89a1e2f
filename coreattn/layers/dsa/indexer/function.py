"""Autograd of the indexer ops and the choice of backend per device.

- The loss (``IndexerLossFunction``): its forward runs the chunked loss of
  coreattn/layers/torch_backend/indexer_loss.py and, when q, k or the weights need a gradient,
  computes their gradients for an incoming gradient of 1 in the same pass; the backward multiplies
  those by the incoming gradient (in float32) and casts them to the inputs' dtypes. Saved: the three
  gradients, in the inputs' dtypes (q's, k's and the weights' sizes; a bf16 q's is half the float32
  one, and the product rounds once more, within one bf16 ulp), nothing of size T x T. The attention side (query,
  key) gets no gradient: Megatron detaches it. The top-k indices it may return are not
  differentiable.
- The Hadamard transform (``HadamardFunction``): the backward is the same transform of the
  gradient (H is symmetric).
- Backends, chosen per step by ``coreattn.layers.backends.select_dsa_backend``: on npu tensors
  torch_npu's operators (``npu_fused``: the top-k on ``npu_lightning_indexer``, the sparse loss on
  ``npu_sparse_lightning_indexer_grad_kl_loss``; coreattn/layers/npu_fused/indexer.py) where the
  call fits their documented limits, else the Triton kernels (top-k, Hadamard) where Triton runs
  (CUDA sm80+, ROCm CDNA, CPU under TRITON_INTERPRET=1, Ascend through triton-ascend), else torch;
  ``backend=`` or COREATTN_BACKEND overrides (COREATTN_BACKEND=npu_fused: the device default). The
  loss otherwise runs its chunks in torch ops (any device); with the Triton backend only its top-k
  selection runs in the kernel.
"""

from __future__ import annotations

import torch

from coreattn.layers.backends import Backend, select_dsa_backend
from coreattn.layers.npu_fused.indexer import indexer_loss_npu
from coreattn.layers.torch_backend.hadamard import hadamard_torch
from coreattn.layers.torch_backend.indexer_loss import LossResult, loss_torch


def indexer_backend(device: torch.device, override=None, *, what: str = "Hadamard transform", ops: tuple = (),
                    unfit=None, triton_unfit=None) -> Backend:
    """The backend of one indexer step on ``device`` (see the module docstring and
    ``coreattn.layers.backends.select_dsa_backend``); ``ops``: torch_npu's operators for it, none
    for the Hadamard transform; ``triton_unfit``: why the Triton kernel refuses this call, or None."""
    return select_dsa_backend(device, override, what=what, ops=ops, unfit=unfit, triton_unfit=triton_unfit)


def loss_npu(q, k, weights, query, key, key_lo, key_hi, fmt: str, *, softmax_scale: float, loss_coeff: float,
             topk_indices: torch.Tensor, per_token: bool, grads: bool, **unused) -> LossResult:
    """``loss_torch``'s result from torch_npu's sparse loss operator (coreattn/layers/npu_fused/indexer.py)."""
    loss, dq, dk, dw = indexer_loss_npu(q, k, weights, query, key, key_lo, key_hi, fmt, softmax_scale=softmax_scale,
                                        loss_coeff=loss_coeff, topk_indices=topk_indices, per_token=per_token,
                                        grads=grads)
    return LossResult(loss, None, None, dq, dk, dw)


class IndexerLossFunction(torch.autograd.Function):
    """loss (and top-k indices, when it selects them) of ``impl`` (``loss_torch`` or ``loss_npu``);
    differentiable in q, k, weights."""

    @staticmethod
    def forward(ctx, q, k, weights, query, key, key_lo, key_hi, topk_indices, grad_mode: bool, options: dict,
                impl=loss_torch):
        grads = grad_mode and any(ctx.needs_input_grad[:3])  # grad mode as the caller had it (off in here)
        with torch.no_grad():
            result = impl(q, k, weights, query, key, key_lo, key_hi, topk_indices=topk_indices, grads=grads, **options)
        ctx.dtypes = (q.dtype, k.dtype, weights.dtype)
        if grads:
            ctx.save_for_backward(*(g.to(dtype) for g, dtype in zip((result.dq, result.dk, result.dw), ctx.dtypes)))
        indices = result.topk_indices
        if indices is None:  # apply's outputs are tensors: an empty stand-in when the chunks selected none
            indices = torch.empty(0, dtype=torch.int64, device=q.device)
        ctx.mark_non_differentiable(indices)
        ctx.set_materialize_grads(False)  # no zero [T, K] gradient made for the indices in the backward
        return result.loss.to(torch.float32) if q.dtype != torch.float64 else result.loss, indices

    @staticmethod
    def backward(ctx, grad_loss, grad_indices):
        dq = dk = dw = None
        if grad_loss is not None and any(ctx.needs_input_grad[:3]):
            saved = ctx.saved_tensors
            work = [torch.float64 if g.dtype == torch.float64 else torch.float32 for g in saved]
            dq, dk, dw = ((g.to(w) * grad_loss.to(w)).to(g.dtype) for g, w in zip(saved, work))
        return dq, dk, dw, None, None, None, None, None, None, None, None


class HadamardFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale: float, backend: Backend):
        ctx.scale, ctx.backend = scale, backend
        return hadamard(x, scale, backend)

    @staticmethod
    def backward(ctx, grad):
        return hadamard(grad.contiguous(), ctx.scale, ctx.backend), None, None


def hadamard(x: torch.Tensor, scale: float, backend: Backend) -> torch.Tensor:
    if backend is Backend.TRITON and x.dtype != torch.float64:
        from coreattn.kernels.hadamard import hadamard_fwd

        return hadamard_fwd(x, scale)
    return hadamard_torch(x, scale)
