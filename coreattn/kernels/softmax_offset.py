"""The softmax offset's (attention sink's) gradient, shared by every backend.

A sink adds ``exp(offset)`` to a row's softmax denominator, so the gradient of that row's sink
logit is ``-p_sink * rowsum(P * dP)`` with ``p_sink = exp(offset - lse)``. An offset per head
(``[Hq]``) sums that over the head's rows; an offset per row and head (given in lse's layout,
``[Hq, T]`` / ``[B, Hq, S]``) takes it row by row. ``rowsum(P * dP)`` equals flash attention's
delta ``rowsum(dO * O)``, but the backends accumulate it from the unrounded P (in fp32, float64
for float64 inputs): with O rounded to a 16-bit output dtype, the sum over every row of a head
would carry O's rounding error.
"""

from __future__ import annotations

import torch

from coreattn.kernels.packing import Packing


def softmax_offset_grad(softmax_offset: torch.Tensor, lse: torch.Tensor, rowsum: torch.Tensor,
                        q_pack: Packing) -> torch.Tensor:
    """The sink logits' gradient, in the offset's shape and dtype: per row ``-p_sink * rowsum(P * dP)``,
    with p_sink = exp(offset - lse) (``rowsum`` and lse in lse's layout; rowsum(P * dP) is rowsum(dO * O)
    computed without rounding O to the output dtype), summed over each head's rows for an ``[Hq]``
    offset; rows never computed (lse = -inf) contribute nothing. Deterministic torch ops (no atomics)."""
    work = torch.float64 if rowsum.dtype == torch.float64 else torch.float32
    delta = rowsum.to(work)
    heads = softmax_offset.shape[0] if softmax_offset.dim() == 1 else lse.shape[-2]
    per_row = softmax_offset.dim() > 1
    offset = softmax_offset.detach().to(work)
    if not per_row:
        offset = offset.view((heads, 1) if q_pack.fmt == "thd" else (1, heads, 1))
    lse = lse.to(work)
    p_sink = torch.where(torch.isfinite(lse), torch.exp(offset - lse), torch.zeros_like(lse))
    grad = -(p_sink * delta)
    if not per_row:
        grad = grad.sum(-1) if q_pack.fmt == "thd" else grad.sum((0, 2))
    return grad.to(softmax_offset.dtype)
