"""How the torch backend's sparse attention splits its work: row statistics on the device, then a plan.

A *unit* is one query token n and one index head h (``topk [N, Hidx, K]``): it covers ``Hu = Hkv /
Hidx`` kv heads (all of them for shared indices, one for per-kv-head indices) and their ``Hu * G``
query heads. Its *keys* are the entries of its row that are inside ``[key_lo[n], key_hi[n])`` and
the sample's rows (``prepare_topk`` already turned repeats into -1), named by their *global row*
``b * Sk + j`` (the row of the backend's key source).

``unit_stats`` computes, in torch ops on the indices' device (no host read), per unit its key
``count`` and the global rows of its first and last key (``first``, ``end`` = last + 1). A unit is
*contiguous* when ``count == end - first``: it sees every key of a range, as a row that sees its
whole causal range does (DSA's top-k names every causal key while a sequence is shorter than K).

``plan_host`` (CPU, where ``coreattn.layers.checks.reads_values`` lets the backend read those
statistics) groups units into work:

- *blocks*: consecutive tokens of one sample and index head whose key ranges overlap. A block's
  keys are one list for all its tokens: the contiguous range ``[first, end)`` of the block (no
  gather: a slice of the key source), or the union of its tokens' keys when that is much smaller
  than the range (one gather serves every token); each token then masks the keys it does not name
  (contiguous units compare against their range, others get a membership mask). One product per
  block, as dense attention does;
- *rows*: units whose block would cost more than gathering each unit's own keys (their keys spread
  over a range far wider than they are), sorted by count and gathered per unit, each chunk as wide
  as its largest count: the work follows the counts, not K.

The choice compares products (``product_cost``): a block is one ``[tokens * G, D] x [D, keys]``
product, its tokens gathered one by one are ``[G, D] x [D, count]`` products each. A product with
few rows M runs slower per flop than a large GEMM, about ``1 + 10 / M`` times (measured on CPU: a
unit's product with G = 4 heads per kv head about 3.5x slower than a 512-row block's, 1.7x at
G = 16), so a block may compute more (query, key) pairs than its tokens name and still win.

``plan_device`` is the plan without reading anything (any other device): every unit in token order
through the per-unit path, each chunk ``static_width`` wide (K bounded by the keys a token can see
at all). Data-dependent block sizes would need the statistics on the host: a sync.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from coreattn.kernels.sparse_index import INT32_MAX

STATS_CHUNK_ENTRIES = 1 << 18  # index entries examined at once in unit_stats (bounds its temporaries)
BLOCK_QUERY_ROWS = 512  # query rows (tokens x query heads per kv head) a block aims at: a GEMM's M
UNION_OVERHEAD = 1.25  # a union block's gather and mask, relative to a range block of the same width


def product_cost(m: int, pairs: int) -> float:
    """Relative time of products with ``m`` query rows over ``pairs`` (query token, key) pairs."""
    return pairs * (1.0 + 10.0 / max(1, m))


def choose_mode(tokens: int, group: int, keys: int, range_width: int, union) -> tuple[str, torch.Tensor | None]:
    """How a span of ``tokens`` consecutive tokens naming ``keys`` keys in all, over a key range
    ``range_width`` wide, runs: "range" (one block over the range), "union" (one block over the
    keys some token names: ``union()`` marks them in the range, computed only when needed, and is
    returned) or "rows" (each unit gathers its own keys)."""
    alone = product_cost(group, keys)
    if product_cost(tokens * group, tokens * range_width) <= alone:
        return "range", None
    if tokens > 1:
        seen = union()
        if UNION_OVERHEAD * product_cost(tokens * group, tokens * int(seen.sum())) <= alone:
            return "union", seen
    return "rows", None


class UnitStats(NamedTuple):
    count: torch.Tensor  # [N, Hidx] int64: keys of the unit
    first: torch.Tensor  # [N, Hidx] int64: global row of its first key (0 without keys)
    end: torch.Tensor  # [N, Hidx] int64: global row of its last key + 1 (0 without keys)


def clipped_bounds(key_lo: torch.Tensor, key_hi: torch.Tensor, start: int, stop: int,
                   seqlen_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[C, 1, 1]`` bounds of tokens [start, stop), clipped to the sample's key rows."""
    lo = key_lo[start:stop].to(torch.int64).clamp(min=0)[:, None, None]
    hi = key_hi[start:stop].to(torch.int64).clamp(max=seqlen_k)[:, None, None]
    return lo, hi


def sample_rows(start: int, stop: int, seqlen_q: int, seqlen_k: int, device) -> torch.Tensor:
    """int64 ``[C, 1, 1]``: the global row of key 0 of each token's sample (``b * Sk``)."""
    n = torch.arange(start, stop, device=device, dtype=torch.int64)
    return (n // max(seqlen_q, 1) * seqlen_k)[:, None, None]


def unit_stats(topk: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, seqlen_q: int,
               seqlen_k: int) -> UnitStats:
    """Count, first and end of every unit (see the module docstring), chunk by chunk of tokens."""
    tokens, heads, slots = topk.shape
    count = torch.zeros(tokens, heads, dtype=torch.int64, device=topk.device)
    first, end = torch.zeros_like(count), torch.zeros_like(count)
    step = max(1, STATS_CHUNK_ENTRIES // max(1, heads * slots))
    for n0 in range(0, tokens, step):
        n1 = min(n0 + step, tokens)
        idx = topk[n0:n1]  # [C, Hidx, K] int32: every key position fits (prepare_topk)
        lo, hi = clipped_bounds(key_lo, key_hi, n0, n1, seqlen_k)
        valid = (idx >= lo) & (idx < hi)
        c = valid.sum(-1)
        base = sample_rows(n0, n1, seqlen_q, seqlen_k, topk.device)[:, :, 0]
        some = c > 0
        count[n0:n1] = c
        first[n0:n1] = torch.where(some, idx.masked_fill(~valid, INT32_MAX).amin(-1) + base, 0)
        end[n0:n1] = torch.where(some, idx.masked_fill(~valid, -1).amax(-1) + 1 + base, 0)
    return UnitStats(count, first, end)


class Block(NamedTuple):
    """Tokens ``[n0, n1)`` (one sample) of index head ``head`` over the global key rows ``[r0, r1)``;
    ``union``: int64 global rows of the keys some token names (sorted), or None for the whole range;
    ``contiguous``: every token's keys are its own range ``[first, end)`` (no membership mask)."""

    head: int
    n0: int
    n1: int
    r0: int
    r1: int
    union: torch.Tensor | None
    contiguous: bool


class BlockCost(NamedTuple):
    """A block's working memory in bytes: per (token, key) pair, per key of a range or of a union, and
    per token (its row of indices turned into a mask)."""

    pair: int
    range_key: int
    union_key: int
    token: int


class Plan(NamedTuple):
    blocks: list[Block]
    rows: list[tuple[torch.Tensor, int]]  # chunks of units: (unit ids n * Hidx + h [C] int64, width)


def _spans(count: list[int], first: list[int], end: list[int], seqlen_q: int, max_tokens: int,
           fits) -> list[tuple[int, int, int, int]]:
    """(n0, n1, r0, r1) of consecutive units with keys, one sample, overlapping key ranges, at most
    ``max_tokens`` tokens, and ``fits(tokens, range width)``."""
    spans = []
    n0 = None
    for n, (c, f, e) in enumerate(zip(count, first, end)):
        if n0 is not None:
            r0n, r1n = min(r0, f), max(r1, e)
            if c == 0 or n % seqlen_q == 0 or f >= r1 or e <= r0 or n - n0 >= max_tokens \
                    or not fits(n + 1 - n0, r1n - r0n):
                spans.append((n0, n, r0, r1))
                n0 = None
            else:
                r0, r1 = r0n, r1n
                continue
        if c > 0:
            n0, r0, r1 = n, f, e
    if n0 is not None:
        spans.append((n0, len(count), r0, r1))
    return spans


def _union(topk: torch.Tensor, key_lo, key_hi, head: int, n0: int, n1: int, r0: int, r1: int, seqlen_q: int,
           seqlen_k: int) -> torch.Tensor:
    """bool ``[r1 - r0]``: which global rows of the range some token of the block names."""
    idx = topk[n0:n1, head:head + 1].to(torch.int64)  # [C, 1, K]
    lo, hi = clipped_bounds(key_lo, key_hi, n0, n1, seqlen_k)
    valid = (idx >= lo) & (idx < hi)
    rows = torch.where(valid, idx + sample_rows(n0, n1, seqlen_q, seqlen_k, topk.device) - r0, r1 - r0)
    seen = torch.zeros(r1 - r0 + 1, dtype=torch.bool, device=topk.device)
    seen[rows.reshape(-1)] = True
    return seen[:-1]


def plan_host(topk: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, stats: UnitStats, *, seqlen_q: int,
              seqlen_k: int, group: int, block_bytes: int, block_cost: BlockCost, chunk_bytes: int,
              unit_bytes) -> Plan:
    """Blocks and row chunks from the unit statistics read on the host (see the module docstring).
    ``block_bytes``: a block's working-memory budget (``block_cost``: what it takes); ``chunk_bytes``:
    a chunk of units', where ``unit_bytes(width)`` is one unit's at that width."""
    hidx = topk.shape[1]
    count, first, end = (x.t().tolist() for x in stats)  # [Hidx][N]
    max_tokens = max(1, BLOCK_QUERY_ROWS // max(1, group))

    def fits(tokens: int, width: int, union: bool = False) -> bool:
        per_key = block_cost.union_key if union else block_cost.range_key
        return width * (per_key + tokens * block_cost.pair) + tokens * block_cost.token <= block_bytes
    blocks, loose = [], []
    for h in range(hidx):
        for n0, n1, r0, r1 in _spans(count[h], first[h], end[h], seqlen_q, max_tokens, fits):
            union = functools.partial(_union, topk, key_lo, key_hi, h, n0, n1, r0, r1, seqlen_q, seqlen_k)
            mode, seen = choose_mode(n1 - n0, group, sum(count[h][n0:n1]), r1 - r0, union)
            if mode == "union" and not fits(n1 - n0, int(seen.sum()), union=True):
                mode = "rows"
            if mode == "range":
                contiguous = all(count[h][n] == end[h][n] - first[h][n] for n in range(n0, n1))
                blocks.append(Block(h, n0, n1, r0, r1, None, contiguous))
            elif mode == "union":
                blocks.append(Block(h, n0, n1, r0, r1, seen.nonzero().squeeze(1) + r0, False))
            else:
                loose += [(count[h][n], n * hidx + h) for n in range(n0, n1)]
    loose.sort()
    rows, i = [], 0
    while i < len(loose):
        j = i + 1  # ascending counts: a chunk is as wide as its last unit's count
        while j < len(loose) and (j + 1 - i) * unit_bytes(loose[j][0]) <= chunk_bytes:
            j += 1
        rows.append((torch.tensor([u for _, u in loose[i:j]], dtype=torch.int64, device=topk.device),
                     loose[j - 1][0]))
        i = j
    return Plan(blocks, rows)


def static_width(topk_k: int, seqlen_k: int) -> int:
    """A unit's keys without reading anything: at most K, and at most the key rows of its sample."""
    return max(0, min(topk_k, seqlen_k))


def plan_device(units: int, width: int, unit_bytes: int, budget: int, device) -> Plan:
    """Every unit in order, chunks of ``budget // unit_bytes`` units of ``width`` slots (no host read)."""
    step = max(1, budget // max(1, unit_bytes))
    rows = [(torch.arange(u0, min(u0 + step, units), device=device), width) for u0 in range(0, units, step)]
    return Plan([], rows)
