"""Pure-torch attention with the kernels' semantics: the CPU backend and the fallback.

``attn_torch_fwd`` / ``attn_torch_bwd`` are the torch backend's implementation of the backend
contract (coreattn/layers/function.py): the forward returns out, lse (including a softmax offset's
sink term) and optionally the max logit; the backward computes dq, dk, dv from the saved out and
lse with flash attention's formulas (P = exp(S - lse), delta = rowsum(dO * O)), so it also serves
callers that merge partial results through lse (context parallelism).

Vectorized over the batch: each sequence (packed thd, or a span of a padded bshd/sbhd batch,
see coreattn/kernels/packing.py) is gathered into a padded [B, S, H, D] batch, the visibility
mask is built from positions and lengths, and rows that see no key give zeros and lse = -inf
(or the sink's logit) without NaN. Memory is O(B * H * Sq * Sk): meant for CPU and small shapes.
Dropout uses the keep mask of coreattn/layers/dropout.py on the same token ids as the kernels.
float64 inputs are computed in float64, everything else in float32.

The padded batch is sized by the true lengths, read from cu_seqlens or the spans (free on the
CPU, one host sync on a device), never by a caller's max_seqlen; malformed layouts raise here
even where the public functions skip their value checks (device tensors, no COREATTN_VALIDATE).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from coreattn.kernels.packing import Packing, default_gid, seq_len_dim
from coreattn.layers import dropout
from coreattn.layers.checks import VarlenParams
from coreattn.layers.softmax_offset import softmax_offset_grad


def _spans(pack: Packing) -> tuple[torch.Tensor, torch.Tensor]:
    if not pack.spans:
        return pack.seq[:-1].long(), (pack.seq[1:] - pack.seq[:-1]).long()
    return pack.seq.long(), pack.lens.long()


def _longest(pack: Packing, n_tokens: int) -> int:
    """The longest sequence of a well-formed layout (one read of device values); raises
    ValueError on malformed cu_seqlens or spans."""
    starts, lens = _spans(pack)
    if lens.numel() == 0:
        return 0
    bad = (starts < 0) | (lens < 0) | (starts + lens > n_tokens)
    if not pack.spans:
        bad = bad | (pack.seq[0] != 0) | (pack.seq[-1] != n_tokens)
    longest, malformed = torch.stack([lens.max(), bad.any().long()]).tolist()
    if malformed:
        what = "spans (start/length or seqused)" if pack.spans else "cu_seqlens"
        raise ValueError(f"malformed {what}: a sequence does not fit in the {n_tokens} tokens (or cu_seqlens does "
                         "not run from 0 to the token count without decreasing)")
    return longest


class _Side(NamedTuple):
    """Where one side's (q or k) sequences sit: token positions [B, S] and which are in a sequence."""

    pack: Packing
    n_tokens: int  # T (thd) or the padded length S
    tok: torch.Tensor  # [B, S] int64 positions in the layout (clamped)
    inside: torch.Tensor  # [B, S] bool: position i < length_b
    lens: torch.Tensor  # [B] int64

    def index(self):
        """Index tuple selecting the [B, S] positions of a tensor in this side's layout."""
        if self.pack.fmt == "thd":
            return (self.tok,)
        b = torch.arange(self.tok.shape[0], device=self.tok.device)[:, None].expand_as(self.tok)
        return (b, self.tok) if self.pack.fmt == "bshd" else (self.tok, b)

    def gather(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x in the layout -> [B, S, H, D] in ``dtype``, zeros outside the sequences."""
        if self.n_tokens == 0:
            return x.new_zeros(self.tok.shape + x.shape[-2:], dtype=dtype)
        return x[self.index()].to(dtype) * self.inside[:, :, None, None].to(dtype)

    def scatter(self, vals: torch.Tensor, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[B, S, H, D] values -> a zero tensor shaped like ``like`` (in ``dtype``) holding them, summed
        where spans overlap (key spans may: each sequence's gradient adds up)."""
        out = torch.zeros(like.shape[:-1] + vals.shape[-1:], dtype=vals.dtype, device=vals.device)
        idx = tuple(i[self.inside] for i in self.index())
        return out.index_put_(idx, vals[self.inside], accumulate=True).to(dtype)

    def keep(self) -> torch.Tensor:
        """The pack's keep mask at the gathered positions [B, S] (all True without a mask)."""
        if self.pack.keep is None:
            return torch.ones(self.tok.shape, dtype=torch.bool, device=self.tok.device)
        b = torch.arange(self.tok.shape[0], device=self.tok.device)[:, None]
        return self.pack.keep[b, self.tok.clamp(max=self.pack.keep.shape[1] - 1)] != 0

    def token_ids(self) -> torch.Tensor:
        """Dropout token ids [B, S] (coreattn/layers/dropout.py)."""
        gid = self.pack.gid if self.pack.gid is not None else default_gid(self.pack, self.n_tokens)
        return gid.long()[:, None] + torch.arange(self.tok.shape[1], device=self.tok.device)[None, :]


def _side(x: torch.Tensor, pack: Packing) -> _Side:
    n = seq_len_dim(x, pack.fmt)
    longest = _longest(pack, n)
    starts, lens = _spans(pack)
    pos = torch.arange(longest, device=x.device)
    inside = pos[None, :] < lens[:, None]
    tok = (starts[:, None] + pos[None, :]).clamp(0, max(n - 1, 0))
    return _Side(pack, n, tok, inside, lens)


def visible_mask(lens_q, lens_k, max_q: int, max_k: int, params: VarlenParams) -> torch.Tensor:
    """[B, Sq, Sk] bool: query i of sequence b may attend to key j."""
    i = torch.arange(max_q, device=lens_q.device)[None, :, None]
    j = torch.arange(max_k, device=lens_q.device)[None, None, :]
    shift = (lens_k - lens_q)[:, None, None] if params.bottom_right else 0
    vis = (i < lens_q[:, None, None]) & (j < lens_k[:, None, None])
    if params.window_left >= 0:
        vis = vis & (j >= i + shift - params.window_left)
    if params.window_right >= 0:
        vis = vis & (j <= i + shift + params.window_right)
    return vis


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _Problem(NamedTuple):
    """One call's gathered operands: q [B, Sq, Hkv, G, Dqk], k [B, Sk, Hkv, Dqk], v [B, Sk, Hkv, Dv],
    scaled scores with masked entries -inf [B, Hkv, G, Sq, Sk], and the dropout scale (keep / (1 - p))
    or None."""

    qs: _Side
    ks: _Side
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scores: torch.Tensor
    drop: torch.Tensor | None


def _problem(q, k, v, q_pack: Packing, k_pack: Packing, params: VarlenParams, rng_state) -> _Problem:
    work = _compute_dtype(q)
    hq, hkv = q.shape[-2], k.shape[-2]
    qs, ks = _side(q, q_pack), _side(k, k_pack)
    qp, kp, vp = qs.gather(q, work), ks.gather(k, work), ks.gather(v, work)
    b, sq = qp.shape[:2]
    qp = qp.view(b, sq, hkv, hq // hkv, qp.shape[-1])
    scores = torch.einsum("bshgd,bthd->bhgst", qp, kp) * params.softmax_scale
    vis = visible_mask(qs.lens, ks.lens, qs.tok.shape[1], ks.tok.shape[1], params)
    vis = vis & qs.keep()[:, :, None] & ks.keep()[:, None, :]
    scores = scores.masked_fill(~vis[:, None, None], float("-inf"))
    drop = None
    if params.dropout_p > 0:
        heads = torch.arange(hq, device=q.device).view(1, hkv, hq // hkv, 1, 1)
        keep = dropout.keep_mask(rng_state, params.dropout_p, heads, qs.token_ids()[:, None, None, :, None],
                                 ks.token_ids()[:, None, None, None, :])
        drop = keep.to(work) / (1.0 - params.dropout_p)
    return _Problem(qs, ks, qp, kp, vp, scores, drop)


def attn_torch_fwd(q, k, v, q_pack: Packing, k_pack: Packing, max_seqlen_q: int, max_seqlen_k: int,
                   params: VarlenParams, rng_state: torch.Tensor | None = None,
                   softmax_offset: torch.Tensor | None = None, return_max_logit: bool = False):
    """(out, lse, max_logit or None). out: q's layout and dtype with last dim Dv; lse ([Hq, Tq]
    packed, [B, Hq, Sq] padded; -inf outside the spans) and max_logit [Hq] in float32, or float64
    for float64 inputs."""
    pb = _problem(q, k, v, q_pack, k_pack, params, rng_state)
    s = pb.scores
    b, hkv, g, sq, sk = s.shape
    max_logit = None
    if return_max_logit:
        flat = s.permute(1, 2, 0, 3, 4).reshape(hkv * g, -1)
        max_logit = flat.amax(dim=1) if flat.shape[1] else flat.new_full((hkv * g,), float("-inf"))
    row_max = s.amax(dim=-1, keepdim=True) if sk else s.new_full(s.shape[:-1] + (1,), float("-inf"))
    if softmax_offset is not None:
        sink = softmax_offset.to(s.dtype).view(1, hkv, g, 1, 1)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(s - row_max)  # masked entries are exactly 0
    denom = e.sum(dim=-1, keepdim=True)
    if softmax_offset is not None:
        denom = denom + torch.exp(sink - row_max)
    p = e / torch.where(denom == 0, torch.ones_like(denom), denom)
    if pb.drop is not None:
        p = p * pb.drop
    out = torch.einsum("bhgst,bthd->bshgd", p, pb.v).reshape(b, sq, hkv * g, pb.v.shape[-1])
    lse = (row_max + torch.log(denom)).reshape(b, hkv * g, sq)  # [B, Hq, Sq]; -inf: no key, no sink
    return pb.qs.scatter(out, q, q.dtype), _lse_to_layout(lse, pb.qs, q), max_logit


def _lse_to_layout(lse: torch.Tensor, qs: _Side, q: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
    """[B, Hq, Sq] (gathered) -> [Hq, Tq] (thd) or [B, Hq, S] (padded), ``fill`` elsewhere."""
    vals = lse.transpose(1, 2)[..., None]  # [B, Sq, Hq, 1]
    like = q[..., :1]
    full = torch.full(like.shape, fill, dtype=lse.dtype, device=q.device)
    idx = tuple(i[qs.inside] for i in qs.index())
    full = full.index_put_(idx, vals[qs.inside])[..., 0]  # [T, Hq] / [B, S, Hq] / [S, B, Hq]
    if qs.pack.fmt == "thd":
        return full.transpose(0, 1).contiguous()
    full = full if qs.pack.fmt == "bshd" else full.transpose(0, 1)
    return full.transpose(1, 2).contiguous()


def _lse_gathered(lse: torch.Tensor, qs: _Side, dtype: torch.dtype) -> torch.Tensor:
    """The layout's lse -> [B, Hq, Sq] at the gathered positions (+inf outside the sequences, so
    P = exp(S - lse) = 0 there)."""
    if qs.n_tokens == 0:
        return torch.full((qs.tok.shape[0], lse.shape[-2], qs.tok.shape[1]), float("inf"), dtype=dtype,
                          device=lse.device)
    if qs.pack.fmt == "thd":
        g = lse[:, qs.tok].permute(1, 0, 2)  # [B, Hq, Sq]
    else:
        b = torch.arange(qs.tok.shape[0], device=lse.device)[:, None, None]
        h = torch.arange(lse.shape[1], device=lse.device)[None, :, None]
        g = lse[b, h, qs.tok[:, None, :]]
    g = g.to(dtype)
    g = torch.where(torch.isneginf(g), torch.full_like(g, float("inf")), g)
    return torch.where(qs.inside[:, None, :], g, torch.full_like(g, float("inf")))


def attn_torch_bwd(dout, q, k, v, out, lse, q_pack: Packing, k_pack: Packing, max_seqlen_q: int, max_seqlen_k: int,
                   params: VarlenParams, rng_state: torch.Tensor | None = None,
                   softmax_offset: torch.Tensor | None = None):
    """(dq, dk, dv, d_offset) in the layouts and dtypes of q, k, v (and the offset), from the saved out
    and lse (which includes any softmax offset, so dq/dk/dv need nothing more); d_offset None without
    an offset."""
    pb = _problem(q, k, v, q_pack, k_pack, params, rng_state)
    work = pb.scores.dtype
    b, hkv, g, sq, sk = pb.scores.shape
    dim_v = v.shape[-1]
    do = pb.qs.gather(dout, work).view(b, sq, hkv, g, dim_v)  # [B, Sq, Hkv, G, Dv]
    o = pb.qs.gather(out, work).view(b, sq, hkv, g, dim_v)
    lse_g = _lse_gathered(lse, pb.qs, work).view(b, hkv, g, sq, 1)
    p = torch.exp(pb.scores - lse_g)  # [B, Hkv, G, Sq, Sk]; 0 where masked or outside
    delta = (do * o).sum(-1).permute(0, 2, 3, 1)[..., None]  # [B, Hkv, G, Sq, 1]
    dp = torch.einsum("bshgd,bthd->bhgst", do, pb.v)
    pd = p
    if pb.drop is not None:
        dp = dp * pb.drop
        pd = p * pb.drop
    ds = p * (dp - delta) * params.softmax_scale
    dv = torch.einsum("bhgst,bshgd->bthd", pd, do)
    dk = torch.einsum("bhgst,bshgd->bthd", ds, pb.q)
    dq = torch.einsum("bhgst,bthd->bshgd", ds, pb.k).reshape(b, sq, hkv * g, q.shape[-1])
    d_offset = None
    if softmax_offset is not None:
        rowsum = (p * dp).sum(-1).reshape(b, hkv * g, sq)  # rowsum(P * dP) without O's rounding
        d_offset = softmax_offset_grad(softmax_offset, lse, _lse_to_layout(rowsum, pb.qs, q, fill=0.0), pb.qs.pack)
    return pb.qs.scatter(dq, q, q.dtype), pb.ks.scatter(dk, k, k.dtype), pb.ks.scatter(dv, v, v.dtype), d_offset
