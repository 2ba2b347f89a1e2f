"""Every kernel launch runs on its inputs' device.

Triton launches on the *current* CUDA device and that device's current stream, not on the device
of the tensors it is handed (triton/runtime/jit.py), and torch's Python custom ops add no device
guard. With tensors on cuda:1 while cuda:0 is current (transformers' ``device_map="auto"``, one
process driving several GPUs) a launch then raises "Pointer argument cannot be accessed from
Triton", or, with peer access on, runs on GPU 0 against GPU 1's memory on GPU 0's stream (a race,
silently wrong). ``on_device`` wraps a launcher so that its launches run under
``torch.cuda.device(x.device)`` of its first tensor argument: that device's current stream, as
torch's own ops on that tensor would use. CPU, NPU and the interpreter pay nothing (no guard is
entered). tests/kernels/test_device_guard.py checks that every ``kernel[grid](...)`` in coreattn
sits in a function wrapped by ``on_device``.
"""

from __future__ import annotations

import contextlib
import functools

import torch


def launch_device(x: torch.Tensor):
    """A context in which Triton launches on ``x``'s device: ``torch.cuda.device(x.device)`` for a
    CUDA tensor (a no-op switch when it is already current), else nothing."""
    if x.device.type == "cuda":
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (tuple, list)):  # e.g. a Packing: its first tensor
            for item in value:
                if isinstance(item, torch.Tensor):
                    return item
    return None


def on_device(launcher):
    """Wraps a launcher: its body (its kernel launches) runs under ``launch_device`` of its first
    tensor argument (in a tuple argument such as a ``Packing``, that tuple's first tensor)."""
    @functools.wraps(launcher)
    def launch(*args, **kwargs):
        x = _first_tensor(args, kwargs)
        if x is None or x.device.type != "cuda":
            return launcher(*args, **kwargs)
        with torch.cuda.device(x.device):
            return launcher(*args, **kwargs)

    launch.__coreattn_on_device__ = True
    return launch
