"""Which target a device is, and the launch facts every kernel family's configs share.

Targets: the Triton interpreter (CPU, tests), CUDA sm80 (A100: 163 KB of shared memory per
block), sm86/sm89 (RTX 30/40, A10, L4, L40S: 99 KB), sm90 (H100/H200: 227 KB, wgmma), sm100
(B200: 227 KB), sm120 (RTX 50 / RTX PRO Blackwell: 99 KB), AMD CDNA under ROCm gfx90a
(MI210/MI250X: 64 KB of LDS per workgroup), gfx942 (MI300X/MI325X: 64 KB), gfx950
(MI350X/MI355X: 160 KB), and Ascend (triton-ascend). ROCm's PyTorch reports AMD GPUs as ``cuda``
devices; ``target_of`` reads the device's gcnArchName.

Every CUDA launch sets ptxas's register ceiling to the register file (``MAXNREG``, 255) and
``enable_fp_fusion`` explicitly (``FP_FUSION``); AMD launches take no ``maxnreg`` (the HIP backend
rejects it). ``launch_options`` gives both to the kernels that have no AttnConfig (the tile scan
and map, the mask kernels). Where a config's TMA loop variant is honoured: ``TMA_TARGETS``.

Ascend runs a persistent grid: as many programs as the device has AI cores (``num_aicore`` for
kernels with ``tl.dot``, ``num_vectorcore`` for element-wise ones), each looping over
(block, sequence, head) tasks inside the kernel (``PERSISTENT``). ``COREATTN_TRITON_TARGET=ascend``
forces that launch on any device, so tests and CI run it under the interpreter on CPU, with
``INTERPRETER_ASCEND_CORES`` standing in for the core counts. Each AI core has a 192 KB on-chip
buffer, halved by double buffering (``ASCEND_STEP_BUDGET``): what each kernel family's Ascend
block sizes are fitted to (configs/dense.py).
"""

from __future__ import annotations

import os

import torch

ENV_TRITON_TARGET = "COREATTN_TRITON_TARGET"
CDNA_TARGETS = ("gfx90a", "gfx942", "gfx950")  # AMD Instinct MI200, MI300X/MI325X, MI350X/MI355X
TARGETS = ("interpreter", "sm80", "sm86", "sm89", "sm90", "sm100", "sm120", *CDNA_TARGETS, "ascend")

ASCEND_BUFFER_BYTES = 192 * 1024  # unified buffer per AI core
ASCEND_STEP_BUDGET = ASCEND_BUFFER_BYTES // 2  # double buffering
INTERPRETER_ASCEND_CORES = (4, 8)  # (aicore, vectorcore) standing in under TRITON_INTERPRET=1
MAX_PERSISTENT_GRID = 65535


def target_of(device: torch.device) -> str:
    """The launch target for tensors on ``device``: "ascend" for npu tensors or when
    ``COREATTN_TRITON_TARGET=ascend`` (read at every call), else "interpreter", a CUDA family
    ("sm90", "sm80", ...) or, on ROCm's PyTorch (whose AMD GPUs are ``cuda`` devices), the CDNA arch
    ("gfx942", ...). Under the interpreter, the first call checks that it can run the kernels
    (kernels/versions.py ``check_interpreter``: Triton 3.6's needs numpy<2.4)."""
    from coreattn.kernels import runs_in_interpreter

    interpreted = runs_in_interpreter()
    if interpreted:  # once per process: RuntimeError naming the fix where this interpreter cannot run them
        from coreattn.kernels.versions import check_interpreter

        check_interpreter()
    forced = os.environ.get(ENV_TRITON_TARGET, "").strip().lower()
    if forced:
        if forced != "ascend":
            raise ValueError(f"{ENV_TRITON_TARGET}={forced!r}: only 'ascend' can be forced")
        return "ascend"
    if device.type == "npu":
        return "ascend"
    if interpreted:
        return "interpreter"
    if device.type == "cuda":
        if torch.version.hip:  # ROCm: the capability (9, 4 on an MI300X) says nothing about CUDA archs
            return hip_target(torch.cuda.get_device_properties(device).gcnArchName)
        return cuda_target(*torch.cuda.get_device_capability(device))
    raise RuntimeError(f"no Triton launch config for device {device}")


def hip_target(arch_name: str) -> str:
    """The config family of a ROCm device from its ``gcnArchName`` ("gfx942:sramecc+:xnack-" ->
    "gfx942"). Only the CDNA archs whose tables were checked by compiling for them are accepted:
    another arch (MI100's gfx908, the RDNA parts' wave32 and WMMA, a future CDNA) could spill or
    exceed its LDS with them, and an error now beats a kernel that fails or crawls at launch."""
    arch = arch_name.split(":", 1)[0].strip().lower()
    if arch in CDNA_TARGETS:
        return arch
    raise RuntimeError(f"coreattn's Triton kernels have launch configs for AMD {', '.join(CDNA_TARGETS)} only, "
                       f"this device is {arch_name!r}; use backend='torch'")


def cuda_target(major: int, minor: int) -> str:
    """The config family of a CUDA compute capability (by shared memory per block and MMA kind)."""
    if major < 8:
        raise RuntimeError(f"coreattn's Triton kernels need compute capability >= 8.0 (Ampere), this device has "
                           f"{major}.{minor}; use backend='torch'")
    if major == 8:
        return {6: "sm86", 9: "sm89"}.get(minor, "sm80")  # 8.0 and 8.7 (Orin) have 163 KB per block
    if major == 9:
        return "sm90"
    if major in (10, 11):
        return "sm100"
    return "sm120"  # 12.x and anything newer: the smallest shared memory of the Blackwell parts


def persistent_grid(device: torch.device, tasks: int, vector_only: bool = False) -> int:
    """Programs of a persistent (Ascend) launch: the core count, never more than the tasks."""
    from coreattn.kernels import runs_in_interpreter

    if runs_in_interpreter():
        aicore, vectorcore = INTERPRETER_ASCEND_CORES
    else:
        from coreattn.kernels.npu import ascend_core_counts

        index = device.index
        if index is None:  # "npu" means the current NPU (what the launch runs on), not NPU 0
            from triton.runtime import driver

            index = driver.active.get_current_device()
        aicore, vectorcore = ascend_core_counts(index)
    cores = vectorcore if vector_only else aicore
    return max(1, min(cores, tasks, MAX_PERSISTENT_GRID))


# Left to itself, ptxas often capped registers well below the register file and spilled (sm120's dQ
# at 64: 128 registers and 4 B spilled, 184 and none with the ceiling at 255; sm80's fp32 forward
# at 64: 48 registers and a spill): every CUDA launch sets the ceiling to the file's 255.
MAXNREG = 255
# Floating-point fusion (a * b + c as one FMA), set explicitly on every CUDA launch: Triton 3.9
# fuses by default and warns that 3.10 will not. Fusion keeps the numerics every test and the
# compile report were checked with (the softmax's s * scale - m is one FMA) and saves the separate
# multiplies and adds. The interpreter ignores launch options and triton-ascend 3.2 does not know
# this one, so their configs leave it unset.
FP_FUSION = True


def launch_options(target: str) -> dict:
    """Launch options for a kernel without an AttnConfig (the tile scan and map, the mask kernels):
    ``enable_fp_fusion`` on GPU targets and, on CUDA, the register ceiling every CUDA launch sets
    (left to itself, Triton 3.8.0's ptxas held the eight-warp tile scan to 64 registers for sm90
    and spilled 4 B); nothing where the launch does not take them."""
    if target in ("interpreter", "ascend"):
        return {}
    return {"enable_fp_fusion": FP_FUSION} | ({} if target in CDNA_TARGETS else {"maxnreg": MAXNREG})


TMA_TARGETS = ("sm90", "sm100", "interpreter")  # where a config's tma is honoured (the interpreter emulates TMA)
