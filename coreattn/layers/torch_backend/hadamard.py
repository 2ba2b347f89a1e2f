"""The Hadamard transform of the last dim in torch ops (CPU and any device): the kernel's definition
(coreattn/kernels/hadamard.py) by the same float32 butterfly, round for round, so the two backends
agree bit for bit on float32 sums; float64 inputs are transformed in float64."""

from __future__ import annotations

import torch


def hadamard_torch(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * x @ H[:dim, :dim]`` over the last dim (H: the Sylvester matrix of the next power of
    two P >= dim; x zero-padded to P), in x's dtype."""
    dim = x.shape[-1]
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    padded = 1 << max(dim - 1, 0).bit_length()
    y = torch.nn.functional.pad(x.to(work), (0, padded - dim))  # [..., P]
    lead = y.shape[:-1]
    j = 1
    while j < padded:  # butterfly at distance j: (a, b) -> (a + b, a - b)
        pairs = y.reshape(*lead, padded // (2 * j), 2, j)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, padded)
        j *= 2
    return (y[..., :dim] * scale).to(x.dtype)
