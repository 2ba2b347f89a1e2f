"""Backend registry: which implementation runs attention for a given device.

Selection rule (first match wins):
1. an explicit override: the ``backend=`` argument, else the ``COREATTN_BACKEND`` environment
   variable; it raises ``RuntimeError`` with the reason if that backend cannot run here (e.g.
   ``backend="triton"`` on a GPU of compute capability 7.5 names the capability);
2. by device type, the first backend of its list that can run on that device:
   ``cuda`` -> Triton (NVIDIA of compute capability >= 8.0, and AMD CDNA GPUs under ROCm's
   PyTorch, which reports them as ``cuda`` devices), else torch;
   ``cpu`` -> Triton through Triton's interpreter when ``TRITON_INTERPRET=1`` was set before
   coreattn was imported, else torch;
   ``npu`` (Ascend) -> ``npu_fused``, torch_npu's ``npu_fusion_attention`` (the vendor's fused
   kernel is the mature path there, forward and backward, tuned per chip, while coreattn's Triton
   kernels on Ascend, triton-ascend with a persistent grid, have only been checked under Triton's
   CPU interpreter), else Triton when the active Triton is triton-ascend, else torch;
   any other device type -> torch.
   A device without kernels for it (a T4 or V100, an AMD GPU outside gfx90a/gfx942/gfx950, an NPU
   without torch_npu) therefore falls back, never raises: the choice and the reason each
   preferred backend was passed over are logged once on the ``coreattn`` logger.

Backends: ``triton`` (CUDA sm80 and newer; ROCm on gfx90a, gfx942 and gfx950; Ascend via
triton-ascend; CPU under ``TRITON_INTERPRET=1``), ``torch`` (any device) and ``npu_fused``
(``npu`` tensors with torch_npu importable).

DeepSeek Sparse Attention's ops (sparse attention, the indexer's top-k and loss) choose per call
with ``select_dsa_backend``: ``npu_fused`` (torch_npu's DSA operators) where they can run on the
device (torch_npu has them, the chip is one their kernels are built for, no earlier call found the
kernel missing) and the call fits the limits their documentation and kernels set, else the next
backend, with the reason logged once.
"""

from __future__ import annotations

import enum
import logging
import os
from typing import Callable, NamedTuple

import torch

from coreattn.kernels import npu

logger = logging.getLogger("coreattn")

ENV_BACKEND = "COREATTN_BACKEND"


class Backend(str, enum.Enum):
    TRITON = "triton"
    TORCH = "torch"
    NPU_FUSED = "npu_fused"


class Availability(NamedTuple):
    ok: bool
    reason: str


def _triton_available(device: torch.device) -> Availability:
    try:
        from coreattn.kernels import runs_in_interpreter
    except ImportError as exc:  # triton missing or broken
        return Availability(False, f"triton cannot be imported ({exc})")
    interpreted = runs_in_interpreter()
    if device.type == "npu":
        if interpreted:
            return Availability(False, "kernels were built for Triton's interpreter (TRITON_INTERPRET=1), which runs on CPU tensors")
        if not npu.triton_is_ascend():
            return Availability(False, f"the active Triton is not triton-ascend on an NPU "
                                       f"(driver backend: {npu.triton_backend()!r})")
        return Availability(True, "Ascend NPU through triton-ascend (persistent grid)")
    if device.type == "cuda":
        if interpreted:
            return Availability(False, "kernels were built for Triton's interpreter (TRITON_INTERPRET=1), which runs on CPU tensors")
        if torch.version.hip:  # ROCm's PyTorch: AMD GPUs are cuda devices
            from coreattn.kernels.configs.targets import target_of

            try:
                target = target_of(device)
            except RuntimeError as exc:
                return Availability(False, str(exc))
            return Availability(True, f"ROCm device ({target}) through Triton's HIP backend")
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            return Availability(False, f"the Triton kernels need compute capability >= 8.0 (Ampere), this GPU has "
                                       f"{major}.{minor}")
        return Availability(True, f"CUDA device of compute capability {major}.{minor}")
    if device.type == "cpu":
        if interpreted:
            return Availability(True, "CPU tensors under TRITON_INTERPRET=1 (slow; for testing)")
        return Availability(False, "CPU tensors need TRITON_INTERPRET=1 set before importing coreattn")
    return Availability(False, f"no Triton target for device type {device.type!r}")


def _torch_available(device: torch.device) -> Availability:
    return Availability(True, "pure torch, any device")


def _npu_fused_available(device: torch.device) -> Availability:
    if device.type != "npu":
        return Availability(False, f"torch_npu.npu_fusion_attention runs on npu tensors, not {device.type}")
    if npu.torch_npu_module() is None:
        return Availability(False, npu.torch_npu_reason())
    return Availability(True, "torch_npu.npu_fusion_attention (Ascend fused attention)")


_REGISTRY: dict[Backend, Callable[[torch.device], Availability]] = {
    Backend.TRITON: _triton_available,
    Backend.TORCH: _torch_available,
    Backend.NPU_FUSED: _npu_fused_available,
}

_logged: set[tuple[str, Backend]] = set()


def parse_backend(value: str | Backend, source: str = "backend") -> Backend:
    if isinstance(value, Backend):
        return value
    if isinstance(value, str):
        try:
            return Backend(value.strip().lower())
        except ValueError:
            pass
    choices = ", ".join(repr(b.value) for b in Backend)
    raise ValueError(f"{source}={value!r} is not a coreattn backend; choose one of {choices}")


def is_available(backend: Backend, device: torch.device) -> Availability:
    return _REGISTRY[backend](device)


# per device type, the backends a call prefers, in order; the first that can run is the default
_PREFERENCES: dict[str, tuple[Backend, ...]] = {
    "cuda": (Backend.TRITON, Backend.TORCH),
    "cpu": (Backend.TRITON, Backend.TORCH),
    "npu": (Backend.NPU_FUSED, Backend.TRITON, Backend.TORCH),
}


def _default_for(device: torch.device) -> tuple[Backend, str]:
    """The default backend for ``device`` and why: the first of its preferences that can run (the
    torch backend runs anywhere), with the reasons the ones before it could not."""
    passed = []
    for backend in _PREFERENCES.get(device.type, (Backend.TORCH,)):
        avail = is_available(backend, device)
        if avail.ok:
            why = avail.reason + "".join(f"; not {b.value}: {r}" for b, r in passed)
            return backend, why
        passed.append((backend, avail.reason))
    raise AssertionError("the torch backend runs on every device")  # pragma: no cover


def select_backend(device: torch.device, override: str | Backend | None = None) -> Backend:
    """Pick the backend for tensors on ``device``; see the module docstring for the rule."""
    source = "backend"
    if override is None and os.environ.get(ENV_BACKEND):
        override, source = os.environ[ENV_BACKEND], ENV_BACKEND
    if override is not None:
        backend = parse_backend(override, source)
        avail = is_available(backend, device)
        if not avail.ok:
            raise RuntimeError(f"{source}={backend.value!r} cannot run on {device.type}: {avail.reason}")
        why = avail.reason
    else:
        backend, why = _default_for(device)
    key = (device.type, backend)
    # not while torch.compile traces: a logging call would break the graph, and a guard on _logged
    # would recompile once the op has logged (it selects again, and logs, when it runs)
    if not torch.compiler.is_compiling() and key not in _logged:
        _logged.add(key)
        logger.info("coreattn: %s tensors use the %s backend (%s)", device.type, backend.value, why)
    return backend



# torch_npu's DSA operators coreattn maps (coreattn/layers/npu_fused/sparse.py, indexer.py): each DSA op
# family runs on npu_fused where every operator it calls can run on the device
NPU_SPARSE_OPS = ("npu_sparse_flash_attention",)
NPU_SPARSE_GRAD_OPS = ("npu_sparse_flash_attention_grad",)
NPU_TOPK_OPS = ("npu_lightning_indexer",)
NPU_LOSS_OPS = ("npu_sparse_flash_attention", "npu_sparse_lightning_indexer_grad_kl_loss")

# The chip families each operator's kernel is built for, as coreattn calls it (cann ops-transformer's op
# definitions, op_host/*_def.cpp AddConfig, and the tilings' SoC checks; docs/ascend.md cites each):
# Atlas A2 (ascend910b) and A3 (ascend910_93). The sparse attention's Ascend 950 configuration takes
# FP8 keys and returns no softmax statistics, the loss's needs that attention's statistics, and the
# grad and the indexer register no 950 kernel.
NPU_OP_SOCS = {name: ("ascend910b", "ascend910_93") for name in
               NPU_SPARSE_OPS + NPU_SPARSE_GRAD_OPS + NPU_TOPK_OPS + NPU_LOSS_OPS}

# per device type, the backends a DSA op prefers (npu_fused where it has the operator and the call fits)
_DSA_PREFERENCES: dict[str, tuple[Backend, ...]] = {"npu": (Backend.NPU_FUSED, Backend.TRITON, Backend.TORCH)}


def npu_ops_available(device: torch.device, ops: tuple[str, ...], what: str) -> Availability:
    """Whether torch_npu's operators ``ops`` can run ``what`` on ``device``: torch_npu has each, the
    device's chip is one its kernel is built for (``NPU_OP_SOCS``; a chip torch_npu cannot name is
    not refused here), and no earlier call on this device found its kernel missing
    (``coreattn.kernels.npu.run_npu_op``: the first call's failure, remembered)."""
    if not ops:
        return Availability(False, f"torch_npu has no {what} operator")
    if device.type != "npu":
        return Availability(False, f"torch_npu's {what} operators run on npu tensors, not {device.type}")
    mod = npu.torch_npu_module()
    if mod is None:
        return Availability(False, npu.torch_npu_reason())
    missing = [name for name in ops if not callable(getattr(mod, name, None))]
    if missing:
        return Availability(False, f"this torch_npu has no {', '.join(missing)}")
    family = npu.soc_family(device)
    for name in ops:
        if family is not None and family not in NPU_OP_SOCS.get(name, (family,)):
            return Availability(False, f"torch_npu.{name}'s kernel is built for {' and '.join(NPU_OP_SOCS[name])} "
                                       f"(Atlas A2/A3), not this NPU ({family})")
        learnt = npu.npu_op_unavailable(device, name)
        if learnt:
            return Availability(False, learnt)
    return Availability(True, "torch_npu." + " + ".join(ops))


def _log_choice(device: torch.device, what: str, backend: Backend, why: str) -> None:
    """Logs a DSA op's choice and why, once per device type, op, backend and reason."""
    key = (device.type, what, backend, why)
    if not torch.compiler.is_compiling() and key not in _logged:
        _logged.add(key)
        logger.info("coreattn: %s tensors run %s on the %s backend (%s)", device.type, what, backend.value, why)


def select_dsa_backend(device: torch.device, override: str | Backend | None = None, *, what: str,
                       ops: tuple[str, ...] = (), unfit: Callable[[], str | None] | None = None) -> Backend:
    """The backend of a DSA op (``what``: "sparse attention", "the indexer top-k", ...) on ``device``.

    ``ops``: the torch_npu operators its ``npu_fused`` mapping calls (none: it has no npu_fused
    mapping); ``unfit()``: None when this call fits those operators' documented limits, else the
    limit it breaks (asked only where npu_fused could run). Rule:
    1. ``override`` (else ``COREATTN_BACKEND``) names the backend; one that cannot run raises
       ``RuntimeError`` with the reason, ``npu_fused`` also when the call is outside its limits
       (the limit named). ``COREATTN_BACKEND=npu_fused`` (set for dense attention) is no override
       here: the device default, which prefers npu_fused on an NPU;
    2. npu tensors: ``npu_fused`` where torch_npu has the operators and the call fits, else Triton
       (triton-ascend), else torch; other devices: Triton where it runs, else torch. Never raises:
       the choice and the reasons the preferred ones were passed over are logged once."""
    source = "backend"
    if override is None and os.environ.get(ENV_BACKEND):
        env = parse_backend(os.environ[ENV_BACKEND], ENV_BACKEND)
        if env is not Backend.NPU_FUSED:
            return select_backend(device)  # COREATTN_BACKEND, checked and logged there
    if override is not None:
        backend = parse_backend(override, source)
        if backend is not Backend.NPU_FUSED:
            return select_backend(device, backend)
        avail = npu_ops_available(device, ops, what)
        if not avail.ok:
            raise RuntimeError(f"{source}='npu_fused' cannot run {what} on {device.type}: {avail.reason}")
        limit = unfit() if unfit is not None else None
        if limit:
            raise RuntimeError(f"{source}='npu_fused' cannot run this {what} call: {limit}")
        _log_choice(device, what, backend, avail.reason)
        return backend
    passed = []
    for backend in _DSA_PREFERENCES.get(device.type, (Backend.TRITON, Backend.TORCH)):
        if backend is Backend.NPU_FUSED:
            avail = npu_ops_available(device, ops, what)
            limit = unfit() if avail.ok and unfit is not None else None
            if limit:
                avail = Availability(False, limit)
        else:
            avail = is_available(backend, device)
        if avail.ok:
            _log_choice(device, what, backend, avail.reason + "".join(f"; not {b.value}: {r}" for b, r in passed))
            return backend
        passed.append((backend, avail.reason))
    raise AssertionError("the torch backend runs on every device")  # pragma: no cover


def select_sparse_backend(device: torch.device, override: str | Backend | None = None,
                          unfit: Callable[[], str | None] | None = None, *, backward: bool = False) -> Backend:
    """The backend of sparse (top-k) attention (``coreattn.sparse_varlen_attn``), forward or
    ``backward``: ``select_dsa_backend`` with torch_npu's ``npu_sparse_flash_attention`` (the forward)
    or ``npu_sparse_flash_attention_grad`` (the backward) as its npu_fused mapping, each with its own
    limits (``unfit``). The default: npu_fused on npu tensors where the call fits, else Triton where it
    can run (CUDA, ROCm, CPU under the interpreter, Ascend through triton-ascend), else torch."""
    if backward:
        return select_dsa_backend(device, override, what="sparse attention backward", ops=NPU_SPARSE_GRAD_OPS,
                                  unfit=unfit)
    return select_dsa_backend(device, override, what="sparse attention", ops=NPU_SPARSE_OPS, unfit=unfit)
