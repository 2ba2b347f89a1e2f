"""Launch tables of the DSA indexer's kernels (kernels/indexer_topk.py, kernels/hadamard.py), per target.

The top-k kernel runs one program per query token: a [heads, dim] x [dim, BLOCK_N] dot per key step
and a running top-k of BLOCK_K packed 64-bit keys in registers (kernels/indexer_topk.py). Its tile is
the key step and the warps; the register load is the q tile (heads x dim, held for the whole row) and
the candidate sets (2 x BLOCK_K int64, the sort's temporaries on top), so the tables are keyed by
BLOCK_K and the q tile's bytes, and a q tile past ``MAX_TOPK_TILE_BYTES`` is refused on CUDA and CDNA
(``topk_refusal``: the ops run it on the torch backend). The Hadamard kernel runs BLOCK_R rows per
program, a butterfly over each row's values in float32 registers.

Every table is static compiler output (``python -m bench.compile_sweep``, ``python -m bench --what
kernels``: registers, spills, shared memory, MMA kind), not a timing: no GPU was available. Lengths
never enter a key: only head count, head dim, top-k, dtype and the target do.
"""

from __future__ import annotations

from typing import NamedTuple

import triton

from coreattn.kernels.configs.targets import CDNA_TARGETS, launch_options


class IndexerConfig(NamedTuple):
    block: int  # top-k: keys per step (BLOCK_N); Hadamard: rows per program (BLOCK_R)
    num_warps: int
    num_stages: int | None = None
    matrix_instr_nonkdim: int | None = None  # AMD: the MFMA's M = N; None: Triton's choice

    def launch(self, target: str) -> dict:
        """Triton launch options on ``target`` (the register ceiling and fp fusion where the target takes them)."""
        opts = dict(num_warps=self.num_warps, **launch_options(target))
        if self.num_stages is not None:
            opts["num_stages"] = self.num_stages
        if self.matrix_instr_nonkdim is not None and target in CDNA_TARGETS:
            opts["matrix_instr_nonkdim"] = self.matrix_instr_nonkdim
        return opts


# Interpreter (tests): small steps, so a top-k of 8-16 spans several key steps and rows end mid-step.
_INTERPRETER_TOPK = IndexerConfig(16, 1, 1)
_INTERPRETER_HADAMARD = IndexerConfig(8, 1)

# Top-k, by BLOCK_K (the top-k rounded up to a power of two) and the q tile's bytes (BLOCK_H x BLOCK_D x the
# input's element size, held in registers beside the candidate sets): the first entry whose bounds hold wins.
# CUDA: a 64-key step on 8 warps up to 16 KB of q (DeepSeek-V3.2's 64 heads x 128 in 16 bits: the [64, 128] x
# [128, 64] wgmma on sm90, mma.sync elsewhere; 4 warps at top-k 256 took 255 registers on sm100 under Triton
# 3.9.0); a 32-key step up to 32 KB (128 heads x 128 at top-k 4096 took 255
# registers and spilled 144 B on the 64-key step under Triton 3.9.0, 238 and none on 32); fp32's FMA dot on
# 16 keys and one stage (64 x 128 at top-k 2048 spilled 596 B on 64 keys, 0 on 16-32).
_TOPK_CUDA = ((4096, 16 << 10, IndexerConfig(64, 8, 2)), (4096, 32 << 10, IndexerConfig(32, 8, 2)))
_TOPK_CUDA_FP32 = ((4096, 32 << 10, IndexerConfig(16, 8, 1)),)
_TOPK_CDNA = ((256, 32 << 10, IndexerConfig(64, 4, 1, 16)), (4096, 32 << 10, IndexerConfig(64, 8, 1, 16)))
_TOPK_ASCEND = ((4096, 1 << 30, IndexerConfig(64, 1, 1)),)
# q tiles past this on CUDA and CDNA are refused (``topk_refusal``): 128 heads x 256 in 16 bits (64 KB) took 255
# registers and spilled 4-212 B on sm90 under Triton 3.9.0 at every step (16-64 keys), warp count (8; 16 with 128
# registers a thread) and stage count tried; fp32 128 x 256 (128 KB) 8 B to 17 KB
MAX_TOPK_TILE_BYTES = 32 << 10
# CUDA float32 (the top-k kernel's FMA dot on 16 keys, 8 warps, one stage): 64 heads x 128 (32 KB) spilled 4-12 B on
# sm90 and 96-108 B on sm100 at top-k 2048-4096 under Triton 3.7.1 (8-48 B on sm90 under 3.9.0; 32 keys, 4 warps or
# two stages as much or more; 16 warps: no launch), and at top-k 4096 32 x 128 and 64 x 64 (16 KB) spilled 12-80 B;
# 32 x 128 at top-k 2048: 226-236 registers, none. Past either bound float32 runs on the torch backend.
FP32_TOPK_TILE_BYTES = 16 << 10
FP32_MAX_BLOCK_K = 2048
_HADAMARD = {"cuda": IndexerConfig(16, 4), "cdna": IndexerConfig(16, 4), "ascend": IndexerConfig(16, 1)}
MAX_BLOCK_K = 4096  # top-k up to 4096 in the kernel (DeepSeek-V3.2 and GLM-5 use 2048)
MAX_TOPK_HEADS = 128
MAX_TOPK_DIM = 256
MAX_HADAMARD_DIM = 256


def _family(target: str) -> str:
    if target in CDNA_TARGETS:
        return "cdna"
    return target if target in ("interpreter", "ascend") else "cuda"


def topk_tile_bytes(heads: int, dim: int, elem: int) -> int:
    """Bytes of the top-k kernel's q tile: heads and dim padded to powers of two (at least 16)."""
    return max(16, triton.next_power_of_2(heads)) * max(16, triton.next_power_of_2(dim)) * elem


def topk_refusal(target: str, heads: int, dim: int, elem: int, topk: int | None = None) -> str | None:
    """Why the Triton top-k kernel (``topk``: its requested top-k) or, ``topk`` None, the block-score kernel does
    not run ``heads`` x ``dim`` of ``elem``-byte inputs on ``target``, or None: past its heads or dim, or (CUDA,
    CDNA) past the q tile it runs without spilling registers; on CUDA in float32 the top-k kernel's FMA dot beside
    its candidate sets also past ``FP32_TOPK_TILE_BYTES`` or a BLOCK_K of ``FP32_MAX_BLOCK_K``."""
    if heads > MAX_TOPK_HEADS or dim > MAX_TOPK_DIM:
        return f"the Triton top-k kernel takes up to {MAX_TOPK_HEADS} heads of dim up to {MAX_TOPK_DIM}, got {heads} x {dim}"
    tile = topk_tile_bytes(heads, dim, elem)
    if _family(target) in ("cuda", "cdna") and tile > MAX_TOPK_TILE_BYTES:
        return (f"{heads} heads x {dim} of {elem}-byte inputs on {target}: a {tile >> 10} KB q tile, past the "
                f"{MAX_TOPK_TILE_BYTES >> 10} KB the Triton top-k kernel holds in registers without spilling "
                f"(coreattn/kernels/configs/indexer.py); the torch backend runs it")
    block_k = triton.next_power_of_2(max(topk, 16)) if topk is not None else 0
    if _family(target) == "cuda" and elem == 4 and topk is not None and (tile > FP32_TOPK_TILE_BYTES
                                                                        or block_k > FP32_MAX_BLOCK_K):
        return (f"float32 {heads} heads x {dim} at top-k {topk} on {target}: the Triton top-k kernel's float32 "
                f"(FMA) dot spills registers past a {FP32_TOPK_TILE_BYTES >> 10} KB q tile or top-k "
                f"{FP32_MAX_BLOCK_K} (coreattn/kernels/configs/indexer.py); the torch backend runs it")
    return None


def triton_topk_refusal(device, dtype, heads: int, dim: int, topk: int | None = None) -> str | None:
    """``topk_refusal`` for an indexer call's tensors (float64 never reaches the kernel: None)."""
    import torch

    from coreattn.kernels.configs.targets import target_of

    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    return topk_refusal(target_of(device), heads, dim, dtype.itemsize, topk)


def topk_config(target: str, block_k: int, heads: int = 64, dim: int = 128, elem: int = 2) -> IndexerConfig:
    """The top-k kernel's config for BLOCK_K ``block_k`` and a q tile of ``heads`` x ``dim`` of ``elem`` bytes
    (``topk_refusal`` first: a refused one raises ValueError naming why)."""
    family = _family(target)
    if family == "interpreter":
        return _INTERPRETER_TOPK
    refused = topk_refusal(target, heads, dim, elem, block_k)
    if refused:
        raise ValueError(refused)
    table = {"cuda": _TOPK_CUDA_FP32 if elem == 4 else _TOPK_CUDA, "cdna": _TOPK_CDNA, "ascend": _TOPK_ASCEND}[family]
    tile = topk_tile_bytes(heads, dim, elem)
    for bound, tile_bound, cfg in table:
        if block_k <= bound and tile <= tile_bound:
            return cfg
    raise ValueError(f"top-k blocks up to {MAX_BLOCK_K} are supported by the Triton kernel, got {block_k}")


def hadamard_config(target: str) -> IndexerConfig:
    family = _family(target)
    return _INTERPRETER_HADAMARD if family == "interpreter" else _HADAMARD[family]


# The block-max scores kernel (kernels/indexer_blocks.py, MiniMax-M3's indexer): one program per query token, the
# top-k kernel's [heads, dim] x [dim, BLOCK_N] key step, without its candidate sets (a running max per head
# instead), keyed by the q tile's bytes as the top-k's (the same limit: ``topk_refusal``). CUDA: a 64-key step on 4
# warps up to 16 KB (MiniMax-M3's 4 x 128: 164-172 registers on sm90 and sm100 under Triton 3.7.1); past it the
# [heads, 64] scores beside the q tile spilled (128 x 128 in bf16: 60 B on sm90; 64 x 128 in fp32's FMA dot: 2 KB on
# sm90 and sm100), so up to 32 KB a 32-key step on 8 warps (128 x 128 in bf16: 139-148 registers, sm90's wgmma and
# sm100's tcgen05) and fp32 a 16-key step on 8 warps, one stage (94). CDNA: a 64-key step on 4 waves up to 32 KB
# (75-191 VGPRs on gfx942, no spill).
_BLOCK_SCORES = {"interpreter": ((1 << 30, IndexerConfig(16, 1, 1)),),
                 "cuda": ((16 << 10, IndexerConfig(64, 4, 2)), (32 << 10, IndexerConfig(32, 8, 2))),
                 "cuda_fp32": ((16 << 10, IndexerConfig(64, 4, 2)), (32 << 10, IndexerConfig(16, 8, 1))),
                 "cdna": ((32 << 10, IndexerConfig(64, 4, 1, 16)),), "ascend": ((1 << 30, IndexerConfig(64, 1, 1)),)}


def block_scores_config(target: str, heads: int = 4, dim: int = 128, elem: int = 2) -> IndexerConfig:
    """The block-score kernel's config for a q tile of ``heads`` x ``dim`` of ``elem`` bytes (``topk_refusal``
    first: a refused one raises ValueError naming why)."""
    family = _family(target)
    if family != "interpreter":
        refused = topk_refusal(target, heads, dim, elem)
        if refused:
            raise ValueError(refused.replace("top-k kernel", "top-k and block-score kernels"))
    table = _BLOCK_SCORES["cuda_fp32" if family == "cuda" and elem == 4 else family]
    tile = topk_tile_bytes(heads, dim, elem)
    return next(cfg for bound, cfg in table if tile <= bound)
