"""Launch configurations per target, in one place.

Targets: the Triton interpreter (CPU, tests), CUDA sm80 (Ampere) and sm90 (Hopper). The NPU
issue adds Ascend. Lengths never enter a config key: packed batches change every step and must
not trigger recompiles; only head dims, dtype and the target do.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton


class AttnConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def head_block(dim: int) -> int:
    """Padded power-of-two block for a real head dim (tl.dot needs >= 16)."""
    return max(16, triton.next_power_of_2(dim))


def target_of(device: torch.device) -> str:
    from coreattn.kernels import runs_in_interpreter

    if runs_in_interpreter():
        return "interpreter"
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return "sm90" if major >= 9 else "sm80"
    raise RuntimeError(f"no Triton launch config for device {device}")


# Interpreter: small, unequal M and N blocks, so tests cross block edges and the diagonal
# logic is exercised with BLOCK_M != BLOCK_N.
_INTERPRETER = AttnConfig(block_m=16, block_n=32, num_warps=1, num_stages=1)


def fwd_config(device: torch.device, block_dqk: int, block_dv: int) -> AttnConfig:
    target = target_of(device)
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


def bwd_config(device: torch.device, block_dqk: int, block_dv: int) -> AttnConfig:
    """Shared by the dK/dV kernel (block_n keys, block_m queries per step) and the dQ kernel."""
    target = target_of(device)
    if target == "interpreter":
        return _INTERPRETER
    widest = max(block_dqk, block_dv)
    if widest <= 64:
        return AttnConfig(64, 128, 4, 2) if target == "sm90" else AttnConfig(64, 64, 4, 2)
    if widest <= 128:
        return AttnConfig(64, 64, 8, 2) if target == "sm90" else AttnConfig(32, 64, 4, 2)
    return AttnConfig(32, 64, 8, 1) if target == "sm90" else AttnConfig(32, 32, 4, 1)
