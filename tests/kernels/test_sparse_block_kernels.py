"""The sparse kernels' block mode (kernels/sparse_fwd.py ``_block_keys``, kernels/sparse_bwd.py
``_block_dkv_program``, kernels/sparse_blocks.py) at the launchers: what the public op's tests
(tests/test_sparse_blocks.py, against the float64 oracle) do not reach.

- Loop addresses stay inside their tensors for iterations the interpreter never runs and values no
  valid entry has: a tiny kernel forms ``_block_keys``' addresses with every lane masked off, under the
  interpreter memcheck's strict mode (every lane checked), for tiles past the row's last block, block
  starts past the tensor or int32, inverted and empty bounds and a side without key rows; the dK/dV
  kernel walks a CSR whose entries are garbage (tokens past the batch, negative) in strict mode too.
- Outputs preallocated with NaN come back without one (every row written, rows without a visible key
  0 and -inf); empty batches, sides without keys and rows of no block launch nothing wrong.
- The helpers' tables: the block table partitions every sequence's keys (thd, empty sequences
  included) and the CSR by block lists each block's tokens ascending.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import interp_memcheck
from attn_cases import KERNEL_DEVICE
from coreattn.kernels import sparse_bwd
from coreattn.kernels.sparse_blocks import BlockCSR, BlockLayout, block_starts, block_table, transpose_blocks
from coreattn.kernels.sparse_bwd import sparse_attn_bwd
from coreattn.kernels.sparse_fwd import _block_keys, _gather, _token_bounds, sparse_attn_fwd
from coreattn.kernels.sparse_index import prepare_topk

ROWS, BLOCK_N, HEAD_DIM, BLOCK_D = 5, 16, 24, 32


@triton.jit
def _block_addresses_kernel(idx_ptr, k_ptr, lo_ptr, hi_ptr, out_ptr, it, n_slots, block_size, n_sub, seqlen_k,
                            k_last, stride_t, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                            CLAMP: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    off = offs_n < 0  # every lane masked off, as in an iteration that does not run
    if CLAMP:
        lo, hi = _token_bounds(lo_ptr, hi_ptr, 0, seqlen_k)
        valid, row = _block_keys(idx_ptr, it, offs_n, n_slots, block_size, n_sub, lo, hi, k_last, BLOCK_N)
        kb = _gather(k_ptr, row, valid & off, stride_t, HEAD_DIM, 0, BLOCK_D)
    else:  # the block start as read, unclamped
        tile = it // BLOCK_N
        start = tl.load(idx_ptr + tile // n_sub + offs_n * 0)
        keys = start + (tile % n_sub) * BLOCK_N + offs_n
        cols = tl.arange(0, BLOCK_D)
        kb = tl.load(k_ptr + keys.to(tl.int64)[:, None] * stride_t + cols[None, :], mask=off[:, None], other=0.0)
    tl.store(out_ptr, tl.sum(tl.sum(kb.to(tl.float32), 1), 0))


BIG = 10**6
BLOCK_CASES = {  # (block starts of the row, tile it (in keys), block size, lo, hi, key rows)
    "tile-past-the-last-block": ([0, 4], 5 * BLOCK_N, 4, 0, ROWS, ROWS),
    "prologue-of-an-empty-row": ([-1], 0, 3, 0, ROWS, ROWS),
    "starts-past-the-tensor": ([BIG, 2**31 - 2, -BIG, ROWS], 2 * BLOCK_N, 2, 0, ROWS, ROWS),
    "bounds-inverted": ([0, 2, BIG], 0, 2, 4, 1, ROWS),
    "bounds-wider-than-the-tensor": ([0, ROWS + 3, -1], BLOCK_N, 40, -7, BIG, ROWS),
    "no-key-rows": ([0, BIG, -BIG], 0, 4, 0, 3, 0),
}


@pytest.mark.interpreter_only("runs the block mode's address helper under the interpreter memcheck")
@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_the_block_loops_addresses_stay_inside_for_any_start_and_tile(case):
    row, it, block_size, lo, hi, seqlen_k = BLOCK_CASES[case]
    idx = torch.tensor(row, dtype=torch.int32)
    k = torch.randn(max(seqlen_k, 1), HEAD_DIM)
    bounds = (torch.tensor([lo], dtype=torch.int32), torch.tensor([hi], dtype=torch.int32))
    n_sub = triton.cdiv(block_size, BLOCK_N)
    args = (idx, k, *bounds, torch.zeros(1), it, len(row), block_size, n_sub, seqlen_k, max(seqlen_k, 1) - 1,
            k.stride(0))
    with interp_memcheck.checking("strict"):
        _block_addresses_kernel[(1,)](*args, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, CLAMP=True)
        if case != "prologue-of-an-empty-row":  # -1's keys are still inside there: nothing to see unclamped
            with pytest.raises(Exception, match="outside every tensor argument"):
                _block_addresses_kernel[(1,)](*args, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, CLAMP=False)


def _inputs(n=11, heads=(4, 2, 2), dim=(24, 16), dtype=torch.float32, seed=3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads[0], dim[0], generator=gen).to(dtype)
    k = torch.randn(n, heads[1], dim[0], generator=gen).to(dtype)
    v = torch.randn(n, heads[2], dim[1], generator=gen).to(dtype)
    return (x.to(KERNEL_DEVICE) for x in (q, k, v))


def _prepared(rows, cu, block_size):
    """thd block rows [N, Hidx, K] prepared as the op prepares them, and causal bounds of one packed batch."""
    cu = torch.tensor(cu, dtype=torch.int64)
    n = torch.arange(int(cu[-1]))
    seq = torch.searchsorted(cu[1:], n, right=True)
    topk = prepare_topk(block_starts(torch.tensor(rows), cu[seq], block_size), "thd")
    lo, hi = cu[seq].to(torch.int32), (n + 1).to(torch.int32)
    return (x.to(KERNEL_DEVICE) for x in (topk, lo, hi)), BlockLayout(block_size, cu.to(torch.int32).to(KERNEL_DEVICE))


@pytest.mark.interpreter_only("the Triton kernels on CPU tensors")
def test_dkv_walks_garbage_csr_entries_inside_the_tensors(monkeypatch):
    """A CSR whose entries name tokens past the batch and negative ones (what a pipelined prefetch or a
    corrupt table may hand the loop): every address the dK/dV kernel forms stays inside, every lane
    checked."""
    q, k, v = _inputs()
    (topk, lo, hi), layout = _prepared([[[n // 4, 0]] * 2 for n in range(11)], [0, 6, 11], 4)
    out, lse = sparse_attn_fwd(q, k, v, topk, lo, hi, "thd", 0.3, blocks=layout)

    def garbage(*args, **kwargs):
        csr = transpose_blocks(*args, **kwargs)
        entries = torch.tensor([10**6, -5, 2**31 - 1, 3], dtype=torch.int32, device=csr.entries.device)
        return BlockCSR(csr.row_ptr, entries.repeat(-(-csr.entries.numel() // 4))[:csr.entries.numel()])

    monkeypatch.setattr(sparse_bwd, "transpose_blocks", garbage)
    with interp_memcheck.checking("strict"):
        grads = sparse_attn_bwd(torch.ones_like(out), q, k, v, out, lse, topk, lo, hi, "thd", 0.3, blocks=layout)
    assert all(not g.isnan().any() for g in grads)


@pytest.mark.interpreter_only("the Triton kernels on CPU tensors")
def test_nan_poisoned_outputs_are_overwritten_and_empty_rows_are_zero():
    q, k, v = _inputs()
    rows = [[[n // 4, -1]] * 2 for n in range(11)]
    rows[3] = [[-1, 7]] * 2  # no visible block
    (topk, lo, hi), layout = _prepared(rows, [0, 6, 11], 4)
    out = torch.full((11, 4, 16), float("nan"), device=KERNEL_DEVICE)
    lse = torch.full((4, 11), float("nan"), device=KERNEL_DEVICE)
    sparse_attn_fwd(q, k, v, topk, lo, hi, "thd", 0.3, out=out, lse=lse, blocks=layout)
    assert not out.isnan().any() and not lse.isnan().any()
    assert not out[3].any() and torch.isneginf(lse[:, 3]).all() and torch.isfinite(lse[:, :3]).all()
    dq, dk, dv = sparse_attn_bwd(torch.randn_like(out), q, k, v, out, lse, topk, lo, hi, "thd", 0.3, blocks=layout)
    assert not dq[3].any() and all(not g.isnan().any() for g in (dq, dk, dv))


@pytest.mark.interpreter_only("the Triton kernels on CPU tensors")
@pytest.mark.parametrize("shape", ["no-tokens", "no-keys"])
def test_empty_sides(shape):
    n_q, n_k = (0, 5) if shape == "no-tokens" else (4, 0)
    q = torch.randn(n_q, 2, 16, device=KERNEL_DEVICE)
    k, v = torch.randn(n_k, 1, 16, device=KERNEL_DEVICE), torch.randn(n_k, 1, 8, device=KERNEL_DEVICE)
    topk = torch.zeros(n_q, 1, 2, dtype=torch.int32, device=KERNEL_DEVICE)
    lo = hi = torch.zeros(n_q, dtype=torch.int32, device=KERNEL_DEVICE)
    layout = BlockLayout(4, torch.tensor([0, n_k], dtype=torch.int32, device=KERNEL_DEVICE))
    out, lse = sparse_attn_fwd(q, k, v, topk, lo, hi, "thd", 0.25, blocks=layout)
    assert not out.any() and (lse.numel() == 0 or torch.isneginf(lse).all())
    dq, dk, dv = sparse_attn_bwd(torch.ones_like(out), q, k, v, out, lse, topk, lo, hi, "thd", 0.25, blocks=layout)
    assert not dq.any() and not dk.any() and not dv.any()


def test_block_table_partitions_every_sequence_and_the_csr_is_ascending():
    cu = torch.tensor([0, 5, 5, 13, 14], dtype=torch.int32)  # lengths 5, 0, 8, 1; blocks of 3
    layout = BlockLayout(3, cu)
    table = block_table(layout, 1, 14, torch.device("cpu"))
    covered = torch.zeros(14, dtype=torch.int64)
    for b, start, end in table.tolist():
        covered[start:end] += 1
        assert b == 0 and end - start <= 3
    assert covered.tolist() == [1] * 14
    seq = torch.searchsorted(cu[1:].to(torch.int64), torch.arange(14), right=True)
    rows = [[[0, 1, -1]] for _ in range(14)]
    topk = prepare_topk(block_starts(torch.tensor(rows), cu[seq].to(torch.int64), 3), "thd")
    lo, hi = cu[seq].to(torch.int32), torch.arange(1, 15, dtype=torch.int32)
    csr = transpose_blocks(topk, lo, hi, layout, batch=1, seqlen_q=14, seqlen_k=14)
    for i, (b, start, end) in enumerate(table.tolist()):
        tokens = csr.entries[csr.row_ptr[i]:csr.row_ptr[i + 1]].tolist()
        want = [n for n in range(14) if lo[n] <= end - 1 and start < hi[n] and (start - lo[n]) // 3 in (0, 1)
                and end > start]
        assert tokens == want, (i, tokens, want)
