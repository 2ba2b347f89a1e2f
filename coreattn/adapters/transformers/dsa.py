"""The DSA machinery the model modules (``models/``) share: the masks coreattn hands sparse-attention
models, their layers' attention, and the wrapping of their indexers.

- ``SparseMask``: what the mask builder hands a model whose attention layer runs a DSA indexer on
  ``attention_mask[:, 0]`` and passes its top-k as ``indices=`` (DeepSeek-V3.2 and the models built
  like it): per query token the key positions ``[lo, hi)`` it may see (causality, left or right
  padding, packed sequences and a KV cache's offsets folded in; built on the device, ``[B, S]``
  each), never a ``[B, 1, S, T]`` tensor. A layer of such a model without an indexer (none passes
  ``indices``) runs dense attention on the mask's ``keep``.
- ``IndexRows``: what coreattn hands the attention function in place of the ``[B, 1, S, T]`` mask a
  layer builds itself from its indexer's rows (GLM-5.3-Flash): the rows.
- ``wrap_indexer``: an indexer's forward that, handed a ``SparseMask``, computes q and k with the
  model's own projections, norm and RoPE (the family's ``project``) and scores them with
  ``coreattn.indexer_topk`` (``score_topk``: chunked, ``sum_h w_h * relu(scale * q_h . k)``, top-k
  among the visible keys, -1 where a row has fewer); handed anything else it runs transformers' code.
- ``sparse_attention``: ``coreattn.sparse_padded_attn`` on the bshd views with the indices (set
  semantics: a key named twice counts once; a row that names no key outputs zeros), the bounds and
  the model's per-head sinks (``s_aux``) as ``softmax_offset``.

Nothing here is S x S: the indexer's scores exist one chunk of queries at a time, the attention
gathers K keys per query.
"""

from __future__ import annotations

import functools
import inspect

import torch

from coreattn.layers.dsa.indexer import indexer_topk
from coreattn.layers.dsa.sparse_attn import sparse_padded_attn


class SparseMask:
    """The attention mask coreattn builds for a DSA model: query token (b, s) sees the key positions
    ``lo[b, s] <= j < hi[b, s]`` (int32 ``[B, S]``; ``lo == hi``: a padded query, which sees
    nothing); ``keep``: the ``[B, kv_length]`` bool padding mask over the keys (None: none given),
    for the model's layers without an indexer. ``backend``: the coreattn backend pinned by
    ``register(backend=...)`` for the sparse attention and the indexer (None: per device; a
    dense-only pin such as npu_fused becomes None)."""

    __slots__ = ("lo", "hi", "backend", "keep")

    def __init__(self, lo: torch.Tensor, hi: torch.Tensor, backend=None, keep: torch.Tensor | None = None):
        self.lo, self.hi, self.backend, self.keep = lo, hi, backend, keep

    def __getitem__(self, item):
        # the models hand their indexer attention_mask[:, 0, :, :]: the same bounds serve it
        return self

    def __repr__(self) -> str:
        return f"SparseMask(batch={self.lo.shape[0]}, queries={self.lo.shape[1]}, backend={self.backend!r})"


class IndexRows:
    """The attention mask of a layer that selects its keys itself (GLM-5.3-Flash): ``indices``
    ``[B, S, W]`` key positions per query (-1 unused; only keys the query may see), ``backend``
    the coreattn backend pinned by ``register(backend=...)``."""

    __slots__ = ("indices", "backend")

    def __init__(self, indices: torch.Tensor, backend=None):
        self.indices, self.backend = indices, backend

    def __repr__(self) -> str:
        return f"IndexRows(shape={tuple(self.indices.shape)}, backend={self.backend!r})"


def key_bounds(batch: int, q_length: int, kv_length: int, q_offset, kv_offset, causal: bool,
               keep: torch.Tensor | None, sequence_ids: torch.Tensor | None,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) int32 ``[B, q_length]``: the key positions each query sees, as transformers' masks
    define them: query s is at position ``q_offset + s``, key j at ``kv_offset + j`` (a cache's
    offsets); causal keeps keys at or before the query; ``keep`` ``[B, kv_length]`` (a contiguous
    run of kept keys per row: left or right padding) bounds the keys and empties the rows of padded
    queries; ``sequence_ids`` ``[B, S]`` (packed sequences, no cache) keeps each query's own sequence."""
    s = torch.arange(q_length, device=device, dtype=torch.int64)
    column = (q_offset + s - kv_offset).to(torch.int64)[None, :].expand(batch, q_length)  # the query among the keys
    lo = torch.zeros(batch, q_length, dtype=torch.int64, device=device)
    hi = (column + 1).clamp(0, kv_length) if causal else torch.full_like(lo, kv_length)
    if sequence_ids is not None:
        ids = sequence_ids.to(device=device).expand(batch, -1)
        start = torch.ones_like(ids, dtype=torch.bool)
        start[:, 1:] = ids[:, 1:] != ids[:, :-1]
        lo = torch.cummax(torch.where(start, s, 0), dim=1).values
        if not causal:
            end = torch.ones_like(start)
            end[:, :-1] = start[:, 1:]
            last = torch.where(end, s, q_length - 1).flip(1).cummin(1).values.flip(1)
            hi = torch.minimum(hi, last + 1)
    if keep is not None:
        kept = keep.to(torch.int64)
        count = kept.sum(1, keepdim=True)
        first = torch.where(count > 0, kept.argmax(1, keepdim=True), 0)
        lo = torch.maximum(lo, first)
        hi = torch.minimum(hi, first + count)
        inside = (column >= 0) & (column < kv_length)
        query_kept = keep.gather(1, column.clamp(0, max(kv_length - 1, 0))) & inside
        hi = torch.where(query_kept, hi, lo)
    hi = torch.maximum(hi, lo)
    return lo.to(torch.int32), hi.to(torch.int32)


def has_holes(keep: torch.Tensor) -> torch.Tensor:
    """0-dim bool: some row of the ``[B, S]`` keep mask has more than one run of kept tokens."""
    runs = keep[:, 0].to(torch.int64) + (keep[:, 1:] & ~keep[:, :-1]).sum(1)
    return (runs > 1).any()


def sparse_attention(query, key, value, indices, scaling, dropout: float, s_aux=None, mask: SparseMask | None = None,
                     backend=None):
    """The attention of a DSA layer, ``[B, S, Hq, Dv]``, through ``coreattn.sparse_padded_attn``: q/k/v
    as the model passes them (``[B, H, S, D]``), ``indices`` ``[B, S, K]`` key positions (-1 unused),
    within ``mask``'s bounds (None: the indices hold only visible keys), ``s_aux`` per-head sinks."""
    if indices is None:
        raise ValueError("coreattn's DSA mask needs the indexer's top-k (indices=[batch, seq, topk]); the attention "
                         "layer passed none")
    if dropout:
        raise NotImplementedError(f"attention dropout ({dropout}) is not supported by coreattn's DSA sparse attention; "
                                  "set config.attention_dropout=0.0 or use attn_implementation='eager'")
    if not isinstance(indices, torch.Tensor) or indices.dim() != 3:
        raise ValueError(f"indices must be the indexer's [batch, seq, topk] tensor, got "
                         f"{tuple(indices.shape) if isinstance(indices, torch.Tensor) else type(indices).__name__}")
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, S, H, D] views
    bounds = None if mask is None else (mask.lo, mask.hi)
    return sparse_padded_attn(q, k, v, indices, layout="bshd", key_bounds=bounds, causal=False, softmax_scale=scaling,
                              softmax_offset=s_aux, backend=mask.backend if mask is not None else backend)


def head_weights(indexer, hidden_states: torch.Tensor) -> torch.Tensor:
    """The indexer's head weights ``[B, S, H]`` float32 as transformers' DSA indexers compute them
    (``weights_proj`` in its weight's dtype, times ``n_heads ** -0.5``), with the softmax scale
    folded in: ``relu(scale * x) = scale * relu(x)`` for the positive scale."""
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
    return weights * (indexer.n_heads ** -0.5 * indexer.softmax_scale)


def score_topk(indexer, q: torch.Tensor, k: torch.Tensor, hidden_states: torch.Tensor, mask: SparseMask,
               cache) -> torch.Tensor:
    """The DSA indexer's top-k ``[B, S, K]`` int32 (K = min(index_topk, keys), -1 unused) of q
    ``[B, S, H, D]`` against k ``[B, S, D]`` (appended to the layer's indexer cache first), scored
    by ``coreattn.indexer_topk`` within the mask's bounds."""
    if cache is not None:
        k = cache.update_indexer(k, indexer.layer_idx)  # [B, T, D]
    return indexer_topk(q, k, head_weights(indexer, hidden_states), indexer.index_topk, layout="bshd",
                        key_bounds=(mask.lo, mask.hi), index_dtype=torch.int32, backend=mask.backend).indices


def wrap_indexer(project):
    """The wrapper of a DSA indexer's ``forward`` (for ``sources.wrap_method``): handed a
    ``SparseMask``, ``project(indexer, arguments)`` (the forward's arguments by name) gives q
    ``[B, S, H, D]`` and k ``[B, S, D]`` as the model computes them and ``score_topk`` selects;
    handed anything else, transformers' forward runs."""
    def wrap(forward):
        signature = inspect.signature(forward)

        @functools.wraps(forward)
        def indexer_forward(self, *args, **kwargs):
            original = indexer_forward.coreattn_wrapped
            if "past_key_values" in kwargs and "cache" not in kwargs:  # transformers' deprecated name
                kwargs["cache"] = kwargs.pop("past_key_values")
            try:
                call = signature.bind(self, *args, **kwargs)
            except TypeError:
                return original(self, *args, **kwargs)  # raises as transformers' forward does
            call.apply_defaults()
            arguments = call.arguments
            mask = arguments["attention_mask"]
            if not isinstance(mask, SparseMask):
                return original(self, *args, **kwargs)
            with torch.no_grad():
                q, k = project(self, arguments)
                return score_topk(self, q, k, arguments["hidden_states"], mask, arguments.get("cache"))

        return indexer_forward

    return wrap


def attention_backend(config) -> tuple[bool, object]:
    """(True, its backend pin) when ``config``'s attention implementation is one ``register()``
    added, else (False, None)."""
    from transformers import AttentionInterface

    function = AttentionInterface().get(getattr(config, "_attn_implementation", None) or "")
    if function is None or not hasattr(function, "coreattn_backend"):
        return False, None
    return True, function.coreattn_backend


def install_indexers(indexers: dict) -> list[str]:
    """Wrap the indexer classes ``{model_type: (module name, class name, project)}`` that this
    transformers ships with ``wrap_indexer(project)`` (idempotent); returns their model types."""
    import importlib

    from coreattn.adapters.transformers.sources import wrap_method

    installed = []
    for model_type, (module_name, class_name, project) in indexers.items():
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue  # a transformers without this model
        wrap_method(cls, "forward", wrap_indexer(project))
        installed.append(model_type)
    return installed
