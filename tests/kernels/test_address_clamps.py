"""The kernels' row clamps (kernels/attn_common.py) keep every lane's address inside the tensor for the
iterations the interpreter never runs: a pipelined prologue of a loop that runs zero times (an empty
sequence, which may start one past the tensor's last row) and prefetches past a loop's last iteration.

A tiny kernel forms the addresses the attention loops form, through the same helpers (``_first_row``,
``_load_rows``, ``_load_keep``, ``_load_row_stats``), for iteration starts the real loops would not run,
and loads them with every lane masked off; the interpreter memcheck (tests/interp_memcheck.py) in strict
mode then checks every lane against the tensor. Without the clamps these addresses leave the tensor."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import interp_memcheck
from conftest import INTERPRETED
from coreattn.kernels.attn_bwd import _load_row_stats
from coreattn.kernels.attn_common import _first_row, _load_keep, _load_rows

pytestmark = pytest.mark.interpreter_only("runs the kernels' address helpers under the interpreter memcheck")
ROWS, BLOCK, HEAD_DIM, BLOCK_D = 5, 16, 24, 32  # a 5-row [T, D] tensor; 24 columns padded to a 32-wide block


@triton.jit
def _addresses_kernel(x_ptr, keep_ptr, stat_ptr, out_ptr, start, seqlen, r0, stride_t,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, CLAMP: tl.constexpr):
    rows = r0 + tl.arange(0, BLOCK)
    off = tl.zeros([BLOCK], tl.int1)  # every lane masked off, as in an iteration that does not run
    if CLAMP:
        first = _first_row(start, seqlen).to(tl.int64)
        x, _ = _load_rows(x_ptr + first * stride_t, stride_t, r0, off, seqlen - 1, HEAD_DIM, BLOCK_D, 0, BLOCK, False)
        k = _load_keep(keep_ptr + first, 1, r0, tl.arange(0, BLOCK), seqlen, False)
        lse, delta = _load_row_stats(stat_ptr + first, stat_ptr + first, rows, off, seqlen - 1)
    else:  # the addresses before issue 30's clamps
        cols = tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + (start + rows)[:, None] * stride_t + cols[None, :], mask=off[:, None], other=0.0)
        k = tl.load(keep_ptr + start + rows, mask=off, other=0) != 0
        lse = tl.load(stat_ptr + start + rows, mask=off, other=0.0)
        delta = lse
    tl.store(out_ptr, tl.sum(tl.sum(x, 1) + k.to(tl.float32) + lse + delta, 0))


@pytest.mark.parametrize("start, seqlen, r0", [
    (ROWS, 0, 0),  # an empty last sequence: starts one past the last row; its loop's prologue at row 0
    (ROWS, 0, 2 * BLOCK),  # ... and the prologue's later stages (num_stages 3)
    (0, 0, 0),  # an empty first sequence
    (3, 2, 0),  # the last sequence's partial block: rows 3..18 of a 5-row tensor
    (3, 2, BLOCK),  # a prefetch past its last block
    (0, ROWS, 3 * BLOCK),  # a prefetch far past the end
], ids=["empty-at-end", "empty-at-end-later-stage", "empty-at-start", "partial-last-block", "prefetch-past-end",
        "prefetch-far"])
def test_a_loops_addresses_stay_inside_for_iterations_that_do_not_run(start, seqlen, r0):
    x = torch.randn(ROWS, HEAD_DIM)  # [T, D]
    keep = torch.ones(ROWS, dtype=torch.uint8)
    stat = torch.zeros(ROWS)
    out = torch.zeros(1)
    args = (x, keep, stat, out, start, seqlen, r0, x.stride(0))
    with interp_memcheck.checking("strict"):
        _addresses_kernel[(1,)](*args, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK=BLOCK, CLAMP=True)
        with pytest.raises(Exception, match="outside every tensor argument"):  # the check sees the old addresses
            _addresses_kernel[(1,)](*args, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK=BLOCK, CLAMP=False)
