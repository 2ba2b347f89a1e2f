"""Tile maps: which sequence and rows each attention program works on, built once per call.

The attention kernels cut every sequence into tiles of BLOCK rows, sequence after sequence, and
launch one program per (tile, head). The grid is sized on the host from ints it knows (the token
count or padded length and B: ``tile_bound``), so max_seqlen is never needed and no value is read
back. Each program must then find its tile's sequence and first row, and the layout (cu_seqlens
or spans) must be checked. Two kernels do that once per call, before the attention kernels:

1. ``_tile_scan_kernel`` (one program): a pass over both sides' layouts in chunks of SCAN_CHUNK
   entries. It checks them (cu_seqlens from 0 to the token count without decreasing; spans inside
   ``[0, total)``; no more tiles than the grid has) and writes, for each side that gets a map, the
   exclusive prefix sum of tile counts ``first[b]`` (``first[B]``: the side's tile count) and a
   status word. O(B) work, once per call.
2. ``_tile_map_kernel`` (one program per MAP_TILES tiles): tile t's sequence is the largest b with
   ``first[b] <= t``, found by a binary search over ``first`` (every tile of a program searches at
   once, as one vector); it writes the tile's entry: (sequence, first row, q start, q length,
   k start, k length), MAP_FIELDS int32 words, or the sequence B for a tile past the last one
   (an idle program), or -1 for every tile when the layout is malformed (the attention programs
   then write NaN over their outputs). O(log B) per tile.

An attention program then reads its entry (one 32-byte sector) instead of scanning the layout:
O(1) work per program, independent of B, where the in-kernel scan each program ran before was
O(B) (the issue: 80,000 sequences made it thousands of loop iterations against one key block).

Why a map kernel and not a binary search inside each attention program: the search is log2(B)
dependent loads (17 at B = 80,000) before the program can load Q, and the attention kernels run
at one or two blocks per SM (registers), so that latency is not hidden and would cost about as
much as the attention of a short sequence; in the small map kernel the same searches run for
hundreds of tiles per program at full occupancy, and the attention program waits on one load.
Why a binary search and not a scatter of each sequence's tiles: a sequence's tile count varies
from 0 to the whole batch's, so a scatter would loop as long as the longest sequence. Why not a
prefix sum across programs (decoupled look-back): it needs inter-program flags and spinning,
which neither the interpreter nor Ascend's persistent grid can rely on; one program scanning
SCAN_CHUNK entries per step is O(B / SCAN_CHUNK) steps, a few at B = 4,096 and about 40 at
80,000.

Scheduling is unchanged from the in-kernel scan: tiles are numbered sequence after sequence and
a query-side map numbers each sequence's tiles from its last (with REVERSE: under a causal mask
the last query tile sees the most keys, so the longest-running programs start first; key tiles
are numbered from the first, which under a causal mask is the one seen by the most queries).

Everything stays a runtime value (B, token counts, tile counts, search depth: never
specialized), so new packed batches do not recompile; the buffers are sized from host ints
(``tile_bound``), so a call can be captured in a CUDA graph and replayed with other lengths.
Trailing zero-length sequences (fixed-capacity cu_seqlens) get no tiles: each adds one idle
program per head to the grid, which returns after reading its entry. Vector indices are int32
and offsets int64 scalars (Ascend's frontend falls back to scalar code for int64 vectors); the
int64 tile totals that guard against overflowing counts are one reduction per chunk. No lane is
multiplied by a runtime stride (entries are an int64 task base plus ``lane * 8``; the layouts are
read at unit stride), so these kernels need no 64-bit lane variant (coreattn/tune/offsets.py
finds no i32 stride product in them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coreattn.kernels.configs.targets import launch_options, persistent_grid
from coreattn.kernels.device import on_device
from coreattn.kernels.launch import launch
from coreattn.kernels.packing import Packing

SCAN_CHUNK = 2048  # layout entries per step of the scan (fixed: the batch size never enters a compile key)
MAP_TILES = 256  # tiles per program of the map kernel
MAP_FIELDS = 8  # int32 words per tile entry (6 used): one 32-byte sector
SCAN_INTS = ("batch", "seqlen_q_total", "seqlen_k_total", "n_tiles_q", "n_tiles_k")
MAP_INTS = ("batch", "n_tiles", "steps")


def tile_bound(batch: int, seqlen_total: int, block: int, packed_layout: bool) -> int:
    """Tiles of ``block`` rows that a layout's sequences can need at most: packed (thd) sequences
    share the T tokens (each adds at most one partial tile); padded ones each fit in S."""
    per_seq = batch * triton.cdiv(seqlen_total, block)
    return min(per_seq, triton.cdiv(seqlen_total, block) + batch) if packed_layout else per_seq


@triton.jit
def _seq_span(seq_ptr, len_ptr, seq, SPANS: tl.constexpr):
    """(start, length) of sequence ``seq``: from cu_seqlens or from span tensors."""
    start = tl.load(seq_ptr + seq)
    if SPANS:
        length = tl.load(len_ptr + seq)
    else:
        length = tl.load(seq_ptr + seq + 1) - start
    return start, length


@triton.jit
def _side_chunk(seq_ptr, len_ptr, idx, at, valid, total, BLOCK: tl.constexpr, SPANS: tl.constexpr):
    """Tile counts of entries ``idx`` of a side's layout (0 where not ``valid``) and which are
    malformed (a negative length; with spans, one outside [0, total)); read at ``at``, ``idx``
    clamped to the last entry (every address inside the layout, masked or not)."""
    start = tl.load(seq_ptr + at, mask=valid, other=0)
    if SPANS:
        length = tl.load(len_ptr + at, mask=valid, other=0)
        bad = (start < 0) | (length < 0) | (start > total - length)
    else:
        length = tl.load(seq_ptr + at + 1, mask=valid, other=0) - start
        bad = length < 0
    length = tl.maximum(length, 0)
    count = length // BLOCK + (length % BLOCK != 0).to(tl.int32)  # cdiv without overflowing int32
    return tl.where(valid, count, 0), valid & bad


@triton.jit(do_not_specialize=SCAN_INTS)
def _tile_scan_kernel(q_seq_ptr, q_len_ptr, k_seq_ptr, k_len_ptr, first_q_ptr, first_k_ptr, status_ptr,
                      batch, seqlen_q_total, seqlen_k_total, n_tiles_q, n_tiles_k,
                      BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, MAP_Q: tl.constexpr, MAP_K: tl.constexpr,
                      SPANS: tl.constexpr, CHUNK: tl.constexpr):
    """One program. Checks both sides' layouts; writes first_*[0..B] for the sides with a map
    (MAP_Q, MAP_K) and status[0] = 1 when everything is well formed and fits the grid."""
    offs = tl.arange(0, CHUNK)
    if SPANS:
        ok = batch >= 0
    else:
        ok = (tl.load(q_seq_ptr) == 0) & (tl.load(q_seq_ptr + batch) == seqlen_q_total)
        ok = ok & (tl.load(k_seq_ptr) == 0) & (tl.load(k_seq_ptr + batch) == seqlen_k_total)
    tiles_q = tl.cast(batch, tl.int64) * 0  # running tile counts, int64: malformed lengths must not wrap
    tiles_k = tiles_q
    for b0 in range(0, batch, CHUNK):
        idx = b0 + offs
        valid = idx < batch
        at = tl.minimum(idx, batch - 1)  # the launchers never call with batch 0
        count_q, bad_q = _side_chunk(q_seq_ptr, q_len_ptr, idx, at, valid, seqlen_q_total, BLOCK_Q, SPANS)
        count_k, bad_k = _side_chunk(k_seq_ptr, k_len_ptr, idx, at, valid, seqlen_k_total, BLOCK_K, SPANS)
        ok = ok & (tl.max((bad_q | bad_k).to(tl.int32), axis=0) == 0)
        if MAP_Q:
            tl.store(first_q_ptr + at, tiles_q.to(tl.int32) + tl.cumsum(count_q, axis=0) - count_q, mask=valid)
            tiles_q += tl.sum(count_q.to(tl.int64), axis=0)
        if MAP_K:
            tl.store(first_k_ptr + at, tiles_k.to(tl.int32) + tl.cumsum(count_k, axis=0) - count_k, mask=valid)
            tiles_k += tl.sum(count_k.to(tl.int64), axis=0)
    if MAP_Q:
        tl.store(first_q_ptr + batch, tiles_q.to(tl.int32))
        ok = ok & (tiles_q <= n_tiles_q)
    if MAP_K:
        tl.store(first_k_ptr + batch, tiles_k.to(tl.int32))
        ok = ok & (tiles_k <= n_tiles_k)
    tl.store(status_ptr, ok.to(tl.int32))


@triton.jit
def _map_tiles(task, q_seq_ptr, q_len_ptr, k_seq_ptr, k_len_ptr, first_ptr, status_ptr, map_ptr, batch, n_tiles,
               steps, BLOCK: tl.constexpr, REVERSE: tl.constexpr, SPANS: tl.constexpr, TILES: tl.constexpr):
    """Entries of tiles [task * TILES, (task + 1) * TILES)."""
    offs = tl.arange(0, TILES)
    tiles = task * TILES + offs  # int32: tiles < n_tiles <= 2**31 - 1
    live = tiles < n_tiles
    ok = tl.load(status_ptr) != 0
    n_real = tl.load(first_ptr + batch)
    # the largest b with first[b] <= tile: first[lo] <= tile < first[hi] throughout (first[0] = 0,
    # first[B] = n_real > tile for a real tile); ``steps`` halvings leave hi = lo + 1
    lo = tl.zeros([TILES], tl.int32)
    hi = lo + batch
    for _ in range(steps):
        mid = (lo + hi) // 2
        right = tl.load(first_ptr + mid) <= tiles
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    if REVERSE:  # a sequence's tiles from its last
        local = tl.load(first_ptr + lo + 1) - 1 - tiles
    else:
        local = tiles - tl.load(first_ptr + lo)
    q_start, q_len = _seq_span(q_seq_ptr, q_len_ptr, lo, SPANS)
    k_start, k_len = _seq_span(k_seq_ptr, k_len_ptr, lo, SPANS)
    seq = tl.where(tiles < n_real, lo, batch)
    seq = tl.where(ok, seq, -1)
    # entries of the program's tiles, lanes past the last tile clamped to it (inside the map for every lane)
    entry = map_ptr + tl.cast(task, tl.int64) * (TILES * 8) + tl.minimum(offs, n_tiles - 1 - task * TILES) * 8
    tl.store(entry + 0, seq, mask=live)
    tl.store(entry + 1, local * BLOCK, mask=live)
    tl.store(entry + 2, q_start, mask=live)
    tl.store(entry + 3, q_len, mask=live)
    tl.store(entry + 4, k_start, mask=live)
    tl.store(entry + 5, k_len, mask=live)


@triton.jit(do_not_specialize=MAP_INTS)
def _tile_map_kernel(q_seq_ptr, q_len_ptr, k_seq_ptr, k_len_ptr, first_ptr, status_ptr, map_ptr,
                     batch, n_tiles, steps, BLOCK: tl.constexpr, REVERSE: tl.constexpr, SPANS: tl.constexpr,
                     TILES: tl.constexpr, PERSISTENT: tl.constexpr):
    # grid: one program per TILES tiles; PERSISTENT (Ascend): those tasks over a core-count grid
    if PERSISTENT:
        for task in range(tl.program_id(0), tl.cdiv(n_tiles, TILES), tl.num_programs(0)):
            _map_tiles(task, q_seq_ptr, q_len_ptr, k_seq_ptr, k_len_ptr, first_ptr, status_ptr, map_ptr, batch,
                       n_tiles, steps, BLOCK, REVERSE, SPANS, TILES)
    else:
        _map_tiles(tl.program_id(0), q_seq_ptr, q_len_ptr, k_seq_ptr, k_len_ptr, first_ptr, status_ptr, map_ptr,
                   batch, n_tiles, steps, BLOCK, REVERSE, SPANS, TILES)


@on_device
def tile_maps(q_pack: Packing, k_pack: Packing, seqlen_q_total: int, seqlen_k_total: int, target: str, *,
              q_tiles: tuple[int, int] | None = None,
              k_tiles: tuple[int, int] | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(query-side map, key-side map), each int32 ``[n_tiles, MAP_FIELDS]`` (see the module
    docstring), for ``q_tiles``/``k_tiles`` = (block, n_tiles): the tile height and the grid's
    tile count (``tile_bound``); None builds no map for that side. Both sides' layouts are checked
    either way. Two launches for one map, three for two; no host sync."""
    seq = q_pack.seq
    device, batch = seq.device, q_pack.batch
    q_lens = q_pack.lens if q_pack.spans else seq  # a dummy pointer in cu_seqlens mode
    k_lens = k_pack.lens if k_pack.spans else k_pack.seq
    new = lambda n: torch.empty(n, dtype=torch.int32, device=device)  # noqa: E731
    status = new(1)
    first_q = new(batch + 1) if q_tiles else status
    first_k = new(batch + 1) if k_tiles else status
    launch(
        target, _tile_scan_kernel, (1,),
        q_pack.seq, q_lens, k_pack.seq, k_lens, first_q, first_k, status, batch, seqlen_q_total, seqlen_k_total,
        q_tiles[1] if q_tiles else 0, k_tiles[1] if k_tiles else 0,
        BLOCK_Q=q_tiles[0] if q_tiles else 16, BLOCK_K=k_tiles[0] if k_tiles else 16, MAP_Q=q_tiles is not None,
        MAP_K=k_tiles is not None, SPANS=q_pack.spans, CHUNK=SCAN_CHUNK, num_warps=8, **launch_options(target))
    maps = []
    for tiles, first, reverse in ((q_tiles, first_q, True), (k_tiles, first_k, False)):
        if tiles is None:
            maps.append(None)
            continue
        block, n_tiles = tiles
        tile_map = new(n_tiles * MAP_FIELDS).view(n_tiles, MAP_FIELDS)
        tasks = triton.cdiv(n_tiles, MAP_TILES)
        persistent = target == "ascend"
        grid = (persistent_grid(device, tasks, vector_only=True) if persistent else tasks,)
        launch(
            target, _tile_map_kernel, grid,
            q_pack.seq, q_lens, k_pack.seq, k_lens, first, status, tile_map, batch, n_tiles,
            max(batch - 1, 0).bit_length(),
            BLOCK=block, REVERSE=reverse, SPANS=q_pack.spans, TILES=MAP_TILES, PERSISTENT=persistent,
            **launch_options(target))
        maps.append(tile_map)
    return maps[0], maps[1]


@triton.jit
def _tile_seq(map_ptr, tile):
    """Tile ``tile``'s sequence: -1 when the layout is malformed (write NaN), B past the last tile
    (nothing to do)."""
    return tl.load(map_ptr + tl.cast(tile, tl.int64) * 8)


@triton.jit
def _tile_rows(map_ptr, tile):
    """(row0, q_start, seqlen_q, k_start, seqlen_k) of a real tile (read where they are used, so
    they are not live across the kernel's early branches)."""
    entry = map_ptr + tl.cast(tile, tl.int64) * 8
    return tl.load(entry + 1), tl.load(entry + 2), tl.load(entry + 3), tl.load(entry + 4), tl.load(entry + 5)
