"""Argument checks of the indexer ops (errors name the argument) and the key bounds they derive."""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

from coreattn.layers.checks import ALIGNMENTS, check_cu_seqlens, check_max_seqlen

LAYOUTS = ("thd", "bshd", "sbhd")
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Tokens(NamedTuple):
    """The query side's shape: ``batch`` samples of ``seqlen_q`` tokens (thd: one sample of T), keys
    ``seqlen_k`` per sample; flat token n = b * seqlen_q + s."""
    layout: str
    batch: int
    seqlen_q: int
    seqlen_k: int

    @property
    def n(self) -> int:
        return self.batch * self.seqlen_q

    @property
    def dims(self) -> tuple[int, ...]:
        """The token dims of a query-side tensor in this layout."""
        if self.layout == "thd":
            return (self.seqlen_q,)
        return (self.batch, self.seqlen_q) if self.layout == "bshd" else (self.seqlen_q, self.batch)

    def key_dims(self) -> tuple[int, ...]:
        if self.layout == "thd":
            return (self.seqlen_k,)
        return (self.batch, self.seqlen_k) if self.layout == "bshd" else (self.seqlen_k, self.batch)

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """A token-dims-first tensor [*dims, ...] as [N, ...] in n order (sbhd: transposed)."""
        if self.layout == "sbhd":
            x = x.transpose(0, 1)
        return x.reshape(self.n, *x.shape[len(self.dims):])

    def unflat(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] in n order as [*dims, ...] (sbhd: a transposed view of the [B, S, ...] buffer)."""
        if self.layout == "thd":
            return x
        x = x.view(self.batch, self.seqlen_q, *x.shape[1:])
        return x.transpose(0, 1) if self.layout == "sbhd" else x


def _tensor(name: str, t, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    return t


def _same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.numel() == 0 or t.stride(-1) == 1 else t.contiguous()


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def check_index_side(q, k, weights, layout: str) -> tuple[Tokens, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Tokens, q, k, weights) with last strides 1: q [T, H, D] / [B, S, H, D] / [S, B, H, D], k
    [T, D] / [B, Sk, D] / [Sk, B, D], weights q's shape without D."""
    padded = check_layout(layout) != "thd"
    q = _tensor("q", q, 4 if padded else 3)
    k = _tensor("k", k, 3 if padded else 2)
    weights = _tensor("weights", weights, 3 if padded else 2)
    for name, t in (("q", q), ("k", k), ("weights", weights)):
        if t.dtype not in FLOATS:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    _same_device("k", k, q.device)
    _same_device("weights", weights, q.device)
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k's head dim {k.shape[-1]} differs from q's {q.shape[-1]}")
    if tuple(weights.shape) != tuple(q.shape[:-1]):
        raise ValueError(f"weights must have shape {tuple(q.shape[:-1])} (q's without its head dim), "
                         f"got {tuple(weights.shape)}")
    if layout == "thd":
        tokens = Tokens(layout, 1, q.shape[0], k.shape[0])
    elif layout == "bshd":
        tokens = Tokens(layout, q.shape[0], q.shape[1], k.shape[1])
    else:
        tokens = Tokens(layout, q.shape[1], q.shape[0], k.shape[0])
    if padded and tokens.key_dims() != tuple(k.shape[:2]):
        raise ValueError(f"k's batch dim must match q's ({tokens.batch}), got shape {tuple(k.shape)}")
    return tokens, _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(weights)


INDEX_DTYPES = (torch.int32, torch.int64)


def check_index_dtype(index_dtype) -> torch.dtype:
    if index_dtype not in INDEX_DTYPES:
        raise TypeError(f"index_dtype must be torch.int32 or torch.int64, got {index_dtype!r}")
    return index_dtype


def _int_at_least(value, name: str, low: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def check_topk(topk, name: str = "topk") -> int:
    """An int >= 1."""
    return _int_at_least(topk, name, 1)


def check_count(value, name: str) -> int:
    """An int >= 0."""
    return _int_at_least(value, name, 0)


def check_span(max_seqlen, tokens: Tokens) -> int | None:
    """thd's ``max_seqlen`` hint as a host int (None: not given; a tensor is never read: None too)."""
    if max_seqlen is None or isinstance(max_seqlen, torch.Tensor):
        if isinstance(max_seqlen, torch.Tensor):
            check_max_seqlen("max_seqlen", max_seqlen, tokens.seqlen_k)
        return None
    return max(int(check_max_seqlen("max_seqlen", max_seqlen, tokens.seqlen_k)), 1)


def check_attention_side(query, key, tokens: Tokens, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """query [*tokens, np, Dq], key [*key tokens, Hkv, Dq] with np % Hkv == 0 (detached)."""
    padded = tokens.layout != "thd"
    query = _tensor("query", query, 4 if padded else 3).detach()
    key = _tensor("key", key, 4 if padded else 3).detach()
    for name, t in (("query", query), ("key", key)):
        if t.dtype not in FLOATS:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    _same_device("query", query, device)
    _same_device("key", key, device)
    if tuple(query.shape[:-2]) != tokens.dims:
        raise ValueError(f"query's token dims must be q's {tokens.dims}, got shape {tuple(query.shape)}")
    if tuple(key.shape[:-2]) != tokens.key_dims():
        raise ValueError(f"key's token dims must be k's {tokens.key_dims()}, got shape {tuple(key.shape)}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"key's head dim {key.shape[-1]} differs from query's {query.shape[-1]}")
    if key.shape[-2] == 0 or query.shape[-2] % key.shape[-2]:
        raise ValueError(f"query's {query.shape[-2]} heads must be a multiple of key's {key.shape[-2]}")
    return query, key


def check_topk_indices(topk_indices, tokens: Tokens, device: torch.device) -> torch.Tensor:
    """[*tokens, K] integer indices as [N, K] in flat token order."""
    t = _tensor("topk_indices", topk_indices, len(tokens.dims) + 1)
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_indices must be int32 or int64, got {t.dtype}")
    _same_device("topk_indices", t, device)
    if tuple(t.shape[:-1]) != tokens.dims:
        raise ValueError(f"topk_indices must have shape {tokens.dims} + (K,), got {tuple(t.shape)}")
    return tokens.flat(t)


def check_query_valid_rows(rows, tokens: Tokens, device: torch.device) -> torch.Tensor | None:
    """bool [N] (flat token order) from a token-dims shaped mask (padded layouts: also [S], shared by the batch)."""
    if rows is None:
        return None
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"query_valid_rows must be a torch.Tensor, got {type(rows).__name__}")
    _same_device("query_valid_rows", rows, device)
    if tokens.layout != "thd" and tuple(rows.shape) == (tokens.seqlen_q,):
        rows = rows[:, None] if tokens.layout == "sbhd" else rows[None, :]
        rows = rows.expand(*tokens.dims)
    if tuple(rows.shape) != tokens.dims:
        raise ValueError(f"query_valid_rows must have shape {tokens.dims}, got {tuple(rows.shape)}")
    return tokens.flat(rows.to(torch.bool))


def key_bounds(tokens: Tokens, device: torch.device, *, cu_seqlens=None, causal: bool = True,
               causal_alignment: str = "bottom_right", bounds=None, max_seqlen=None):
    """(key_lo, key_hi int32 [N] contiguous in flat token order, key_range): the keys ``lo <= j < hi``
    each query sees, in key positions of its sample (thd: rows of the packed stream); ``key_range``
    maps a chunk of query positions [s0, s1) to a key range known on the host that holds their keys
    (None: the whole sample), for the torch backend on devices whose bounds it does not read. thd:
    ``max_seqlen`` (a host int >= every sequence's length; optional) bounds the range to
    max_seqlen - 1 keys around the chunk.

    Given ``bounds`` = (lo, hi): int tensors shaped like the token dims (padded layouts: also [S],
    shared by the batch: Megatron's varlen_starts/ends), clamped into the sample ([0, Sk], hi >= lo). Else thd: from ``cu_seqlens`` (int32 [B+1];
    None: one sequence), lo = the sequence's first row, hi = the row + 1 (causal) or the sequence's
    end; padded: lo = 0, hi = s + 1 + shift (causal; shift = Sk - S with ``causal_alignment``
    "bottom_right", 0 with "top_left") or Sk, clamped to [0, Sk]. Built on device, no host sync."""
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {ALIGNMENTS}, got {causal_alignment!r}")
    n = tokens.n
    if bounds is not None:
        if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
            raise TypeError("key_bounds must be a pair (key_lo, key_hi) of integer tensors")
        if cu_seqlens is not None:
            raise ValueError("give key_bounds or cu_seqlens, not both")
        flat = []
        for name, t in zip(("key_bounds[0]", "key_bounds[1]"), bounds):
            if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"{name} must be an int32 or int64 tensor")
            _same_device(name, t, device)
            if tokens.layout != "thd" and tuple(t.shape) == (tokens.seqlen_q,):
                t = (t[:, None] if tokens.layout == "sbhd" else t[None, :]).expand(*tokens.dims)
            if tuple(t.shape) != tokens.dims:
                raise ValueError(f"{name} must have shape {tokens.dims}, got {tuple(t.shape)}")
            flat.append(tokens.flat(t).to(torch.int64))
        lo = flat[0].clamp(0, tokens.seqlen_k)  # keys outside the sample do not exist; hi < lo: no key
        hi = torch.maximum(flat[1].clamp(0, tokens.seqlen_k), lo)
        return lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous(), None
    rows = torch.arange(tokens.seqlen_q, device=device, dtype=torch.int64)
    if tokens.layout == "thd":
        if cu_seqlens is None:
            lo = torch.zeros_like(rows)
            hi = rows + 1 if causal else torch.full_like(rows, tokens.seqlen_k)
        else:
            check_cu_seqlens("cu_seqlens", cu_seqlens, device)
            cu = cu_seqlens.to(torch.int64)
            seq = torch.searchsorted(cu[1:], rows, right=True)  # B for rows past the last sequence
            lo = cu[seq]  # rows past cu[-1] see only rows past it, as Megatron's varlen bounds have it
            hi = rows + 1 if causal else cu[(seq + 1).clamp_max(cu.numel() - 1)]
        span = tokens.seqlen_k if max_seqlen is None else max_seqlen
        if causal:
            key_range = lambda s0, s1: (s0 - span + 1, s1)  # noqa: E731
        else:
            key_range = lambda s0, s1: (s0 - span + 1, s1 + span - 1)  # noqa: E731
        return lo.to(torch.int32), hi.clamp(0, tokens.seqlen_k).to(torch.int32), key_range
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens is for layout='thd'; padded layouts take key_bounds")
    shift = tokens.seqlen_k - tokens.seqlen_q if causal_alignment == "bottom_right" else 0
    hi = (rows + 1 + shift).clamp(0, tokens.seqlen_k) if causal else torch.full_like(rows, tokens.seqlen_k)
    lo = torch.zeros(n, dtype=torch.int32, device=device)
    hi = hi.to(torch.int32).repeat(tokens.batch)  # n = b * S + s
    return lo, hi, ((lambda s0, s1: (0, s1 + shift)) if causal else None)
