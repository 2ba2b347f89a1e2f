"""The softmax offset's (attention sink's) gradient, shared by every backend.

A sink adds ``exp(offset[h])`` to each row's softmax denominator, so ``d offset[h] = -sum over rows
of p_sink * rowsum(P * dP)`` with ``p_sink = exp(offset[h] - lse)``. ``rowsum(P * dP)`` equals
flash attention's delta ``rowsum(dO * O)``, but the backends accumulate it from the unrounded P (in
fp32, float64 for float64 inputs): with O rounded to a 16-bit output dtype, the sum over every row
of a head would carry O's rounding error.
"""

from __future__ import annotations

import torch

from coreattn.kernels.packing import Packing


def softmax_offset_grad(softmax_offset: torch.Tensor, lse: torch.Tensor, rowsum: torch.Tensor,
                        q_pack: Packing) -> torch.Tensor:
    """d softmax_offset[h] = -sum over rows of p_sink * rowsum(P * dP), with p_sink = exp(offset[h] - lse)
    (``rowsum`` and lse in lse's layout; rowsum(P * dP) is rowsum(dO * O) computed without rounding O
    to the output dtype); rows never computed (lse = -inf) contribute nothing. A deterministic torch
    reduction (no atomics)."""
    work = torch.float64 if rowsum.dtype == torch.float64 else torch.float32
    delta = rowsum.to(work)
    heads = softmax_offset.numel()
    offset = softmax_offset.detach().to(work).view((heads, 1) if q_pack.fmt == "thd" else (1, heads, 1))
    lse = lse.to(work)
    p_sink = torch.where(torch.isfinite(lse), torch.exp(offset - lse), torch.zeros_like(lse))
    grad = -(p_sink * delta)
    grad = grad.sum(-1) if q_pack.fmt == "thd" else grad.sum((0, 2))
    return grad.to(softmax_offset.dtype)
