"""The DSA indexer's scores and top-k in torch ops (CPU and any device), chunked over query tokens.

Same semantics as the kernel (coreattn/kernels/indexer_topk.py, whose docstring states the selection
rule): score[n, j] = sum_h w[n, h] act(q[n, h] . k[j]) in float32 (float64 for float64 inputs), keys
``key_lo[n] <= j < key_hi[n]``, each candidate ranked by the same 64-bit key (score bits in the high
word, ``0xFFFFFFFF - j`` in the low word), so the selected set and its order are those of the kernel
for the same scores: score descending, the lower position first among equal scores, -1 after.

Memory: one chunk of C query tokens at a time, scores over the chunk's key range only (a [C, H, keys]
float32 product, C from a byte budget), never [T, T]. The key range of a chunk is the union of its
rows' bounds where reading them is free (CPU), else a range known on the host (causal bounds,
``max_seqlen``) or the whole sample: no host sync on a GPU.
"""

from __future__ import annotations

import os
from typing import Iterator, NamedTuple

import torch

from coreattn.layers.checks import reads_values

ENV_CHUNK_BYTES = "COREATTN_INDEXER_CHUNK_BYTES"
DEFAULT_CHUNK_BYTES = 64 * 2**20  # per chunk's largest temporary (the [C, H, keys] product and its peers)
CHUNK_BYTES = {"cpu": 16 * 2**20}  # per device type; a CPU chunk's temporaries are host memory next to the model's
LOW_WORD = 2**32 - 1
NEG_INF_WORD = -2139095041  # the ordered high word of -inf: keys at or below it are never selected
MIN_KEY = -(2**63)
NAN_WORD = 0x7FC00000  # the ordered high word of every NaN score (the positive quiet NaN's)


def chunk_bytes(device: torch.device | None = None) -> int:
    """The byte budget of one chunk's largest temporary on ``device`` (``CHUNK_BYTES``, else
    ``DEFAULT_CHUNK_BYTES``; ``COREATTN_INDEXER_CHUNK_BYTES`` overrides)."""
    value = os.environ.get(ENV_CHUNK_BYTES, "").strip()
    if value:
        return max(1, int(value))
    return CHUNK_BYTES.get(getattr(device, "type", None), DEFAULT_CHUNK_BYTES)


class Chunk(NamedTuple):
    """Query tokens ``rows`` (flat n = b * S + s) of sample ``b``, positions [s0, s1); their keys are
    positions [k0, k1) of the sample."""
    b: int
    s0: int
    s1: int
    k0: int
    k1: int

    @property
    def rows(self) -> slice:
        return slice(self.s0, self.s1)


def score_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def chunks(key_lo: torch.Tensor, key_hi: torch.Tensor, batch: int, seqlen_q: int, seqlen_k: int,
           row_bytes: int, key_range=None) -> Iterator[Chunk]:
    """Chunks of query tokens whose temporaries fit the budget: ``row_bytes`` per query token (its
    temporaries over a whole sample's keys). Key ranges: where coreattn reads values on the host
    (``coreattn.layers.checks.reads_values``: CPU by default, no device sync) the exact union of the
    rows' bounds; elsewhere
    ``key_range(s0, s1)`` (host-known bounds: a causal chunk's keys end at its last row's, a packed
    stream's start max_seqlen - 1 before its first row) or the whole sample."""
    if batch * seqlen_q == 0:
        return
    size = max(1, chunk_bytes(key_lo.device) // max(1, row_bytes))
    exact = reads_values(key_lo)
    if exact:
        lo = key_lo.view(batch, seqlen_q)
        hi = key_hi.view(batch, seqlen_q)
    for b in range(batch):
        for s0 in range(0, seqlen_q, size):
            s1 = min(s0 + size, seqlen_q)
            if exact:
                k0 = min(max(int(lo[b, s0:s1].min()), 0), seqlen_k)
                k1 = max(min(int(hi[b, s0:s1].max()), seqlen_k), k0)
            else:
                k0, k1 = (0, seqlen_k) if key_range is None else key_range(s0, s1)
                k0 = min(max(k0, 0), seqlen_k)
                k1 = max(min(k1, seqlen_k), k0)
            yield Chunk(b, s0, s1, k0, k1)


def sample_dims(q: torch.Tensor, k: torch.Tensor, fmt: str) -> tuple[int, int, int]:
    """(samples, query positions per sample, key positions per sample) of index-side q and k in ``fmt``
    (thd: one sample, the packed stream)."""
    if fmt == "thd":
        return 1, q.shape[0], k.shape[0]
    if fmt == "bshd":
        return q.shape[0], q.shape[1], k.shape[1]
    return q.shape[1], q.shape[0], k.shape[0]


def side_rows(x: torch.Tensor, fmt: str, b: int, s0: int, s1: int) -> torch.Tensor:
    """Tokens [s0, s1) of sample b of a thd/bshd/sbhd tensor, token dim first."""
    if fmt == "thd":
        return x[s0:s1]
    if fmt == "bshd":
        return x[b, s0:s1]
    return x[s0:s1, b]


def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, relu: bool, dtype: torch.dtype):
    """(scores [C, J], x [C, H, J]): x = q . k per head (q [C, H, D], k [J, D], w [C, H]), scores =
    sum_h w act(x), in ``dtype``."""
    x = torch.matmul(q.to(dtype), k.to(dtype).t())  # [C, H, J]
    act = x.clamp_min(0) if relu else x
    return (act * w.to(dtype)[:, :, None]).sum(1), x


def visible(chunk: Chunk, key_lo: torch.Tensor, key_hi: torch.Tensor) -> torch.Tensor:
    """[C, J] bool: key position chunk.k0 + j lies in the row's bounds."""
    cols = torch.arange(chunk.k0, chunk.k1, device=key_lo.device)
    return (cols[None, :] >= key_lo[:, None]) & (cols[None, :] < key_hi[:, None])


def pack_keys(scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered by (score desc, position asc) from float32 scores (a float64 score is
    rounded to float32 for the ranking only when it is not float32 already: see ``select``)."""
    s = torch.where(scores == 0, torch.zeros_like(scores), scores).to(torch.float32)  # -0.0 -> +0.0
    bits = s.view(torch.int32)
    okey = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    okey = torch.where(torch.isnan(s), NAN_WORD, okey)  # any NaN (either sign): above +inf, as torch.topk
    keys = (okey.to(torch.int64) << 32) | (LOW_WORD - positions.to(torch.int64))
    return torch.where(valid, keys, torch.full_like(keys, MIN_KEY))


def unpack_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions int64, -1 where unselectable; float32 scores, -inf there)."""
    high = (keys >> 32).to(torch.int32)
    ok = high > NEG_INF_WORD
    bits = high ^ ((high >> 31) & 0x7FFFFFFF)
    idx = torch.where(ok, LOW_WORD - (keys & LOW_WORD), torch.full_like(keys, -1))
    scores = torch.where(ok, bits.view(torch.float32), torch.full_like(bits, float("-inf"), dtype=torch.float32))
    return idx, scores


def select(scores: torch.Tensor, valid: torch.Tensor, k0: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``width`` of a chunk's [C, J] scores (keys at positions k0 + j; ``valid`` [C, J]) by the
    64-bit rule: (indices int64 [C, width], their scores [C, width] in the scores' dtype, -inf
    unused). float64 scores (the torch backend's float64 path) rank by the float64 value with the
    same tie rule (a stable sort), since their float32 rounding could tie distinct values."""
    c, j = scores.shape
    idx = torch.full((c, width), -1, dtype=torch.int64, device=scores.device)
    out = torch.full((c, width), float("-inf"), dtype=scores.dtype, device=scores.device)
    take = min(width, j)
    if take == 0:
        return idx, out
    positions = torch.arange(k0, k0 + j, device=scores.device)
    if scores.dtype == torch.float64:
        ranked = torch.where(valid, scores, torch.full_like(scores, float("-inf")))
        ranked = torch.where(ranked == 0, torch.zeros_like(ranked), ranked)
        order = torch.sort(ranked, dim=1, descending=True, stable=True).indices[:, :take]
        top = ranked.gather(1, order)
        ok = (top > float("-inf")) | top.isnan()
        idx[:, :take] = torch.where(ok, positions[order], torch.full_like(order, -1))
        out[:, :take] = torch.where(ok, top, torch.full_like(top, float("-inf")))
        return idx, out
    keys = pack_keys(scores, positions[None, :].expand(c, j), valid)
    top = torch.topk(keys, take, dim=1, sorted=True).values
    idx[:, :take], out[:, :take] = unpack_keys(top)
    return idx, out


def topk_torch(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor,
               topk: int, fmt: str, *, relu: bool = True, return_scores: bool = False, key_range=None,
               index_dtype: torch.dtype = torch.int64):
    """The torch backend of ``indexer_topk_fwd`` (same arguments and results; ``key_range``: host-known
    key ranges per chunk, see ``chunks``). Scores in float32, float64 for float64 inputs (then the
    returned scores are float64)."""
    heads = q.shape[-2]
    batch, seqlen_q, seqlen_k = sample_dims(q, k, fmt)
    width = min(topk, seqlen_k)
    dtype = score_dtype(q, k, weights)
    idx = torch.full((batch * seqlen_q, width), -1, dtype=index_dtype, device=q.device)
    scores = torch.full((batch * seqlen_q, width), float("-inf"), dtype=dtype, device=q.device) if return_scores else None
    # per key: x, its activated and weighted copies [H], the score, its key, mask and position
    row_bytes = (3 * heads + 2) * torch.finfo(dtype).bits // 8 * seqlen_k + 24 * seqlen_k
    for ch in chunks(key_lo, key_hi, batch, seqlen_q, seqlen_k, row_bytes, key_range):
        rows = slice(ch.b * seqlen_q + ch.s0, ch.b * seqlen_q + ch.s1)
        qc = side_rows(q, fmt, ch.b, ch.s0, ch.s1)  # [C, H, D]
        wc = side_rows(weights, fmt, ch.b, ch.s0, ch.s1)  # [C, H]
        kc = side_rows(k, fmt, ch.b, ch.k0, ch.k1)  # [J, D]
        sc, _ = index_scores(qc, kc, wc, relu, dtype)
        idx[rows], chosen = select(sc, visible(ch, key_lo[rows], key_hi[rows]), ch.k0, width)
        if scores is not None:
            scores[rows] = chosen
    return idx, scores
