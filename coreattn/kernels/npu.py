"""Ascend NPU detection, with or without ``torch_npu`` and triton-ascend installed.

Nothing here runs at ``import coreattn``: ``torch_npu`` is imported on first use, and the
active Triton driver is only asked when a caller needs to know. Answers are cached; tests that
swap a fake ``torch_npu`` into ``sys.modules`` call ``cache_clear()``.

- ``torch_npu_module()``: the ``torch_npu`` module, or None when it cannot be imported;
- ``npu_usable()``: torch_npu imports and ``torch.npu.is_available()``;
- ``triton_backend()``: the active Triton driver's target backend ("cuda", "hip", "npu", ...), or
  None when no driver is active (a CPU-only machine, or under ``TRITON_INTERPRET=1`` without a
  device); it never raises;
- ``triton_is_ascend()``: that backend is "npu", i.e. triton-ascend runs on an Ascend device;
- ``triton_distribution()`` / ``triton_ascend_installed()``: which distribution provides the
  ``triton`` module (triton-ascend in the Ascend CI lane on CPU, where no driver is active);
- ``ascend_core_counts(device)``: ``(num_aicore, num_vectorcore)`` from triton-ascend's driver.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import warnings
from types import ModuleType
from typing import NamedTuple

import torch


class AscendCores(NamedTuple):
    aicore: int  # cube+vector cores: the grid of kernels that use tl.dot
    vectorcore: int  # vector cores: the grid of element-wise kernels


def _import_torch_npu() -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module("torch_npu"), "torch_npu imported"
    except Exception as exc:  # ImportError, or a broken CANN install raising at import
        return None, f"torch_npu cannot be imported ({type(exc).__name__}: {exc})"


@functools.lru_cache(maxsize=None)
def _torch_npu() -> tuple[ModuleType | None, str]:
    return _import_torch_npu()


def torch_npu_module() -> ModuleType | None:
    """The ``torch_npu`` module (importing it on first call), or None if it cannot be imported."""
    return _torch_npu()[0]


def torch_npu_reason() -> str:
    """Why ``torch_npu_module()`` is None (or that it imported)."""
    return _torch_npu()[1]


@functools.lru_cache(maxsize=None)
def npu_usable() -> bool:
    """torch_npu imports and reports at least one usable NPU."""
    if torch_npu_module() is None:
        return False
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available())
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def triton_backend() -> str | None:
    """The active Triton driver's target backend, or None when there is none (never raises)."""
    try:
        from triton.runtime import driver

        with warnings.catch_warnings():
            # triton-ascend warns (and then raises) when its compiler is missing on a CPU machine
            warnings.simplefilter("ignore")
            return str(driver.active.get_current_target().backend)
    except Exception:
        return None


def triton_is_ascend() -> bool:
    """The active Triton is triton-ascend driving an Ascend device."""
    return triton_backend() == "npu"


@functools.lru_cache(maxsize=None)
def triton_distribution() -> str | None:
    """The installed distribution whose files hold the imported ``triton/__init__.py``
    ("triton", "triton-ascend", ...), or None if none does (e.g. a source checkout)."""
    try:
        import triton
    except Exception:
        return None
    target = os.path.realpath(triton.__file__)
    for name in importlib.metadata.packages_distributions().get("triton", []):
        for f in importlib.metadata.distribution(name).files or []:
            if str(f).replace("\\", "/") == "triton/__init__.py" and os.path.realpath(f.locate()) == target:
                return name
    return None


def triton_ascend_installed() -> bool:
    """The ``triton`` module comes from triton-ascend (which replaces the ``triton`` package)."""
    return triton_distribution() == "triton-ascend"


@functools.lru_cache(maxsize=None)
def ascend_core_counts(device_index: int = 0) -> AscendCores:
    """(num_aicore, num_vectorcore) of an Ascend device, from triton-ascend's driver."""
    from triton.runtime import driver

    props = driver.active.utils.get_device_properties(device_index)
    return AscendCores(int(props["num_aicore"]), int(props["num_vectorcore"]))


_CACHED = (_torch_npu, npu_usable, triton_backend, triton_distribution, ascend_core_counts)


def cache_clear() -> None:
    """Forget every cached answer (tests that install or remove a fake torch_npu)."""
    for fn in _CACHED:
        fn.cache_clear()
