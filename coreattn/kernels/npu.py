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
- ``ascend_core_counts(device)``: ``(num_aicore, num_vectorcore)`` from triton-ascend's driver;
- ``soc_family(device)``: the NPU's chip family as ops-transformer's operator definitions name it
  ("ascend910b": Atlas A2, "ascend910_93": Atlas A3, "ascend950"), or None when torch_npu cannot say;
- which torch_npu operators cannot run on a device, learnt from their first call
  (``run_npu_op``: a call that fails because the installed CANN has no kernel for the operator, or
  none for this chip, is remembered per device and operator and raised as ``NpuOpUnavailable``
  for the caller to fall back; any other error propagates unchanged), ``npu_op_unavailable``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import re
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


# chip families by the prefix of the SoC name torch_npu reports (aclrtGetSocName: "Ascend910B3",
# "Ascend910_9391", ...), as ops-transformer's op definitions register them (AddConfig("ascend910b"), ...)
SOC_FAMILIES = ("ascend910_93", "ascend910b", "ascend950")


def device_index(device) -> int:
    """The NPU index ``device`` names (None: the current NPU, else 0)."""
    index = getattr(device, "index", None)
    if index is not None:
        return int(index)
    try:
        return int(torch_npu_module().npu.current_device())
    except Exception:
        return 0


@functools.lru_cache(maxsize=None)
def _soc_name(index: int) -> str | None:
    mod = torch_npu_module()
    try:
        return str(mod.npu.get_device_name(index))
    except Exception:  # no torch_npu, no such API, or no device to ask
        return None


def soc_family(device) -> str | None:
    """The chip family of the NPU ``device`` names (see ``SOC_FAMILIES``); "other: NAME" for a chip
    outside them, None when torch_npu cannot name it."""
    name = _soc_name(device_index(device)) if torch_npu_module() is not None else None
    if name is None:
        return None
    lower = name.lower()
    return next((f for f in SOC_FAMILIES if lower.startswith(f)), f"other: {name}")


class NpuOpUnavailable(RuntimeError):
    """A torch_npu operator has no kernel for this CANN install or chip (remembered per device)."""


# (device index, operator) -> why it cannot run there, learnt from a failed first call
_unavailable: dict[tuple[int, str], str] = {}

# what torch_npu raises when the kernel is missing: op-plugin's EXEC_NPU_CMD when libopapi.so lacks the
# aclnn symbols ("aclnnX or aclnnXGetWorkspaceSize not in libopapi.so, or libopapi.so not found",
# Ascend/op-plugin op_plugin/utils/op_api_common.h), and the tiling's chip check ("SOC Version[N] is not
# support.", ops-transformer attention/lightning_indexer/op_host/lightning_indexer_tiling.cpp)
_MISSING_KERNEL = re.compile(r"GetWorkspaceSize not in \S*libopapi|SOC Version\[-?\d+\] is not support")


def npu_op_unavailable(device, name: str) -> str | None:
    """Why torch_npu's operator ``name`` cannot run on ``device`` (learnt from its first call), or None."""
    return _unavailable.get((device_index(device), name))


def run_npu_op(name: str, device, *args, **kwargs):
    """``torch_npu.<name>(*args, **kwargs)``; a failure saying the installed CANN or this chip has no
    kernel for it is remembered for ``device`` and raised as ``NpuOpUnavailable`` (the reason named);
    any other error (a wrong shape, ...) propagates as it is."""
    mod = torch_npu_module()
    if mod is None:
        raise RuntimeError(f"torch_npu's {name} needs torch_npu: {torch_npu_reason()}")
    try:
        return getattr(mod, name)(*args, **kwargs)
    except RuntimeError as exc:
        if not _MISSING_KERNEL.search(str(exc)):
            raise
        reason = f"torch_npu.{name} has no kernel here (its first call raised: {str(exc).strip()[:300]})"
        _unavailable[(device_index(device), name)] = reason
        raise NpuOpUnavailable(reason) from exc


_CACHED = (_torch_npu, npu_usable, triton_backend, triton_distribution, ascend_core_counts, _soc_name)


def cache_clear() -> None:
    """Forget every cached answer (tests that install or remove a fake torch_npu)."""
    for fn in _CACHED:
        fn.cache_clear()
    _unavailable.clear()
