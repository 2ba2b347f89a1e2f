"""The dense attention kernels' launch tables per target (forward, dK/dV, dQ and the backward
preprocess; kernels/attn_fwd.py, kernels/attn_bwd.py) and the launchers' calls into them.

``shipped_config`` reads the tables; ``fwd_config``, ``bwd_configs`` and ``preprocess_config`` are
what the launchers call (through configs/pick.py: forced > tuned > these tables); ``split_dkdv``
says when dK and dV take two passes. The forward, the dK/dV kernel and the dQ kernel each have
their own tile: dK/dV holds many keys and steps over few queries, dQ the reverse, so each dot's
rows are the tile's long side and no warp computes another warp's rows.

CUDA tables, as the compile report shows them (``python -m bench --what kernels``: static
compiler output for each arch; bf16 and fp16, causal and not, MHA and GQA 4, fp32, and dropout,
softmax offset and max logit at every head dim; tests/kernels/test_kernel_structure.py keeps the main ones).
One table serves every Triton release CI tests (3.6.0, 3.7.1, 3.8.0, 3.9.0: kernels/versions.py),
whose compilers differ (register allocation, spills): docs/compile-report.md has each one's figures.

- Every CUDA launch sets ptxas's register ceiling to the register file (``maxnreg`` 255): left to
  itself ptxas often stopped at 48-168 registers and spilled.
- sm90: at 64, 128 and 192/128 every forward, dK/dV and dQ kernel, the feature variants (dropout,
  softmax offset with the SINK_GRAD dQ, max logit) included, has 0 spill bytes, every tl.dot is a
  wgmma, no MMA layout is wider than its tile and num_stages >= 2. 8 warps (two warpgroups) per
  tile; registers bound occupancy to one block per SM, shared memory does not. At 256 the
  forward's and dQ's key steps shrink to 16 (128 x 16; dQ's 128 x 32 spilled 4 B under Triton 3.6.0
  and 3.7.1, not 3.9.0) and dK and dV take two passes (split_dkdv): also 0 spills, at the cost of
  narrow key steps and Q K^T recomputed once. Since issue 30's address clamps (every row index of
  a loop clamped into its sequence: kernels/attn_common.py), GQA at 192/128 takes two dK/dV passes
  too, and the dropout forward at 128 steps over 32 keys (their one-pass and 64-key tiles, at
  253-255 registers before, spilled 4-40 B).
- sm100: sm90's backward tiles (same 227 KB per block; tcgen05 MMAs) but the dK/dV kernel at 64,
  which steps over 16 queries (32 spilled under Triton 3.6.0 with the address clamps); the forward
  steps over 32 keys at 128 and 192 (64 spilled there), and at 64 with dropout; the dropout
  backward takes narrower tiles (dQ 128 x 32 at 64 and 128, dK/dV 16 x 64 at 256: Triton 3.7.1
  spilled the wider ones). No kernel spills, 256 included.
- sm80 (163 KB) and the 99 KB parts (sm86, sm89, sm120: the "sm86" table; sm120 takes smaller
  dropout tiles at 64 and 256) use mma.sync, whose accumulators stay in registers: 128-row tiles
  take 8 warps (64), wider heads 4 warps and 16-64-row tiles (sm80's dK/dV at 64: 32 x 32, as
  Triton 3.6.0 spilled 32 x 64). No kernel spills at any head dim.
  What is left at 256 on these archs is tile size, not correctness: 32 x 32 tiles and
  single-stage backward loops, about half the MMA work per loaded byte of a 64-row tile, because
  64 rows x 256 fp32 columns of accumulator are 128 registers per thread on top of the operands.
- fp32 (IEEE, no tensor cores) takes one small tile on every arch (``_FP32``): 0 spills.

CDNA tables (ROCm's PyTorch reports AMD GPUs as ``cuda`` devices; ``target_of`` reads the
device's gcnArchName), checked the same way (``python -m bench --what kernels --arch gfx90a gfx942
gfx950``: the AMDGCN LLVM emits, no GPU or ROCm needed; tests/kernels/test_kernel_structure.py keeps
gfx942 and gfx950 at the main dims, gfx90a where its tables differ; figures from
bench/results/compile-report_2026-11-27/):

- Every bf16 and fp16 kernel at 64, 128, 192/128 and 256, the feature variants included (the additive
  biases on their own tiles, ``_BIAS``: bench/results/compile-report-bias_2026-12-06/), spills no
  VGPR and uses no scratch, keeps its LDS within the arch's limit (at most 64 KB of 64 or 160), and
  every tl.dot is an MFMA of the input type that no two waves duplicate, and keeps 2 waves per
  SIMD. SGPRs spill in some forwards (up to 33, into VGPR lanes: no memory traffic).
- Registers shape the tiles, not LDS. A SIMD has 512 registers per lane (VGPRs and AGPRs), a wave
  addresses at most 256 VGPRs and LLVM keeps only MFMA accumulators in AGPRs; an 8-wave workgroup
  (2 waves per SIMD) caps each wave at 256. The tiles are the largest whose long side is at most
  128 (as on CUDA: a packed batch's short sequences leave partial tiles) that stay within that
  without spilling; at 256 the dK/dV and dQ tiles take 4 waves, whose extra register freedom let
  LLVM fit them (dQ as 128 x 16 with 8 waves spilled 6 VGPRs in fp16, 64 x 16 with 4 waves did not).
- matrix_instr_nonkdim 16, the one AMD launch option the tables set (waves_per_eu 2 made LLVM
  spill gfx942's dropout dK pass at 256, 3 VGPRs, where it otherwise takes 259 registers). With
  Triton's default 32x32 MFMAs 8 waves on a 128-row tile (or 4 on a 64-row one) repeat each MFMA
  in two waves (gfx942's forward at 128, 128 x 64: 240 registers, 26 SGPRs spilled and DUP 2 with
  32x32; 210, none and none with 16x16).
- num_stages 1, as Triton's fused-attention tutorial sets on HIP: 2 spilled gfx942's forward at
  128 (11 VGPRs). On gfx950 (async copies to LDS) 2 stages compiled without spills there (198
  registers, 66 KB of LDS): a candidate to time on hardware.
- No ``maxnreg`` (the HIP backend rejects it) and dot precision "ieee" (it allows tf32 on gfx942
  only); fp32 runs on CDNA's IEEE fp32 MFMAs with one small tile (``_FP32_CDNA``), one wave per
  SIMD, spill-free at 128. At 256 fp32's dK and dQ kernels spill on CDNA: a 16-row fp32 tile of q,
  dO and dQ plus the k and v tiles is more than 256 VGPRs however it is cut.
- gfx950 (16x16x32 MFMAs) needs fewer registers than gfx942 and takes wider tiles where they stay
  spill-free; gfx90a needs more in the forward (narrower key steps at 64, 128 and 256) and in the
  dK/dV kernel at 256 (2 waves on 16 x 32).
- None of these tiles has been timed: no AMD GPU was available. The tuner may search the rest.

None of these tables has been timed: they come from compiler output alone.

Ascend block sizes come from the on-chip buffer: 192 KB per core, halved by double buffering
(the compiler's multibuffer), so a step's live tiles must fit in 96 KB. ``fwd_step_bytes`` and
``bwd_step_bytes`` count every tile a step of the kernels holds at once, as if all sat in that one
buffer (tl.dot operands really pass through the cube unit's own L0/L1 buffers, so this
over-counts: a conservative bound). ``_ascend_blocks`` takes the first (BLOCK_M, BLOCK_N) of
a short list, largest first, that fits. Worked example, forward, fp16, Dqk = 192 (padded 256)
and Dv = 128, M = 64, N = 32: inputs 2 B x (q 64x256 + k 32x256 + v 32x128 + p 64x32) =
61,440 B; fp32 4 B x (scores 64x32 + acc 64x128 + m, l, alpha 3x64) = 41,728 B; 103,168 B >
98,304 B, so it takes the next, M = 32, N = 64: 2 x (8192 + 16384 + 8192 + 2048) +
4 x (2048 + 4096 + 96) = 94,592 B. Only the fp32 backward at head dims 256/256 exceeds the
budget even at 16x16 (103,552 B by this count); it runs at 16x16 and relies on the
over-count.
"""

from __future__ import annotations

import functools

import torch

from coreattn.kernels.configs.base import AttnConfig
from coreattn.kernels.configs.pick import pick_config
from coreattn.kernels.configs.targets import ASCEND_STEP_BUDGET, CDNA_TARGETS, FP_FUSION, MAXNREG, target_of

# (BLOCK_M, BLOCK_N) candidates, largest first; the first whose step fits the budget wins
_ASCEND_BLOCKS = ((128, 128), (128, 64), (64, 128), (64, 64), (64, 32), (32, 64), (32, 32), (32, 16), (16, 32),
                  (16, 16))


def fwd_step_bytes(block_m: int, block_n: int, block_dqk: int, block_dv: int, elem: int) -> int:
    """On-chip bytes of one forward key step: q, k, v and p (input dtype), scores, acc and the
    row statistics m, l, alpha (fp32)."""
    inputs = block_m * block_dqk + block_n * block_dqk + block_n * block_dv + block_m * block_n
    return elem * inputs + 4 * (block_m * block_n + block_m * block_dv + 3 * block_m)


def bwd_step_bytes(block_m: int, block_n: int, block_dqk: int, block_dv: int, elem: int) -> int:
    """On-chip bytes of one backward step, the larger of the two kernels. dK/dV: k, v, q, dO and
    the casts of p, ds (input dtype); dk, dv accumulators, p, dp, ds (fp32); lse, delta. dQ: the
    same tiles with a dq accumulator in place of dk and dv."""
    inputs = (block_m + block_n) * (block_dqk + block_dv) + 2 * block_m * block_n
    dkdv = elem * inputs + 4 * (block_n * (block_dqk + block_dv) + 3 * block_m * block_n + 2 * block_m)
    dq = elem * inputs + 4 * (block_m * block_dqk + 3 * block_m * block_n + 2 * block_m)
    return max(dkdv, dq)


def _ascend_blocks(step_bytes, block_dqk: int, block_dv: int, elem: int) -> AttnConfig:
    for block_m, block_n in _ASCEND_BLOCKS:
        if step_bytes(block_m, block_n, block_dqk, block_dv, elem) <= ASCEND_STEP_BUDGET:
            return AttnConfig(block_m, block_n, 1, 1)
    return AttnConfig(*_ASCEND_BLOCKS[-1], 1, 1)  # tl.dot's minimum; see the module docstring


# Interpreter: small, unequal M and N blocks, so tests cross block edges and the diagonal
# logic is exercised with BLOCK_M != BLOCK_N.
_INTERPRETER = AttnConfig(block_m=16, block_n=32, num_warps=1, num_stages=1)


# CUDA tiles per target, by the widest padded head dim (q/k blocks summed when split, e.g. 192):
# (max width, AttnConfig(block_m, block_n, num_warps, num_stages)), first match wins. The forward
# and dQ tiles are block_m queries per program stepping over block_n keys; the dK/dV tile is
# block_n keys per program stepping over block_m queries. Each table is checked by compiling for
# its architecture (python -m bench --what kernels; tests/kernels/test_kernel_structure.py): shared memory
# within the arch's per-block limit, 0 spill bytes (see the module docstring for what is left).
# "sm86" is the table of the 99 KB mma.sync parts: sm86, sm89 and sm120.
_C = AttnConfig
_FWD = {
    "sm90": ((64, _C(128, 64, 8, 3)), (128, _C(128, 64, 8, 3)), (192, _C(128, 64, 8, 2)), (256, _C(128, 16, 8, 2))),
    "sm80": ((64, _C(128, 64, 8, 3)), (128, _C(64, 32, 4, 3)), (192, _C(64, 32, 4, 2)), (256, _C(32, 32, 4, 2))),
    "sm86": ((64, _C(128, 64, 8, 2)), (128, _C(64, 32, 4, 2)), (256, _C(32, 32, 4, 2))),
}
_DKDV = {
    "sm90": ((64, _C(32, 128, 8, 3)), (128, _C(16, 128, 8, 2)), (192, _C(16, 128, 8, 3)), (256, _C(16, 128, 8, 2))),
    # sm80 at 64: 32 keys, as at 128 (32 x 64 took 255 registers and spilled in fp16 GQA under Triton 3.6.0, 8 B of
    # spill stores and 4 B of loads;
    # 32 x 32: 128-208 registers, none, under 3.6.0 to 3.9.0)
    "sm80": ((64, _C(32, 32, 4, 2)), (128, _C(32, 32, 4, 2)), (256, _C(32, 32, 4, 1))),
    "sm86": ((64, _C(32, 64, 4, 2)), (128, _C(32, 32, 4, 2)), (256, _C(32, 32, 4, 1))),
}
_DQ = {
    # at 256 the key step is 16, as in the forward: 128 x 32 (255 registers) spilled 4 B under Triton 3.6.0 and 3.7.1
    "sm90": ((64, _C(128, 64, 8, 2)), (128, _C(128, 64, 8, 2)), (192, _C(128, 32, 8, 2)), (256, _C(128, 16, 8, 2))),
    "sm80": ((64, _C(64, 32, 4, 2)), (128, _C(64, 32, 4, 2)), (256, _C(32, 32, 4, 1))),
    "sm86": ((64, _C(32, 64, 4, 2)), (128, _C(64, 32, 4, 2)), (192, _C(16, 32, 4, 1)), (256, _C(32, 32, 4, 1))),
}
# Dropout adds Philox's state to the live registers: where the plain tile runs out of them, the
# dropout kernels take these instead (and the dK/dV kernel splits, see split_dkdv).
# sm90 at 128: the 64-key step took 255 registers and spilled 28-40 B since issue 30's address clamps
_FWD_DROPOUT = {"sm90": ((128, _C(128, 32, 8, 3)), (192, _C(128, 32, 8, 2))), "sm80": (), "sm86": ()}
_DQ_DROPOUT = {"sm90": (), "sm80": (), "sm86": ()}
# The INT64_LANES variant (64-bit lane offsets, for launches whose strides need them: kernels/attn_common.py)
# takes a few more registers in some kernels; where that spilled on the table's tile, that variant takes these.
# sm90's dropout dQ at 64: 128 x 64 (254 registers in the int32 variant) took 255 and spilled 4 B under Triton
# 3.6.0 and 3.7.1 (docs/compile-report.md#64-bit-lane-offsets); 128 x 32 takes 191-227 under 3.6.0 to 3.9.0.
# At 192/128 with every feature (GQA, window, dropout, sink, max logit, strided keep masks) the table's
# 128 x 32 took 255 and spilled 60 B under Triton 3.9.0 (CI's 3.9.0 lane): a 16-key step there.
_DQ_DROPOUT_INT64 = {"sm90": ((64, _C(128, 32, 8, 2)), (192, _C(128, 16, 8, 2)))}
# sm100: sm90's tiles (same 227 KB per block) but for the forward, whose 64-key step at 128 and
# 192 ran out of registers there (255, 24-84 B spilled; with dropout at 64 too): 32-key steps.
_FWD["sm100"] = ((64, _C(128, 64, 8, 3)), (128, _C(128, 32, 8, 3)), (192, _C(128, 32, 8, 2)), (256, _C(128, 16, 8, 2)))
_FWD_DROPOUT["sm100"] = ((64, _C(128, 32, 8, 3)),)
# and sm100's dropout backward under Triton 3.7.1: dQ at 128 on 128 x 64 (255 registers) spilled 20 B stored, 44 B
# loaded, and the dK pass at 256 on 16 x 128 20 B each way; 128 x 32 and 16 x 64 on 8 warps compile spill-free
# under 3.6.0, 3.7.1, 3.8.0 and 3.9.0 (dQ 153-187 registers, dK 177-243)
_DQ_DROPOUT["sm100"] = ((64, _C(128, 32, 8, 2)), (128, _C(128, 32, 8, 2)))
_DKDV_DROPOUT = {"sm100": ((256, _C(16, 64, 8, 2)),)}
for _table in (_DKDV, _DQ):
    _table["sm100"] = _table["sm90"]
# but the dK/dV kernel at 64 steps over 16 queries: 32 x 128 with 3 stages took 255 registers and spilled
# 52-184 B without a causal mask under Triton 3.6.0 (since issue 30's address clamps); 16 x 128: 78-218
_DKDV["sm100"] = ((64, _C(16, 128, 8, 3)),) + _DKDV["sm90"][1:]
for _table in (_FWD, _DKDV, _DQ, _FWD_DROPOUT, _DQ_DROPOUT):
    _table["sm89"] = _table["sm120"] = _table["sm86"]  # the 99 KB mma.sync parts share one table
# sm120's ptxas needs more registers than sm86's for the same dropout kernels at 64 and 256
_FWD_DROPOUT["sm120"] = ((64, _C(128, 32, 8, 2)),)
_DQ_DROPOUT["sm120"] = ((256, _C(16, 32, 4, 1)),)
# fp32 runs at IEEE precision, which no tensor core computes: tl.dot becomes FMA loops whose
# operands are spread over the threads, so the 16-bit tiles spilled kilobytes (sm90's forward at
# 128: 46 KB) and dQ overflowed the 99 KB parts' shared memory. One small tile for every arch.
_FP32 = ((128, _C(16, 32, 8, 1)), (256, _C(16, 16, 8, 1)))
# AMD CDNA (ROCm): tiles of 16x16 MFMAs (matrix_instr_nonkdim 16), single-stage loops, 8 waves
# (wave64) per workgroup but in the backward at 256; see the module docstring. gfx942's is the base.
_W = functools.partial(AttnConfig, matrix_instr_nonkdim=16)
_FWD["gfx942"] = ((64, _W(128, 128, 8, 1)), (128, _W(128, 64, 8, 1)), (192, _W(128, 64, 8, 1)), (256, _W(128, 32, 8, 1)))
_DKDV["gfx942"] = ((64, _W(32, 128, 8, 1)), (128, _W(16, 128, 8, 1)), (192, _W(16, 128, 8, 1)), (256, _W(16, 64, 4, 1)))
_DQ["gfx942"] = ((64, _W(128, 64, 8, 1)), (128, _W(128, 32, 8, 1)), (192, _W(128, 32, 8, 1)), (256, _W(64, 16, 4, 1)))
# the dropout forward at 128 steps over 32 keys (64 took 256 VGPRs and spilled 2 since issue 30's
# address clamps; 32: 161-163)
_FWD_DROPOUT["gfx942"] = ((64, _W(128, 64, 8, 1)), (128, _W(128, 32, 8, 1)), (192, _W(128, 32, 8, 1)))
_DQ_DROPOUT["gfx942"] = ((192, _W(128, 16, 8, 1)),)
for _table in (_FWD, _DKDV, _DQ, _FWD_DROPOUT, _DQ_DROPOUT):
    _table["gfx90a"] = _table["gfx950"] = _table["gfx942"]
# gfx950 (16x16x32 MFMAs) needs fewer registers for the same tile: a wider forward key step at 128,
# dK/dV tiles stepping over more queries at 64, 128 and 256
_FWD["gfx950"] = ((64, _W(128, 128, 8, 1)), (128, _W(128, 128, 8, 1)), (192, _W(128, 64, 8, 1)), (256, _W(128, 32, 8, 1)))
_FWD_DROPOUT["gfx950"] = ((64, _W(128, 64, 8, 1)), (128, _W(128, 64, 8, 1)))
_DKDV["gfx950"] = ((64, _W(64, 128, 8, 1)), (128, _W(32, 128, 8, 1)), (192, _W(16, 128, 8, 1)), (256, _W(16, 128, 8, 1)))
_DQ_DROPOUT["gfx950"] = ()
# gfx90a's forward needs more registers than gfx942's for the same tile (at 128 and 256 it spilled;
# at 64 the 128-key step took all 256 VGPRs and spilled 6 with max_logit, 182 without: 64-key steps,
# 113-122 VGPRs and 4 waves per SIMD in every variant)
_FWD["gfx90a"] = ((64, _W(128, 64, 8, 1)), (128, _W(128, 32, 8, 1)), (192, _W(128, 64, 8, 1)), (256, _W(128, 16, 8, 1)))
# and its dK pass at 256 took 256 VGPRs + 1-4 AGPRs on gfx942's 16 x 64 x 4 waves (1 wave per SIMD):
# 16 x 32 on 2 waves keeps each wave's 16 keys, 252-254 VGPRs, 2 waves per SIMD, no MFMA duplicated
_DKDV["gfx90a"] = _DKDV["gfx942"][:3] + ((256, _W(16, 32, 2, 1)),)
# fp32 takes CDNA's IEEE fp32 MFMAs; one small tile for every kernel (see the module docstring)
_FP32_CDNA = ((128, _W(32, 32, 2, 1)), (256, _W(16, 16, 1, 1)))


# The additive bias (kernels/attn_common.py _bias_scores) adds an [M, N] index and bias tile to each step and R
# gathered table loads per score (the dQ kernel R more for its coefficients' gradient): on sm90 the 128 x 64 forward
# and dQ tiles at 128 spilled 2.2-2.5 KB with Inkling 2's rank 16 (12 B and 4 B with T5's rank 1) under Triton
# 3.7.1; the bias kernels step over 16 keys (8 registers per [M, N] tile per thread at 8 warps)
_BIAS_STEP = tuple((w, _C(128, 16, 8, 2)) for w in (64, 128, 192, 256))
_BIAS = {"fwd": {"sm90": _BIAS_STEP, "sm100": _BIAS_STEP}, "dkdv": {}, "dq": {"sm90": _BIAS_STEP, "sm100": _BIAS_STEP}}
# with per-row coefficients (Inkling 2's rank 16) the dQ kernel also holds their gradient and reads the table twice:
# on sm90 its 128 x 16 tile spilled at 192/128 (28 B under Triton 3.7.1, 100 B under 3.9.0) and at 256 (244-440 B),
# as did the forward's at 256 under 3.9.0 (112 B). Half the rows at 192/128 (64 x 16, still two warpgroups of
# wgmma) and at 256 the forward; the dQ at 256 on 32 x 16 with 4 warps, which is mma.sync, not wgmma (64 x 16
# spilled 88-92 B there): smaller, slower tiles without spills (docs/compile-report.md)
_BIAS_COEF_FWD = ((256, _C(64, 16, 8, 2)),)
_BIAS_COEF_DQ = ((192, _C(64, 16, 8, 2)), (256, _C(32, 16, 4, 2)))
# and on sm100 the dK/dV passes at 192/128 (16 x 128, 3 stages: 8 B under Triton 3.8.0) and 256 (16 x 128: 20 B under
# 3.9.0) and the dQ at 256 (32 x 16 on 4 warps: 4 B under 3.8.0) spilled at 255 registers: dK/dV on 16 x 64 (160-218
# registers under 3.6.0-3.9.0), the dQ at 256 on 16 x 16 (185-206)
_BIAS_COEF = {"fwd": {"sm90": _BIAS_COEF_FWD, "sm100": _BIAS_COEF_FWD},
              "dkdv": {"sm100": ((192, _C(16, 64, 8, 2)), (256, _C(16, 64, 8, 2)))},
              "dq": {"sm90": _BIAS_COEF_DQ, "sm100": _BIAS_COEF_DQ[:1] + ((256, _C(16, 16, 4, 2)),)}}
# CDNA: the plain tiles' forward and dQ spilled with either bias (Triton 3.9.0, the forward's 128 x 128 at 64 with the
# low-rank bias 2.4-2.7 KB, T5's 0.5 KB; dQ 68-568 B), and gfx950's wider dK/dV tiles with the low-rank bias (64 x 128
# at 64: 636 B; 32 x 128 at 128: 240 B): 16-key steps for the forward and dQ (the dQ at 192/128 and 256 on 64 x 16 with
# 4 waves, as the plain dQ at 256: 128 x 16 took all 256 VGPRs and spilled 12-172 B), and gfx950's dK/dV on gfx942's
# tiles but at 192/128, where 16 x 128 on 8 waves spilled 12 B under 3.9.0: 16 x 64 on 4 waves (249-254 VGPRs)
_BIAS_CDNA_FWD = tuple((w, _W(128, 16, 8, 1)) for w in (64, 128, 192, 256))
_BIAS_CDNA_DQ = ((64, _W(128, 16, 8, 1)), (128, _W(128, 16, 8, 1)), (192, _W(64, 16, 4, 1)), (256, _W(64, 16, 4, 1)))
for _target in CDNA_TARGETS:
    _BIAS["fwd"][_target], _BIAS["dq"][_target] = _BIAS_CDNA_FWD, _BIAS_CDNA_DQ
_BIAS["dkdv"]["gfx950"] = _DKDV["gfx942"] + ((192, _W(16, 64, 4, 1)),)  # later entries win
# with the low-rank bias under Triton 3.6.0 the dK/dV at 64 on 32 x 128 spilled 116-140 B on every CDNA arch, and
# gfx950's at 128 on 16 x 128 8 B: 16 x 128 at 64 (155-226 VGPRs under 3.6.0-3.9.0), gfx950's 16 x 64 on 4 waves at 128
_BIAS_CDNA_COEF_DKDV = ((64, _W(16, 128, 8, 1)),)
_BIAS_COEF["dkdv"].update(gfx90a=_BIAS_CDNA_COEF_DKDV, gfx942=_BIAS_CDNA_COEF_DKDV,
                          gfx950=_BIAS_CDNA_COEF_DKDV + ((128, _W(16, 64, 4, 1)),))


def _cuda_config(table: dict, target: str, block_dqk: int, block_dv: int, elem: int,
                 override: dict | None = None) -> AttnConfig:
    """The entry of the first width class that holds the widest block (``override``'s entry for
    that class if it has one); the fp32 tile for 4-byte inputs. CUDA and CDNA targets alike; only
    CUDA launches carry the register ceiling."""
    widest = max(block_dqk, block_dv)
    cdna = target in CDNA_TARGETS
    for width, cfg in ((_FP32_CDNA if cdna else _FP32) if elem == 4 else table[target]):
        if widest <= width:
            if elem != 4:
                cfg = dict((override or {}).get(target, ())).get(width, cfg)
            return cfg._replace(fp_fusion=FP_FUSION) if cdna else cfg._replace(maxnreg=MAXNREG, fp_fusion=FP_FUSION)
    raise ValueError(f"head dims up to 256 are supported, got blocks {block_dqk}/{block_dv}")


def shipped_config(target: str, kernel: str, block_dqk: int, block_dv: int, elem: int = 2,
                   dropout: bool = False, int64_lanes: bool = False, bias: bool = False) -> AttnConfig:
    """The table's config of ``kernel`` ("fwd", "dkdv", "dq", "preprocess" or "bias_grad") on ``target``:
    ``block_dqk`` the q/k blocks' total width (192 for 128 + 64), ``elem`` bytes per input element
    (2 for fp16/bf16, 4 for fp32), ``dropout`` the dropout kernels, ``int64_lanes`` the kernels'
    INT64_LANES variant (``_DQ_DROPOUT_INT64``), ``bias`` the kernels with an additive bias
    (``_BIAS``, which wins over the dropout tiles where it has an entry; "coef": one with per-row
    coefficients, ``_BIAS_COEF`` too)."""
    if kernel == "bias_grad":
        return _bias_grad_config(target)
    if kernel == "preprocess":  # the dQ tile's rows and warps: 4 warps on 128 x 256 rows of out and dO would spill
        # and its register ceiling: left to itself, Triton 3.7.1's ptxas gave sm80's (64 and 32 rows, 4 warps) 48
        # registers and spilled 8 B
        dq = shipped_config(target, "dq", block_dqk, block_dv, elem, dropout, bias=bias)
        return AttnConfig(dq.block_m, 0, dq.num_warps, None, maxnreg=dq.maxnreg, fp_fusion=dq.fp_fusion)
    if target == "ascend":
        step = fwd_step_bytes if kernel == "fwd" else bwd_step_bytes
        return _ascend_blocks(step, block_dqk, block_dv, elem)
    if target == "interpreter":
        return _INTERPRETER
    table, override = {"fwd": (_FWD, _FWD_DROPOUT), "dkdv": (_DKDV, _DKDV_DROPOUT), "dq": (_DQ, _DQ_DROPOUT)}[kernel]
    if kernel == "dq" and dropout and int64_lanes and target in _DQ_DROPOUT_INT64:
        override = {**override, target: override.get(target, ()) + _DQ_DROPOUT_INT64[target]}
    override = dict(override) if dropout else {}
    for on, tables in ((bias, _BIAS), (bias == "coef", _BIAS_COEF)):  # over the dropout tiles: later entries win
        own = tables[kernel] if on else {}
        override = {t: override.get(t, ()) + own.get(t, ()) for t in set(override) | set(own)}
    return _cuda_config(table, target, block_dqk, block_dv, elem, override or None)


def fwd_config(device: torch.device, block_dqk: int, block_dv: int, elem: int = 2,
               dropout: bool = False, cls=None, bias: bool = False) -> AttnConfig:
    """The forward's config: the table's (``shipped_config``), unless the tuner forces one or, on a
    CUDA device, the tuned cache has an entry for the launch's class ``cls`` (kernels/tuned_cache.py
    ``KernelClass``; None: no cache lookup)."""
    target = target_of(device)
    return pick_config("fwd", device, target, cls,
                       shipped_config(target, "fwd", block_dqk, block_dv, elem, dropout, bias=bias))


def split_dkdv(block_dqk: int, block_dv: int, target: str, dropout: bool = False, gqa: bool = False,
               bias: bool | str = False) -> bool:
    """On CUDA and CDNA, dK and dV of a key tile are computed in two passes of the dK/dV kernel when
    their fp32 accumulators (BLOCK_N x (Dqk + Dv)) cannot stay in registers: 64 rows per warpgroup x
    (256 + 256) columns is 256 registers per thread, the whole register file (with dropout,
    Philox's state needs the room of 192 + 128 already; a CDNA wave addresses 256 VGPRs too). The
    second pass recomputes Q K^T (about 1/7 more backward matmul work) instead of spilling. On sm90,
    GQA at 192/128 splits too (``gqa``: each query step moves to another q head, whose addresses
    take the last registers): in one pass it took 253-254 registers at 23b22de and spilled 4-16 B
    in fp16 and bf16 since the address clamps of issue 30 (Triton 3.9.0); two passes take 158-226.
    MLA's 192/128 is MHA and stays one pass. An additive bias (``bias``) splits as dropout does: at
    192/128 one pass on sm90 spilled 144 B stored and 292 B loaded with Inkling 2's per-row coefficients
    (16 table reads per score) and 4 B with T5's bucketed table; two passes took 0 (Triton 3.7.1). With per-row
    coefficients (``bias == "coef"``) on sm90 and sm100 from 128/128 on: the one pass there took 255 registers and
    its INT64_LANES variant spilled 4 B under Triton 3.6.0 (GQA, per-token sinks), and neither 16 x 64 nor 32 x 64
    kept both variants spill-free under 3.6.0-3.9.0; two passes do (240-255 registers)."""
    if target in ("interpreter", "ascend"):
        return False
    if bias == "coef" and target in ("sm90", "sm100"):
        return block_dqk + block_dv > 192
    return block_dqk + block_dv > (256 if dropout or bias or (gqa and target == "sm90") else 320)


def bwd_configs(device: torch.device, block_dqk: int, block_dv: int, elem: int = 2, dropout: bool = False, cls=None,
                int64_lanes: bool = False, bias: bool = False) -> tuple[AttnConfig, AttnConfig]:
    """(dK/dV config, dQ config); arguments as for fwd_config, ``int64_lanes`` as for shipped_config."""
    target = target_of(device)
    return tuple(pick_config(kernel, device, target, cls,
                             shipped_config(target, kernel, block_dqk, block_dv, elem, dropout, int64_lanes, bias))
                 for kernel in ("dkdv", "dq"))


def preprocess_config(device: torch.device, block_dqk: int, block_dv: int, elem: int = 2,
                      dropout: bool = False, cls=None, bias: bool = False) -> AttnConfig:
    """The backward preprocess kernel's rows per program (block_m) and warps; arguments as for fwd_config."""
    target = target_of(device)
    return pick_config("preprocess", device, target, cls,
                       shipped_config(target, "preprocess", block_dqk, block_dv, elem, dropout, bias=bias))


def bias_grad_config(device: torch.device) -> AttnConfig:
    """The bias table's gradient kernel (kernels/attn_bias.py): block_m query rows per step of a
    program and block_n distances per program (its key window: the next power of two of block_m +
    block_n - 1 keys). Never tuned: the table's."""
    return _bias_grad_config(target_of(device))


def _bias_grad_config(target: str) -> AttnConfig:
    """32 rows x 32 distances (a 64-key window) on CUDA and CDNA, 16 x 16 on the interpreter and Ascend;
    one pipeline stage (its loop holds the tile map read and a branch); 8 warps (4 spilled 8-16 B at
    192/128 with rank 16 on sm90, Triton 3.7.1)."""
    if target in ("interpreter", "ascend"):
        return AttnConfig(16, 16, 1, 1)
    cfg = AttnConfig(32, 32, 8, 1)
    if target in CDNA_TARGETS:
        return cfg._replace(matrix_instr_nonkdim=16, fp_fusion=FP_FUSION)
    return cfg._replace(maxnreg=MAXNREG, fp_fusion=FP_FUSION)
