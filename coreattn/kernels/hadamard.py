"""The Hadamard transform of the last dim (the DSA indexer's ``rotate_activation``): kernel and launcher.

Definition (fast_hadamard_transform's ``hadamard_transform(x, scale)``, which Megatron calls with
``scale = dim ** -0.5``): ``out = scale * x @ H[:dim, :dim]``, H the Sylvester Hadamard matrix of the
next power of two P >= dim, ``H[i, j] = (-1) ** popcount(i & j)``: x is zero-padded to P columns,
transformed and cut back to dim. H is symmetric, so the backward is the same transform of the
output gradient with the same scale. Computed in float32, rounded once to the input's dtype.

Kernel: BLOCK_R rows per program, each row's P values in float32 registers (zeros past dim), and
log2(P) butterfly rounds ``(a, b) -> (a + b, a - b)`` at distances 1, 2, ..., P / 2, each a reshape
that puts the pair's two lanes on a last axis of size 2 and a split/join: the library's fast
Walsh-Hadamard algorithm, in float32, no matrix. (A tensor-core dot with the +-1 matrix generated in
registers spilled on sm90: the compiler hoisted every slice of the generated matrix.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coreattn.kernels.configs.targets import target_of
from coreattn.kernels.configs.indexer import MAX_HADAMARD_DIM, hadamard_config
from coreattn.kernels.device import on_device
from coreattn.kernels.launch import launch, slices


@triton.jit(do_not_specialize=("n_rows",))
def _hadamard_kernel(x_ptr, out_ptr, n_rows, stride_xr, stride_or, scale,
                     DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    # grid: cdiv(n_rows, BLOCK_R) programs of BLOCK_R rows; BLOCK_D = P, the padded power of two
    LOG_D: tl.constexpr = BLOCK_D.bit_length() - 1
    r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    offs = r0 + tl.arange(0, BLOCK_R)
    row_ok = offs < n_rows
    rows = tl.minimum(offs, n_rows - 1)  # n_rows >= 1 wherever a program runs
    cols = tl.arange(0, BLOCK_D)
    safe = tl.minimum(cols, DIM - 1)  # columns past the dim read its last (masked): addresses inside the row
    mask = row_ok[:, None] & (cols < DIM)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xr + safe[None, :], mask=mask, other=0.0).to(tl.float32)
    for stage in tl.static_range(LOG_D):  # butterfly at distance j = 2 ** stage: (a, b) -> (a + b, a - b)
        y = tl.reshape(x, [BLOCK_R, BLOCK_D >> (stage + 1), 2, 1 << stage])
        a, b = tl.split(tl.permute(y, [0, 1, 3, 2]))
        y = tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2])
        x = tl.reshape(y, [BLOCK_R, BLOCK_D])
    tl.store(out_ptr + rows[:, None] * stride_or + safe[None, :], (x * scale).to(out_ptr.dtype.element_ty), mask=mask)


def hadamard_block(dim: int) -> int:
    """The padded power of two P >= dim."""
    padded = triton.next_power_of_2(max(dim, 1))
    if padded > MAX_HADAMARD_DIM:
        raise ValueError(f"the Triton Hadamard kernel takes dims up to {MAX_HADAMARD_DIM}, got {dim}")
    return padded


@on_device
def hadamard_fwd(x: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``scale * x @ H[:dim, :dim]`` over the last dim of ``x`` (any leading shape, last stride 1;
    dim <= 256), in x's dtype. Rows are read through a 2D view (a copy only when the leading dims
    cannot be flattened to one stride). The backward is ``hadamard_fwd(grad, scale)``."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim) if dim > 0 else x.reshape(-1, 1)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out_rows = out.view(-1, dim)
    n_rows = rows.shape[0]
    if n_rows == 0 or dim == 0:
        return out
    target = target_of(x.device)
    cfg = hadamard_config(target)
    options = cfg.launch(target)
    # a launch per slice of rows whose grid is within the target's limits (kernels/launch.py)
    for p0, p1 in slices(target, triton.cdiv(n_rows, cfg.block), options.get("num_warps")):
        part, out_part = rows[p0 * cfg.block:p1 * cfg.block], out_rows[p0 * cfg.block:p1 * cfg.block]
        launch(target, _hadamard_kernel, (p1 - p0,), part, out_part, part.shape[0], rows.stride(0),
               out_rows.stride(0), float(scale), DIM=dim, BLOCK_D=hadamard_block(dim), BLOCK_R=cfg.block, **options)
    return out
