"""What the tuner tunes: launch classes from the command line, and each kernel's candidates for them.

A class (kernels/tuned_cache.py ``KernelClass``) is head dims, dtype, mask (causal or full), GQA and at
most one feature (dropout, sink, max_logit). Each kernel sees a class through ``for_kernel``: the
features that do not change its code drop out (the dK/dV kernel of the sink class is the plain
one), so ``kernel_classes`` tunes each (kernel, class) pair once. The candidates are
kernels/configs/space.py's ``candidates`` for the class's blocks, the shipped config first.
"""

from __future__ import annotations

from typing import NamedTuple

from coreattn.kernels.configs.base import KERNELS, AttnConfig, head_blocks
from coreattn.kernels.configs.space import candidates
from coreattn.kernels.tuned_cache import KernelClass

MAIN_DIMS = ((64, 64), (128, 128), (192, 128), (256, 256))
MASKS = ("causal", "full")
EXTRAS = ("dropout", "sink", "max_logit")
FEATURE_CHOICES = MASKS + EXTRAS
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def parse_dims(text: str) -> list[tuple[int, int]]:
    """"64,128,192/128" -> [(64, 64), (128, 128), (192, 128)]; ValueError naming a bad entry."""
    dims = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        qk, _, v = part.partition("/")
        try:
            pair = (int(qk), int(v or qk))
        except ValueError:
            raise ValueError(f"--dims: {part!r} is not DIM or QKDIM/VDIM") from None
        if not all(1 <= d <= 256 for d in pair):
            raise ValueError(f"--dims: {part!r}: head dims from 1 to 256")
        dims.append(pair)
    if not dims:
        raise ValueError("--dims: no head dims given")
    return dims


def classes(dims, dtype: str = "bf16", features=("causal",), gqa: bool = False) -> list[KernelClass]:
    """Every (dims, mask, feature) class: each mask of ``features`` (causal if none is named) plain
    and with each extra feature named."""
    unknown = [f for f in features if f not in FEATURE_CHOICES]
    if unknown:
        raise ValueError(f"--features: unknown {unknown}; choose from {FEATURE_CHOICES}")
    masks = [m for m in MASKS if m in features] or ["causal"]
    extras = [f for f in EXTRAS if f in features]
    return [KernelClass(qk, v, dtype, mask == "causal", gqa, (extra,) if extra else ())
            for qk, v in dims for mask in masks for extra in ("", *extras)]


class KernelTask(NamedTuple):
    kernel: str
    cls: KernelClass  # the class as the kernel sees it (for_kernel): the cache entry's key
    source: KernelClass  # a class that launches it (the inputs the tuner builds)


def kernel_classes(user_classes, kernels=KERNELS) -> list[KernelTask]:
    """One task per distinct (kernel, class as the kernel sees it), in a stable order."""
    tasks, seen = [], set()
    for cls in user_classes:
        for kernel in kernels:
            key = (kernel, cls.for_kernel(kernel))
            if key not in seen:
                seen.add(key)
                tasks.append(KernelTask(kernel, key[1], cls))
    return tasks


def blocks(cls: KernelClass) -> tuple[int, int, int]:
    """(q/k blocks' total width, v block, bytes per element): what config lookups take."""
    block_dqk, block_dqk2, block_dv = head_blocks(cls.dim_qk, cls.dim_v)
    return block_dqk + block_dqk2, block_dv, ELEMENT_BYTES[cls.dtype]


def kernel_candidates(target: str, kernel: str, cls: KernelClass, limit: int | None = None) -> list[AttnConfig]:
    """The candidates of ``kernel`` for ``cls`` on ``target``, the shipped config first; ``limit``
    keeps the first few (the shipped one always)."""
    found = candidates(target, kernel, *blocks(cls), dropout="dropout" in cls.features)
    return found[:limit] if limit else found


def shipped_configs(target: str, cls: KernelClass) -> dict:
    """{kernel: shipped config} for a class: what the tuner holds the other kernels at."""
    return {kernel: kernel_candidates(target, kernel, cls)[0] for kernel in KERNELS}


def describe_config(cfg: AttnConfig) -> str:
    """128x64 w8 s3 [tma] [ws]: a config in a table cell."""
    tile = f"{cfg.block_m}x{cfg.block_n}" if cfg.block_n else f"{cfg.block_m} rows"
    stages = f" s{cfg.num_stages}" if cfg.num_stages is not None else ""
    return f"{tile} w{cfg.num_warps}{stages}" + (" tma" if cfg.tma else "") + (" ws" if cfg.warp_specialize else "")
