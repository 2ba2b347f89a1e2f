"""Launch tables of the sparse (top-k) attention kernels (kernels/sparse_fwd.py, sparse_bwd.py).

Slot mode (the rows that name part of their range): ``fwd`` and ``dq`` (a program per (query token,
kv head, block of BLOCK_H q heads) stepping over BLOCK_N of the token's valid slots), ``dkv`` (a
program per (query token, kv head, block of BLOCK_N slots) stepping over the group's heads in blocks
of BLOCK_H), ``reduce`` (programs stepping over the chunk's (key, kv head) segments summing their CSR
entries: no tile, warps only) and ``keys`` (the key-centric dK/dV of small groups: a program per (key row,
kv head) stepping over the tokens that name the key, ``block_m`` rows of entries x the group's heads, no
tl.dot). A config is an ``AttnConfig`` whose ``block_m`` is BLOCK_H (q heads: the rows of the
forward's and dQ's dots, the inner dimension of dK's) and ``block_n`` BLOCK_N (slots).

Range mode (full rows as dense attention): ``range_fwd``, ``range_dq`` (a program per (block of
BLOCK_T query tokens, kv head, block of BLOCK_H q heads) stepping over BLOCK_N contiguous keys) and
``range_dkv`` (a program per (block of BLOCK_N keys, kv head) stepping over token blocks x head
blocks). Their ``block_m`` is the tile's MMA rows, BLOCK_T x BLOCK_H (``range_tile``: the group's
heads rounded up to a power of two, tokens for the rest), and ``block_n`` keys; the tables give
them the slot mode's row counts and register budget (the 576/512 forward 32 rows, so 16 heads take
two tokens).

BLOCK_H is the table's for the widest heads (``block_m``) or, for a smaller GQA group, the group
rounded up to a power of two, at least 16 (tl.dot's minimum; a group smaller than 16 is padded
with masked rows): ``sparse_config``. Tables are keyed by target and the width class of the
padded head dims (q/k blocks summed, e.g. 576 for 512 + 64, and v's), like the dense ones, and by
the group class (heads per kv head: the 16-row tiles of GQA and the 64-row ones of absorbed MLA's
64-128 heads take different warps).

How the CUDA and CDNA entries were picked: by compiling (``python -m bench --what kernels``,
coreattn/tune/compiler.py; docs/compile-report.md has the figures per arch and Triton): every sparse
kernel of the report (absorbed 576/512 at 16-128 heads, GQA 4 at 192/128, 128 and 64, bf16, fp16
and fp32; both modes) has 0 spill bytes and fits its arch's shared memory (LDS), and every 16-bit
tl.dot is an MMA of its input type (mma.sync; tcgen05 for sm100's 64-head slot-mode forward; 16x16 MFMAs).
The slot mode's tables were chosen on sm80, sm86, sm89, sm90, sm100 and sm120 under Triton 3.6.0,
3.7.1, 3.8.0 and 3.9.0 and on the CDNA archs under 3.9.0; with the range mode, sm90, sm100, gfx90a,
gfx942 and gfx950 were compiled under all four releases (the CDNA forward at 576/512 changed for
it). The comments below say what each choice avoided. What is left is MMA work: the score dots of
16- and 32-row tiles repeat on 2-4 warps (CDNA waves), and a slot-mode GQA group smaller than 16
pads the 16-row tile with masked heads (the range mode fills it with tokens). None has been timed.

Ascend (triton-ascend: one warp, a persistent grid) sizes the tiles by the on-chip buffer as the
dense tables do (``step_bytes``); the kernels run under triton-ascend 3.2's interpreter in the
Ascend CI lane. At 576/512 the backward's accumulators exceed the 96 KB step budget even at
16 x 16, which relies on the count's overestimate (the dense fp32 kernels at 256 do the same).
"""

from __future__ import annotations

import functools

import triton

from coreattn.kernels.configs.base import AttnConfig
from coreattn.kernels.configs.targets import ASCEND_STEP_BUDGET, CDNA_TARGETS, FP_FUSION, MAXNREG

KERNELS = ("fwd", "dq", "dkv", "range_fwd", "range_dq", "range_dkv", "reduce", "keys", "pre", "block_fwd", "block_dq",
           "block_dkv")
RANGE_KERNELS = {"range_fwd": "fwd", "range_dq": "dq", "range_dkv": "dkv"}  # each with its slot-mode twin
# the block mode (block-sparse rows): its forward and dQ tile q heads as the slot mode's, its dK/dV tokens x heads
# as the range mode's; each with the twin whose fp32 and Ascend configs it takes
BLOCK_KERNELS = {"block_fwd": "fwd", "block_dq": "dq", "block_dkv": "dkv"}
MIN_BLOCK_H = 16  # tl.dot's smallest M

_C = AttnConfig
_W = functools.partial(AttnConfig, matrix_instr_nonkdim=16)

# The interpreter: small tiles, so tests cross slot blocks (K up to 40) and head blocks (groups > 16), and
# unequal (16 heads x 32 slots), so a kernel that mixed up the two would fail on shapes.
# Range mode: 16 rows (tokens x heads) over 16 keys, so the short sequences of the tests cross key blocks and
# a row block holds several tokens (8 with a group of 2).
_INTERPRETER = {"fwd": _C(16, 32, 1, 1), "dq": _C(16, 32, 1, 1), "dkv": _C(16, 32, 1, 1), "reduce": _C(0, 64, 1, 1),
                "keys": _C(4, 0, 1, 1),
                "pre": _C(16, 0, 1, None), "range_fwd": _C(16, 16, 1, 1), "range_dq": _C(16, 16, 1, 1),
                "range_dkv": _C(16, 16, 1, 1), "block_fwd": _C(16, 16, 1, 1), "block_dq": _C(16, 16, 1, 1),
                "block_dkv": _C(16, 16, 1, 1)}

# CUDA and CDNA tables: kernel -> target -> ((max width, max group, AttnConfig), ...), first match wins;
# width = the larger of the q/k blocks' sum and the v block. fp32 takes _FP32 (no tensor-core MMA at IEEE).
_TABLES: dict = {kernel: {} for kernel in ("fwd", "dq", "dkv", *RANGE_KERNELS, *BLOCK_KERNELS)}
_REDUCE = {"cuda": _C(0, 512, 4, 2), "cdna": _W(0, 512, 4, 1)}
# the key-centric dK/dV (small groups): block_m rows = entries x the group's heads per step, no tl.dot; its fp32
# q and dO rows take block_m x (q/k + v blocks) registers over 4 warps: fewer rows for wider heads. One stage:
# with no tl.dot in its loop Triton's pipeliner leaves its gathers synchronous (two compiled no async load)
_KEYS = {"cuda": ((384, _C(32, 0, 4, 1)), (768, _C(16, 0, 4, 1)), (1 << 30, _C(8, 0, 4, 1))),
         "cdna": ((384, _C(32, 0, 4, 1)), (768, _C(16, 0, 4, 1)), (1 << 30, _C(8, 0, 4, 1)))}
# the delta preprocess (the dense kernel): rows per program and warps by v's block
_PRE = ((128, _C(64, 0, 4, None)), (256, _C(32, 0, 4, None)), (512, _C(16, 0, 8, None)))
_FP32 = {"fwd": _C(16, 16, 4, 1), "dq": _C(16, 16, 8, 2), "dkv": _C(16, 16, 4, 1)}
# CDNA's fp32 MFMAs (IEEE): one or two waves per 16-row tile as for 16-bit (dK/dV on 4: 1-2 waves took 256
# VGPRs, one wave per SIMD)
_FP32_CDNA = {"fwd": _W(16, 16, 1, 1), "dq": _W(16, 16, 2, 1), "dkv": _W(16, 16, 4, 1)}

# (max width, max group, config), by the MMA family. mma.sync (every CUDA arch at 16- and 32-row tiles:
# sm90's wgmma needs 64 rows per warpgroup) holds both operands of a dot in registers, and q (the
# dK/dV kernel's) or the gathered keys (dQ's) take two roles, so the head blocks of the backward stay
# at 16 rows; a 512-column fp32 accumulator (absorbed MLA's V and dK) needs 4-8 warps beside it.
_CUDA = {
    # GQA (<= 256): 16 q heads per step over 64 slots, 4 warps splitting the columns (no duplicated MMA).
    # 576/512: 16 heads on 4 warps; 32 and more on 8 (64 on sm100's tcgen05). The 32-row tile repeats its
    # score dot on 2 warps (Triton lays a chained dot's warps along its rows); a layout without any
    # repeat would hold 256 registers of 512-column accumulator per thread.
    "fwd": ((256, 1 << 30, _C(16, 64, 4, 2)), (1024, 16, _C(16, 32, 4, 2)), (1024, 1 << 30, _C(32, 32, 8, 2))),
    "dq": ((256, 1 << 30, _C(16, 32, 4, 2)), (1024, 1 << 30, _C(16, 32, 8, 2))),
    # dK/dV: 16 slots by 16 heads per step (32 slots took 226-255 registers and spilled 36 B in the atomic
    # variant at 192/128 under Triton 3.9.0; 16: 154-166); at 576/512, 16 slots by 32 heads on 8 warps
    "dkv": ((256, 1 << 30, _C(16, 16, 4, 2)), (1024, 1 << 30, _C(32, 16, 8, 2))),
}
for _kernel, _rows in _CUDA.items():
    for _target in ("sm80", "sm86", "sm89", "sm90", "sm100", "sm120"):
        _TABLES[_kernel][_target] = _rows
# sm100: 64 heads per forward step (64-128 heads) on tcgen05 over 16 slots (32 slots took 208 KB and 255
# registers and spilled 12 B under Triton 3.7.1). sm90's wgmma at 64 heads (64 x 32 on two warpgroups:
# 234-244 registers and no spill under 3.6.0-3.8.0) spilled 144 B under 3.9.0 (64 x 16: 64 B; one
# stage: 360 B), so sm90 keeps mma.sync's 32-head tile.
_TABLES["fwd"]["sm100"] = _CUDA["fwd"][:2] + ((1024, 32, _C(32, 32, 8, 2)), (1024, 1 << 30, _C(64, 16, 8, 2)))
# AMD CDNA (wave64, 16x16 MFMAs, single-stage loops): a chained dot's waves go along its rows too, so
# a 16-row tile takes 1-2 waves (each more repeats the score dots: 8 waves on the 576/512 backward
# were spill-free at 2 waves per SIMD but repeated them 8 times); at 576/512 the backward's two
# waves hold their accumulators partly in AGPRs, one wave per SIMD. Same table for gfx90a, gfx942
# and gfx950.
_CDNA = {
    "fwd": ((256, 1 << 30, _W(16, 64, 1, 1)), (1024, 16, _W(16, 32, 2, 1)), (1024, 1 << 30, _W(64, 16, 8, 1))),
    "dq": ((256, 1 << 30, _W(16, 32, 2, 1)), (1024, 1 << 30, _W(16, 16, 2, 1))),
    "dkv": ((256, 1 << 30, _W(16, 32, 2, 1)), (1024, 1 << 30, _W(16, 16, 2, 1))),
}
_CDNA_RANGE_DKV = _CDNA["dkv"]
# DeepSeek-V4's 512/512 (K = V): the slot-mode dK/dV on 2 waves spilled 1 VGPR (256 VGPRs, AGPRs to spare) on
# gfx942 under Triton 3.6.0 and on gfx90a under 3.7.1; 4 waves
_CDNA["dkv"] = _CDNA["dkv"][:1] + ((512, 1 << 30, _W(16, 16, 4, 1)),) + _CDNA["dkv"][1:]
for _kernel, _rows in _CDNA.items():
    for _target in CDNA_TARGETS:
        _TABLES[_kernel][_target] = _rows

# Range mode (full rows as dense attention over contiguous keys): block_m is the tile's MMA rows, BLOCK_T
# query tokens x BLOCK_H q heads (``range_tile``), so a GQA group smaller than 16 fills the rows with tokens
# instead of masked heads, and at 576/512 16 heads take two tokens per 32-row tile: one key block serves both.
_CUDA_RANGE = {
    "range_fwd": ((256, 1 << 30, _C(16, 64, 4, 2)), (1024, 1 << 30, _C(32, 32, 8, 2))),
    "range_dq": ((256, 1 << 30, _C(16, 32, 4, 2)), (1024, 1 << 30, _C(16, 32, 8, 2))),
    # keys x rows as the slot-mode dK/dV's slots x heads, but 16 rows at 576/512: its 32 spilled 40 B on sm90 under
    # Triton 3.7.1 (the range program holds its key block across two loops; one stage: 118 KB, unpipelined), and
    # on 4 warps 16 x 16 spilled 244 B
    "range_dkv": ((256, 1 << 30, _C(16, 16, 4, 2)), (1024, 1 << 30, _C(16, 16, 8, 2))),
}
_CDNA_RANGE = {
    "range_fwd": ((256, 1 << 30, _W(16, 64, 1, 1)), (1024, 1 << 30, _W(64, 16, 8, 1))),
    "range_dq": _CDNA["dq"],
    "range_dkv": _CDNA_RANGE_DKV,
}
for _kernel in RANGE_KERNELS:
    for _target in ("sm80", "sm86", "sm89", "sm90", "sm100", "sm120"):
        _TABLES[_kernel][_target] = _CUDA_RANGE[_kernel]
    for _target in CDNA_TARGETS:
        _TABLES[_kernel][_target] = _CDNA_RANGE[_kernel]
# sm100 keeps mma.sync's 32 rows in the range mode: its slot mode's 64 x 16 on tcgen05 spilled 84-120 B in the
# range forward under Triton 3.8.0 (the rows' own bounds and the [64, 16] mask beside the accumulator)
# gfx90a and gfx942: the 576/512 forward's 64 x 16 on 8 waves spilled 4-84 B per lane under Triton 3.6.0 and
# 3.7.1 (both modes; none under 3.9.0); 32 x 32 on 4 waves holds its accumulators in VGPRs and AGPRs
for _target in ("gfx90a", "gfx942"):
    _TABLES["fwd"][_target] = _CDNA["fwd"][:2] + ((1024, 1 << 30, _W(32, 32, 4, 1)),)
    _TABLES["range_fwd"][_target] = _CDNA_RANGE["range_fwd"][:1] + ((1024, 1 << 30, _W(32, 32, 4, 1)),)


# Block mode (block-sparse rows, a block's keys read as contiguous rows): the forward and dQ as the slot mode's
# tables (q heads of one token x keys of a named block). The dK/dV (a program per tile of a block's keys, walking
# the tokens that name the block, BLOCK_T tokens x BLOCK_H heads per step) reads each token's q and dO rows once per
# tile, so up to 256 its tile is 64 keys: 16 rows x 64 keys on 8 warps compiled to sm90's wgmma (145-154 registers)
# and sm100's tcgen05 (96), 4 waves on CDNA (210-216 VGPRs on gfx942, no repeated MFMA; 8 waves repeat it twice),
# where the range mode's 16 x 16 read them four times as often; above 256 the range mode's tile.
_BLOCK_TWINS = {"block_fwd": "fwd", "block_dq": "dq", "block_dkv": "range_dkv"}
for _kernel, _twin in _BLOCK_TWINS.items():
    for _target, _rows in _TABLES[_twin].items():
        _TABLES[_kernel][_target] = _rows
for _target in ("sm80", "sm86", "sm89", "sm90", "sm100", "sm120"):
    _TABLES["block_dkv"][_target] = ((256, 1 << 30, _C(16, 64, 8, 2)),) + _CUDA_RANGE["range_dkv"][1:]
for _target in CDNA_TARGETS:
    _TABLES["block_dkv"][_target] = ((256, 1 << 30, _W(16, 64, 4, 1)),) + _CDNA_RANGE["range_dkv"][1:]


def range_tile(group: int, rows: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_H) of a range-mode tile of ``rows`` MMA rows: the group's q heads rounded up to
    a power of two (at most ``rows``), and as many query tokens as fill the rest."""
    block_h = min(rows, triton.next_power_of_2(max(group, 1)))
    return rows // block_h, block_h


def block_h_for(group: int, block_h: int) -> int:
    """BLOCK_H for a group of ``group`` q heads per kv head: the config's, or the group rounded up
    to a power of two when smaller, at least MIN_BLOCK_H."""
    return max(MIN_BLOCK_H, min(block_h, triton.next_power_of_2(max(group, 1))))


# Ascend: tiles sized by the on-chip buffer (configs of the dense kernels: kernels/config.py), 1 warp.
_ASCEND_TILES = ((64, 64), (64, 32), (32, 64), (32, 32), (16, 64), (16, 32), (16, 16))


def step_bytes(kernel: str, block_h: int, block_n: int, block_dqk: int, block_dv: int, elem: int) -> int:
    """On-chip bytes one step of ``kernel`` holds at once, as kernels/config.py counts the dense
    kernels' (every tile as if in one buffer: a conservative bound). fwd: q, the gathered k and v,
    p (input dtype); scores and acc (fp32). dq: q, dO, k, v, p and ds; scores, dp and the dq
    accumulator. dkv: k, v, q, dO, p and ds; scores, dp and the dk/dv accumulators."""
    tiles = block_h * block_dqk + block_n * block_dqk + block_n * block_dv + block_h * block_n
    if kernel == "fwd":
        return elem * tiles + 4 * (block_h * block_n + block_h * block_dv + 3 * block_h)
    tiles += block_h * block_dv + block_h * block_n
    acc = block_h * block_dqk if kernel == "dq" else block_n * (block_dqk + block_dv)
    return elem * tiles + 4 * (2 * block_h * block_n + acc + 2 * block_h)


def _ascend(kernel: str, block_dqk: int, block_dv: int, elem: int) -> AttnConfig:
    if kernel == "reduce":
        return _C(0, 64, 1, 1)
    if kernel == "keys":
        return _C(16, 0, 1, 1)
    if kernel == "pre":
        return _C(16, 0, 1, None)
    for block_h, block_n in _ASCEND_TILES:
        if step_bytes(kernel, block_h, block_n, block_dqk, block_dv, elem) <= ASCEND_STEP_BUDGET:
            return _C(block_h, block_n, 1, 1)
    return _C(*_ASCEND_TILES[-1], 1, 1)  # tl.dot's minimum: relies on the over-count


def sparse_config(target: str, kernel: str, block_dqk: int, block_dv: int, elem: int = 2,
                  group: int = 1) -> AttnConfig:
    """The config of sparse ``kernel`` (``KERNELS``: the slot mode's "fwd", "dq", "dkv", the range
    mode's "range_fwd", "range_dq", "range_dkv", "reduce", "keys", "pre") on ``target``: ``block_dqk`` the
    q/k blocks' total width (576 for 512 + 64), ``block_dv`` v's block, ``elem`` bytes per input
    element, ``group`` q heads per kv head. ``block_m`` is the slot mode's BLOCK_H, fitted to the group
    (``block_h_for``), and the range mode's MMA rows (``range_tile`` splits them)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown sparse kernel {kernel!r}; expected one of {KERNELS}")
    twin = RANGE_KERNELS.get(kernel, BLOCK_KERNELS.get(kernel, kernel))
    if target == "interpreter":
        cfg = _INTERPRETER[kernel]
    elif target == "ascend":
        cfg = _ascend(twin, block_dqk, block_dv, elem)
    else:
        cdna = target in CDNA_TARGETS
        if kernel == "reduce":
            cfg = _REDUCE["cdna" if cdna else "cuda"]
        elif kernel == "keys":
            cfg = next(c for w, c in _KEYS["cdna" if cdna else "cuda"] if block_dqk + block_dv <= w)
        elif kernel == "pre":
            cfg = next(c for w, c in _PRE if block_dv <= w)
        elif elem == 4:
            cfg = (_FP32_CDNA if cdna else _FP32)[twin]
        else:
            widest = max(block_dqk, block_dv)
            rows = [c for w, g, c in _TABLES[kernel][target] if widest <= w and group <= g]
            if not rows:
                raise ValueError(f"no sparse {kernel} config for head blocks {block_dqk}/{block_dv} on {target}")
            cfg = rows[0]
        cfg = cfg._replace(fp_fusion=FP_FUSION) if cdna else cfg._replace(maxnreg=MAXNREG, fp_fusion=FP_FUSION)
    if kernel in ("reduce", "keys", "pre", "block_dkv") or kernel in RANGE_KERNELS:
        return cfg
    return cfg._replace(block_m=block_h_for(group, cfg.block_m))
