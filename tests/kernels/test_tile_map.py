"""The tile map (coreattn/kernels/tile_map.py) against a plain Python numbering of the tiles, on the
layouts where a lookup goes wrong: empty sequences at the start, middle and end, all empty, one
sequence, more sequences than tiles, spans with gaps, more entries than one scan chunk holds,
malformed layouts; then attention on those layouts against the float64 oracle."""

import pytest
import torch

import coreattn
from attn_cases import KERNEL_DEVICE, assert_flash_criterion, assert_grad_criterion
from coreattn.kernels.configs.targets import ENV_TRITON_TARGET
from coreattn.kernels.packing import Packing, packed
from coreattn.kernels.tile_map import MAP_FIELDS, SCAN_CHUNK, tile_bound, tile_maps
from oracle import attention_ref, padded_attention_ref

BLOCK_Q, BLOCK_K = 16, 32


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _spans(pack: Packing):
    """(starts, lengths) as lists, from cu_seqlens or spans."""
    seq = pack.seq.tolist()
    if pack.spans:
        return seq, pack.lens.tolist()
    return seq[:-1], [b - a for a, b in zip(seq[:-1], seq[1:])]


def _expected(q_pack, k_pack, side_pack, block, n_tiles, reverse):
    """Entries in order: each sequence's tiles (from its last with ``reverse``), then idle ones."""
    q_starts, q_lens = _spans(q_pack)
    k_starts, k_lens = _spans(k_pack)
    rows = []
    for b, length in enumerate(_spans(side_pack)[1]):
        count = -(-length // block)
        for j in (reversed(range(count)) if reverse else range(count)):
            rows.append([b, j * block, q_starts[b], q_lens[b], k_starts[b], k_lens[b]])
    assert len(rows) <= n_tiles
    return rows + [[q_pack.batch]] * (n_tiles - len(rows))


def _check(q_pack, k_pack, total_q, total_k, target="interpreter"):
    n_q = tile_bound(q_pack.batch, total_q, BLOCK_Q, q_pack.fmt == "thd")
    n_k = tile_bound(k_pack.batch, total_k, BLOCK_K, k_pack.fmt == "thd")
    map_q, map_k = tile_maps(q_pack, k_pack, total_q, total_k, target, q_tiles=(BLOCK_Q, n_q), k_tiles=(BLOCK_K, n_k))
    for got, side, block, n, reverse in ((map_q, q_pack, BLOCK_Q, n_q, True), (map_k, k_pack, BLOCK_K, n_k, False)):
        assert got.shape == (n, MAP_FIELDS)
        want = _expected(q_pack, k_pack, side, block, n, reverse)
        assert got[:, 0].tolist() == [row[0] for row in want]  # sequence, or B for an idle program
        real = [i for i, row in enumerate(want) if len(row) > 1]
        assert got[real, :6].tolist() == [want[i] for i in real]
    return map_q, map_k


LAYOUTS = {
    "empty-start-middle-end": (0, 0, 5, 0, 17, 40, 0, 0),
    "one-sequence": (37,),
    "one-token-sequences": (1,) * 9,
    "more-sequences-than-tiles": (0,) * 20 + (1, 0, 2, 0, 1) + (0,) * 15,
    "exact-blocks": (16, 32, 64, 0),
}


@pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="tile maps compared on CPU")
@pytest.mark.parametrize("target", ["interpreter", "ascend"])
@pytest.mark.parametrize("lens", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_cu_seqlens_maps(monkeypatch, lens, target):
    if target == "ascend":
        monkeypatch.setenv(ENV_TRITON_TARGET, "ascend")  # the persistent map grid
    k_lens = tuple(reversed(lens))  # other key lengths, same batch
    q_pack, k_pack = packed(_cu(lens)), packed(_cu(k_lens))
    _check(q_pack, k_pack, sum(lens), sum(k_lens), target)


@pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="tile maps compared on CPU")
def test_more_entries_than_a_scan_chunk():
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(0, 4, (2 * SCAN_CHUNK + 5,), generator=gen).tolist()
    q_pack = packed(_cu(lens))
    _check(q_pack, q_pack, sum(lens), sum(lens))


@pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="tile maps compared on CPU")
def test_span_maps_with_gaps_and_all_empty():
    starts = torch.tensor([0, 10, 30, 40], dtype=torch.int32)
    lens = torch.tensor([4, 0, 7, 0], dtype=torch.int32)
    q_pack = Packing("thd", starts, lens)
    k_pack = Packing("thd", starts, torch.tensor([9, 3, 10, 0], dtype=torch.int32))
    _check(q_pack, k_pack, 40, 40)
    empty = Packing("bshd", torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    map_q, map_k = _check(empty, empty, 21, 21)
    assert (map_q[:, 0] == 3).all() and (map_k[:, 0] == 3).all()  # every program idle


@pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="tile maps compared on CPU")
@pytest.mark.parametrize("q_pack, k_pack, total", [
    (packed(_cu((3, 4))), packed(torch.tensor([1, 3, 7], dtype=torch.int32)), 7),  # k side not from 0
    (packed(torch.tensor([0, 5, 3, 7], dtype=torch.int32)), packed(_cu((3, 0, 4))), 7),  # q side decreasing
    (packed(_cu((3, 4))), packed(_cu((3, 5))), 7),  # k side past T
    (Packing("thd", torch.tensor([0, 0, 0], dtype=torch.int32), torch.tensor([64, 64, 64], dtype=torch.int32)),
     Packing("thd", torch.tensor([0, 0, 0], dtype=torch.int32), torch.tensor([64, 64, 64], dtype=torch.int32)),
     64),  # overlapping spans: more tiles than the grid has
    (Packing("thd", torch.tensor([0, 60], dtype=torch.int32), torch.tensor([1, 5], dtype=torch.int32)),
     Packing("thd", torch.tensor([0, 0], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32)), 64),
], ids=["not-from-0", "decreasing", "past-T", "too-many-tiles", "span-outside"])
def test_malformed_layouts_mark_every_tile(q_pack, k_pack, total):
    n = tile_bound(q_pack.batch, total, BLOCK_Q, True)
    map_q, map_k = tile_maps(q_pack, k_pack, total, total, "interpreter", q_tiles=(BLOCK_Q, n),
                             k_tiles=(BLOCK_K, tile_bound(k_pack.batch, total, BLOCK_K, True)))
    assert (map_q[:, 0] == -1).all() and (map_k[:, 0] == -1).all()


def _cotangent(out):
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)


@pytest.mark.parametrize("lens", [LAYOUTS["empty-start-middle-end"], LAYOUTS["more-sequences-than-tiles"],
                                  LAYOUTS["one-token-sequences"]], ids=["empty-start-middle-end",
                                                                       "more-sequences-than-tiles", "one-token"])
def test_attention_on_edge_layouts(lens):
    gen = torch.Generator().manual_seed(0)
    t = sum(lens)
    q = torch.randn(t, 2, 24, generator=gen).to(KERNEL_DEVICE).requires_grad_()
    k = torch.randn(t, 1, 24, generator=gen).to(KERNEL_DEVICE).requires_grad_()
    v = torch.randn(t, 1, 16, generator=gen).to(KERNEL_DEVICE).requires_grad_()
    cu = _cu(lens).to(KERNEL_DEVICE)
    out = coreattn.varlen_attn(q, k, v, cu, cu, max(lens), max(lens), causal=True, backend="triton")
    ref, _ = attention_ref(q, k, v, cu, cu, causal=True)
    naive, _ = attention_ref(q, k, v, cu, cu, causal=True, upcast=False)
    assert_flash_criterion("out", out, naive, ref)
    assert_grad_criterion(out, ref, naive, (q, k, v), _cotangent(out))


def test_attention_on_spans_with_gaps_and_keep_masks():
    gen = torch.Generator().manual_seed(2)
    b, s = 4, 40
    q, k, v = (torch.randn(b, s, h, d, generator=gen).to(KERNEL_DEVICE).requires_grad_()
               for h, d in ((2, 24), (1, 24), (1, 16)))
    start = torch.tensor([0, 10, 30, 3], dtype=torch.int32, device=KERNEL_DEVICE)
    length = torch.tensor([4, 0, 7, 33], dtype=torch.int32, device=KERNEL_DEVICE)
    keep = torch.rand(b, s, generator=gen).to(KERNEL_DEVICE) < 0.8
    out = coreattn.padded_attn(q, k, v, q_start=start, q_len=length, k_start=start, k_len=length, q_keep_mask=keep,
                               k_keep_mask=keep, causal=True, backend="triton")
    pos = torch.arange(s, device=KERNEL_DEVICE)[None]
    both = keep & (pos >= start[:, None]) & (pos < (start + length)[:, None])
    # equal q/k spans: causal visibility depends on position differences only, so the spans fold
    # into the keep masks for the oracle
    ref = padded_attention_ref(q, k, v, both, both, causal=True)
    naive = padded_attention_ref(q, k, v, both, both, causal=True, upcast=False)
    assert_flash_criterion("out", out, naive, ref)
    assert_grad_criterion(out, ref, naive, (q, k, v), _cotangent(out))
