"""A host-sync detector for CPU runs: the reads a device would have to wait for, made to raise.

On a GPU, ``.item()``, ``.tolist()``, ``bool(t)``, ``nonzero()``, boolean-mask indexing and the
ops whose output size depends on values (``unique``, ``bincount``, ``masked_select``,
``repeat_interleave`` without ``output_size``) stall the host until the device catches up, and
cannot be captured in a CUDA graph; ``torch.cuda.set_sync_debug_mode("error")`` catches them there
(bench/acceptance.py and tests/test_gpu.py run that). On CPU nothing syncs, so this detector
patches those entry points to raise ``HostRead`` when **coreattn's own code** calls them (the
immediate caller's module is ``coreattn.*``); torch's and Triton's (the interpreter stands in for
the GPU) are left alone. With ``COREATTN_VALIDATE=0`` coreattn reads on CPU exactly what it reads
on a device (``coreattn.layers.checks.reads_values``), so a path that passes here reads nothing
on a GPU either, as far as Python calls go (a read inside torch's C++ is not seen; the GPU side is).

The tools on top of the library (``coreattn.selfcheck``, ``coreattn.tune``) and the backends that
read lengths by design (the torch backend, the npu_fused op's host lists) are not attention paths
of the kernels and are exempt.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch

EXEMPT = ("coreattn.selfcheck", "coreattn.tune", "coreattn.layers.torch_backend", "coreattn.layers.npu_fused")


class HostRead(AssertionError):
    pass


def _caller_module(depth: int) -> str:
    return sys._getframe(depth).f_globals.get("__name__", "")


def _ours(depth: int = 3) -> str | None:
    name = _caller_module(depth)
    if name == "coreattn" or name.startswith("coreattn."):
        if not name.startswith(EXEMPT):
            return name
    return None


def _is_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


def _guard(name: str, real, when=None):
    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        caller = _ours()
        if caller is not None and (when is None or when(*args, **kwargs)):
            frame = sys._getframe(1)
            raise HostRead(f"{name} called by {caller} ({frame.f_code.co_filename}:{frame.f_lineno}): a host sync "
                           "on a device")
        return real(*args, **kwargs)

    return wrapper


_TENSOR_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy",
                   "__array__", "unique", "unique_consecutive", "bincount", "masked_select", "equal", "allclose")
_TORCH_FUNCTIONS = ("nonzero", "unique", "unique_consecutive", "bincount", "masked_select", "equal", "allclose",
                    "is_nonzero", "argwhere")


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    """Inside, coreattn code that reads a tensor's values on the host raises HostRead."""
    monkeypatch.setenv("COREATTN_VALIDATE", "0")
    for name in _TENSOR_METHODS:
        monkeypatch.setattr(torch.Tensor, name, _guard(f"Tensor.{name}", getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.Tensor, "__getitem__",
                        _guard("boolean-mask indexing", torch.Tensor.__getitem__,
                               lambda self, index: _is_bool_index(index)))
    monkeypatch.setattr(torch.Tensor, "__setitem__",
                        _guard("boolean-mask assignment", torch.Tensor.__setitem__,
                               lambda self, index, value: _is_bool_index(index)))
    for name in _TORCH_FUNCTIONS:
        monkeypatch.setattr(torch, name, _guard(f"torch.{name}", getattr(torch, name)))
    monkeypatch.setattr(torch, "repeat_interleave",
                        _guard("torch.repeat_interleave without output_size", torch.repeat_interleave,
                               lambda *a, **kw: kw.get("output_size") is None
                               and any(isinstance(x, torch.Tensor) for x in a[1:2] + (kw.get("repeats"),))))
    yield
