"""Launch configurations per target, in one place.

Targets: the Triton interpreter (CPU, tests), CUDA sm80 (Ampere), sm90 (Hopper) and Ascend
(triton-ascend). Lengths never enter a config key: packed batches change every step and must
not trigger recompiles; only head dims, dtype and the target do.

Ascend runs a persistent grid: as many programs as the device has AI cores (``num_aicore`` for
kernels with ``tl.dot``, ``num_vectorcore`` for element-wise ones), each looping over
(block, sequence, head) tasks inside the kernel (``PERSISTENT``). ``COREATTN_TRITON_TARGET=ascend``
forces that launch on any device, so tests and CI run it under the interpreter on CPU, with
``INTERPRETER_ASCEND_CORES`` standing in for the core counts.

Ascend block sizes come from the on-chip buffer: 192 KB per core, halved by double buffering
(the compiler's multibuffer), so a step's live tiles must fit in 96 KB. ``fwd_step_bytes`` and
``bwd_step_bytes`` count every tile a step of the kernels holds at once, as if all sat in that one
buffer (tl.dot operands really pass through the cube unit's own L0/L1 buffers, so this
over-counts: a conservative bound). ``_ascend_blocks`` takes the first (BLOCK_M, BLOCK_N) of
a short list, largest first, that fits. Worked example, forward, fp16, Dqk = 192 (padded 256)
and Dv = 128, M = 64, N = 32: inputs 2 B x (q 64x256 + k 32x256 + v 32x128 + p 64x32) =
61,440 B; fp32 4 B x (scores 64x32 + acc 64x128 + m, l, alpha 3x64) = 41,728 B; 103,168 B >
98,304 B, so it takes the next, M = 32, N = 64: 2 x (8192 + 16384 + 8192 + 2048) +
4 x (2048 + 4096 + 96) = 94,592 B. Only the fp32 backward at head dims 256/256 exceeds the
budget even at 16x16 (103,552 B by this count); it runs at 16x16 and relies on the
over-count.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton

ENV_TRITON_TARGET = "COREATTN_TRITON_TARGET"
TARGETS = ("interpreter", "sm80", "sm90", "ascend")

ASCEND_BUFFER_BYTES = 192 * 1024  # unified buffer per AI core
ASCEND_STEP_BUDGET = ASCEND_BUFFER_BYTES // 2  # double buffering
# (BLOCK_M, BLOCK_N) candidates, largest first; the first whose step fits the budget wins
_ASCEND_BLOCKS = ((128, 128), (128, 64), (64, 128), (64, 64), (64, 32), (32, 64), (32, 32), (32, 16), (16, 32),
                  (16, 16))
INTERPRETER_ASCEND_CORES = (4, 8)  # (aicore, vectorcore) standing in under TRITON_INTERPRET=1
MAX_PERSISTENT_GRID = 65535


class AttnConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def head_block(dim: int) -> int:
    """Padded power-of-two block for a real head dim (tl.dot needs >= 16; triton-ascend's
    frontend also requires power-of-two tl.arange)."""
    return max(16, triton.next_power_of_2(dim))


def target_of(device: torch.device) -> str:
    """The launch target for tensors on ``device``: "ascend" for npu tensors or when
    ``COREATTN_TRITON_TARGET=ascend`` (read at every call), else "interpreter", "sm90" or "sm80"."""
    from coreattn.kernels import runs_in_interpreter

    forced = os.environ.get(ENV_TRITON_TARGET, "").strip().lower()
    if forced:
        if forced != "ascend":
            raise ValueError(f"{ENV_TRITON_TARGET}={forced!r}: only 'ascend' can be forced")
        return "ascend"
    if device.type == "npu":
        return "ascend"
    if runs_in_interpreter():
        return "interpreter"
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return "sm90" if major >= 9 else "sm80"
    raise RuntimeError(f"no Triton launch config for device {device}")


def persistent_grid(device: torch.device, tasks: int, vector_only: bool = False) -> int:
    """Programs of a persistent (Ascend) launch: the core count, never more than the tasks."""
    from coreattn.kernels import runs_in_interpreter

    if runs_in_interpreter():
        aicore, vectorcore = INTERPRETER_ASCEND_CORES
    else:
        from coreattn.adapters.npu import ascend_core_counts

        aicore, vectorcore = ascend_core_counts(device.index or 0)
    cores = vectorcore if vector_only else aicore
    return max(1, min(cores, tasks, MAX_PERSISTENT_GRID))


def fwd_step_bytes(block_m: int, block_n: int, block_dqk: int, block_dv: int, elem: int) -> int:
    """On-chip bytes of one forward key step: q, k, v and p (input dtype), scores, acc and the
    row statistics m, l, alpha (fp32)."""
    inputs = block_m * block_dqk + block_n * block_dqk + block_n * block_dv + block_m * block_n
    return elem * inputs + 4 * (block_m * block_n + block_m * block_dv + 3 * block_m)


def bwd_step_bytes(block_m: int, block_n: int, block_dqk: int, block_dv: int, elem: int) -> int:
    """On-chip bytes of one backward step, the larger of the two kernels. dK/dV: k, v, q, dO and
    the casts of p, ds (input dtype); dk, dv accumulators, p, dp, ds (fp32); lse, delta. dQ: the
    same tiles with a dq accumulator in place of dk and dv."""
    inputs = (block_m + block_n) * (block_dqk + block_dv) + 2 * block_m * block_n
    dkdv = elem * inputs + 4 * (block_n * (block_dqk + block_dv) + 3 * block_m * block_n + 2 * block_m)
    dq = elem * inputs + 4 * (block_m * block_dqk + 3 * block_m * block_n + 2 * block_m)
    return max(dkdv, dq)


def _ascend_blocks(step_bytes, block_dqk: int, block_dv: int, elem: int) -> AttnConfig:
    for block_m, block_n in _ASCEND_BLOCKS:
        if step_bytes(block_m, block_n, block_dqk, block_dv, elem) <= ASCEND_STEP_BUDGET:
            return AttnConfig(block_m, block_n, 1, 1)
    return AttnConfig(*_ASCEND_BLOCKS[-1], 1, 1)  # tl.dot's minimum; see the module docstring


# Interpreter: small, unequal M and N blocks, so tests cross block edges and the diagonal
# logic is exercised with BLOCK_M != BLOCK_N.
_INTERPRETER = AttnConfig(block_m=16, block_n=32, num_warps=1, num_stages=1)


def fwd_config(device: torch.device, block_dqk: int, block_dv: int, elem: int = 2) -> AttnConfig:
    """``elem``: bytes per input element (2 for fp16/bf16, 4 for fp32); only Ascend uses it."""
    target = target_of(device)
    if target == "ascend":
        return _ascend_blocks(fwd_step_bytes, block_dqk, block_dv, elem)
    if target == "interpreter":
        return _INTERPRETER
    widest = max(block_dqk, block_dv)
    if target == "sm90":
        if widest <= 64:
            return AttnConfig(128, 64, 4, 3)
        if widest <= 128:
            return AttnConfig(128, 64, 8, 3)
        return AttnConfig(128, 32, 8, 2)
    if widest <= 64:
        return AttnConfig(128, 64, 4, 3)
    if widest <= 128:
        return AttnConfig(128, 32, 4, 2)
    return AttnConfig(64, 32, 4, 2)


def bwd_config(device: torch.device, block_dqk: int, block_dv: int, elem: int = 2) -> AttnConfig:
    """Shared by the dK/dV kernel (block_n keys, block_m queries per step) and the dQ kernel."""
    target = target_of(device)
    if target == "ascend":
        return _ascend_blocks(bwd_step_bytes, block_dqk, block_dv, elem)
    if target == "interpreter":
        return _INTERPRETER
    widest = max(block_dqk, block_dv)
    if widest <= 64:
        return AttnConfig(64, 128, 4, 2) if target == "sm90" else AttnConfig(64, 64, 4, 2)
    if widest <= 128:
        return AttnConfig(64, 64, 8, 2) if target == "sm90" else AttnConfig(32, 64, 4, 2)
    return AttnConfig(32, 64, 8, 1) if target == "sm90" else AttnConfig(32, 32, 4, 1)
