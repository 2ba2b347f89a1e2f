"""Every Triton launch of coreattn goes through ``launch``: the one place that fits a launch's grid
to its target's limits.

The limits (``max_programs``), per launch:

- CUDA (and the interpreter, which checks the CUDA limits so CPU tests see them): grid x <= 2**31 - 1,
  y and z <= 65,535;
- HIP (AMD CDNA): the dispatch packet counts work-items, grid x block, in a uint32, and Triton's AMD
  launcher makes a program 64 x num_warps work-items, so programs x 64 x num_warps < 2**32 (2**24
  programs at 4 waves): past it ``hipErrorInvalidValue``, or on some ROCm releases a truncated grid
  that leaves rows of ``torch.empty`` outputs unwritten;
- Ascend (triton-ascend): a grid of at most 65,535 programs (the launchers take a core-count grid).

A 1D launch over more tasks than that fit is *looped*, not refused, when its kernel has a
``PERSISTENT`` constexpr (every attention, sparse and tile-map kernel: their programs then step over
the tasks ``pid, pid + grid, ...``): ``launch`` sets ``PERSISTENT=True`` and the grid to the most
programs the target takes. A kernel without that mode whose grid does not fit raises
``GridLimitError`` naming the limit; so does a looped launch whose int32 task counter would step
past 2**31 - 1. Nothing is launched past a limit. The kernels without a looped mode whose grids
follow the tokens (the indexer's top-k, the Hadamard rotation) launch once per range of ``slices``.

``launch(target, kernel, grid, *args, **kwargs)`` is ``kernel[grid](*args, **kwargs)`` after that
fit; ``num_warps`` is read from the launch options (Triton's default, 4, when absent). A kernel that
is not a Triton function (a test's recorder) is called the same way.
"""

from __future__ import annotations

import math

from coreattn.kernels.configs.targets import CDNA_TARGETS, MAX_PERSISTENT_GRID

CUDA_MAX_X = 2**31 - 1
CUDA_MAX_YZ = 65535
HIP_MAX_WORK_ITEMS = 2**32  # exclusive: the packet's uint32
HIP_WAVE = 64  # work-items per warp (wave64)
MAX_TASK_INDEX = 2**31 - 1  # program ids and looped task indices are int32
DEFAULT_WARPS = 4  # Triton's default num_warps


class GridLimitError(ValueError):
    """A launch that does not fit its target's grid limits and cannot loop."""


def max_programs(target: str, num_warps: int = DEFAULT_WARPS) -> int:
    """The most programs along x one launch of ``num_warps`` warps may have on ``target``."""
    if target == "ascend":
        return MAX_PERSISTENT_GRID
    if target in CDNA_TARGETS:
        return min(CUDA_MAX_X, (HIP_MAX_WORK_ITEMS - 1) // (HIP_WAVE * max(num_warps, 1)))
    return CUDA_MAX_X


def grid_limit_name(target: str, num_warps: int = DEFAULT_WARPS) -> str:
    """The limit ``max_programs`` applies, in words (for errors and the launch plan)."""
    if target == "ascend":
        return f"Ascend's grid of at most {MAX_PERSISTENT_GRID:,} programs"
    if target in CDNA_TARGETS:
        return (f"HIP's 2**32 work-items per dispatch (programs x 64 x {num_warps} warps: at most "
                f"{max_programs(target, num_warps):,} programs)")
    return f"CUDA's grid x <= {CUDA_MAX_X:,}"


def fits(target: str, grid: tuple[int, ...], num_warps: int = DEFAULT_WARPS) -> bool:
    """Whether ``grid`` (1 to 3 dims) is within ``target``'s limits."""
    x, y, z = (tuple(grid) + (1, 1))[:3]
    if y > CUDA_MAX_YZ or z > CUDA_MAX_YZ:
        return False
    if target in CDNA_TARGETS and x * y * z * HIP_WAVE * num_warps >= HIP_MAX_WORK_ITEMS:
        return False
    return x <= max_programs(target, num_warps)


def fit_grid(target: str, grid: tuple[int, ...], num_warps: int, loops: bool) -> tuple[tuple[int, ...], bool]:
    """(grid, looped): ``grid`` as it is when it fits, else (a kernel that ``loops``) the largest 1D
    grid the target takes, whose programs step over the tasks. Raises ``GridLimitError`` naming the
    limit otherwise."""
    grid = tuple(int(g) for g in grid)
    if fits(target, grid, num_warps):
        return grid, False
    tasks = math.prod(grid)
    limit = grid_limit_name(target, num_warps)
    if not loops or len(grid) != 1:
        raise GridLimitError(f"a launch of {tasks:,} programs ({grid}) exceeds {limit}, and the kernel cannot loop "
                             "over its tasks; split the batch")
    programs = max_programs(target, num_warps)
    if tasks - 1 + programs > MAX_TASK_INDEX:
        raise GridLimitError(f"{tasks:,} tasks over {programs:,} programs ({limit}) overflow the kernels' int32 "
                             "task counter; split the batch")
    return (programs,), True


def slices(target: str, n: int, num_warps: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) ranges of ``n`` programs, each as many as one launch of ``num_warps`` warps may have
    on ``target``: a kernel without a looped mode launched once per range (with its start as an offset)."""
    step = max_programs(target, num_warps or DEFAULT_WARPS)
    return [(start, min(n, start + step)) for start in range(0, n, step)]


def launch(target: str, kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` with ``grid`` fitted to ``target``'s limits (``fit_grid``;
    a looped launch gets ``PERSISTENT=True``)."""
    num_warps = kwargs.get("num_warps") or DEFAULT_WARPS
    grid, looped = fit_grid(target, grid, num_warps, loops="PERSISTENT" in kwargs)
    if looped:
        kwargs["PERSISTENT"] = True
    return kernel[grid](*args, **kwargs)
