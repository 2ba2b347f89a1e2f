"""The relative-position biases the public attention functions take (``bias=``), and their checks.

Both are functions of the distance ``d = i + shift - j`` between query i and key j of a sequence
(shift as for causality: Lk - Lq with bottom-right alignment, 0 top-left; so with equal lengths
d = i - j, and with a KV cache of past tokens d is the query's absolute position minus the key's),
plus, for the low-rank bias, of the query token:

- ``LowRankRelativeBias(states, proj)`` (Inkling 2): ``bias(i, j, h) = states[i, h, :] .
  proj[:, d]`` for ``0 <= d < extent = proj.shape[1]``, else 0. Gradients for both.
- ``BucketedRelativeBias(embedding, bidirectional, max_distance)`` (T5, mT5, UMT5, LongT5,
  Switch Transformers): ``bias(i, j, h) = embedding[bucket(j - i - shift), h]`` with T5's
  log-spaced buckets (``t5_buckets``: ``num_buckets = embedding.shape[0]``; bidirectional in
  encoders, causal in decoders; every distance at or past ``max_distance`` shares the last bucket).
  Gradient for the embedding.

Either becomes a ``TableBias`` (coreattn/kernels/attn_common.py) for the attention ops, through
differentiable torch ops on tensors of O(T x H x R) and O(H x max_distance) elements: the
low-rank states are its per-row coefficients and ``proj`` its one table; the bucketed bias is a
table per head of the 2 * max_distance + 1 distances -max_distance..max_distance (a one-hot matmul
of the embedding), clamped at its ends.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from coreattn.kernels.attn_common import TableBias


class LowRankRelativeBias(NamedTuple):
    """Inkling 2's relative position bias: ``bias(i, j, h) = states[i, h, :] . proj[:, i - j]`` for
    ``0 <= i - j < proj.shape[1]`` (i - j counted along the causal diagonal), else 0."""

    states: torch.Tensor  # q's token layout with [Hq, R] last: thd [T, Hq, R], bshd [B, S, Hq, R], sbhd [S, B, Hq, R]
    proj: torch.Tensor  # [R, extent]


class BucketedRelativeBias(NamedTuple):
    """T5's relative position bias: ``bias(i, j, h) = embedding[bucket(j - i), h]``. ``buckets``
    (optional, integer ``[2 * max_distance + 1]``): the bucket of each relative position
    ``j - i = -max_distance .. max_distance``, when a model computes them its own way (default:
    ``t5_buckets``)."""

    embedding: torch.Tensor  # [num_buckets, Hq]
    bidirectional: bool
    max_distance: int
    buckets: torch.Tensor | None = None


def t5_buckets(bidirectional: bool, num_buckets: int, max_distance: int, device=None) -> torch.Tensor:
    """int64 ``[2 * max_distance + 1]``: T5's bucket of each relative position j - i from -max_distance
    to max_distance, computed as transformers' ``T5Attention._relative_position_bucket`` computes it
    (the same float32 ops, so the same boundaries on the same device); positions beyond share the
    end buckets."""
    rel = torch.arange(-max_distance, max_distance + 1, dtype=torch.long, device=device)
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets += (rel > 0).to(torch.long) * num_buckets
        rel = torch.abs(rel)
    else:
        rel = -torch.min(rel, torch.zeros_like(rel))
    max_exact = num_buckets // 2
    is_small = rel < max_exact
    large = max_exact + (torch.log(rel.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, rel, large)


def _check_floating(name: str, t, q: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def _low_rank(bias: LowRankRelativeBias, q: torch.Tensor, work: torch.dtype) -> TableBias:
    states, proj = bias.states, bias.proj
    _check_floating("bias.proj", proj, q, 2)
    _check_floating("bias.states", states, q, q.dim())
    rank, extent = proj.shape
    if rank < 1 or extent < 1:
        raise ValueError(f"bias.proj has shape {tuple(proj.shape)}; expected [R, extent] with R, extent >= 1")
    if tuple(states.shape) != tuple(q.shape[:-1]) + (rank,):
        raise ValueError(f"bias.states has shape {tuple(states.shape)}; expected q's token and head dims then R: "
                         f"{list(q.shape[:-1]) + [rank]}")
    return TableBias(proj.to(work).unsqueeze(0).contiguous(), states.to(work).contiguous(), 0, False)


def _bucketed(bias: BucketedRelativeBias, q: torch.Tensor, work: torch.dtype) -> TableBias:
    emb, max_distance = bias.embedding, bias.max_distance
    _check_floating("bias.embedding", emb, q, 2)
    heads = q.shape[-2]
    if emb.shape[1] != heads or emb.shape[0] < 1:
        raise ValueError(f"bias.embedding has shape {tuple(emb.shape)}; expected [num_buckets, Hq] = "
                         f"[num_buckets, {heads}]")
    if not isinstance(bias.bidirectional, bool):
        raise TypeError(f"bias.bidirectional must be a bool, got {type(bias.bidirectional).__name__}")
    if isinstance(max_distance, bool) or not isinstance(max_distance, int) or max_distance < 1:
        raise ValueError(f"bias.max_distance must be an int >= 1, got {max_distance!r}")
    buckets = bias.buckets
    if buckets is None:
        if emb.shape[0] < (4 if bias.bidirectional else 2):
            raise ValueError(f"bias.embedding has {emb.shape[0]} buckets; T5's buckets need at least "
                             f"{4 if bias.bidirectional else 2}")
        buckets = t5_buckets(bias.bidirectional, emb.shape[0], max_distance, emb.device)
    elif not isinstance(buckets, torch.Tensor) or buckets.dtype.is_floating_point or buckets.dtype == torch.bool:
        raise TypeError("bias.buckets must be an integer tensor")
    elif tuple(buckets.shape) != (2 * max_distance + 1,) or buckets.device != emb.device:
        raise ValueError(f"bias.buckets has shape {tuple(buckets.shape)} on {buckets.device}; expected "
                         f"[2 * max_distance + 1] = [{2 * max_distance + 1}] on {emb.device}")
    # the table runs over d = i + shift - j = -(j - i - shift) from -max_distance: relative positions reversed
    one_hot = torch.nn.functional.one_hot(buckets.flip(0).long(), emb.shape[0]).to(work)  # [2L + 1, num_buckets]
    table = (one_hot @ emb.to(work)).t().unsqueeze(1).contiguous()  # [Hq, 1, 2L + 1]
    return TableBias(table, None, -max_distance, True)


def check_bias(bias, q: torch.Tensor, return_max_logit: bool = False) -> TableBias | None:
    """The public ``bias`` argument as the attention ops take it (None stays None); raises naming the
    argument for anything else. Differentiable in the bias's tensors."""
    if bias is None:
        return None
    if return_max_logit:
        raise NotImplementedError("bias with return_max_logit is not supported: the max logit (qk-clip's) is of "
                                  "softmax_scale * q.k alone; call without one of them")
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    if isinstance(bias, LowRankRelativeBias):
        return _low_rank(bias, q, work)
    if isinstance(bias, BucketedRelativeBias):
        return _bucketed(bias, q, work)
    raise TypeError(f"bias must be a coreattn.LowRankRelativeBias or coreattn.BucketedRelativeBias (computed in "
                    f"registers; an [S, T] bias tensor is not taken), got {type(bias).__name__}")
