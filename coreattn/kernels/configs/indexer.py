"""Launch tables of the DSA indexer's kernels (kernels/indexer_topk.py, kernels/hadamard.py), per target.

The top-k kernel runs one program per query token: a [heads, dim] x [dim, BLOCK_N] dot per key step
and a running top-k of BLOCK_K packed 64-bit keys in registers (kernels/indexer_topk.py). Its tile is
the key step and the warps; the register load is dominated by the candidate sets (2 x BLOCK_K int64,
the sort's temporaries on top), so wide top-k takes more warps, which spread those registers over
more threads. The Hadamard kernel runs BLOCK_R rows per program, one [BLOCK_R, D] x [D, D] dot with
the +-1 matrix generated in registers (two at D = 256).

Every table is static compiler output (``python -m bench --what kernels``: registers, spills, shared
memory, MMA kind), not a timing: no GPU was available. Lengths never enter a key: only head count,
head dim, top-k, dtype and the target do.
"""

from __future__ import annotations

from typing import NamedTuple

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

# Top-k, by BLOCK_K (the top-k rounded up to a power of two): first entry whose BLOCK_K bound holds
# wins. CUDA: a 64-key step (the [64 heads, 128] x [128, 64] wgmma on sm90, mma.sync elsewhere).
_TOPK_CUDA = ((256, IndexerConfig(64, 4, 2)), (1024, IndexerConfig(64, 8, 2)), (4096, IndexerConfig(64, 8, 2)))
_TOPK_CDNA = ((256, IndexerConfig(64, 4, 1, 16)), (1024, IndexerConfig(64, 8, 1, 16)), (4096, IndexerConfig(64, 8, 1, 16)))
_TOPK_ASCEND = ((4096, IndexerConfig(64, 1, 1)),)
_HADAMARD = {"cuda": IndexerConfig(16, 4), "cdna": IndexerConfig(16, 4), "ascend": IndexerConfig(16, 1)}
MAX_BLOCK_K = 4096  # top-k up to 4096 in the kernel (DeepSeek-V3.2 and GLM-5 use 2048)
MAX_TOPK_HEADS = 128
MAX_TOPK_DIM = 256
MAX_HADAMARD_DIM = 256


def _family(target: str) -> str:
    if target in CDNA_TARGETS:
        return "cdna"
    return target if target in ("interpreter", "ascend") else "cuda"


def topk_config(target: str, block_k: int) -> IndexerConfig:
    family = _family(target)
    if family == "interpreter":
        return _INTERPRETER_TOPK
    table = {"cuda": _TOPK_CUDA, "cdna": _TOPK_CDNA, "ascend": _TOPK_ASCEND}[family]
    for bound, cfg in table:
        if block_k <= bound:
            return cfg
    raise ValueError(f"top-k blocks up to {MAX_BLOCK_K} are supported by the Triton kernel, got {block_k}")


def hadamard_config(target: str) -> IndexerConfig:
    family = _family(target)
    return _INTERPRETER_HADAMARD if family == "interpreter" else _HADAMARD[family]


# The block-max scores kernel (kernels/indexer_blocks.py, MiniMax-M3's indexer): one program per query token, the
# top-k kernel's [heads, dim] x [dim, BLOCK_N] key step and warps, without its candidate sets (a running max per
# head instead).
_BLOCK_SCORES = {"interpreter": IndexerConfig(16, 1, 1), "cuda": IndexerConfig(64, 4, 2),
                 "cdna": IndexerConfig(64, 4, 1, 16), "ascend": IndexerConfig(64, 1, 1)}


def block_scores_config(target: str) -> IndexerConfig:
    return _BLOCK_SCORES[_family(target)]
