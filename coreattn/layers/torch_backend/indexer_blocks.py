"""The indexer's block-max scoring and its top-k in torch ops (MiniMax-M3's lightning indexer), chunked.

Block mode of ``indexer_topk`` (``block_size`` B): the keys of a row's sample are cut into blocks of B
(block c: key positions ``origin + c * B .. origin + (c + 1) * B - 1``, ``origin`` the row's first
visible key ``key_lo`` in thd, 0 in the padded layouts), and each query head h scores each block by
the largest ``act(q[n, h] . k[j])`` over the block's keys it sees (``key_lo <= j < key_hi``; act ReLU
or identity: MiniMax-M3's is raw q . k), a block without a visible key scoring -inf. The blocks
``own - local_blocks + 1 .. own`` (at least 0), ``own`` the block of the row's last visible key, score
+inf: always kept. Each (row, head) keeps the K = min(topk, cdiv(Sk, B)) best blocks by the 64-bit
rule of the token top-k (``indexer_topk.select``: score descending, the lower block first among
equal scores, -1 for blocks scoring -inf).

Memory: one chunk of C query tokens at a time, the ``[C, H, keys]`` scores of its key range and
``[C, H, blocks]`` block scores, within the chunk budget (``indexer_topk.chunk_bytes``); the result
``[N, H, K]``. Never ``[T, T]``: blocks are T / B per row.
"""

from __future__ import annotations

import torch

from coreattn.layers.torch_backend.indexer_topk import Chunk, chunks, sample_dims, score_dtype, select, side_rows


def block_count(seqlen_k: int, block_size: int) -> int:
    """Blocks of a sample's keys (the block ids a row may name: 0 .. count - 1)."""
    return -(-seqlen_k // block_size)


def _block_scores(x: torch.Tensor, ch: Chunk, lo: torch.Tensor, hi: torch.Tensor, origin: torch.Tensor,
                  block_size: int, n_blocks: int) -> torch.Tensor:
    """``[C, H, n_blocks]``: the largest visible score of each block (-inf without one) from the chunk's
    scores ``x`` ``[C, H, J]`` (masked in place) over key positions ``ch.k0 + j``; ``origin`` ``[C]``: where
    each row's block 0 starts (None: position 0 for every row)."""
    c, heads, width = x.shape
    cols = torch.arange(ch.k0, ch.k1, device=x.device)
    seen = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])  # [C, J]
    x = x.masked_fill_(~seen[:, None, :], float("-inf"))
    out = torch.full((c, heads, n_blocks + 1), float("-inf"), dtype=x.dtype, device=x.device)
    if origin is None:  # blocks from position 0 for every row (padded): a max over contiguous [.., B] views
        first, end = ch.k0 // block_size, -(-ch.k1 // block_size)
        aligned = torch.nn.functional.pad(x, (ch.k0 - first * block_size, end * block_size - ch.k1),
                                          value=float("-inf"))
        out[..., first:end] = aligned.view(c, heads, end - first, block_size).amax(-1)
        return out[..., :n_blocks]
    block = torch.div(cols[None, :] - origin[:, None], block_size, rounding_mode="floor")
    block = torch.where(seen, block.clamp(0, n_blocks - 1), n_blocks)  # unseen keys: the dropped column
    return out.scatter_reduce_(2, block[:, None, :].expand(c, heads, width), x, "amax")[..., :n_blocks]


def force_local(scores: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, origin: torch.Tensor, block_size: int,
                local_blocks: int) -> None:
    """Scores +inf (in place, ``[C, H, n_blocks]``) for the ``local_blocks`` blocks ending at the block of
    each row's last visible key (at least block 0); rows without a visible key are left alone."""
    if local_blocks <= 0 or scores.shape[-1] == 0:
        return
    own = torch.div(hi - 1 - origin, block_size, rounding_mode="floor")  # [C]
    back = torch.arange(local_blocks, device=scores.device)
    cols = (own[:, None] - back[None, :]).clamp(0, scores.shape[-1] - 1)  # [C, L]
    cols = torch.where((hi > lo)[:, None], cols, scores.shape[-1])  # no visible key: nothing forced
    padded = torch.nn.functional.pad(scores, (0, 1))
    padded.scatter_(2, cols[:, None, :].expand(-1, scores.shape[1], -1), float("inf"))
    scores.copy_(padded[..., :-1])


def block_origin(fmt: str, lo: torch.Tensor) -> torch.Tensor:
    """Where block 0 starts for each row: thd, its first visible key (its sequence's first row); padded,
    position 0 of the sample."""
    return lo if fmt == "thd" else torch.zeros_like(lo)


def block_topk_torch(q: torch.Tensor, k: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, topk: int,
                     fmt: str, *, block_size: int, local_blocks: int = 1, relu: bool = False,
                     return_scores: bool = False, key_range=None, index_dtype: torch.dtype = torch.int64,
                     scorer=None):
    """The block mode of ``indexer_topk`` (see the module docstring): q ``[*tokens, H, D]``, k
    ``[*key tokens, D]`` in ``fmt``, bounds int32 ``[N]``. Returns (block ids ``[N, H, K]`` of
    ``index_dtype``, their scores ``[N, H, K]`` or None). ``scorer(row0, row1, n_blocks)``: the block
    scores ``[C, H, n_blocks]`` of query tokens [row0, row1) from elsewhere (the Triton kernel,
    coreattn/kernels/indexer_blocks.py); None: computed here."""
    heads = q.shape[-2]
    batch, seqlen_q, seqlen_k = sample_dims(q, k, fmt)
    n_blocks = block_count(seqlen_k, block_size)
    width = min(topk, n_blocks)
    dtype = score_dtype(q, k)
    idx = torch.full((batch * seqlen_q, heads, width), -1, dtype=index_dtype, device=q.device)
    scores = None
    if return_scores:
        scores = torch.full((batch * seqlen_q, heads, width), float("-inf"), dtype=dtype, device=q.device)
    if width == 0:
        return idx, scores
    # per key: x [H] and its masked copy, the block id and mask; per block: the scores [H] and the 64-bit keys
    row_bytes = (2 * heads * torch.finfo(dtype).bits // 8 + 17) * seqlen_k + 3 * heads * 8 * (n_blocks + 1)
    for ch in chunks(key_lo, key_hi, batch, seqlen_q, seqlen_k, row_bytes, key_range):
        rows = slice(ch.b * seqlen_q + ch.s0, ch.b * seqlen_q + ch.s1)
        lo, hi = key_lo[rows].to(torch.int64), key_hi[rows].to(torch.int64)
        origin = block_origin(fmt, lo)
        if scorer is not None:
            blocks = scorer(rows.start, rows.stop, n_blocks)
        else:
            qc = side_rows(q, fmt, ch.b, ch.s0, ch.s1).to(dtype)  # [C, H, D]
            kc = side_rows(k, fmt, ch.b, ch.k0, ch.k1).to(dtype)  # [J, D]
            x = torch.matmul(qc, kc.t())  # [C, H, J]
            if relu:
                x = x.clamp_min(0)
            blocks = _block_scores(x, ch, lo, hi, origin if fmt == "thd" else None, block_size, n_blocks)
            del x
        force_local(blocks, lo, hi, origin, block_size, local_blocks)
        flat = blocks.reshape(-1, n_blocks)
        chosen_idx, chosen = select(flat, flat > float("-inf"), 0, width)
        idx[rows] = chosen_idx.view(-1, heads, width).to(index_dtype)
        if scores is not None:
            scores[rows] = chosen.view(-1, heads, width)
    return idx, scores
