"""Top-k sparse attention on torch_npu's ``npu_sparse_flash_attention`` (+ ``_grad``): the npu_fused pair.

``sparse_attn_npu_fwd`` / ``sparse_attn_npu_bwd`` take what the torch backend's pair takes
(coreattn/layers/torch_backend/sparse.py: prepared ``topk [N, 1, K]``, key bounds ``[N]``, q/k in
``fmt``) and return the same results. Each operator runs only where the call fits its limits
(``sparse_unfit``, ``sparse_grad_unfit`` name the first one it breaks; docs/ascend.md cites each):
absorbed MLA only (``attention_mode=2``: v None, one key head, q/k 576 = 512 + a 64-wide rope part
passed separately, V = the key's first 512 columns), 1, 2, 4, ..., 128 query heads, float16 or
bfloat16; the grad also B <= 256 samples, S1 and S2 up to 128K (thd counts as one sample of all its
tokens), index rows of at most its K (2,048), and bfloat16 (below).

How coreattn's semantics reach the operators: every call is "BSND" (thd as one sample of T tokens,
sbhd transposed), ``sparse_mode=0`` (no mask of its own) and ``actual_seq_lengths_*`` None, and
the index list carries everything else: an entry is kept when it names a key inside the token's
bounds ``[key_lo, key_hi)`` (its sequence, causality in either alignment, ``key_bounds``;
``prepare_topk`` already dropped -1 entries, repeats and entries past ``topk_length``), and the
kept entries are moved to the front of the row. So no sequence boundary, length list or causal
mode of the operator's is relied on, and nothing is read on the host.

- The forward's rows end in -1: its kernel gathers a row's entries up to the first negative one and
  gives the slots it did not fill no weight (ops-transformer sparse_flash_attention, see the docs).
  ``softmax_max`` / ``softmax_sum`` (``return_softmax_lse=True``, ``[B, 1, S, Hq]``: the largest
  scaled logit and the sum of exp(logit - max)) give coreattn's lse as ``max + log(sum)``.
- The grad's kernel reads ``min(K, S2)`` slots of every row (sparse_mode 0) whatever they hold: a -1
  there is gathered as a key (the row before the sample's) and its weight added to dq. So every slot
  of the grad's rows names a key: the kept entries, then a filler, the index of a zero key row
  appended after each sample's keys (key, rope and so value all zero: its logit is 0 and its value 0,
  so its weight exp(-lse) multiplies a zero key in dq; its own dk, dv are dropped), the row padded to
  the grad's K. The statistics handed in are ``(lse, 1)``, the same softmax. In float16 that weight
  overflows once a row's lse is below about -11 (a zero key times inf is NaN in dq), so the grad
  takes bfloat16 only (overflow there: lse below about -88); float16 falls back.

A token with no kept entry gets out 0, lse -inf and zero gradients here (the forward's statistics
for such a row are max -2e38 and sum 0; its output is not documented). The query/key halves are
copied once per call into contiguous tensors (the operators take no strided input), the key serving
as ``value`` too.
"""

from __future__ import annotations

import torch

from coreattn.kernels import npu
from coreattn.layers.torch_backend.sparse import sparse_attn_torch_bwd, sparse_attn_torch_fwd

SFA_DIM = 512  # query/key/value head dim ("D: fixed at 512")
SFA_ROPE_DIM = 64  # query_rope/key_rope head dim
SFA_QUERY_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
SFA_DTYPES = (torch.float16, torch.bfloat16)
ABSORBED = 2  # attention_mode: MLA-absorb, the only documented value
NO_MASK = 0  # sparse_mode 0: every indexed key ("全部计算"); 3 would add the operator's bottom-right causal mask
UNLIMITED = 2**63 - 1  # pre_tokens / next_tokens: only their defaults are supported
INT32_MAX = 2**31 - 1
# npu_sparse_flash_attention_grad's documented limits (aclnnSparseFlashAttentionGrad's page)
GRAD_MAX_BATCH = 256  # B 1..256
GRAD_MAX_SEQLEN = 128 * 1024  # S1, S2 1..128K
GRAD_TOPK = 2048  # K of sparse_indices
GRAD_DTYPES = (torch.bfloat16,)  # the zero filler's weight exp(-lse) must not overflow the dtype (module docstring)


def sample_shape(q: torch.Tensor, k: torch.Tensor, fmt: str) -> tuple[int, int, int]:
    """(B, S1, S2) of the BSND call (thd: one sample of all tokens)."""
    if fmt == "thd":
        return 1, q.shape[0], k.shape[0]
    if fmt == "bshd":
        return q.shape[0], q.shape[1], k.shape[1]
    return q.shape[1], q.shape[0], k.shape[0]


def sparse_unfit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, topk: torch.Tensor | None,
                 v_dim: int) -> str | None:
    """None when ``npu_sparse_flash_attention`` can run this call, else the documented limit it breaks."""
    if q.dtype not in SFA_DTYPES or k.dtype != q.dtype:
        return f"npu_sparse_flash_attention takes float16 or bfloat16 q and k of one dtype, got {q.dtype} / {k.dtype}"
    if v is not None:
        return ("npu_sparse_flash_attention runs absorbed MLA only (attention_mode=2: V is the key's first 512 "
                "columns); got a separate v")
    if q.shape[-1] != SFA_DIM + SFA_ROPE_DIM or v_dim != SFA_DIM:
        return (f"npu_sparse_flash_attention takes q/k head dim {SFA_DIM} + {SFA_ROPE_DIM} rope and V of "
                f"{SFA_DIM}; got q/k {q.shape[-1]}, v_head_dim {v_dim}")
    if k.shape[-2] != 1:
        return f"npu_sparse_flash_attention takes one key head, got {k.shape[-2]}"
    if q.shape[-2] not in SFA_QUERY_HEADS:
        return f"npu_sparse_flash_attention takes {', '.join(map(str, SFA_QUERY_HEADS))} query heads, got {q.shape[-2]}"
    if topk is not None and topk.dim() == 3 and topk.shape[1] != 1:
        return f"npu_sparse_flash_attention takes one index row per token, got {topk.shape[1]}"
    return None


def sparse_grad_unfit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, topk: torch.Tensor | None,
                      v_dim: int, fmt: str) -> str | None:
    """None when ``npu_sparse_flash_attention_grad`` can run this backward as coreattn calls it (rows
    filled to its K with the zero-key filler), else the limit it breaks."""
    unfit = sparse_unfit(q, k, v, topk, v_dim)
    if unfit:
        return unfit.replace("npu_sparse_flash_attention ", "npu_sparse_flash_attention_grad ", 1)
    name = "npu_sparse_flash_attention_grad"
    if q.dtype not in GRAD_DTYPES:
        return (f"{name}: {q.dtype} cannot hold the zero-key filler's weight exp(-lse) (it reads min(K, S2) slots of "
                "every row whatever they hold, so coreattn fills the rows; bfloat16 only)")
    batch, seqlen_q, seqlen_k = sample_shape(q, k, fmt)
    if batch > GRAD_MAX_BATCH or seqlen_q > GRAD_MAX_SEQLEN or seqlen_k + 1 > GRAD_MAX_SEQLEN:
        return (f"{name} takes B <= {GRAD_MAX_BATCH} and S1, S2 <= {GRAD_MAX_SEQLEN} (S2: the keys and the filler "
                f"row; thd: one sample of T), got B {batch}, S1 {seqlen_q}, S2 {seqlen_k} + 1")
    if topk is not None and topk.shape[-1] > GRAD_TOPK:
        return f"{name} takes index rows of K = {GRAD_TOPK}, got {topk.shape[-1]} entries"
    return None


def to_bsnd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``[B, S, ...]`` view of a tensor in ``fmt`` (thd: one sample)."""
    if fmt == "thd":
        return x.unsqueeze(0)
    return x if fmt == "bshd" else x.transpose(0, 1)


def from_bsnd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """A ``[B, S, ...]`` tensor back in ``fmt``'s layout, contiguous."""
    if fmt == "thd":
        return x[0]
    return x if fmt == "bshd" else x.transpose(0, 1).contiguous()


def split_rope(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(nope ``[B, S, H, 512]``, rope ``[B, S, H, 64]``), contiguous copies of x's halves."""
    x = to_bsnd(x, fmt)
    return x[..., :SFA_DIM].contiguous(), x[..., SFA_DIM:].contiguous()


def op_indices(topk: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, seqlen_k: int,
               batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sparse_indices int32 ``[B, S, 1, K]``, has_key bool ``[N]``) from prepared ``topk [N, 1, K]``:
    the entries inside ``[max(key_lo, 0), min(key_hi, seqlen_k))``, ascending, then -1."""
    lo = key_lo.to(torch.int64).clamp(min=0)[:, None, None]
    hi = key_hi.to(torch.int64).clamp(max=seqlen_k)[:, None, None]
    kept = (topk >= lo) & (topk < hi)  # [N, 1, K]
    ordered = torch.sort(torch.where(kept, topk, INT32_MAX), dim=-1).values
    idx = torch.where(ordered == INT32_MAX, -1, ordered).to(torch.int32)
    return idx.view(batch, -1, 1, topk.shape[-1]).contiguous(), kept.flatten(1).any(-1)


def _shape(q: torch.Tensor, k: torch.Tensor, fmt: str) -> tuple[int, int, int]:
    qb, kb = to_bsnd(q, fmt), to_bsnd(k, fmt)
    return qb.shape[0], qb.shape[1], kb.shape[1]


def _empty(q: torch.Tensor, k: torch.Tensor, topk: torch.Tensor, fmt: str) -> bool:
    """Nothing for the operator to do (no query, key or index slot): the torch backend's exact zeros."""
    batch, seqlen_q, seqlen_k = _shape(q, k, fmt)
    return batch * seqlen_q == 0 or seqlen_k == 0 or topk.shape[-1] == 0


def sfa_forward(query: torch.Tensor, query_rope: torch.Tensor, key: torch.Tensor, key_rope: torch.Tensor,
                idx: torch.Tensor, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One ``npu_sparse_flash_attention`` call on ``split_rope``'s halves: (out ``[B, S, Hq, 512]``,
    softmax_max, softmax_sum ``[B, 1, S, Hq]`` float32)."""
    out, smax, ssum = npu.run_npu_op(
        "npu_sparse_flash_attention", query.device, query, key, key, idx, softmax_scale, block_table=None,
        actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=query_rope, key_rope=key_rope,
        sparse_block_size=1, layout_query="BSND", layout_kv="BSND", sparse_mode=NO_MASK, pre_tokens=UNLIMITED,
        next_tokens=UNLIMITED, attention_mode=ABSORBED, return_softmax_lse=True)
    return out, smax, ssum


def sparse_attn_npu_fwd(q, k, v, topk, key_lo, key_hi, fmt: str, softmax_scale: float, *, v_dim: int | None = None):
    """(out, lse) of top-k sparse attention, as ``sparse_attn_torch_fwd`` returns them."""
    if _empty(q, k, topk, fmt):
        return sparse_attn_torch_fwd(q, k, v, topk, key_lo, key_hi, fmt, softmax_scale, v_dim=v_dim)
    batch, seqlen_q, seqlen_k = _shape(q, k, fmt)
    idx, has_key = op_indices(topk, key_lo, key_hi, seqlen_k, batch)
    out, smax, ssum = sfa_forward(*split_rope(q, fmt), *split_rope(k, fmt), idx, softmax_scale)
    has_key = has_key.view(batch, seqlen_q)
    out = torch.where(has_key[..., None, None], out, 0).to(q.dtype)  # [B, S, Hq, 512]
    lse = (smax + torch.log(ssum))[:, 0].transpose(1, 2)  # [B, Hq, S]
    lse = torch.where(has_key[:, None, :], lse, float("-inf")).to(torch.float32)
    return from_bsnd(out, fmt), (lse[0] if fmt == "thd" else lse).contiguous()


def grad_indices(idx: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """The grad's rows (int32 ``[B, S, 1, GRAD_TOPK]``) from the forward's: -1 slots and the padding to
    its K name the filler row ``seqlen_k`` (module docstring)."""
    idx = torch.nn.functional.pad(idx, (0, GRAD_TOPK - idx.shape[-1]), value=-1)
    return torch.where(idx < 0, seqlen_k, idx).to(torch.int32).contiguous()


def with_filler_row(x: torch.Tensor) -> torch.Tensor:
    """``[B, S2, 1, D]`` with a zero row appended to each sample: ``[B, S2 + 1, 1, D]``."""
    return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, 1))


def sparse_attn_npu_bwd(dout, q, k, v, out, lse, topk, key_lo, key_hi, fmt: str, softmax_scale: float, *,
                        v_dim: int | None = None):
    """(dq, dk, None) from the forward's out and lse; dV (the key's first 512 columns) is folded into dk."""
    if _empty(q, k, topk, fmt):
        return sparse_attn_torch_bwd(dout, q, k, v, out, lse, topk, key_lo, key_hi, fmt, softmax_scale, v_dim=v_dim)
    batch, seqlen_q, seqlen_k = _shape(q, k, fmt)
    idx, has_key = op_indices(topk, key_lo, key_hi, seqlen_k, batch)
    idx = grad_indices(idx, seqlen_k)  # every slot names a key: the kept ones, then the zero filler row
    query, query_rope = split_rope(q, fmt)
    key, key_rope = (with_filler_row(x) for x in split_rope(k, fmt))  # [B, S2 + 1, 1, 512 / 64]
    has_key = has_key.view(batch, seqlen_q)
    row_lse = (lse[None] if fmt == "thd" else lse).transpose(1, 2)  # [B, S, Hq]
    smax = torch.where(has_key[..., None], row_lse, 0.0).to(torch.float32)[:, None].contiguous()  # [B, 1, S, Hq]
    ssum = torch.ones_like(smax)
    rows = has_key[..., None, None]
    d_out = torch.where(rows, to_bsnd(dout, fmt), 0).to(q.dtype).contiguous()
    out_b = to_bsnd(out, fmt).contiguous()
    dq, dk, dv, dq_rope, dk_rope = npu.run_npu_op(
        "npu_sparse_flash_attention_grad", q.device, query, key, key, idx, d_out, out_b, smax, ssum, softmax_scale, 1,
        query_rope=query_rope, key_rope=key_rope, actual_seq_qlen=None, actual_seq_kvlen=None, layout="BSND",
        sparse_mode=NO_MASK, pre_tokens=UNLIMITED, next_tokens=UNLIMITED, attention_mode=ABSORBED)
    dq = torch.where(rows, torch.cat([dq, dq_rope], dim=-1), 0).to(q.dtype)  # [B, S, Hq, 576]
    dk = torch.cat([dk.float() + dv.float(), dk_rope.float()], dim=-1)[:, :seqlen_k].to(k.dtype)  # [B, Sk, 1, 576]
    return from_bsnd(dq, fmt), from_bsnd(dk, fmt), None
