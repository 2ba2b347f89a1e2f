"""The sparse kernels' loop addresses (kernels/sparse_fwd.py ``_slot_rows``, ``_gather``;
kernels/sparse_bwd.py ``_entry_row``) stay inside their tensors for iterations the interpreter never
runs: a slot block past the last (the pipeliner's prefetch; its prologue when K is small), index
values that no valid entry has (negative, past the tensor, past int32's range: a masked-off
asynchronous copy may leave anything in the index register), bounds that are empty, inverted or
wider than the tensor, a side without any key row (its one-row stand-in), and the reduce's CSR
entries past a segment's end.

A tiny kernel forms the addresses the sparse loops form, through the same helpers, with every lane
of the gather masked off, and the interpreter memcheck (tests/interp_memcheck.py) in strict mode
checks every lane; the same addresses without the clamps leave the tensors, which the check must see
(tests/kernels/test_address_clamps.py does the same for the dense kernels' helpers)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import interp_memcheck
from coreattn.kernels.sparse_bwd import _entry_row
from coreattn.kernels.sparse_fwd import _gather, _slot_rows, _token_bounds

pytestmark = pytest.mark.interpreter_only("runs the sparse kernels' address helpers under the interpreter memcheck")
ROWS, BLOCK_N, HEAD_DIM, BLOCK_D = 5, 16, 24, 32  # a 5-row [T, D] key tensor; 24 columns in a 32-wide block


@triton.jit
def _gather_addresses_kernel(idx_ptr, k_ptr, lo_ptr, hi_ptr, out_ptr, s0, n_slots, seqlen_k, k_last, stride_t,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                             CLAMP: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    off = offs_n < 0  # every lane masked off, as in an iteration that does not run
    if CLAMP:
        lo, hi = _token_bounds(lo_ptr, hi_ptr, 0, seqlen_k)
        valid, row = _slot_rows(idx_ptr, s0, offs_n, n_slots, lo, hi, k_last)
        kb = _gather(k_ptr, row, valid & off, stride_t, HEAD_DIM, 0, BLOCK_D)
    else:  # the slot and the index as read, unclamped
        slots = s0 + offs_n
        idx = tl.load(idx_ptr + slots, mask=slots < n_slots, other=-1)
        cols = tl.arange(0, BLOCK_D)
        kb = tl.load(k_ptr + idx.to(tl.int64)[:, None] * stride_t + cols[None, :], mask=off[:, None], other=0.0)
    tl.store(out_ptr, tl.sum(tl.sum(kb.to(tl.float32), 1), 0))


BIG = 10**6
GATHER_CASES = {  # (index row, s0, lo, hi, key rows)
    "prefetch-past-last-block": ([0, 1, 2, 3, 4], 2 * BLOCK_N, 0, ROWS, ROWS),
    "prologue-of-a-short-row": ([3], BLOCK_N, 0, ROWS, ROWS),
    "indices-past-the-tensor": ([BIG, -BIG, 2**31 - 1, -2**31, ROWS, -1, 7, 3], 0, 0, ROWS, ROWS),
    "bounds-inverted": ([BIG, -BIG, 4, 0], 0, 4, 1, ROWS),
    "bounds-wider-than-the-tensor": ([BIG, -BIG, ROWS + 2, 2], 0, -7, BIG, ROWS),
    "no-key-rows": ([BIG, 0, 1, -BIG], 0, 0, 3, 0),
}


@pytest.mark.parametrize("case", list(GATHER_CASES))
def test_the_slot_loops_addresses_stay_inside_for_any_index_and_slot_block(case):
    row, s0, lo, hi, seqlen_k = GATHER_CASES[case]
    idx = torch.tensor(row, dtype=torch.int32)
    k = torch.randn(max(seqlen_k, 1), HEAD_DIM)  # [rows, D]; no key row: the launchers' one-row stand-in
    bounds = (torch.tensor([lo], dtype=torch.int32), torch.tensor([hi], dtype=torch.int32))
    out = torch.zeros(1)
    args = (idx, k, *bounds, out, s0, len(row), seqlen_k, max(seqlen_k, 1) - 1, k.stride(0))
    with interp_memcheck.checking("strict"):
        _gather_addresses_kernel[(1,)](*args, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, CLAMP=True)
        with pytest.raises(Exception, match="outside every tensor argument"):  # the check sees the raw addresses
            _gather_addresses_kernel[(1,)](*args, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, CLAMP=False)


@triton.jit
def _entry_addresses_kernel(entries_ptr, part_ptr, out_ptr, e, n_entries, chunk_slots, stride_row,
                            BLOCK_W: tl.constexpr, CLAMP: tl.constexpr):
    cols = tl.arange(0, BLOCK_W)
    off = cols < 0
    if CLAMP:
        ent = _entry_row(entries_ptr, e, n_entries, chunk_slots)
    else:
        ent = tl.load(entries_ptr + e)
    x = tl.load(part_ptr + ent.to(tl.int64) * stride_row + cols, mask=off, other=0.0)
    tl.store(out_ptr, tl.sum(x, 0))


@pytest.mark.parametrize("e, entries", [(6, [0, 5, 2, 1, 3, 4]), (2, [3, BIG, -BIG, 0, 1, 2])],
                         ids=["entry-past-the-end", "entry-values-outside-the-chunk"])
def test_the_reduce_loops_addresses_stay_inside(e, entries):
    chunk_slots, width = 6, 16
    part = torch.zeros(chunk_slots, width)  # [C * K, row]
    args = (torch.tensor(entries, dtype=torch.int32), part, torch.zeros(1), e, len(entries), chunk_slots, width)
    with interp_memcheck.checking("strict"):
        _entry_addresses_kernel[(1,)](*args, BLOCK_W=width, CLAMP=True)
        with pytest.raises(Exception, match="outside every tensor argument"):
            _entry_addresses_kernel[(1,)](*args, BLOCK_W=width, CLAMP=False)


def test_the_compacted_reduce_stays_inside_for_any_segment_value():
    """The reduce over a chunk's compacted segments (kernels/sparse_index.py ``TopkCSR``) with what no real
    CSR holds: a segment count past its slots, key rows and heads outside the accumulator, segment bounds
    past the entries, entry values outside the chunk: every lane of every load and store inside."""
    from coreattn.kernels.sparse_bwd import _sparse_attn_reduce_kernel

    key_rows, heads_kv, chunk_slots, width = 4, 2, 6, 24
    part = torch.zeros(heads_kv, chunk_slots, 32)  # [Hkv, C * K, stride_row]
    acc = torch.zeros(key_rows, heads_kv, 32)
    i32 = dict(dtype=torch.int32)
    seg_ptr = torch.tensor([0, 4, 9], **i32)  # the second segment ends past the 5 entries
    seg_row, seg_head = torch.tensor([BIG, -BIG], **i32), torch.tensor([-BIG, BIG], **i32)
    entries = torch.tensor([BIG, -BIG, 0, 5, 2**31 - 1], **i32)
    n_segs = torch.tensor([7], **i32)  # more than the 2 slots
    with interp_memcheck.checking("strict"):
        _sparse_attn_reduce_kernel[(3,)](part, acc, seg_ptr, seg_row, seg_head, n_segs, entries, heads_kv, 1, 2,
                                         key_rows, chunk_slots, entries.numel(), width, 2, 32, BLOCK_W=16)


def test_the_key_centric_dkv_stays_inside_for_any_entry():
    """The key-centric dK/dV (kernels/sparse_bwd.py ``_sparse_attn_dkv_keys_kernel``) over a segment that runs
    past the entries, with token values outside the tokens: every lane inside."""
    from coreattn.kernels.sparse_bwd import _sparse_attn_dkv_keys_kernel

    tokens, key_rows, heads, dim = 3, 2, 2, 16
    q, k, v, do = (torch.randn(tokens if i != 1 and i != 2 else key_rows, heads, dim) for i in range(4))
    lse, delta = torch.zeros(heads, tokens), torch.zeros(heads, tokens)
    acc = torch.zeros(key_rows, heads, 2 * dim)
    row_ptr = torch.tensor([0, 3, 3, 9, 11], dtype=torch.int64)  # segments past the 5 entries
    entries = torch.tensor([BIG, -BIG, 2, 0, 2**31 - 1], dtype=torch.int32)
    strides = (0, q.stride(0), q.stride(1), 0, k.stride(0), k.stride(1), 0, v.stride(0), v.stride(1), 0,
               do.stride(0), do.stride(1), 0, lse.stride(0), 2 * dim)
    with interp_memcheck.checking("strict"):
        _sparse_attn_dkv_keys_kernel[(key_rows * heads,)](
            q, k, v, do, lse, delta, acc, row_ptr, entries, key_rows * heads, entries.numel(), tokens, tokens,
            key_rows, key_rows, heads, 1, heads, 0.25, 0.36, *strides, HEAD_DIM_QK=dim, HEAD_DIM_V=dim,
            BLOCK_DQK=dim, BLOCK_DQK2=0, BLOCK_DV=dim, BLOCK_M=2, BLOCK_G=1, V_IS_K=False, PERSISTENT=False,
            BATCH_ALIGNED=True)
