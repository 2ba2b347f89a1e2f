"""TMA tensor descriptors for the attention kernels' loop loads (the configs' ``tma`` variant).

A descriptor covers a whole packed thd tensor ``[T, H, D]`` as the 2D view ``[T, H * D]``: a
sequence's token i of head h is row ``start + i``, columns ``h * D`` on. The descriptors are built
on the host (``triton.tools.tensor_descriptor.TensorDescriptor``) and passed as kernel arguments:
no device-side ``tl.make_tensor_descriptor``, so no ``triton.set_allocator`` scratch buffer and no
descriptor written per program. TMA zero-fills only past T: rows past a sequence's end are the
next sequence's tokens, which the kernels zero wherever a probability of 0 could meet them (0 * inf
is NaN; kernels/attn_fwd.py, attn_bwd.py).

A launch uses descriptors only where ``usable`` says so, and otherwise takes the pointer loads with
the same tile: packed thd layouts (cu_seqlens or spans, not the padded bshd/sbhd ones), head dims
that fill their blocks (64, 128, 192 = 128 + 64, 256; a dim like 40 or 111 pads its block, and the
padded columns would be the next head's), heads contiguous in a token (``stride(-2) == D``), and
TMA's alignment rules: 16-byte aligned base pointers and token strides. Strided views that break
these (e.g. q sliced out of a fused QKV with heads interleaved) fall back to pointers.
"""

from __future__ import annotations

import torch

from coreattn.kernels.packing import Packing


def usable(packs: tuple[Packing, ...], tensors: tuple[tuple[torch.Tensor, int], ...]) -> bool:
    """Descriptors can stand in for the pointer loads of ``tensors`` (each with the total width of
    its head blocks) in a launch on ``packs``. The [T, H * D] view must be a real 2D tensor: heads
    contiguous, tokens apart by at least a token's H * D elements (a token stride of 0, e.g. a dO
    expanded along the tokens, or tokens overlapping, would hand the descriptor encoder a layout
    that is not one), 16-byte aligned."""
    if any(pack.fmt != "thd" for pack in packs):
        return False
    for x, width in tensors:
        elem = x.element_size()
        if not (x.dim() == 3 and x.shape[0] > 0 and x.shape[-1] == width and x.stride(-1) == 1
                and x.stride(-2) == width and x.stride(0) >= x.shape[1] * width
                and (x.stride(0) * elem) % 16 == 0 and x.data_ptr() % 16 == 0):
            return False
    return True


def row_descriptor(x: torch.Tensor, block_rows: int, block_cols: int):
    """A descriptor of thd ``x`` [T, H, D] as [T, H * D], loading [block_rows, block_cols] boxes."""
    from triton.tools.tensor_descriptor import TensorDescriptor  # Triton >= 3.4: imported only when used

    return TensorDescriptor(x, [x.shape[0], x.shape[1] * x.shape[2]], [x.stride(0), 1], [block_rows, block_cols])


def row_descriptors(x: torch.Tensor, block_rows: int, block_d: int, block_d2: int = 0) -> tuple:
    """(descriptor of the first head block, of the second or None): a split q/k dim (192 = 128 + 64)
    loads its two column blocks through two descriptors (a descriptor has one box shape)."""
    return row_descriptor(x, block_rows, block_d), row_descriptor(x, block_rows, block_d2) if block_d2 else None
