"""The ``npu_fused`` backend: ``torch_npu.npu_fusion_attention`` with the torch backend's contract.

``attn_npu_fused`` takes what ``attn_torch`` takes (q/k/v laid out as ``Packing`` says, see
kernels/packing.py) and returns ``(out, None)``: out in q's layout with last dim Dv, zeros on rows
that see no key and outside the spans. No lse: the op's ``softmax_max``/``softmax_sum`` outputs
are for its own backward and their layout is not part of torch_npu's documented API, so
``return_lse=True`` gives None on this backend. Gradients come from torch_npu's autograd.

How each input maps onto the op (``input_layout``; atten_mask True = masked out):
- packed thd with cu_seqlens -> "TND" with ``actual_seq_qlen/kvlen`` = cumulative ends (host
  lists: one host sync, which the op's API requires). Sequences empty on both sides are dropped
  from the lists; at most ``MAX_VARLEN_SEQUENCES`` remain, else ValueError.
- padded sbhd/bshd whose spans cover every row, no keep masks -> "SBH" (sbhd, Dqk == Dv) or
  "BSND" (a view for bshd; sbhd is transposed) with no padding mask at all.
- spans that leave padding (or spans on a packed tensor) -> each span's tokens are gathered into
  "TND" and the output scattered back, so positions count from each span's start as in the kernels.
- keep masks (padded layouts, holes allowed) -> "BSND" with a ``[B, 1, Sq, Sk]`` bool mask built
  from the spans, keep masks and the causal/window band at raw positions (O(B*Sq*Sk) memory, as
  the op needs). The caller's masks are only read, never modified; the derived mask's diagonal
  gives the keep mask back (``coreattn.masks.keep_mask_from_4d(mask, "megatron")``) for
  self-attention.
Masks: none -> sparse_mode 0 without atten_mask; causal -> sparse_mode 2 (top-left) or 3
(bottom-right) with ``npu_compressed_causal_mask``; a sliding window -> sparse_mode 4 (band,
bottom-right aligned) with pre_tockens = left, next_tockens = right (2147483647 = unlimited), exact
for flash-attn windows when aligned bottom-right or when every sequence has Lq == Lk; a top-left
window with lengths that differ raises NotImplementedError. Head dims: Dqk >= Dv natively (V is
never padded); Dv > Dqk raises. GQA uses the op's own (Hq a multiple of Hkv). The scale is passed
explicitly. Rows that see no key are zeroed here (the op's output there is not specified), and
``inner_precise=2`` (the op's invalid-row handling) is requested whenever such rows exist.
"""

from __future__ import annotations

import torch

from coreattn.adapters import npu
from coreattn.kernels.packing import Packing, packed, seq_len_dim
from coreattn.layers.checks import VarlenParams
from coreattn.layers.masks import npu_compressed_causal_mask
from coreattn.layers.torch_backend import attn_torch

INT_MAX = 2147483647  # the op's "unlimited" pre_tockens/next_tockens
MAX_VARLEN_SEQUENCES = 1024  # the op's limit on actual_seq_qlen/kvlen entries ("1K")
OP_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INVALID_ROWS = 2  # inner_precise: high precision with invalid-row (all keys masked) handling


def _op():
    mod = npu.torch_npu_module()
    if mod is None:
        raise RuntimeError(f"the npu_fused backend needs torch_npu: {npu.torch_npu_reason()}")
    return mod.npu_fusion_attention


def _check_supported(q: torch.Tensor, v: torch.Tensor) -> None:
    if q.dtype not in OP_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; npu_fusion_attention supports float16, bfloat16, float32")
    if v.shape[-1] > q.shape[-1]:
        raise ValueError(f"v head dim {v.shape[-1]} > q/k head dim {q.shape[-1]}: npu_fusion_attention needs "
                         "Dqk >= Dv (use backend='triton' or 'torch')")


def _band(params: VarlenParams, equal_lengths: bool, device: torch.device) -> dict:
    """sparse_mode, atten_mask, pre/next_tockens for the causal/window part of ``params``."""
    left, right = params.window_left, params.window_right
    if left < 0 and right < 0:
        return dict(sparse_mode=0, atten_mask=None)
    mask = npu_compressed_causal_mask(device)
    if left < 0 and right == 0:
        return dict(sparse_mode=3 if params.bottom_right else 2, atten_mask=mask)
    if not params.bottom_right and not equal_lengths:
        raise NotImplementedError(
            "npu_fusion_attention's band (sparse_mode 4) is aligned bottom-right: a top-left sliding window "
            "matches it only when every sequence has equal q and k lengths; use causal_alignment='bottom_right' "
            "or backend='triton'/'torch'")
    return dict(sparse_mode=4, atten_mask=mask, pre_tockens=left if left >= 0 else INT_MAX,
                next_tockens=right if right >= 0 else INT_MAX)


def _rows_without_keys(lens_q: list[int], lens_k: list[int], params: VarlenParams) -> torch.Tensor | None:
    """[sum(lens_q)] bool on the CPU: packed query rows whose causal/window range holds no key
    (None when every row sees one). From host lists, so no device work or sync."""
    lq = torch.tensor(lens_q, dtype=torch.int64)
    lk = torch.tensor(lens_k, dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(lq.numel()), lq)  # [T]
    pos = torch.arange(seq.numel()) - (torch.cumsum(lq, 0) - lq)[seq]
    shift = (lk - lq)[seq] if params.bottom_right else torch.zeros_like(pos)
    lo = (pos + shift - params.window_left).clamp(min=0) if params.window_left >= 0 else torch.zeros_like(pos)
    hi = lk[seq] - 1
    if params.window_right >= 0:
        hi = torch.minimum(hi, pos + shift + params.window_right)
    empty = lo > hi
    return empty if bool(empty.any()) else None


def _call(q, k, v, layout: str, opts: dict, rows_without_keys: bool) -> torch.Tensor:
    """One npu_fusion_attention call on [.., H, D] tensors; ``opts``: scale, sparse_mode,
    atten_mask and the optional pre/next_tockens, actual_seq_qlen/kvlen."""
    heads = q.shape[-2]
    q, k, v = (t.contiguous() for t in (q, k, v))
    if layout == "SBH":
        q, k, v = (t.flatten(-2) for t in (q, k, v))  # [S, B, H*D]
    out = _op()(q, k, v, heads, layout, keep_prob=1.0, inner_precise=INVALID_ROWS if rows_without_keys else 0,
                **opts)[0]
    return out.unflatten(-1, (heads, -1)) if layout == "SBH" else out


def _varlen(q, k, v, lens_q: list[int], lens_k: list[int], params: VarlenParams) -> torch.Tensor:
    """Packed q [Tq, Hq, Dqk], k/v [Tk, Hkv, D] holding sequences of the given lengths, in order."""
    pairs = [(a, b) for a, b in zip(lens_q, lens_k) if a or b]
    if len(pairs) > MAX_VARLEN_SEQUENCES:
        raise ValueError(f"{len(pairs)} non-empty sequences: npu_fusion_attention's TND layout takes at most "
                         f"{MAX_VARLEN_SEQUENCES}; split the batch or use backend='triton'")
    lens_q, lens_k = [a for a, _ in pairs], [b for _, b in pairs]
    if sum(lens_q) == 0 or sum(lens_k) == 0:  # nothing for the op to attend: exact zeros from torch
        cu_q, cu_k = (torch.tensor([0] + lens, device=q.device).cumsum(0).int() for lens in (lens_q, lens_k))
        return attn_torch(q, k, v, packed(cu_q), packed(cu_k), params)[0]
    cum_q, cum_k = torch.tensor(lens_q).cumsum(0).tolist(), torch.tensor(lens_k).cumsum(0).tolist()
    empty = _rows_without_keys(lens_q, lens_k, params)
    opts = dict(_band(params, lens_q == lens_k, q.device), scale=params.softmax_scale,
                actual_seq_qlen=cum_q, actual_seq_kvlen=cum_k)
    out = _call(q, k, v, "TND", opts, empty is not None)  # [Tq, Hq, Dv]
    if empty is not None:
        out = out.masked_fill(empty.to(out.device)[:, None, None], 0)
    return out


def _whole_rows(q, k, v, fmt: str, params: VarlenParams) -> torch.Tensor:
    """Padded batch whose every row is one sequence: the op's own padded layouts, no mask tensor."""
    seqlen_q, seqlen_k = seq_len_dim(q, fmt), seq_len_dim(k, fmt)
    empty = _rows_without_keys([seqlen_q], [seqlen_k], params)  # the same rows in every sample
    opts = dict(_band(params, seqlen_q == seqlen_k, q.device), scale=params.softmax_scale)
    if fmt == "sbhd" and q.shape[-1] == v.shape[-1]:
        # SBH infers D = H / head_num and Hkv = H_kv / D: unambiguous only when Dqk == Dv
        out = _call(q, k, v, "SBH", opts, empty is not None)
    elif fmt == "sbhd":
        out = _call(*(t.transpose(0, 1) for t in (q, k, v)), "BSND", opts, empty is not None).transpose(0, 1)
    else:
        out = _call(q, k, v, "BSND", opts, empty is not None)
    if empty is not None:
        shape = (-1, 1, 1, 1) if fmt == "sbhd" else (1, -1, 1, 1)
        out = out.masked_fill(empty.to(out.device).view(shape), 0)
    return out


def _span_index(pack: Packing, starts: list[int], lens: list[int], device) -> tuple[torch.Tensor, ...]:
    """Index tuple picking each span's tokens, in order, from a tensor in ``pack``'s layout."""
    lens_t = torch.tensor(lens, dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(lens_t.numel()), lens_t)
    tok = torch.tensor(starts, dtype=torch.int64)[seq] + torch.arange(seq.numel()) - (lens_t.cumsum(0) - lens_t)[seq]
    seq, tok = seq.to(device), tok.to(device)
    if pack.fmt == "thd":
        return (tok,)
    return (seq, tok) if pack.fmt == "bshd" else (tok, seq)


def _spans(q, k, v, q_pack: Packing, k_pack: Packing, params: VarlenParams) -> torch.Tensor:
    """Span descriptors (padded batches or packed tensors): gather into TND, scatter back."""
    starts_q, lens_q, starts_k, lens_k = (t.tolist() for t in (q_pack.seq, q_pack.lens, k_pack.seq, k_pack.lens))
    seqlen_q, seqlen_k = seq_len_dim(q, q_pack.fmt), seq_len_dim(k, k_pack.fmt)
    if q_pack.fmt != "thd" and all(s == 0 and n == seqlen_q for s, n in zip(starts_q, lens_q)) \
            and all(s == 0 and n == seqlen_k for s, n in zip(starts_k, lens_k)):
        return _whole_rows(q, k, v, q_pack.fmt, params)
    idx_q = _span_index(q_pack, starts_q, lens_q, q.device)
    idx_k = _span_index(k_pack, starts_k, lens_k, k.device)
    out_packed = _varlen(q[idx_q], k[idx_k], v[idx_k], lens_q, lens_k, params)
    token_dims = 1 if q_pack.fmt == "thd" else 2
    out = out_packed.new_zeros(q.shape[:token_dims] + out_packed.shape[1:])
    return out.index_put(idx_q, out_packed)


def keep_mask_band(q_pack: Packing, k_pack: Packing, seqlen_q: int, seqlen_k: int,
                   params: VarlenParams) -> torch.Tensor:
    """[B, Sq, Sk] bool: query i of sample b may attend to key j, at raw padded positions, from
    the spans, the keep masks and the causal/window band (positions counted from each span's
    start). Read-only on the packs' tensors; no host sync."""
    i = torch.arange(seqlen_q, device=q_pack.seq.device)[None, :, None] - q_pack.seq.long()[:, None, None]
    j = torch.arange(seqlen_k, device=q_pack.seq.device)[None, None, :] - k_pack.seq.long()[:, None, None]
    len_q, len_k = q_pack.lens.long()[:, None, None], k_pack.lens.long()[:, None, None]
    vis = (i >= 0) & (i < len_q) & (j >= 0) & (j < len_k)
    shift = len_k - len_q if params.bottom_right else 0
    if params.window_left >= 0:
        vis = vis & (j >= i + shift - params.window_left)
    if params.window_right >= 0:
        vis = vis & (j <= i + shift + params.window_right)
    if q_pack.keep is not None:
        vis = vis & (q_pack.keep != 0)[:, :, None]
    if k_pack.keep is not None:
        vis = vis & (k_pack.keep != 0)[:, None, :]
    return vis


def _keep_masks(q, k, v, q_pack: Packing, k_pack: Packing, params: VarlenParams) -> torch.Tensor:
    """Keep masks on a padded batch: one [B, 1, Sq, Sk] mask (True = masked out), BSND."""
    fmt = q_pack.fmt
    vis = keep_mask_band(q_pack, k_pack, seq_len_dim(q, fmt), seq_len_dim(k, fmt), params)
    if fmt == "sbhd":
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    sees_key = vis.any(dim=-1)  # [B, Sq]; False for dropped queries and rows outside the band
    out = _call(q, k, v, "BSND", dict(sparse_mode=0, atten_mask=~vis[:, None], scale=params.softmax_scale), True)
    out = out.masked_fill(~sees_key[:, :, None, None], 0)  # [B, Sq, Hq, Dv]
    return out.transpose(0, 1) if fmt == "sbhd" else out


def attn_npu_fused(q, k, v, q_pack: Packing, k_pack: Packing, max_seqlen_q: int, max_seqlen_k: int,
                   params: VarlenParams) -> tuple[torch.Tensor, None]:
    """``attn_torch``'s contract over ``torch_npu.npu_fusion_attention``; returns (out, None).

    out: q's layout (thd ``[Tq, Hq, Dv]``, bshd/sbhd padded) and dtype, zeros on rows that see no
    key and outside the spans. See the module docstring for the layouts, masks and limits.
    """
    _check_supported(q, v)
    if q.numel() == 0 or k.numel() == 0:
        # no query or no key token at all: nothing for a kernel to do; the torch backend gives
        # the zeros (and zero gradients) exactly
        return attn_torch(q, k, v, q_pack, k_pack, params)[0], None
    if q_pack.keep is not None or k_pack.keep is not None:
        return _keep_masks(q, k, v, q_pack, k_pack, params), None
    if q_pack.spans:
        return _spans(q, k, v, q_pack, k_pack, params), None
    cu_q, cu_k = q_pack.seq.tolist(), k_pack.seq.tolist()  # the op takes host lists
    lens_q = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
    lens_k = [b - a for a, b in zip(cu_k[:-1], cu_k[1:])]
    return _varlen(q, k, v, lens_q, lens_k, params), None
