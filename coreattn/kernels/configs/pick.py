"""Which config a launch uses: forced (the tuner) > tuned cache (CUDA) > shipped table.

``pick_config``: one the tuner forces (``forced_configs``), else on a CUDA device the tuned
cache's entry for the launch's class (kernels/tuned_cache.py: files ``python -m coreattn.tune``
writes on the user's GPU, or shipped in the package for named GPUs), else the kernel family's
table (configs/dense.py), the shipped default. A tuned config that fails to compile at launch is
dropped with a warning and the launch reruns on the table (``tuned_fallback``).
``record_configs`` collects what the launchers picked (``ConfigUse``), for the self-check and the
bench.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch

from coreattn.kernels import tuned_cache
from coreattn.kernels.configs.base import KERNELS, AttnConfig
from coreattn.kernels.configs.targets import FP_FUSION


class ConfigUse(NamedTuple):
    kernel: str
    cls: str | None  # the launch's class id as the kernel sees it (kernels/tuned_cache.py KernelClass.for_kernel)
    config: AttnConfig
    source: str  # "shipped table (sm90)", "tuned: <file>", "forced by the tuner", ...

    def as_json(self) -> dict:
        return {"kernel": self.kernel, "class": self.cls, "config": self.config._asdict(), "source": self.source}


_FORCED: dict[str, AttnConfig] = {}
_RECORDERS: list[dict] = []


@contextlib.contextmanager
def forced_configs(**configs: AttnConfig):
    """Inside, the launchers use these configs (by kernel: fwd, dkdv, dq, preprocess) whatever the
    target, table or cache say: how the tuner times and compiles candidates, and how tests run a
    variant under the interpreter."""
    unknown = set(configs) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; expected some of {KERNELS}")
    saved = dict(_FORCED)
    _FORCED.update(configs)
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(saved)


@contextlib.contextmanager
def record_configs():
    """Yields a dict that receives, keyed by (kernel, class id), the ConfigUse of every config the
    launchers pick inside (the last one for each key): what the self-check and the bench report."""
    uses: dict = {}
    _RECORDERS.append(uses)
    try:
        yield uses
    finally:  # by identity: two recorders may hold equal dicts
        del _RECORDERS[next(i for i, r in enumerate(_RECORDERS) if r is uses)]


def pick_config(kernel: str, device: torch.device, target: str, cls, shipped: AttnConfig) -> AttnConfig:
    """``kernel``'s config for a launch of class ``cls`` on ``device``: forced, else tuned (CUDA
    devices only, kernels/tuned_cache.py), else ``shipped``."""
    if kernel in _FORCED:
        cfg, source = _FORCED[kernel], "forced by the tuner"
    else:
        hit = None
        if cls is not None and device.type == "cuda" and target not in ("interpreter", "ascend"):
            hit = tuned_cache.lookup(device, kernel, cls)
        if hit is not None:
            cfg, source = hit.config._replace(fp_fusion=FP_FUSION), f"tuned: {hit.path}"
        else:
            cfg, source = shipped, f"shipped table ({target})"
    if _RECORDERS:
        use = ConfigUse(kernel, None if cls is None else cls.for_kernel(kernel).id, cfg, source)
        for uses in _RECORDERS:
            uses[(kernel, use.cls)] = use
    return cfg


def _compile_failure(exc: BaseException) -> bool:
    """Triton failed to compile or load a kernel (a config that does not fit this GPU or Triton)."""
    from triton.errors import TritonError
    from triton.runtime.errors import InterpreterError

    if isinstance(exc, TritonError):
        return not isinstance(exc, InterpreterError)
    return isinstance(exc, RuntimeError) and "PassManager::run failed" in str(exc)


def tuned_fallback(launcher):
    """Wraps a launcher: when a launch that used tuned configs fails to compile, those cache entries
    are dropped (one warning naming their file, kernels/tuned_cache.py ``reject``) and the launch runs
    again on the shipped table. Any other failure propagates."""
    @functools.wraps(launcher)
    def launch(*args, **kwargs):
        with record_configs() as uses:
            try:
                return launcher(*args, **kwargs)
            except Exception as exc:
                tuned_uses = [u for u in uses.values() if u.source.startswith("tuned: ")]
                if not tuned_uses or not _compile_failure(exc):
                    raise
                for use in tuned_uses:
                    tuned_cache.reject(use, exc)
        return launcher(*args, **kwargs)

    return launch
