"""Test set-up: without CUDA, the Triton kernels run under Triton's CPU interpreter.

TRITON_INTERPRET must be set before coreattn (and its @triton.jit kernels) is imported.
torch.cuda.is_available() does not create a CUDA context (on ROCm's PyTorch it is True for AMD GPUs,
and the GPU tests run there alike). Under the interpreter,
interpreter_bf16 corrects its bf16 tl.dot and casts so the bf16 kernel paths run on CPU, and
interp_memcheck fails any load or store outside the kernel's tensor arguments (every lane inside
a loop; ``COREATTN_MEMCHECK=masked`` or ``off`` relaxes it, see tests/interp_memcheck.py).
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MEMCHECK = "not installed (the kernels run compiled)"
if INTERPRETED:
    import interp_memcheck
    import interpreter_bf16

    interpreter_bf16.install()
    try:
        interp_memcheck.install()
        MEMCHECK = interp_memcheck.mode()
    except RuntimeError as exc:  # this Triton's interpreter lacks what it wraps: said in the header and failed
        MEMCHECK = f"DISABLED: {exc}"  # by tests/kernels/test_interp_memcheck.py


def pytest_report_header(config):
    return f"interpreter memcheck: {MEMCHECK}"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a GPU (CUDA, or ROCm's PyTorch, whose AMD GPUs are cuda devices)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
