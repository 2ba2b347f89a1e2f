"""The sparse kernels' index preparation (coreattn/kernels/sparse_index.py) against Python loops
written from its definition: the prepared rows (sorted, set semantics, topk_length, negatives and
values past int32 unused, sbhd's token order) and the CSR by key (every valid entry once, in
(token, slot) order within a key)."""

import pytest
import torch

import coreattn.kernels.sparse_index as sparse_index
from coreattn.kernels.sparse_index import INT32_MAX, prepare_topk, transpose_topk


def _expected_row(row: list[int], length: int | None) -> list[int]:
    """A prepared row from its definition: the first ``length`` entries, each valid value once,
    ascending, and -1 for every other slot (wherever the -1s sit, the multiset of a row is this)."""
    kept = row if length is None else row[:max(length, 0)]
    values = sorted({x for x in kept if 0 <= x <= INT32_MAX})
    return values + [-1] * (len(row) - len(values))


def _check_rows(prepared: torch.Tensor, rows: list[list[int]], lengths: list[int | None]):
    for got, row, length in zip(prepared.tolist(), rows, lengths):
        valid = [x for x in got if x >= 0]
        assert valid == sorted(valid) and len(set(valid)) == len(valid)  # ascending, no repeat
        assert sorted(got) == sorted(_expected_row(row, length))


def test_rows_sorted_deduplicated_and_unused_entries_minus_one():
    raw = torch.tensor([[5, 3, 5, -1, 3, 9],  # duplicates and a -1
                        [-7, -1, -1, -2, -1, -1],  # nothing valid
                        [2**31, 2**32 + 1, 0, 1, 2**31 - 1, 7],  # past int32 (2^32 + 1 must not wrap to 1)
                        [4, 4, 4, 4, 4, 4]], dtype=torch.int64)
    prepared = prepare_topk(raw, "thd")
    assert prepared.dtype == torch.int32 and prepared.shape == (4, 1, 6) and prepared.is_contiguous()
    _check_rows(prepared[:, 0], raw.tolist(), [None] * 4)


def test_topk_length_keeps_the_prefix_in_the_rows_own_order():
    raw = torch.tensor([[9, 1, 5, 3], [2, 2, 8, 0], [7, 6, 5, 4]], dtype=torch.int32)
    length = torch.tensor([2, 3, 0])
    prepared = prepare_topk(raw, "thd", topk_length=length)
    _check_rows(prepared[:, 0], raw.tolist(), length.tolist())
    assert sorted(prepared[0, 0].tolist()) == [-1, -1, 1, 9]  # 9 and 1 (slots 0, 1), not the two smallest
    assert (prepared[2] == -1).all()


@pytest.mark.parametrize("chunk", [None, 1, 7], ids=["whole", "chunk1", "chunk7"])
@pytest.mark.parametrize("fmt, heads", [("bshd", 1), ("sbhd", 1), ("sbhd", 2), ("thd", 3)])
def test_token_order_and_index_heads(fmt, heads, chunk, monkeypatch):
    """Also prepared a few positions at a time (``PREPARE_CHUNK_ENTRIES``: 1 entry, so one position per
    chunk, and 7): the same rows."""
    if chunk is not None:
        monkeypatch.setattr(sparse_index, "PREPARE_CHUNK_ENTRIES", chunk)
    gen = torch.Generator().manual_seed(0)
    batch, seqlen, n_slots = 2, 3, 5
    token_shape = {"thd": (batch * seqlen,), "bshd": (batch, seqlen), "sbhd": (seqlen, batch)}[fmt]
    head_shape = (heads,) if heads > 1 else ()
    raw = torch.randint(-2, 6, (*token_shape, *head_shape, n_slots), generator=gen)
    length = torch.randint(0, n_slots + 2, token_shape, generator=gen)
    prepared = prepare_topk(raw, fmt, topk_length=length)
    assert prepared.shape == (batch * seqlen, heads, n_slots)
    for n in range(batch * seqlen):
        b, s = divmod(n, seqlen)
        at = {"thd": (n,), "bshd": (b, s), "sbhd": (s, b)}[fmt]  # token n = b * S + s
        for h in range(heads):
            row = raw[at + ((h,) if heads > 1 else ())].tolist()
            _check_rows(prepared[n, h:h + 1], [row], [int(length[at])])


def test_empty_inputs():
    assert prepare_topk(torch.zeros(0, 4, dtype=torch.int64), "thd").shape == (0, 1, 4)
    assert prepare_topk(torch.zeros(0, 3, 4, dtype=torch.int64), "bshd").shape == (0, 1, 4)
    assert prepare_topk(torch.zeros(3, 0, dtype=torch.int64), "thd").shape == (3, 1, 0)
    assert prepare_topk(torch.zeros(0, 2, 4, dtype=torch.int64), "sbhd").shape == (0, 1, 4)


def _expected_csr(prepared, lo, hi, start, stop, seqlen_q, seqlen_k, batch):
    """{(index head, key row): [n_local * K + slot, ...]} in (token, slot) order, from loops."""
    n_slots = prepared.shape[-1]
    out = {}
    for n in range(start, stop):
        b = n // seqlen_q
        for h in range(prepared.shape[1]):
            for slot, j in enumerate(prepared[n, h].tolist()):
                if max(int(lo[n]), 0) <= j < min(int(hi[n]), seqlen_k):
                    out.setdefault((h, b * seqlen_k + j), []).append((n - start) * n_slots + slot)
    return out


@pytest.mark.parametrize("heads, start, stop", [(1, 0, 8), (2, 3, 7)], ids=["shared-whole", "per-head-chunk"])
def test_csr_by_key_lists_every_valid_entry_in_token_slot_order(heads, start, stop):
    gen = torch.Generator().manual_seed(1)
    batch, seqlen_q, seqlen_k, n_slots = 2, 4, 5, 6
    raw = torch.randint(-2, seqlen_k + 2, (batch * seqlen_q, heads, n_slots), generator=gen)
    prepared = prepare_topk(raw, "thd")
    lo = torch.randint(-1, 2, (batch * seqlen_q,), generator=gen, dtype=torch.int32)
    hi = torch.randint(0, seqlen_k + 2, (batch * seqlen_q,), generator=gen, dtype=torch.int32)
    csr = transpose_topk(prepared, lo, hi, start, stop, seqlen_q=seqlen_q, seqlen_k=seqlen_k, batch=batch)
    key_rows = batch * seqlen_k
    assert csr.row_ptr.dtype == torch.int32 and csr.row_ptr.shape == (heads * key_rows + 1,)
    assert csr.entries.dtype == torch.int32 and csr.entries.shape == ((stop - start) * heads * n_slots,)
    expected = _expected_csr(prepared, lo, hi, start, stop, seqlen_q, seqlen_k, batch)
    ptr, entries = csr.row_ptr.tolist(), csr.entries.tolist()
    for h in range(heads):
        for r in range(key_rows):
            seg = h * key_rows + r
            assert entries[ptr[seg]:ptr[seg + 1]] == expected.get((h, r), []), (h, r)
    assert ptr[-1] == sum(len(v) for v in expected.values())
