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
- Backends: the Triton kernels (top-k, Hadamard) where ``coreattn.layers.backends`` says Triton
  runs (CUDA sm80+, ROCm CDNA, CPU under TRITON_INTERPRET=1; an NPU defaults to torch), else torch;
  ``backend=`` or COREATTN_BACKEND overrides ("npu_fused" has no indexer: the device default then).
  The loss always runs its chunks in torch ops (any device); with the Triton backend only its top-k
  selection runs in the kernel.
"""

from __future__ import annotations

import os

import torch

from coreattn.layers.backends import ENV_BACKEND, Backend, is_available, parse_backend
from coreattn.layers.torch_backend.hadamard import hadamard_torch
from coreattn.layers.torch_backend.indexer_loss import loss_torch


def indexer_backend(device: torch.device, override=None) -> Backend:
    """Triton or torch for the indexer ops on ``device`` (see the module docstring)."""
    source = "backend"
    if override is None and os.environ.get(ENV_BACKEND):
        override, source = os.environ[ENV_BACKEND], ENV_BACKEND
    if override is not None:
        backend = parse_backend(override, source)
        if backend is Backend.NPU_FUSED:
            if source == "backend":
                raise ValueError("backend='npu_fused' has no indexer ops; use 'triton' or 'torch'")
        else:
            avail = is_available(backend, device)
            if not avail.ok:
                raise RuntimeError(f"{source}={backend.value!r} cannot run on {device.type}: {avail.reason}")
            return backend
    if device.type != "npu" and is_available(Backend.TRITON, device).ok:
        return Backend.TRITON
    return Backend.TORCH


class IndexerLossFunction(torch.autograd.Function):
    """loss (and top-k indices, when it selects them) of ``loss_torch``; differentiable in q, k, weights."""

    @staticmethod
    def forward(ctx, q, k, weights, query, key, key_lo, key_hi, topk_indices, grad_mode: bool, options: dict):
        grads = grad_mode and any(ctx.needs_input_grad[:3])  # grad mode as the caller had it (off in here)
        with torch.no_grad():
            result = loss_torch(q, k, weights, query, key, key_lo, key_hi, topk_indices=topk_indices, grads=grads,
                                **options)
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
        return dq, dk, dw, None, None, None, None, None, None, None


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
