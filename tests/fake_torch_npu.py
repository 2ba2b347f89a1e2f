"""A CPU stand-in for ``torch_npu``: ``npu_fusion_attention``'s documented semantics in plain torch.

Tests install ``FakeTorchNpu().module`` as ``sys.modules["torch_npu"]``; every call's arguments are
recorded in ``calls``. What it implements, from torch_npu's documentation of the op:
- layouts "TND" (with ``actual_seq_qlen``/``actual_seq_kvlen``: cumulative ends, no leading 0,
  last = T, strictly increasing: real CANN versions read a zero length specially, so an empty
  sequence is rejected), "BSND" ``[B, S, N, D]`` and "SBH" ``[S, B, N*D]`` (D = H / head_num; the
  kv head count is H_kv / D);
- GQA: head_num q heads, a multiple of the kv heads; Dq = Dk >= Dv;
- ``scale`` multiplies q @ k^T; ``keep_prob`` in (0, 1]: dropout with the fake's own RNG (torch's
  generator for the tensors' device), kept probabilities scaled by 1 / keep_prob, gradients through
  torch's autograd (the real op keeps its mask for its backward the same way);
- atten_mask bool/uint8 with 1 = masked out; sparse_mode 0 (no mask: full attention; with a mask
  of shape BNSS/B1SS/11SS/SS: that mask, and pre/next_tockens as a top-left band), 1 (the full
  mask, pre/next ignored), 2 (top-left causal), 3 (bottom-right causal), 4 (band between
  pre_tockens and next_tockens, counted from the bottom-right diagonal). Modes 2-4 must get the
  compressed 2048x2048 ``triu(ones, 1)`` mask, which is checked, and otherwise ignore its values;
- at most 1024 sequences in TND.
Not documented, chosen here: a query row whose every key is masked gets the plain average of its
sequence's V (what a large finite mask fill gives) and zeros if the sequence has no key, so the
caller must zero such rows itself; softmax_max/softmax_sum come back as None.
"""

from __future__ import annotations

import types

import torch

INT_MAX = 2147483647
COMPRESSED = 2048
MASK_FILL = -1e30  # finite, like the op's documented reference (-10000 * mask)


def _compressed_mask_ok(mask) -> bool:
    if mask is None or tuple(mask.shape) != (COMPRESSED, COMPRESSED) or mask.dtype not in (torch.bool, torch.uint8):
        return False
    ref = torch.ones(COMPRESSED, COMPRESSED, dtype=torch.bool, device=mask.device).triu_(1)
    return torch.equal(mask.bool(), ref)


def _band(len_q: int, len_k: int, sparse_mode: int, pre: int, nxt: int, device) -> torch.Tensor:
    """[Lq, Lk] visibility of a mode's band."""
    i = torch.arange(len_q, device=device)[:, None]
    j = torch.arange(len_k, device=device)[None, :]
    shift = len_k - len_q
    if sparse_mode == 2:
        return j <= i
    if sparse_mode == 3:
        return j <= i + shift
    if sparse_mode == 4:
        return (j >= i + shift - pre) & (j <= i + shift + nxt)
    if sparse_mode == 0:
        return (j >= i - pre) & (j <= i + nxt)
    return torch.ones(len_q, len_k, dtype=torch.bool, device=device)


def _attend(q, k, v, visible, scale, keep_prob):
    """q [Lq, N1, D], k [Lk, N2, D], v [Lk, N2, Dv], visible [N1 or 1, Lq, Lk] -> [Lq, N1, Dv]."""
    group = q.shape[1] // k.shape[1]
    if k.shape[0] == 0:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    kk = k.float().repeat_interleave(group, dim=1)
    vv = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("ihd,jhd->hij", q.float(), kk) * scale
    s = s.masked_fill(~visible, MASK_FILL)
    p = torch.softmax(s, dim=-1)
    if keep_prob < 1.0:
        p = p * (torch.rand(p.shape, device=p.device) < keep_prob) / keep_prob
    return torch.einsum("hij,jhd->ihd", p, vv).to(q.dtype)


class FakeTorchNpu:
    def __init__(self):
        self.calls: list[dict] = []
        self.module = types.ModuleType("torch_npu")
        self.module.npu_fusion_attention = self.npu_fusion_attention

    def npu_fusion_attention(self, query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                             atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=INT_MAX, next_tockens=INT_MAX,
                             inner_precise=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                             sparse_mode=0, gen_mask_parallel=True, sync=False):
        self.calls.append(dict(query=query, key=key, value=value, head_num=head_num, input_layout=input_layout,
                               atten_mask=atten_mask, scale=scale, keep_prob=keep_prob, pre_tockens=pre_tockens,
                               next_tockens=next_tockens, inner_precise=inner_precise,
                               actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
                               sparse_mode=sparse_mode))
        if pse is not None or padding_mask is not None or prefix is not None:
            raise NotImplementedError("the fake implements no pse, padding_mask or prefix")
        if not 0.0 < keep_prob <= 1.0:
            raise ValueError(f"keep_prob must be in (0, 1], got {keep_prob}")
        if not (query.dtype == key.dtype == value.dtype) or query.dtype not in (torch.float16, torch.bfloat16,
                                                                                torch.float32):
            raise TypeError("query, key, value must share a dtype among float16, bfloat16, float32")
        seqs, assemble = self._split(query, key, value, head_num, input_layout, actual_seq_qlen, actual_seq_kvlen)
        if sparse_mode in (2, 3, 4):
            if not _compressed_mask_ok(atten_mask):
                raise ValueError(f"sparse_mode {sparse_mode} needs the compressed 2048x2048 triu(1) atten_mask")
            if sparse_mode == 4 and pre_tockens + next_tockens < 0:
                raise ValueError("sparse_mode 4 needs pre_tockens + next_tockens >= 0")
        elif sparse_mode in (0, 1):
            if sparse_mode == 1 and atten_mask is None:
                raise ValueError("sparse_mode 1 needs the full atten_mask")
            if atten_mask is not None and input_layout == "TND":
                raise NotImplementedError("the fake does not implement full masks with TND")
            if atten_mask is not None and atten_mask.dtype not in (torch.bool, torch.uint8):
                raise TypeError(f"atten_mask must be bool or uint8, got {atten_mask.dtype}")
        else:
            raise NotImplementedError(f"sparse_mode {sparse_mode}")
        outs = []
        for b, (q, k, v) in enumerate(seqs):
            visible = _band(q.shape[0], k.shape[0], sparse_mode, pre_tockens, next_tockens, q.device)[None]
            if sparse_mode == 1:
                visible = torch.ones_like(visible)
            if sparse_mode in (0, 1) and atten_mask is not None:
                visible = visible & (self._full_mask(atten_mask, b, q.shape[0], k.shape[0]) == 0)
            if sparse_mode == 0 and atten_mask is None:
                visible = torch.ones_like(visible)  # no mask: full attention, pre/next ignored
            outs.append(_attend(q, k, v, visible, scale, keep_prob))
        return assemble(outs), None, None, None, 0, 0, 0

    @staticmethod
    def _full_mask(mask, b, len_q, len_k):
        """A BNSS/B1SS/11SS/SS mask's [N or 1, Sq, Sk] slice for sample b."""
        if mask.dim() == 2:
            mask = mask[None, None]
        if mask.dim() != 4 or tuple(mask.shape[-2:]) != (len_q, len_k):
            raise ValueError(f"atten_mask of shape {tuple(mask.shape)} does not fit Sq={len_q}, Sk={len_k}")
        return mask[b if mask.shape[0] > 1 else 0]

    @staticmethod
    def _split(query, key, value, head_num, layout, seq_q, seq_k):
        """Per-sequence (q [Lq, N1, D], k [Lk, N2, D], v [Lk, N2, Dv]) and how to put outputs back."""
        if layout == "TND":
            if seq_q is None or seq_k is None or len(seq_q) != len(seq_k):
                raise ValueError("TND needs actual_seq_qlen and actual_seq_kvlen of equal length")
            if len(seq_q) > 1024:
                raise ValueError("TND takes at most 1024 sequences")
            for name, ends, total in (("qlen", seq_q, query.shape[0]), ("kvlen", seq_k, key.shape[0])):
                bounds = [0] + list(ends)
                if not ends or not all(isinstance(e, int) for e in ends) or ends[-1] != total \
                        or any(a >= b for a, b in zip(bounds, bounds[1:])):
                    raise ValueError(f"actual_seq_{name} must be strictly increasing host ints without the leading 0, "
                                     f"ending at {total}: {ends}")
            q_bounds, k_bounds = [0] + list(seq_q), [0] + list(seq_k)
            seqs = [(query[q_bounds[b]:q_bounds[b + 1]], key[k_bounds[b]:k_bounds[b + 1]],
                     value[k_bounds[b]:k_bounds[b + 1]]) for b in range(len(seq_q))]
            _check_heads(query, key, value, head_num)
            return seqs, lambda outs: torch.cat(outs)
        if layout == "BSND":
            _check_heads(query, key, value, head_num)
            seqs = [(query[b], key[b], value[b]) for b in range(query.shape[0])]
            return seqs, lambda outs: torch.stack(outs)
        if layout == "SBH":
            dim = query.shape[-1] // head_num
            heads_kv = key.shape[-1] // dim
            q = query.unflatten(-1, (head_num, dim))
            k = key.unflatten(-1, (heads_kv, dim))
            v = value.unflatten(-1, (heads_kv, -1))
            _check_heads(q, k, v, head_num)
            seqs = [(q[:, b], k[:, b], v[:, b]) for b in range(q.shape[1])]
            return seqs, lambda outs: torch.stack(outs, dim=1).flatten(-2)
        raise NotImplementedError(f"the fake implements TND, BSND and SBH, not {layout!r}")


def _check_heads(q, k, v, head_num):
    if q.shape[-2] != head_num or head_num % k.shape[-2] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"head_num {head_num}: q has {q.shape[-2]} heads, k {k.shape[-2]}, v {v.shape[-2]}")
    if q.shape[-1] != k.shape[-1] or v.shape[-1] > q.shape[-1]:
        raise ValueError(f"head dims: q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]} (need Dq = Dk >= Dv)")
