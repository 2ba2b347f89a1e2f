"""Argument checks for the mask utilities: clear errors that name the argument.

Shape and dtype checks are free and always run. Checks that read values run when the tensor
is on the CPU (free) or when COREATTN_VALIDATE=1 (a host sync on a device): ``reads_values``,
coreattn.layers.checks'.
"""

from __future__ import annotations

import operator

import torch

from coreattn.layers.checks import check_binary_values, reads_values  # noqa: F401 (the mask modules' checks.reads_values)

INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
MASK_DTYPES = (torch.bool,) + INT_DTYPES
INT32_MAX = 2**31 - 1


def check_tensor(name: str, t, ndims: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in ndims:
        want = " or ".join(str(n) for n in ndims)
        raise ValueError(f"{name} must have {want} dims, got shape {tuple(t.shape)}")


def check_int(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_seqlens(name: str, seqlens, max_len: int | None = None) -> None:
    """seqlens: 1D integer tensor of non-negative lengths (<= max_len when given)."""
    check_tensor(name, seqlens, (1,))
    if seqlens.dtype not in INT_DTYPES:
        raise TypeError(f"{name} must have an integer dtype, got {seqlens.dtype}")
    if reads_values(seqlens) and seqlens.numel() > 0:
        lo, hi = int(seqlens.min()), int(seqlens.max())
        if lo < 0:
            raise ValueError(f"{name} must be >= 0, got a length of {lo}")
        if max_len is not None and hi > max_len:
            raise ValueError(f"{name} has a length of {hi}, longer than max_len = {max_len}")
        if int(seqlens.sum(dtype=torch.int64)) > INT32_MAX:
            raise ValueError(f"{name} sums to more than {INT32_MAX} tokens: int32 cu_seqlens would overflow")


def check_cu_seqlens(name: str, cu) -> None:
    """cu_seqlens: 1D integer tensor [B+1] starting at 0, non-decreasing."""
    check_tensor(name, cu, (1,))
    if cu.dtype not in INT_DTYPES:
        raise TypeError(f"{name} must have an integer dtype (int32 by convention), got {cu.dtype}")
    if cu.numel() < 1:
        raise ValueError(f"{name} must have B+1 >= 1 entries, got none")
    if reads_values(cu):
        if int(cu[0]) != 0:
            raise ValueError(f"{name} must start at 0, got {int(cu[0])}")
        if cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"{name} must be non-decreasing, got {cu.tolist()}")
        if int(cu[-1]) > INT32_MAX:
            raise ValueError(f"{name}[-1] = {int(cu[-1])} does not fit int32")


def check_keep_mask(name: str, mask) -> None:
    """A [B, S] keep mask: bool, or integer holding only 0 and 1."""
    check_tensor(name, mask, (2,))
    check_mask_values(name, mask)


def check_mask_values(name: str, mask: torch.Tensor) -> None:
    if mask.dtype not in MASK_DTYPES:
        hint = " (an additive float mask? pass `mask == 0` or `mask != 0` as bool)" if mask.is_floating_point() else ""
        raise TypeError(f"{name} must be bool or an integer dtype, got {mask.dtype}{hint}")
    if mask.dtype != torch.bool and reads_values(mask) and mask.numel() > 0:
        check_binary_values(name, mask)


def keep_bool(keep_mask: torch.Tensor) -> torch.Tensor:
    """A checked keep mask as bool (0/1 integer masks: nonzero = kept)."""
    return keep_mask if keep_mask.dtype == torch.bool else keep_mask != 0
