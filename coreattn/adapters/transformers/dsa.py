"""DeepSeek Sparse Attention models of transformers (DeepSeek-V3.2, GLM-5) under "coreattn".

Their attention layer runs the lightning indexer itself (``attention_mask[:, 0, :, :]`` is its
``[B, S, T]`` mask) and passes the top-k to the attention function as ``indices=`` ``[B, S, K]``.
Under coreattn:

- the mask builder hands these models a ``SparseMask``: per query token the key positions
  ``[lo, hi)`` it may see (causality, left or right padding, packed sequences and a KV cache's
  offsets folded in; built on the device, ``[B, S]`` each), never a ``[B, 1, S, T]`` tensor;
- ``register()`` wraps the models' indexer classes: given a ``SparseMask``, the indexer keeps its
  own projections, norm and RoPE and scores with ``coreattn.indexer_topk`` (chunked, the same math:
  ``sum_h w_h * relu(scale * q_h . k)``, top-k among the visible keys, -1 where a row has fewer);
  given anything else it runs as transformers wrote it;
- the attention function runs ``coreattn.sparse_padded_attn`` on the bshd views with the indices and
  the mask's bounds (set semantics: a key named twice counts once; a padded query row outputs zeros).

Nothing on this path is S x S: the indexer's scores exist one chunk of queries at a time, the
attention gathers K keys per query.
"""

from __future__ import annotations

import functools
import sys

import torch

from coreattn.layers.dsa.indexer import indexer_topk
from coreattn.layers.dsa.sparse_attn import sparse_padded_attn

# model_type -> (the indexer's class in the model's module, the name of the RoPE function it applies)
INDEXERS = {
    "deepseek_v32": ("transformers.models.deepseek_v32.modeling_deepseek_v32", "DeepseekV32Indexer",
                     "apply_rotary_pos_emb"),  # half-split RoPE
    "glm_moe_dsa": ("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaIndexer",
                    "apply_rotary_pos_emb_interleave"),
}
SERVED = tuple(INDEXERS)


class SparseMask:
    """The attention mask coreattn builds for a DSA model: query token (b, s) sees the key positions
    ``lo[b, s] <= j < hi[b, s]`` (int32 ``[B, S]``; ``lo == hi``: a padded query, which sees
    nothing). ``backend``: the coreattn backend pinned by ``register(backend=...)`` for the sparse
    attention and the indexer (None: per device; a dense-only pin such as npu_fused becomes None)."""

    __slots__ = ("lo", "hi", "backend")

    def __init__(self, lo: torch.Tensor, hi: torch.Tensor, backend=None):
        self.lo, self.hi, self.backend = lo, hi, backend

    def __getitem__(self, item):
        # the models hand their indexer attention_mask[:, 0, :, :]: the same bounds serve it
        return self

    def __repr__(self) -> str:
        return f"SparseMask(batch={self.lo.shape[0]}, queries={self.lo.shape[1]}, backend={self.backend!r})"


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


def sparse_attention(query, key, value, mask: SparseMask, indices, scaling, dropout: float):
    """The attention of a DSA layer: ``[B, S, Hq, Dv]`` through ``coreattn.sparse_padded_attn``."""
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
    return sparse_padded_attn(q, k, v, indices, layout="bshd", key_bounds=(mask.lo, mask.hi), causal=False,
                              softmax_scale=scaling, backend=mask.backend)


def _indexer_topk(indexer, rope, hidden_states, q_resid, position_embeddings, mask: SparseMask, cache):
    """The DSA indexer's top-k ``[B, S, K]`` int32 with the model's own projections, norm and RoPE,
    scored by ``coreattn.indexer_topk`` within the mask's bounds."""
    batch, seqlen, _ = hidden_states.shape
    rope_dim, dim = indexer.qk_rope_head_dim, indexer.head_dim
    cos, sin = position_embeddings
    q = indexer.wq_b(q_resid).view(batch, seqlen, indexer.n_heads, dim)  # [B, S, H, D]
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)  # [B, S, 1, D]
    q_rot, k_rot = rope(q[..., :rope_dim], k[..., :rope_dim], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., rope_dim:]], dim=-1)
    k = torch.cat([k_rot, k[..., rope_dim:]], dim=-1).squeeze(2)  # [B, S, D]
    if cache is not None:
        k = cache.update_indexer(k, indexer.layer_idx)  # [B, T, D]
    # relu(scale * x) = scale * relu(x): the softmax scale joins the head weights
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
    weights = weights * (indexer.n_heads ** -0.5 * indexer.softmax_scale)  # [B, S, H]
    return indexer_topk(q, k, weights, indexer.index_topk, layout="bshd", key_bounds=(mask.lo, mask.hi),
                        index_dtype=torch.int32, backend=mask.backend).indices


def _wrap(forward, rope_name: str):
    @functools.wraps(forward)
    def indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None,
                        cache=None, **kwargs):
        if not isinstance(attention_mask, SparseMask):
            return indexer_forward.coreattn_wrapped(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids,
                           cache=cache, **kwargs)
        cache = kwargs.pop("past_key_values", cache)
        if kwargs:
            raise TypeError(f"{type(self).__name__}.forward got unexpected arguments {sorted(kwargs)}")
        rope = getattr(sys.modules[type(self).__module__], rope_name)
        with torch.no_grad():
            return _indexer_topk(self, rope, hidden_states, q_resid, position_embeddings, attention_mask, cache)

    indexer_forward.coreattn_wrapped = forward
    return indexer_forward


def install_indexers() -> list[str]:
    """Wrap the DSA indexers of the models this transformers ships (idempotent); returns their model types."""
    import importlib

    installed = []
    for model_type, (module_name, class_name, rope_name) in INDEXERS.items():
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue  # an older transformers without this model
        if not hasattr(cls.forward, "coreattn_wrapped"):
            cls.forward = _wrap(cls.forward, rope_name)
        installed.append(model_type)
    return installed
