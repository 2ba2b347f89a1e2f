"""The ``npu_fused`` backend: ``torch_npu.npu_fusion_attention`` with the torch backend's contract.

``attn_npu_fused`` takes what ``attn_torch`` takes (q/k/v laid out as ``Packing`` says, see
kernels/packing.py) and returns ``(out, None)``: out in q's layout with last dim Dv, zeros on rows
that see no key and outside the spans. No lse: the op's ``softmax_max``/``softmax_sum`` outputs
are for its own backward and their layout is not part of torch_npu's documented API, so
``return_lse=True`` gives None on this backend. Gradients come from torch_npu's autograd.
``attn_npu_dense_mask`` is ``dense_mask_attn``'s counterpart (CoreAttention's dense masks).

How each input maps onto the op (``input_layout``; atten_mask True = masked out):
- packed thd with cu_seqlens -> "TND" with ``actual_seq_qlen/kvlen`` = cumulative ends (host
  lists: a host sync, which the op's API requires; cu_seqlens are checked there at no cost).
  A sequence with no query or no key outputs zeros and is left out of the op call (the tokens of
  the others are gathered when needed), so the lists never hold an empty sequence; more than
  ``MAX_VARLEN_SEQUENCES`` sequences run as several calls on contiguous token ranges.
- padded sbhd/bshd whose spans cover every row, no keep masks -> "SBH" (sbhd, Dqk == Dv) or
  "BSND" (a view for bshd; sbhd is transposed) with no padding mask at all.
- spans that leave padding (or spans on a packed tensor) -> each span's tokens are gathered into
  "TND" and the output scattered back, so positions count from each span's start as in the kernels.
- keep masks whose every row is one run of kept tokens (right or left padding, e.g. Megatron's
  ``[b, 1, 1, s]``) -> folded into the spans (each run cut to its span) and run as spans above.
  Deciding this reads the masks (a host sync; the span path syncs for its TND lists anyway).
  Masks with holes, or runs that would move the
  causal/window band (it is anchored at each span's start, or end when bottom-right, so q and k
  must be trimmed alike there), and top-left windows over runs of unequal q/k lengths -> "BSND"
  with a ``[B, 1, Sq, Sk]`` bool mask built from the spans, keep masks and the band at raw
  positions (O(B*Sq*Sk) memory, as the op needs). The caller's masks are only read, never
  modified; the derived mask's diagonal gives the keep mask back
  (``coreattn.masks.keep_mask_from_4d(mask, "megatron")``) for self-attention.
- a dense ``[B, 1 or Hq, Sq, Sk]`` mask (``attn_npu_dense_mask``) -> "BSND" with that mask,
  sparse_mode 0.
Masks: none -> sparse_mode 0 without atten_mask; causal -> sparse_mode 2 (top-left) or 3
(bottom-right) with ``npu_compressed_causal_mask``; a sliding window -> sparse_mode 4 (band,
bottom-right aligned) with pre_tockens = left, next_tockens = right, each capped at the longest
sequence (an unlimited side becomes that length: the op bounds both by the sequence lengths and
2147483647 on one side overflows their int32 sum), exact for flash-attn windows when aligned
bottom-right or when every sequence has Lq == Lk; a top-left window with lengths that differ
raises NotImplementedError. Head dims: Dqk >= Dv natively (V is never padded); Dv > Dqk raises.
Dropout -> ``keep_prob = 1 - dropout_p``: the op draws its mask with its own RNG and regenerates
it in its backward, so its masks differ from the other backends' (which share
coreattn/kernels/dropout.py's keep mask); softmax offsets and max logits have no counterpart in
the op and raise NotImplementedError (coreattn.layers.dispatch). GQA uses the op's own (Hq a multiple of Hkv). The scale is passed explicitly. Rows that see no
key are zeroed here (the op's output there is not specified), and ``inner_precise=2`` (the op's
invalid-row handling) is requested whenever such rows may exist.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from coreattn.kernels import npu
from coreattn.kernels.packing import Packing, packed, seq_len_dim
from coreattn.layers.checks import VarlenParams, check_cu_seqlens_values
from coreattn.layers.torch_backend.dense_mask import dense_mask_attn
from coreattn.layers.masks import npu_compressed_causal_mask, spans_from_keep_mask
from coreattn.layers.function import attn_torch

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


def _is_causal(params: VarlenParams) -> bool:
    return params.window_left < 0 and params.window_right == 0


def _band(params: VarlenParams, equal_lengths: bool, longest: int, device: torch.device) -> dict:
    """sparse_mode, atten_mask, pre/next_tockens for the causal/window part of ``params``;
    ``longest``: the longest q or k sequence."""
    left, right = params.window_left, params.window_right
    if left < 0 and right < 0:
        return dict(sparse_mode=0, atten_mask=None)
    mask = npu_compressed_causal_mask(device)
    if _is_causal(params):
        return dict(sparse_mode=3 if params.bottom_right else 2, atten_mask=mask)
    if not params.bottom_right and not equal_lengths:
        raise NotImplementedError(
            "npu_fusion_attention's band (sparse_mode 4) is aligned bottom-right: a top-left sliding window "
            "matches it only when every sequence has equal q and k lengths; use causal_alignment='bottom_right' "
            "or backend='triton'/'torch'")
    # a side of `longest` already spans every sequence, so capping is exact and keeps pre + next in int32
    return dict(sparse_mode=4, atten_mask=mask, pre_tockens=longest if left < 0 else min(left, longest),
                next_tockens=longest if right < 0 else min(right, longest))


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
    """One npu_fusion_attention call on [.., H, D] tensors; ``opts``: scale, keep_prob, sparse_mode,
    atten_mask and the optional pre/next_tockens, actual_seq_qlen/kvlen."""
    heads = q.shape[-2]
    q, k, v = (t.contiguous() for t in (q, k, v))
    if layout == "SBH":
        q, k, v = (t.flatten(-2) for t in (q, k, v))  # [S, B, H*D]
    out = _op()(q, k, v, heads, layout, inner_precise=INVALID_ROWS if rows_without_keys else 0, **opts)[0]
    return out.unflatten(-1, (heads, -1)) if layout == "SBH" else out


def _tnd(q, k, v, lens_q: list[int], lens_k: list[int], band: dict, params: VarlenParams) -> torch.Tensor:
    """One TND call over at most MAX_VARLEN_SEQUENCES sequences, none empty on either side."""
    empty = _rows_without_keys(lens_q, lens_k, params)
    opts = dict(band, scale=params.softmax_scale, keep_prob=1.0 - params.dropout_p,
                actual_seq_qlen=list(accumulate(lens_q)),
                actual_seq_kvlen=list(accumulate(lens_k)))
    out = _call(q, k, v, "TND", opts, empty is not None)  # [Tq, Hq, Dv]
    if empty is not None:
        out = out.masked_fill(empty.to(out.device)[:, None, None], 0)
    return out


def _tokens_of(lens: list[int], used: list[bool], device) -> torch.Tensor | None:
    """int64 indices of the used sequences' tokens in a packed tensor; None when there are no
    others (nothing to gather)."""
    if all(u or n == 0 for n, u in zip(lens, used)):
        return None
    return torch.repeat_interleave(torch.tensor(used), torch.tensor(lens)).nonzero().flatten().to(device)


def _varlen(q, k, v, lens_q: list[int], lens_k: list[int], params: VarlenParams) -> torch.Tensor:
    """Packed q [Tq, Hq, Dqk], k/v [Tk, Hkv, D] holding sequences of the given lengths, in order."""
    # a sequence with no query or no key contributes nothing; CANN reads zeros in actual_seq_* specially
    used = [a > 0 and b > 0 for a, b in zip(lens_q, lens_k)]
    if not any(used):  # nothing for the op to attend: exact zeros from torch, in the autograd graph
        cu_q, cu_k = (torch.tensor([0] + lens, device=q.device).cumsum(0).int() for lens in (lens_q, lens_k))
        return attn_torch(q, k, v, packed(cu_q), packed(cu_k), params)[0]
    idx_q, idx_k = _tokens_of(lens_q, used, q.device), _tokens_of(lens_k, used, k.device)
    total_q = q.shape[0]
    if idx_q is not None:
        q = q[idx_q]
    if idx_k is not None:
        k, v = k[idx_k], v[idx_k]
    lens_q = [n for n, u in zip(lens_q, used) if u]
    lens_k = [n for n, u in zip(lens_k, used) if u]
    band = _band(params, lens_q == lens_k, max(lens_q + lens_k), q.device)
    outs, q0, k0 = [], 0, 0
    for g in range(0, len(lens_q), MAX_VARLEN_SEQUENCES):  # each group: contiguous token ranges
        group_q, group_k = lens_q[g:g + MAX_VARLEN_SEQUENCES], lens_k[g:g + MAX_VARLEN_SEQUENCES]
        q1, k1 = q0 + sum(group_q), k0 + sum(group_k)
        outs.append(_tnd(q[q0:q1], k[k0:k1], v[k0:k1], group_q, group_k, band, params))
        q0, k0 = q1, k1
    out = torch.cat(outs) if len(outs) > 1 else outs[0]  # [Tq used, Hq, Dv]
    if idx_q is None:
        return out
    return out.new_zeros((total_q,) + out.shape[1:]).index_put((idx_q,), out)


def _whole_rows(q, k, v, fmt: str, params: VarlenParams) -> torch.Tensor:
    """Padded batch whose every row is one sequence: the op's own padded layouts, no mask tensor."""
    seqlen_q, seqlen_k = seq_len_dim(q, fmt), seq_len_dim(k, fmt)
    empty = _rows_without_keys([seqlen_q], [seqlen_k], params)  # the same rows in every sample
    opts = dict(_band(params, seqlen_q == seqlen_k, max(seqlen_q, seqlen_k), q.device), scale=params.softmax_scale,
                keep_prob=1.0 - params.dropout_p)
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


def _keep_in_span(pack: Packing) -> Packing:
    """``pack`` with its keep mask folded into its spans: each row's run of kept tokens cut to its
    span. Reads the mask (a host sync); ValueError when a row's kept tokens are not one run."""
    if pack.keep is None:
        return pack
    run = spans_from_keep_mask(pack.keep, check=True)
    start = torch.maximum(pack.seq, run.start)
    end = torch.minimum(pack.seq + pack.lens, run.start + run.length)
    return Packing(pack.fmt, start, (end - start).clamp(min=0).to(torch.int32))


def _anchor(pack: Packing, bottom_right: bool) -> torch.Tensor:
    """[B] raw position the causal/window band is aligned to: each span's end or start."""
    return pack.seq + pack.lens if bottom_right else pack.seq


def _keep_as_spans(q_pack: Packing, k_pack: Packing, params: VarlenParams) -> tuple[Packing, Packing] | None:
    """Keep masks without holes as spans, or None when the result would differ from the keep
    masks' (holes; a band that would move; a top-left window over unequal lengths)."""
    try:
        new_q, new_k = _keep_in_span(q_pack), _keep_in_span(k_pack)
    except ValueError:  # a row with holes
        return None
    if params.window_left < 0 and params.window_right < 0:
        return new_q, new_k
    # rows that drop every query or key output zeros whatever the band
    same = (new_q.lens == 0) | (new_k.lens == 0)
    moved = _anchor(new_k, params.bottom_right) - _anchor(new_q, params.bottom_right)
    same |= moved == _anchor(k_pack, params.bottom_right) - _anchor(q_pack, params.bottom_right)
    if not params.bottom_right and not _is_causal(params):
        same &= (new_q.lens == new_k.lens) | (new_q.lens == 0) | (new_k.lens == 0)
    return (new_q, new_k) if bool(same.all()) else None


def _masked(q, k, v, fmt: str, visible: torch.Tensor, softmax_scale: float, dropout_p: float) -> torch.Tensor:
    """Padded bshd/sbhd batch under visible [B, 1 or Hq, Sq, Sk] (True = may attend): "BSND" with
    atten_mask = ~visible, sparse_mode 0; rows that see no key are zeroed."""
    if fmt == "sbhd":
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    sees_key = visible.any(dim=-1).transpose(1, 2)[..., None]  # [B, Sq, 1 or Hq, 1]
    opts = dict(sparse_mode=0, atten_mask=~visible, scale=softmax_scale, keep_prob=1.0 - dropout_p)
    out = _call(q, k, v, "BSND", opts, True)
    out = out.masked_fill(~sees_key, 0)  # [B, Sq, Hq, Dv]
    return out.transpose(0, 1) if fmt == "sbhd" else out


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
    return _masked(q, k, v, fmt, vis[:, None], params.softmax_scale, params.dropout_p)


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
        as_spans = _keep_as_spans(q_pack, k_pack, params)
        if as_spans is None:
            return _keep_masks(q, k, v, q_pack, k_pack, params), None
        q_pack, k_pack = as_spans
    if q_pack.spans:
        return _spans(q, k, v, q_pack, k_pack, params), None
    cu_q, cu_k = q_pack.seq.cpu(), k_pack.seq.cpu()  # the op takes host lists
    check_cu_seqlens_values("cu_seqlens_q", cu_q, q.shape[0], "max_seqlen_q", None)
    check_cu_seqlens_values("cu_seqlens_k", cu_k, k.shape[0], "max_seqlen_k", None)
    return _varlen(q, k, v, (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist(), params), None


def attn_npu_dense_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor, layout: str,
                        softmax_scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """``dense_mask_attn``'s contract over ``torch_npu.npu_fusion_attention``: ``masked`` bool
    ``[B or 1, 1 or Hq, Sq or 1, Sk]`` (True = masked out), e.g. a Megatron dense mask with the
    causal/window band folded in, goes to the op as one ``[B, 1 or Hq, Sq, Sk]`` atten_mask
    ("BSND", sparse_mode 0). q/k/v sbhd or bshd; out in q's layout, zeros on rows that see no key."""
    _check_supported(q, v)
    if q.numel() == 0 or k.numel() == 0:  # nothing for the op to do; exact zeros from torch
        return dense_mask_attn(q, k, v, masked, layout, softmax_scale, dropout_p=dropout_p)
    batch, seqlen_q = (q.shape[1], q.shape[0]) if layout == "sbhd" else q.shape[:2]
    heads = 1 if masked.shape[1] == 1 else q.shape[-2]
    visible = ~masked.expand(batch, heads, seqlen_q, seq_len_dim(k, layout))
    return _masked(q, k, v, layout, visible, softmax_scale, dropout_p)
