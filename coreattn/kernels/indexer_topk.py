"""The DSA lightning indexer's scores and their top-k, fused and streaming over keys: kernel and launcher.

For query token n (sample b, position s) and key position j of the same sample, with
``key_lo[n] <= j < key_hi[n]`` (causality folded into the bounds):

    score[n, j] = sum_h w[n, h] * act(q[n, h, :] . k[j, :])        (float32; act = ReLU or identity)

and the row keeps the ``topk`` keys of largest score. Nothing of size [T, T] (or [T, H, T]) exists:
each program holds one query's heads and streams its keys.

**Selection rule (both backends).** Each candidate is one 64-bit integer: the float32 score's bits
mapped to a signed integer of the same order (``bits ^ ((bits >> 31) & 0x7FFFFFFF)``; -0.0 is made
+0.0 first, so equal scores compare equal) in the high word, ``0xFFFFFFFF - j`` in the low word. All
keys of a row are distinct, so "the ``topk`` largest keys" is one set with no ties left: larger
score first, **the lower key position first among equal scores**. A key whose score is -inf is
never selected. **NaN**: the ReLU keeps a NaN product NaN (``where(x < 0, 0, x)``; a max would
turn it into 0 on a GPU while torch's ``clamp_min`` keeps it), and every NaN score, of either sign
(x86 makes negative ones), ranks as one word above +inf: selected first, lower position first among
NaNs, its score returned as NaN — ``torch.topk``'s order, which Megatron's indexer uses, on both
backends. Rows are written in that order (score descending, then position
ascending), then -1 for the slots left when fewer than ``topk`` keys are selectable. The torch
backend (coreattn/layers/torch_backend/indexer_topk.py) ranks the same 64-bit keys with
``torch.topk``: the same set and order for the same float32 scores. The two backends sum the heads
in different orders, so their scores may differ in the last bits and a near-tie at the boundary
may fall either way; with exactly representable scores they agree bit for bit.

**Kernel: a streaming top-k in registers.** One program per query token; its q rows [H, D] and
weights [H] stay in registers. Keys come in super-steps of BLOCK_K (the top-k rounded up to a power
of two), each as BLOCK_K / BLOCK_N key steps of a [H, D] x [D, BLOCK_N] dot, the activation and the
weighted head sum; the packed keys of a super-step are placed into a [BLOCK_K] register tensor
(``staged``). The running set ``best`` (BLOCK_K keys, sorted descending) then merges it: ``staged``
is sorted ascending (bitonic) and met elementwise (``max(best[i], staged[i])`` holds the BLOCK_K
largest of both as a bitonic sequence), and one bitonic merge sorts that descending. A
super-step none of whose keys beats the current top-k-th is not merged. Exact (integer keys,
no float comparison ties), deterministic (no atomics: the result is a function of the keys alone),
and its memory is the [T, topk] output alone. Cost per query and BLOCK_K keys: BLOCK_K x H x D multiply-adds on the
tensor cores, BLOCK_K x BLOCK_K / BLOCK_N selects to stage the keys, and when merged a sort and a
merge of BLOCK_K (about log2(BLOCK_K)^2 / 2 + log2(BLOCK_K) compare-exchange rounds of BLOCK_K
int64); registers: two BLOCK_K int64 sets plus the sort's temporaries. (A radix select on the
score bits instead would keep no set in registers but recompute the scores once per radix digit,
4 to 5 times; the scores are the costly part.)

Kernel-loop rules (kernels/attn_common.py): key rows are clamped into ``[lo, max(hi, lo + 1) - 1]``
and then into the sample before an address is formed, values masked; row and batch offsets in
int64; lengths, token counts and the output width are runtime ints that never specialize (only the
top-k's power-of-two block BLOCK_K, a model constant, is a constexpr).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coreattn.kernels.attn_fwd import dot_precision
from coreattn.kernels.configs.targets import target_of
from coreattn.kernels.configs.indexer import MAX_TOPK_DIM, MAX_TOPK_HEADS, topk_config
from coreattn.kernels.device import on_device
from coreattn.kernels.launch import launch, slices

MIN_KEY = tl.constexpr(-(2**63))  # below every packed key: a lane with no key
NAN_WORD = tl.constexpr(0x7FC00000)  # the ordered word of every NaN score: the positive quiet NaN's
RUNTIME_INTS = ("row0", "n_rows", "seqlen_q", "seqlen_k", "topk", "stride_qb", "stride_kb", "stride_wb", "stride_qs",
                "stride_ks", "stride_ws")


@triton.jit
def _merge(best, staged, LOG_K: tl.constexpr):
    """The BLOCK_K = 2 ** LOG_K largest of ``best`` (sorted descending) and ``staged`` (any order),
    sorted descending: a bitonic sort of ``staged`` ascending, met elementwise with ``best`` (the
    larger of best[i] and staged[i] over all i: a bitonic sequence holding the BLOCK_K largest of both),
    then a bitonic merge to descending order. A compare-exchange round at distance J reshapes the keys
    so that lanes i (bit J clear) and i + J are the two halves of a size-2 axis, splits, and joins
    (max, min) or (min, max) back. (``tl.gather`` of the partner lane instead compiled to tens of
    thousands of warp shuffles where the keys sit in the dot's column-slice layout.) Inline, not
    helper calls: Triton's interpreter pays milliseconds per nested call."""
    BLOCK_K: tl.constexpr = 2**LOG_K
    x = staged
    for stage in tl.static_range(1, LOG_K + 1):  # blocks of 2 ** stage, alternately ascending, the last ascending
        for sub in tl.static_range(stage):
            y = tl.permute(tl.reshape(x, [BLOCK_K >> (stage - sub), 2, 1 << (stage - 1 - sub)]), [0, 2, 1])
            a, b = tl.split(y)  # lanes i and i + J, J = 2 ** (stage - 1 - sub)
            up = ((tl.arange(0, BLOCK_K >> (stage - sub)) << (stage - sub)) & (1 << stage)) == 0
            lo = tl.minimum(a, b)
            hi = tl.maximum(a, b)
            y = tl.join(tl.where(up[:, None], lo, hi), tl.where(up[:, None], hi, lo))
            x = tl.reshape(tl.permute(y, [0, 2, 1]), [BLOCK_K])
    x = tl.maximum(best, x)
    for sub in tl.static_range(LOG_K):  # bitonic merge, descending
        y = tl.permute(tl.reshape(x, [1 << sub, 2, BLOCK_K >> (sub + 1)]), [0, 2, 1])
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(tl.maximum(a, b), tl.minimum(a, b)), [0, 2, 1]), [BLOCK_K])
    return x


@triton.jit(do_not_specialize=RUNTIME_INTS)
def _indexer_topk_kernel(q_ptr, k_ptr, w_ptr, lo_ptr, hi_ptr, idx_ptr, score_ptr,
                         row0, n_rows, seqlen_q, seqlen_k, heads, topk,
                         stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_wb, stride_ws, stride_wh,
                         HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RELU: tl.constexpr,
                         RETURN_SCORES: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # grid: one program per query token n = row0 + program id = b * seqlen_q + s, row0 + grid <= n_rows (a
    # launch per slice of rows where they pass the grid limits); seqlen_k >= 1 and topk >= 1 (the launcher does
    # not launch otherwise); topk <= BLOCK_K
    row = row0 + tl.program_id(0).to(tl.int64)
    b = row // seqlen_q
    s = row - b * seqlen_q
    lo = tl.minimum(tl.maximum(tl.load(lo_ptr + row), 0), seqlen_k)
    hi = tl.maximum(tl.minimum(tl.load(hi_ptr + row), seqlen_k), lo)
    last = tl.minimum(tl.maximum(hi, lo + 1), seqlen_k) - 1  # every key address stays on rows [lo, last]

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < heads
    h_rows = tl.minimum(offs_h, heads - 1).to(tl.int64)
    d_cols = tl.minimum(offs_d, HEAD_DIM - 1)  # columns past the head dim read its last (masked)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + s * stride_qs + h_rows[:, None] * stride_qh + d_cols[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # [H, D]
    w = tl.load(w_ptr + b * stride_wb + s * stride_ws + h_rows * stride_wh, mask=h_ok, other=0.0).to(tl.float32)
    k_base = k_ptr + b * stride_kb

    N_SUB: tl.constexpr = BLOCK_K // BLOCK_N
    LOG_K: tl.constexpr = BLOCK_K.bit_length() - 1
    offs_n = tl.arange(0, BLOCK_N)
    slots = tl.arange(0, N_SUB)
    offs_k = tl.arange(0, BLOCK_K)
    best = tl.full([BLOCK_K], MIN_KEY, tl.int64)
    for j0 in range(lo, hi, BLOCK_K):
        staged = tl.full([N_SUB, BLOCK_N], MIN_KEY, tl.int64)
        for i in range(N_SUB):
            cols = j0 + i * BLOCK_N + offs_n  # [N] key positions
            rows = tl.minimum(cols, last).to(tl.int64)  # cols >= lo already
            kt = tl.load(k_base + rows[:, None] * stride_ks + d_cols[None, :], mask=d_ok[None, :], other=0.0)
            x = tl.dot(q, tl.trans(kt), input_precision=DOT_PRECISION)  # [H, N] float32
            if RELU:  # NaN stays NaN (tl.maximum would return 0 for it, as the GPU's max does)
                x = tl.where(x < 0.0, 0.0, x)
            scores = tl.sum(x * w[:, None], axis=0)  # [N]
            scores = tl.where(scores == 0.0, 0.0, scores)  # -0.0 -> +0.0: equal scores, equal keys
            bits = scores.to(tl.int32, bitcast=True)
            okey = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # a signed int of the float's order
            okey = tl.where(scores != scores, NAN_WORD, okey)  # any NaN: above +inf (torch.topk's order)
            keys = (okey.to(tl.int64) << 32) | (4294967295 - cols.to(tl.int64))  # ties: lower position first
            keys = tl.where(cols < hi, keys, MIN_KEY)
            staged = tl.where(slots[:, None] == i, keys[None, :], staged)
        staged = tl.reshape(staged, [BLOCK_K])
        kth = tl.min(tl.where(offs_k < topk, best, 9223372036854775807), axis=0)
        if tl.max(staged, axis=0) > kth:
            best = _merge(best, staged, LOG_K)

    high = (best >> 32).to(tl.int32)
    ok = high > -2139095041  # above -inf's ordered word: selectable
    idx = tl.where(ok, 4294967295 - (best & 4294967295), -1)
    out_cols = tl.minimum(offs_k, topk - 1)
    tl.store(idx_ptr + row * topk + out_cols, idx, mask=offs_k < topk)
    if RETURN_SCORES:
        bits = high ^ ((high >> 31) & 0x7FFFFFFF)
        score = tl.where(ok, bits.to(tl.float32, bitcast=True), float("-inf"))
        tl.store(score_ptr + row * topk + out_cols, score, mask=offs_k < topk)


def topk_blocks(topk: int, block_n: int) -> int:
    """BLOCK_K: the top-k rounded up to a power of two, at least one key step."""
    return max(triton.next_power_of_2(max(topk, 1)), block_n)


@on_device
def indexer_topk_fwd(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, key_lo: torch.Tensor,
                     key_hi: torch.Tensor, topk: int, fmt: str, *, relu: bool = True,
                     return_scores: bool = False, index_dtype: torch.dtype = torch.int64,
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the fused scores + top-k kernel.

    ``fmt`` "thd": q [T, H, D], k [T, D], weights [T, H]; "bshd": q [B, S, H, D], k [B, Sk, D],
    weights [B, S, H]; "sbhd": q [S, B, H, D], k [Sk, B, D], weights [S, B, H] (views with last stride
    1, used in place). key_lo / key_hi: int32 [N] contiguous, query token n = b * S + s (thd: the
    row), key positions in the sample (thd: rows of the packed stream). Returns indices
    (``index_dtype``, int64 or int32: key positions fit either) [N, K] with K = min(topk, Sk) (score descending, then position ascending; -1 in unused slots)
    and, with ``return_scores``, their float32 scores [N, K] (-inf in unused slots), else None.
    Inputs are assumed checked by the caller (coreattn/layers/dsa/indexer).
    """
    heads, dim = q.shape[-2:]
    if fmt == "thd":
        batch, seqlen_q, seqlen_k = 1, q.shape[0], k.shape[0]
        qb, qs, qh = 0, q.stride(0), q.stride(1)
        kb, ks = 0, k.stride(0)
        wb, ws, wh = 0, weights.stride(0), weights.stride(1)
    elif fmt == "bshd":
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        qb, qs, qh = q.stride(0), q.stride(1), q.stride(2)
        kb, ks = k.stride(0), k.stride(1)
        wb, ws, wh = weights.stride(0), weights.stride(1), weights.stride(2)
    else:
        batch, seqlen_q, seqlen_k = q.shape[1], q.shape[0], k.shape[0]
        qb, qs, qh = q.stride(1), q.stride(0), q.stride(2)
        kb, ks = k.stride(1), k.stride(0)
        wb, ws, wh = weights.stride(1), weights.stride(0), weights.stride(2)
    n_rows = batch * seqlen_q
    width = min(topk, seqlen_k)
    idx = torch.empty(n_rows, width, dtype=index_dtype, device=q.device)  # the kernel's store casts
    scores = torch.empty(n_rows, width, dtype=torch.float32, device=q.device) if return_scores else None
    if n_rows == 0 or width == 0:
        return idx, scores
    if heads > MAX_TOPK_HEADS or dim > MAX_TOPK_DIM:
        raise ValueError(f"the Triton top-k kernel takes up to {MAX_TOPK_HEADS} heads of dim up to {MAX_TOPK_DIM}, "
                         f"got {heads} x {dim}; use backend='torch'")
    target = target_of(q.device)
    cfg = topk_config(target, topk_blocks(topk, 16))  # the requested top-k: short samples do not recompile
    block_k = topk_blocks(topk, cfg.block)
    options = cfg.launch(target)
    for row0, row1 in slices(target, n_rows, options.get("num_warps")):  # launches within the grid limits
        launch(target, _indexer_topk_kernel, (row1 - row0,), q, k, weights, key_lo, key_hi, idx,
               scores if return_scores else idx, row0, n_rows, seqlen_q, seqlen_k, heads, width, qb, qs, qh, kb, ks,
               wb, ws, wh, HEAD_DIM=dim, BLOCK_H=max(16, triton.next_power_of_2(heads)),
               BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=cfg.block, BLOCK_K=block_k, RELU=relu,
               RETURN_SCORES=return_scores, DOT_PRECISION=dot_precision(q.dtype, target), **options)
    return idx, scores
