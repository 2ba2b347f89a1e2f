"""The kernel source compiles with both Tritons, without a device: upstream Triton to sm90 cubin
(3D grid and PERSISTENT), triton-ascend through its Linalg/HIVM lowering (PERSISTENT). Each runs
tests/kernels/kernel_compile.py in a subprocess, where TRITON_INTERPRET is unset."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coreattn.kernels import npu

SCRIPT = Path(__file__).with_name("kernel_compile.py")


def _run(which: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT), which], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


def _has_nvidia_backend() -> bool:
    from triton.backends import backends

    return "nvidia" in backends


@pytest.mark.skipif(not _has_nvidia_backend(), reason="upstream Triton's nvidia backend is not installed")
def test_kernels_compile_for_cuda_in_both_launch_modes():
    lines = _run("cuda").splitlines()
    assert len(lines) == 24 and all("cubin" in line for line in lines)


@pytest.mark.skipif(not npu.triton_ascend_installed(), reason="triton-ascend is not the installed triton")
def test_kernels_lower_for_ascend():
    lines = _run("ascend").splitlines()
    assert len(lines) == 16 and all("ttadapter" in line for line in lines)
