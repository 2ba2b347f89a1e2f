"""The sparse kernels' index preparation (coreattn/kernels/sparse_index.py) against Python loops
written from its definition: the prepared rows (sorted, set semantics, topk_length, negatives and
values past int32 unused, sbhd's token order), the CSR by key (every valid entry once, in
(token, slot) order within a key; the full rows left out where asked), the row classes (full rows, the
slots of the others' valid entries) and the token blocks the range-mode dK/dV visits per key block."""

import pytest
import torch

import coreattn.kernels.sparse_index as sparse_index
from coreattn.kernels.sparse_index import INT32_MAX, key_csr, prepare_topk, transpose_topk


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


@pytest.mark.parametrize("chunk", [None, 1, 9], ids=["whole", "chunk1", "chunk9"])
def test_extra_entries_join_every_head_after_the_length(chunk, monkeypatch):
    """A key window's entries (``extra``, made per chunk of tokens) join every index head's row after
    topk_length applies to the given entries: the same rows as preparing the concatenation, which is
    never materialized (each chunk asks for its own tokens' entries only)."""
    if chunk is not None:
        monkeypatch.setattr(sparse_index, "PREPARE_CHUNK_ENTRIES", chunk)
    gen = torch.Generator().manual_seed(4)
    tokens, heads, n_slots, width = 7, 2, 4, 3
    raw = torch.randint(-2, 9, (tokens, heads, n_slots), generator=gen)
    length = torch.randint(0, n_slots + 1, (tokens,), generator=gen)
    window = torch.randint(-1, 9, (tokens, width), generator=gen)
    asked = []

    def extra(n0, n1):
        asked.append((n0, n1))
        return window[n0:n1]

    prepared = prepare_topk(raw, "thd", length, extra=extra, extra_width=width)
    given = raw.masked_fill(torch.arange(n_slots) >= length[:, None, None], -1)
    expected = prepare_topk(torch.cat([given, window[:, None, :].expand(tokens, heads, width)], -1), "thd")
    assert torch.equal(prepared, expected)
    assert asked[0][0] == 0 and asked[-1][1] == tokens and all(a[1] == b[0] for a, b in zip(asked, asked[1:]))
    with pytest.raises(ValueError, match="thd"):
        prepare_topk(raw.view(1, tokens, heads, n_slots), "bshd", extra=extra, extra_width=width)


def test_empty_inputs():
    assert prepare_topk(torch.zeros(0, 4, dtype=torch.int64), "thd").shape == (0, 1, 4)
    assert prepare_topk(torch.zeros(0, 3, 4, dtype=torch.int64), "bshd").shape == (0, 1, 4)
    assert prepare_topk(torch.zeros(3, 0, dtype=torch.int64), "thd").shape == (3, 1, 0)
    assert prepare_topk(torch.zeros(0, 2, 4, dtype=torch.int64), "sbhd").shape == (0, 1, 4)


def _expected_csr(prepared, lo, hi, start, stop, seqlen_q, seqlen_k, batch, skip=None):
    """{(index head, key row): [n_local * K + slot, ...]} in (token, slot) order, from loops."""
    n_slots = prepared.shape[-1]
    out = {}
    for n in range(start, stop):
        b = n // seqlen_q
        for h in range(prepared.shape[1]):
            if skip is not None and skip[n, h]:
                continue
            for slot, j in enumerate(prepared[n, h].tolist()):
                if max(int(lo[n]), 0) <= j < min(int(hi[n]), seqlen_k):
                    out.setdefault((h, b * seqlen_k + j), []).append((n - start) * n_slots + slot)
    return out


def _csr_case(heads, skip, seed=1):
    gen = torch.Generator().manual_seed(seed)
    batch, seqlen_q, seqlen_k, n_slots = 2, 4, 5, 6
    raw = torch.randint(-2, seqlen_k + 2, (batch * seqlen_q, heads, n_slots), generator=gen)
    prepared = prepare_topk(raw, "thd")
    lo = torch.randint(-1, 2, (batch * seqlen_q,), generator=gen, dtype=torch.int32)
    hi = torch.randint(0, seqlen_k + 2, (batch * seqlen_q,), generator=gen, dtype=torch.int32)
    skip = torch.randint(0, 2, (batch * seqlen_q, heads), generator=gen, dtype=torch.int8) if skip else None
    return prepared, lo, hi, skip, dict(seqlen_q=seqlen_q, seqlen_k=seqlen_k, batch=batch)


@pytest.mark.parametrize("heads, start, stop, skip", [(1, 0, 8, False), (2, 3, 7, True), (2, 5, 6, False)],
                         ids=["shared-whole", "per-head-chunk-skipping-rows", "one-token"])
def test_csr_by_key_lists_every_valid_entry_in_token_slot_order(heads, start, stop, skip):
    """The chunk's CSR compacted to the keys it names, in (head, key row) order, each listing its
    entries in (token, slot) order; ``skip``: the rows marked (the range mode's full rows) are left out.
    Its arrays follow the chunk's entries (min(entries, Hidx x key rows) segment slots), not the key rows."""
    prepared, lo, hi, skip, dims = _csr_case(heads, skip)
    csr = transpose_topk(prepared, lo, hi, start, stop, skip=skip, **dims)
    key_rows, n_slots = dims["batch"] * dims["seqlen_k"], prepared.shape[-1]
    entries_count = (stop - start) * heads * n_slots
    slots = min(entries_count, heads * key_rows)
    assert csr.entries.dtype == torch.int32 and csr.entries.shape == (entries_count,)
    assert csr.seg_ptr.dtype == torch.int32 and csr.seg_ptr.shape == (slots + 1,)
    assert csr.seg_row.shape == csr.seg_head.shape == (slots,) and csr.n_segs.shape == (1,)
    expected = _expected_csr(prepared, lo, hi, start, stop, dims["seqlen_q"], dims["seqlen_k"], dims["batch"], skip)
    n_segs = int(csr.n_segs)
    ptr, entries = csr.seg_ptr.tolist(), csr.entries.tolist()
    keys = list(zip(csr.seg_head.tolist(), csr.seg_row.tolist()))
    assert keys[:n_segs] == sorted(expected), "one segment per named key, in (head, key row) order"
    for u, key in enumerate(keys[:n_segs]):
        assert entries[ptr[u]:ptr[u + 1]] == expected[key], key
    valid = sum(len(v) for v in expected.values())
    assert ptr[n_segs:] == [valid] * (slots + 1 - n_segs), "segments past the count are empty"


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunks-of-one-token"])
@pytest.mark.parametrize("heads, skip", [(1, False), (2, True)], ids=["shared", "per-head-skipping-rows"])
def test_key_csr_lists_the_tokens_naming_each_key_in_order(heads, skip, chunk, monkeypatch):
    """The key-centric dK/dV's CSR over every token: per (index head, key row) the tokens naming it,
    ascending, built a chunk at a time (7 entries: one token's 6 slots per chunk) with the same result."""
    if chunk is not None:
        monkeypatch.setattr(sparse_index, "KEY_CSR_CHUNK_ENTRIES", chunk)
    prepared, lo, hi, skip, dims = _csr_case(heads, skip, seed=3)
    csr = key_csr(prepared, lo, hi, skip=skip, **dims)
    n_tokens, n_slots = prepared.shape[0], prepared.shape[-1]
    key_rows = dims["batch"] * dims["seqlen_k"]
    assert csr.row_ptr.dtype == torch.int64 and csr.row_ptr.shape == (heads * key_rows + 1,)
    assert csr.entries.dtype == torch.int32 and csr.entries.shape == (n_tokens * heads * n_slots,)
    expected = _expected_csr(prepared, lo, hi, 0, n_tokens, dims["seqlen_q"], dims["seqlen_k"], dims["batch"], skip)
    ptr, entries = csr.row_ptr.tolist(), csr.entries.tolist()
    for h in range(heads):
        for r in range(key_rows):
            seg = h * key_rows + r
            assert entries[ptr[seg]:ptr[seg + 1]] == [e // n_slots for e in expected.get((h, r), [])], (h, r)
    assert ptr[-1] == sum(len(v) for v in expected.values())


def _classes_by_loops(prepared, lo, hi, seqlen_k):
    """(span [N][H] (begin, end), full [N][H]) from row_classes' definition."""
    spans, fulls = [], []
    for n, heads in enumerate(prepared.tolist()):
        lo_n, hi_n = max(int(lo[n]), 0), min(int(hi[n]), seqlen_k)
        spans.append([])
        fulls.append([])
        for row in heads:
            slots = [i for i, j in enumerate(row) if lo_n <= j < hi_n]
            full = len(slots) == max(hi_n - lo_n, 0)
            fulls[-1].append(int(full))
            spans[-1].append((slots[0], slots[-1] + 1) if slots and not full else (0, 0))
    return spans, fulls


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunk5"])
def test_row_classes_full_rows_and_the_span_of_the_valid_entries(chunk, monkeypatch):
    """Full rows (every key of [lo, hi), in any order, among -1, repeats and keys outside; an empty
    range), rows one key short, rows without a valid entry, random rows; bounds clamped to the keys."""
    if chunk is not None:
        monkeypatch.setattr(sparse_index, "CLASSIFY_CHUNK_ENTRIES", chunk)
    gen = torch.Generator().manual_seed(2)
    seqlen_k, n_slots = 9, 8
    lo = torch.tensor([0, 2, 3, -2, 4, 5, 0, 1, 6, 0], dtype=torch.int32)
    hi = torch.tensor([3, 6, 3, 2, 12, 8, 9, 4, 7, 5], dtype=torch.int32)
    rows = [[2, 0, -1, 1, 1, 7, -5, 3],  # full [0, 3) with a repeat and keys outside
            [5, 3, 4, 2, -1, -1, -1, -1],  # full [2, 6)
            [1, 2, -1, -1, -1, -1, -1, -1],  # empty range: full
            [0, 1, -1, 5, -1, -1, -1, -1],  # [-2, 2) clamped to [0, 2): full
            [4, 5, 6, 7, -1, 8, 11, 20],  # [4, 12) clamped to [4, 9): full
            [5, 7, -1, -1, -1, -1, -1, -1],  # one short of [5, 8)
            [-1] * n_slots,  # nothing valid
            [0, 1, 2, 3, 3, 2, 1, 0],  # [1, 4) with repeats and 0 outside: full
            [6, 6, 6, 6, 6, 6, 6, 6],  # full [6, 7)
            torch.randint(-2, 11, (n_slots,), generator=gen).tolist()]
    prepared = prepare_topk(torch.tensor(rows), "thd")
    classes = sparse_index.row_classes(prepared, lo, hi, seqlen_k)
    assert classes.span.dtype == torch.int32 and classes.span.shape == (len(rows), 1, 2)
    assert classes.full.dtype == torch.int8 and classes.full.shape == (len(rows), 1)
    spans, fulls = _classes_by_loops(prepared, lo, hi, seqlen_k)
    assert classes.full.tolist() == fulls
    assert [[tuple(s) for s in n] for n in classes.span.tolist()] == spans
    assert fulls[:6] == [[1], [1], [1], [1], [1], [0]] and fulls[6:9] == [[0], [1], [1]]


def test_range_visits_cover_every_token_block_a_key_block_meets():
    """Per (index head, sample, key block): [first, end) holds every token block with a full row whose
    range meets the key block (random bounds, two samples, two index heads), and is exactly the blocks
    from the key block's own to the sample's last where rows are causal and all full."""
    gen = torch.Generator().manual_seed(3)
    batch, seqlen_q, seqlen_k, block_t, block_n = 2, 11, 13, 4, 4
    n = batch * seqlen_q
    lo = torch.randint(-1, 8, (n,), generator=gen, dtype=torch.int32)
    hi = lo + torch.randint(-1, 7, (n,), generator=gen, dtype=torch.int32)
    full = torch.randint(0, 2, (n, 2), generator=gen, dtype=torch.int8)
    visits = sparse_index.range_visits(full, lo, hi, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                       block_t=block_t, block_n=block_n)
    n_kblocks = -(-seqlen_k // block_n)
    assert visits.dtype == torch.int32 and visits.shape == (2, batch, n_kblocks, 2)
    for h in range(2):
        for b in range(batch):
            for kb in range(n_kblocks):
                first, end = visits[h, b, kb].tolist()
                for s in range(seqlen_q):
                    t = b * seqlen_q + s
                    lo_t, hi_t = max(int(lo[t]), 0), min(int(hi[t]), seqlen_k)
                    if full[t, h] and lo_t < hi_t and lo_t < (kb + 1) * block_n and hi_t > kb * block_n:
                        assert first <= s // block_t < end, (h, b, kb, s)
    # causal, every row full: key block kb is seen from its own positions to the end of the sample
    pos = torch.arange(seqlen_q, dtype=torch.int32).repeat(batch)
    visits = sparse_index.range_visits(torch.ones(n, 1, dtype=torch.int8), torch.zeros(n, dtype=torch.int32),
                                       pos + 1, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_q, block_t=block_t,
                                       block_n=block_n)
    n_tblocks = -(-seqlen_q // block_t)
    want = [[(kb * block_n) // block_t, n_tblocks] for kb in range(-(-seqlen_q // block_n))]
    assert visits[0, 0].tolist() == want and visits[0, 1].tolist() == want
