"""What a launch config is, and what every kernel family's tables are keyed by.

``AttnConfig``: a kernel's tile (block_m x block_n), warps, pipeline stages, each backend's launch
options and the loop-variant constexprs. ``head_block`` / ``split_head_block`` / ``head_blocks``:
the padded power-of-two blocks a real head dim is computed in, whose widest is a table's width
class. ``KERNELS``: the dense attention kernels configs are picked for, by name. Lengths never
enter a config key: packed batches change every step and must not trigger recompiles; only head
dims, dtype and the target do.

Imports nothing from coreattn: kernels/tuned_cache.py builds on this module, and configs/pick.py
on tuned_cache.
"""

from __future__ import annotations

from typing import NamedTuple

import triton

KERNELS = ("fwd", "dkdv", "dq", "preprocess")


class AttnConfig(NamedTuple):
    block_m: int
    block_n: int  # 0 for the backward preprocess kernel, which has rows only
    num_warps: int
    num_stages: int | None  # None: Triton's default (the preprocess kernel has no loop to pipeline)
    maxnreg: int | None = None  # CUDA: ptxas's register ceiling per thread (.maxnreg); None: ptxas's choice
    matrix_instr_nonkdim: int | None = None  # AMD: the MFMA instruction's M = N (16, 32); None: Triton's choice
    warp_specialize: bool = False  # the key (dK/dV: query) loop as tl.range(..., warp_specialize=True)
    tma: bool = False  # that loop's q/k/v/dO loads through TMA descriptors where allowed (kernels/descriptors.py)
    fp_fusion: bool | None = None  # the enable_fp_fusion launch option; None: not passed (interpreter, Ascend)

    def launch(self) -> dict:
        """The kernel launch options of this config, each backend's own (the HIP backend rejects
        ``maxnreg``, the CUDA backend the AMD ones); warp_specialize and tma are constexprs, not options."""
        opts = dict(num_warps=self.num_warps, num_stages=self.num_stages, maxnreg=self.maxnreg,
                    matrix_instr_nonkdim=self.matrix_instr_nonkdim, enable_fp_fusion=self.fp_fusion)
        return {k: v for k, v in opts.items() if v is not None}


def head_block(dim: int) -> int:
    """Padded power-of-two block for a real head dim (tl.dot needs >= 16; triton-ascend's
    frontend also requires power-of-two tl.arange)."""
    return max(16, triton.next_power_of_2(dim))


def split_head_block(dim: int) -> tuple[int, int]:
    """A q/k head dim as one power-of-two block, or two (the largest power of two below it and a
    block for the rest) when two cost less than the padded one: 192 -> (128, 64), not 256; 96 ->
    (64, 32); 111 -> (128, 0): two blocks would cover 128 as well."""
    full = head_block(dim)
    if dim <= 16 or full == dim:
        return full, 0
    first = full // 2
    second = head_block(dim - first)
    return (first, second) if first + second < full else (full, 0)


def head_blocks(dim_qk: int, dim_v: int) -> tuple[int, int, int]:
    """(BLOCK_DQK, BLOCK_DQK2, BLOCK_DV): the q/k dim, split where that saves work, and the v dim
    padded to its own power of two (never to q/k's)."""
    return (*split_head_block(dim_qk), head_block(dim_v))
