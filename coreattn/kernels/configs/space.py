"""The tuner's candidate spaces (``python -m coreattn.tune``) and the loop variants' constexprs.

``candidates`` lists what the tuner may try per target and kernel: the shipped entry first
(configs/dense.py), tiles from ``_SPACES`` and the loop variants of ``_VARIANTS``, which are kernel
constexprs (``loop_flags``): TMA descriptor loads in the key (dK/dV: query) loops on sm90 and
sm100 (kernels/descriptors.py: host-side descriptors over the packed tensors, no
``triton.set_allocator``; launches whose tensors do not allow them take the pointer loads), and a
warp-specialized loop over those descriptor loads. The defaults (TMA and WARP_SPEC off) compile to
the same PTX instructions as before the variants existed.

Tiles per kernel and width class (block_m, block_n, num_warps, num_stages; the preprocess kernel:
rows, 0, warps, None), by MMA family. Which candidates compile spill-free and fit shared memory is the dry run's
answer (python -m coreattn.tune --dry-run --arch ...), not assumed here: the tuner times only those.
New targets (e.g. AMD's gfx*) join with a _SPACES entry (and _VARIANTS where they have any).
"""

from __future__ import annotations

from coreattn.kernels.configs.base import AttnConfig
from coreattn.kernels.configs.dense import shipped_config
from coreattn.kernels.configs.targets import FP_FUSION, MAXNREG, TMA_TARGETS

_PREPROCESS_SPACE = {256: ((32, 0, 4, None), (64, 0, 4, None), (128, 0, 8, None), (64, 0, 8, None))}
_WGMMA_SPACE = {  # sm90, sm100: 227 KB per block; a warpgroup (4 warps) per 64 rows of a dot
    "fwd": {64: ((128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3), (64, 128, 4, 2)),
            128: ((128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)),
            192: ((128, 32, 8, 3), (64, 64, 4, 2), (64, 32, 4, 3)),
            256: ((128, 32, 8, 2), (128, 16, 8, 3), (64, 32, 4, 2), (64, 16, 4, 3))},
    # the dK/dV dots have the key tile's rows: 64 per warpgroup; at 192 and 256 its accumulators fill
    # the registers, so the space there is mostly pipeline depth
    "dkdv": {64: ((64, 128, 8, 2), (32, 64, 4, 3), (16, 128, 8, 3), (64, 64, 4, 2)),
             128: ((32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 2), (16, 64, 4, 3)),
             192: ((16, 128, 8, 4), (16, 128, 8, 5), (32, 128, 8, 2), (16, 64, 4, 3), (32, 64, 4, 2)),
             256: ((16, 128, 8, 3), (16, 128, 8, 4), (32, 128, 8, 2), (16, 64, 4, 2))},
    "dq": {64: ((128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3), (64, 128, 4, 2)),
           128: ((128, 32, 8, 2), (64, 64, 4, 2), (128, 128, 8, 2), (64, 32, 4, 3)),
           192: ((128, 64, 8, 2), (64, 32, 4, 2), (64, 64, 4, 2)),
           256: ((128, 16, 8, 2), (128, 16, 8, 3), (64, 16, 4, 3), (64, 32, 4, 2))},
    "preprocess": _PREPROCESS_SPACE,
}
_MMA_SYNC_SPACE = {  # sm80 (163 KB) and the 99 KB parts: accumulators in registers, smaller tiles
    "fwd": {64: ((64, 64, 4, 3), (128, 32, 8, 3), (64, 32, 4, 3)),
            128: ((64, 32, 4, 2), (32, 64, 4, 2), (64, 64, 8, 2), (32, 32, 4, 3)),
            256: ((32, 16, 4, 2), (16, 32, 4, 2), (32, 32, 4, 3), (64, 64, 8, 2))},
    "dkdv": {64: ((32, 128, 8, 2), (16, 64, 4, 2), (32, 64, 4, 3)),
             128: ((32, 64, 4, 2), (64, 64, 8, 2), (16, 64, 4, 2)),
             192: ((16, 32, 4, 2), (32, 32, 4, 2), (32, 16, 4, 1)),
             256: ((16, 32, 4, 1), (32, 64, 8, 1), (16, 64, 4, 1))},
    "dq": {64: ((128, 64, 8, 2), (64, 32, 4, 3), (32, 64, 4, 2)),
           128: ((64, 64, 4, 2), (32, 32, 4, 2), (64, 32, 4, 3)),
           192: ((16, 32, 4, 1), (32, 16, 4, 1), (32, 32, 4, 2), (16, 64, 4, 1)),
           256: ((16, 32, 4, 1), (32, 16, 4, 1), (32, 32, 4, 2), (64, 32, 8, 1))},
    "preprocess": _PREPROCESS_SPACE,
}
_SPACES = {"sm80": _MMA_SYNC_SPACE, "sm86": _MMA_SYNC_SPACE, "sm89": _MMA_SYNC_SPACE, "sm120": _MMA_SYNC_SPACE,
           "sm90": _WGMMA_SPACE, "sm100": _WGMMA_SPACE}
# Loop variants, as (warp_specialize, tma), where Triton 3.9 compiles them for these kernels:
# - TMA descriptors on every tile of sm90 and sm100 (sm80 and the 99 KB parts: not offered; Triton
#   rewrites descriptors into pointer loads below sm90);
# - warp specialization only on TMA loops: with pointer loads the loop compiled without a
#   warp-specialized region on sm90 and sm100 (Hopper's pass also rejects pointer loads in its
#   producer). With TMA, sm100 compiles one region per key loop, but every tile tried spilled
#   (20 B to 3.5 KB of stores, with or without the 255-register ceiling), so it is offered on the
#   shipped tile only, for the dry run to show; sm90 compiled no region at all (8 warps, or 4 warps
#   with 64-row tiles), so it has none. Warp-specializing only the unmasked middle loop crashed
#   Triton 3.9's TritonGPUHoistTMEMAlloc pass on sm100.
_VARIANTS = {
    "sm90": {kernel: (((False, True), ()),) for kernel in ("fwd", "dkdv", "dq")},
    "sm100": {kernel: (((False, True), ()), ((True, True), ("shipped",))) for kernel in ("fwd", "dkdv", "dq")},
}


def _width_entry(classes: dict, widest: int):
    for width in sorted(classes):
        if widest <= width:
            return classes[width]
    return ()


def candidates(target: str, kernel: str, block_dqk: int, block_dv: int, elem: int = 2,
               dropout: bool = False) -> list[AttnConfig]:
    """The configs the tuner may try for ``kernel`` on ``target``, the shipped one first (always a
    candidate); fp32 and targets without a space have the shipped one only."""
    shipped = shipped_config(target, kernel, block_dqk, block_dv, elem, dropout)
    if elem == 4 or target not in _SPACES:
        return [shipped]
    opts = dict(maxnreg=MAXNREG, fp_fusion=FP_FUSION)
    tiles = [shipped] + [AttnConfig(*tile, **opts) for tile in _width_entry(_SPACES[target][kernel],
                                                                            max(block_dqk, block_dv))]
    out = []
    for i, tile in enumerate(tiles):
        for (ws, tma), only in (((False, False), ()), *_VARIANTS.get(target, {}).get(kernel, ())):
            cfg = tile._replace(warp_specialize=ws, tma=tma)
            if (not only or i == 0) and cfg not in out:  # only: ("shipped",) = on the shipped tile alone
                out.append(cfg)
    return out


def loop_flags(cfg: AttnConfig, target: str, tma_possible: bool) -> dict:
    """The kernels' TMA and WARP_SPEC constexprs for ``cfg``: TMA where the config asks for it, the
    target has it and the launch's tensors allow it (``tma_possible``: kernels/descriptors.py);
    warp specialization only on a TMA loop (see _VARIANTS)."""
    tma = cfg.tma and tma_possible and target in TMA_TARGETS
    return dict(TMA=tma, WARP_SPEC=cfg.warp_specialize and tma)
