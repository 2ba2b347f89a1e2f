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
with masked rows): ``sparse_config``. Tables are keyed by what sets a kernel's register pressure:
target, the width class of the padded head dims (q/k blocks summed, e.g. 576 for 512 + 64, and v's),
the V form (V the gathered key block, absorbed MLA's ``V_IS_K``, or a separate V tile: a row may name
one), the dtype (fp32 has its own tables) and the group class (heads per kv head: the 16-row tiles of
GQA and the 64-row ones of absorbed MLA's 64-128 heads take different warps). A configuration no
config fits is refused by name (``refusal``, ``SparseRefused``: float32 past 256 columns), and the
sparse ops run it on the torch backend.

How the CUDA and CDNA entries were picked: by compiling (``python -m bench.compile_sweep``,
coreattn/tune/compiler.py; docs/compile-report.md has the figures per arch and Triton). The sweep
(every configuration class of the supported set: absorbed 576/512 and 512/512 at 8-128 q heads,
per-head K/V at 576/512, 512/512, 256/256 and 192/128, GQA 4 and 16, one kv head with a separate
512-wide V; bf16, fp16 and fp32; both modes, both dK/dV variants) compiles for sm90, sm100, gfx90a, gfx942
and gfx950 under one Triton release per run, and asks of every kernel 0 spill bytes, shared memory (LDS)
within the arch's, no pipelined-load hazard nor i32 stride offset, and every 16-bit tl.dot an MMA of its
input type (mma.sync; tcgen05 for sm100's 64-head slot-mode forward; 16x16 MFMAs): the comments below
name the spills it found and what removed them (docs/compile-report.md has the runs' figures, and which
releases they cover); tests/kernels/test_kernel_structure.py and test_pipeline_hazards.py compile a subset in CI. sm80,
sm86, sm89 and sm120 share the CUDA tables (chosen on them under all four releases before the sweep;
not in it). The comments below say what each choice avoided. What is left is MMA work: the score dots
of 16- and 32-row tiles repeat on 2-4 warps (CDNA waves), and a slot-mode GQA group smaller than 16
pads the 16-row tile with masked heads (the range mode fills it with tokens). None has been timed.

Ascend (triton-ascend: one warp, a persistent grid) sizes the tiles by the on-chip buffer as the
dense tables do (``step_bytes``); the kernels run under triton-ascend 3.2's interpreter in the
Ascend CI lane. At 576/512 the backward's accumulators exceed the 96 KB step budget even at
16 x 16, which relies on the count's overestimate (the dense fp32 kernels at 256 do the same).
"""

from __future__ import annotations

import functools

import torch
import triton

from coreattn.kernels.configs.base import AttnConfig, head_blocks
from coreattn.kernels.configs.targets import ASCEND_STEP_BUDGET, CDNA_TARGETS, FP_FUSION, MAXNREG, target_of

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
# fp32 (IEEE: FMA loops on CUDA; fp32 MFMAs on CDNA; past 256 columns ``refusal`` refuses both), rows as below,
# the range mode's twin's unless given. CUDA: 8 warps spread an FMA dot's operands (the range forward at 256/256
# with GQA 4 took 255 registers and spilled 24 B on 4 warps under Triton 3.9.0, 89 on 8; dK/dV per-head 4-8 B, 89)
_FP32 = {"fwd": ((256, 1 << 30, _C(16, 16, 8, 1)),), "dq": ((256, 1 << 30, _C(16, 16, 8, 2)),),
         "dkv": ((256, 1 << 30, _C(16, 16, 8, 1)),)}
# CDNA's fp32 MFMAs (IEEE): one or two waves per 16-row tile as for 16-bit (dK/dV on 4: 1-2 waves took 256
# VGPRs, one wave per SIMD)
_FP32_CDNA = {"fwd": ((256, 1 << 30, _W(16, 16, 1, 1)),), "dq": ((256, 1 << 30, _W(16, 16, 2, 1)),),
              "dkv": ((256, 1 << 30, _W(16, 16, 4, 1)),)}

# (max width, max group, config), by the MMA family. mma.sync (every CUDA arch at 16- and 32-row tiles:
# sm90's wgmma needs 64 rows per warpgroup) holds both operands of a dot in registers, and q (the
# dK/dV kernel's) or the gathered keys (dQ's) take two roles, so the head blocks of the backward stay
# at 16 rows; a 512-column fp32 accumulator (absorbed MLA's V and dK) needs 4-8 warps beside it.
_CUDA = {
    # GQA up to 192: 16 q heads per step over 64 slots, 4 warps splitting the columns (no duplicated MMA); at
    # 256 over 32 slots (64 spilled 4-20 B in both modes, per-head and GQA, under Triton 3.9.0: a 256-column V
    # tile and accumulator). 576/512 and 512/512: 16 heads on 8 warps (4 warps: 254 registers with V the key
    # block, 4-28 B of spill with a separate V under 3.9.0; 8: 164-170), 32 and more on 8 (64 on sm100's
    # tcgen05). The 16- and 32-row tiles repeat their score dot on 2 warps (Triton lays a chained dot's warps
    # along its rows); a layout without any repeat would hold 256 registers of 512-column accumulator per thread.
    "fwd": ((192, 1 << 30, _C(16, 64, 4, 2)), (256, 1 << 30, _C(16, 32, 4, 2)), (1024, 16, _C(16, 32, 8, 2)),
            (1024, 1 << 30, _C(32, 32, 8, 2))),
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
_TABLES["fwd"]["sm100"] = _CUDA["fwd"][:3] + ((1024, 32, _C(32, 32, 8, 2)), (1024, 1 << 30, _C(64, 16, 8, 2)))
# AMD CDNA (wave64, 16x16 MFMAs, single-stage loops): a chained dot's waves go along its rows too, so
# a 16-row tile takes 1-2 waves (each more repeats the score dots: 8 waves on the 576/512 backward
# were spill-free at 2 waves per SIMD but repeated them 8 times); at 576/512 the backward's two
# waves hold their accumulators partly in AGPRs, one wave per SIMD. Same table for gfx90a, gfx942
# and gfx950.
# With a separate V tile past 256 columns (per-head K/V, one kv head with its own V) the 16-head forward takes 4
# waves (2 spilled a VGPR at 512/512 on gfx90a under Triton 3.9.0; 4: 204 VGPRs, two waves per SIMD) and the
# range dK/dV too (2 waves took 504-512 VGPRs + AGPRs at 576/512 and 512/512 on gfx90a; 4: 338). dK/dV at 256
# on 16 slots (32 left 36 B of scratch in the atomic variant at 256/256 on gfx90a; 16: 138-151 VGPRs).
_CDNA = {
    "fwd": ((256, 1 << 30, _W(16, 64, 1, 1)), (1024, 16, _W(16, 32, 4, 1), False), (1024, 16, _W(16, 32, 2, 1)),
            (1024, 1 << 30, _W(64, 16, 8, 1))),
    "dq": ((256, 1 << 30, _W(16, 32, 2, 1)), (1024, 1 << 30, _W(16, 16, 2, 1))),
    "dkv": ((192, 1 << 30, _W(16, 32, 2, 1)), (256, 1 << 30, _W(16, 16, 2, 1)), (1024, 1 << 30, _W(16, 16, 2, 1))),
}
_CDNA_RANGE_DKV = ((256, 1 << 30, _W(16, 32, 2, 1)), (1024, 1 << 30, _W(16, 16, 4, 1), False),
                   (1024, 1 << 30, _W(16, 16, 2, 1)))
# DeepSeek-V4's 512/512 (K = V): the slot-mode dK/dV on 2 waves spilled 1 VGPR (256 VGPRs, AGPRs to spare) on
# gfx942 under Triton 3.6.0 and on gfx90a under 3.7.1; 4 waves
_CDNA["dkv"] = _CDNA["dkv"][:2] + ((512, 1 << 30, _W(16, 16, 4, 1)),) + _CDNA["dkv"][2:]
# per-head K/V at 256 (a separate V, one head per program): 2 waves left 36 B of scratch in the atomic variant at
# 256/256 in fp16 on gfx942 under Triton 3.7.1; 4 waves: 126-152 VGPRs on gfx90a, gfx942 and gfx950, no scratch
_CDNA["dkv"] = _CDNA["dkv"][:1] + ((256, 1, _W(16, 16, 4, 1), False),) + _CDNA["dkv"][1:]
for _kernel, _rows in _CDNA.items():
    for _target in CDNA_TARGETS:
        _TABLES[_kernel][_target] = _rows
# gfx90a: absorbed 576/512 with 8 q heads a program (128 heads at TP 16), the atomic dK/dV on 2 waves spilled a VGPR in
# fp16 under Triton 3.7.1 (256 VGPRs, 96 AGPRs); 4 waves
_TABLES["dkv"]["gfx90a"] = _CDNA["dkv"][:4] + ((1024, 8, _W(16, 16, 4, 1)),) + _CDNA["dkv"][4:]

# Range mode (full rows as dense attention over contiguous keys): block_m is the tile's MMA rows, BLOCK_T
# query tokens x BLOCK_H q heads (``range_tile``), so a GQA group smaller than 16 fills the rows with tokens
# instead of masked heads, and at 576/512 16 heads take two tokens per 32-row tile: one key block serves both.
_CUDA_RANGE = {
    # with a separate V tile past 256 columns 16 rows (32 x 32 spilled 4-8 B per-head at 576/512 on sm90 and sm100
    # under Triton 3.7.1; 16 x 32: 183-199 registers)
    "range_fwd": ((192, 1 << 30, _C(16, 64, 4, 2)), (256, 1 << 30, _C(16, 32, 4, 2)),
                  (1024, 1 << 30, _C(16, 32, 8, 2), False), (1024, 1 << 30, _C(32, 32, 8, 2))),
    "range_dq": ((256, 1 << 30, _C(16, 32, 4, 2)), (1024, 1 << 30, _C(16, 32, 8, 2))),
    # keys x rows as the slot-mode dK/dV's slots x heads, but 16 rows at 576/512: its 32 spilled 40 B on sm90 under
    # Triton 3.7.1 (the range program holds its key block across two loops; one stage: 118 KB, unpipelined), and
    # on 4 warps 16 x 16 spilled 244 B. Absorbed MLA with a group under 16 (rows of 2-8 tokens) at 576/512 spilled
    # 8 B on 2 stages on sm90 and sm100 under Triton 3.9.0 (each row's own bounds beside the pipelined loads): one
    # stage, 206 registers (the key block is loaded once per program; its q and dO loads go unpipelined)
    "range_dkv": ((256, 1 << 30, _C(16, 16, 4, 2)), (512, 1 << 30, _C(16, 16, 8, 2)), (1024, 8, _C(16, 16, 8, 1), True),
                  (1024, 1 << 30, _C(16, 16, 8, 2))),
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
    _TABLES["fwd"][_target] = _CDNA["fwd"][:3] + ((1024, 1 << 30, _W(32, 32, 4, 1)),)
    _TABLES["range_fwd"][_target] = _CDNA_RANGE["range_fwd"][:1] + ((1024, 1 << 30, _W(32, 32, 4, 1)),)
# gfx942: the slot forward up to 256 columns on 16 x 64 (1 wave) spilled 44-64 B per lane in bf16 and fp16 under
# Triton 3.8.0 (per-head and GQA 256/256, the block mode); 16 x 32 (243-255 VGPRs, no spill under 3.6.0 and 3.8.0)
_TABLES["fwd"]["gfx942"] = ((256, 1 << 30, _W(16, 32, 1, 1)),) + _TABLES["fwd"]["gfx942"][1:]


# Block mode (block-sparse rows, a block's keys read as contiguous rows): the forward and dQ as the slot mode's
# tables (q heads of one token x keys of a named block). The dK/dV (a program per tile of a block's keys, walking
# the tokens that name the block, BLOCK_T tokens x BLOCK_H heads per step) reads each token's q and dO rows once per
# tile, so up to 256 its tile is 64 keys: 16 rows x 64 keys on 8 warps compiled to sm90's wgmma (145-154 registers)
# and sm100's tcgen05 (96), 4 waves on CDNA (210-216 VGPRs on gfx942, no repeated MFMA; 8 waves repeat it twice),
# where the range mode's 16 x 16 read them four times as often; above 256 the range mode's tile. At 256 on CUDA 32
# keys: 16 x 64 spilled 24 B at 255 registers on sm90 under Triton 3.9.0 (one stage 220 B, 4 warps 3 KB); 16 x 32 on
# 8 warps compiles to mma.sync at 152-156 registers, no spill, on sm90 and sm100 under 3.6.0-3.9.0.
_BLOCK_TWINS = {"block_fwd": "fwd", "block_dq": "dq", "block_dkv": "range_dkv"}
for _kernel, _twin in _BLOCK_TWINS.items():
    for _target, _rows in _TABLES[_twin].items():
        _TABLES[_kernel][_target] = _rows
for _target in ("sm80", "sm86", "sm89", "sm90", "sm100", "sm120"):
    _TABLES["block_dkv"][_target] = ((192, 1 << 30, _C(16, 64, 8, 2)), (256, 1 << 30, _C(16, 32, 8, 2))
                                     ) + _CUDA_RANGE["range_dkv"][1:]
for _target in CDNA_TARGETS:
    _TABLES["block_dkv"][_target] = ((256, 1 << 30, _W(16, 64, 4, 1)),) + _CDNA_RANGE["range_dkv"][1:]


class SparseRefused(ValueError):
    """A configuration the Triton kernels do not run on a target (``refusal`` names why): the sparse
    ops run it on the torch backend (``backend="triton"`` raises)."""


CUDA_TARGETS = ("sm80", "sm86", "sm89", "sm90", "sm100", "sm120")
# fp32 (IEEE) past 256 columns: CUDA runs an fp32 tl.dot as FMA loops whose operand layout holds a whole row block
# of the reduced dim per thread, repeated across the warps, so a 512-wide q/k block (absorbed 576/512, 512/512)
# spills 1.4-5.5 KB in dQ and dK/dV on 4 or 8 warps (sm90, Triton 3.7.1 and 3.9.0; 16 warps leave 128 registers
# a thread). CDNA's fp32 MFMAs (16x16x4) lay a 16-row tile's waves along its rows, each holding the whole q, key
# and dO blocks: at 576/512 on gfx942 (Triton 3.9.0) dQ spilled 660 B on 2 waves and 220 B on 4, dK/dV 80-148 B
# on 4 and 0.9 KB on 8 (two waves per SIMD halve the registers). Such calls run on the torch backend.
FP32_MAX_WIDTH = 256


def refusal(target: str, block_dqk: int, block_dv: int, elem: int) -> str | None:
    """Why the Triton kernels refuse the configuration on ``target`` (widths as in ``sparse_config``), or None."""
    widest = max(block_dqk, block_dv)
    if elem == 4 and (target in CUDA_TARGETS or target in CDNA_TARGETS) and widest > FP32_MAX_WIDTH:
        return (f"float32 with head blocks {block_dqk}/{block_dv} on {target}: the float32 (IEEE) kernels spill "
                f"registers at head blocks wider than {FP32_MAX_WIDTH} (coreattn/kernels/configs/sparse.py "
                f"FP32_MAX_WIDTH); bfloat16 and float16 run on Triton, float32 on the torch backend")
    return None


def triton_refusal(device: torch.device, dtype: torch.dtype, dim_qk: int, dim_v: int) -> str | None:
    """``refusal`` for a sparse attention call's tensors: q/k head dim ``dim_qk``, V's ``dim_v``."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None  # not a kernel dtype: the layer names it
    block_dqk, block_dqk2, block_dv = head_blocks(dim_qk, dim_v)
    return refusal(target_of(device), block_dqk + block_dqk2, block_dv, dtype.itemsize)


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


def _pick(rows, widest: int, group: int, v_is_k: bool) -> AttnConfig | None:
    """The first row ``(max width, max group, config[, V form])`` that holds: the V form, where given,
    True for rows whose V is the gathered key block (absorbed, ``V_IS_K``), False for a separate V tile."""
    for w, g, cfg, *form in rows:
        if widest <= w and group <= g and (not form or form[0] == v_is_k):
            return cfg
    return None


def sparse_config(target: str, kernel: str, block_dqk: int, block_dv: int, elem: int = 2,
                  group: int = 1, v_is_k: bool = False) -> AttnConfig:
    """The config of sparse ``kernel`` (``KERNELS``: the slot mode's "fwd", "dq", "dkv", the range
    mode's "range_fwd", "range_dq", "range_dkv", "reduce", "keys", "pre") on ``target``: ``block_dqk`` the
    q/k blocks' total width (576 for 512 + 64), ``block_dv`` v's block, ``elem`` bytes per input
    element, ``group`` q heads per kv head. ``block_m`` is the slot mode's BLOCK_H, fitted to the group
    (``block_h_for``), and the range mode's MMA rows (``range_tile`` splits them)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown sparse kernel {kernel!r}; expected one of {KERNELS}")
    refused = refusal(target, block_dqk, block_dv, elem)
    if refused:
        raise SparseRefused(refused)
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
        else:
            fp32 = _FP32_CDNA if cdna else _FP32
            rows = fp32.get(kernel, fp32[twin]) if elem == 4 else _TABLES[kernel][target]
            cfg = _pick(rows, max(block_dqk, block_dv), group, v_is_k)
            if cfg is None:
                raise ValueError(f"no sparse {kernel} config for head blocks {block_dqk}/{block_dv} on {target}")
        cfg = cfg._replace(fp_fusion=FP_FUSION) if cdna else cfg._replace(maxnreg=MAXNREG, fp_fusion=FP_FUSION)
    if kernel in ("reduce", "keys", "pre", "block_dkv") or kernel in RANGE_KERNELS:
        return cfg
    if kernel == "dkv" and group == 1 and cfg.num_stages:
        # one q head per kv head (per-head K/V): Triton specializes the group argument 1 to a constant, so the
        # slot-mode dK/dV's loop over the group's head blocks has one step and nothing to pipeline (two stages
        # compiled no asynchronous load under Triton 3.7.1 on sm90 and sm100)
        cfg = cfg._replace(num_stages=1)
    return cfg._replace(block_m=block_h_for(group, cfg.block_m))
