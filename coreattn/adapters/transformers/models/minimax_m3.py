"""MiniMax-M3 (transformers' ``minimax_m3_vl``: ``MiniMaxM3VLForCausalLM`` and the VL model) under "coreattn".

Its sparse layers (``layer_types`` "minimax_m3_sparse") run a lightning indexer inside the attention
layer: per KV head, raw ``q . k`` scores max-pooled over blocks of ``index_block_size`` keys, the
query's own block (and ``index_local_blocks - 1`` before it) always kept, the top ``index_topk_blocks``
blocks passed to the attention function as ``block_indices=[B, index heads, S, topk]`` (-1 unused);
eager and SDPA expand them into a ``[B, H, S, T]`` mask (``build_block_mask``). Under coreattn:

- the mask builder hands these models a ``BlockMask``: per query token the key positions ``[lo, hi)``
  it may see (causality, left or right padding, a cache's offsets; built on the device, ``[B, S]``
  each) for the sparse layers, and the padding mask the dense layers take as any model's;
- ``install()`` (run by ``register()``) wraps ``MiniMaxM3VLIndexer.forward``: on a model whose
  attention implementation is coreattn's, the indexer keeps its own projections, norms, RoPE and
  cache update and scores with ``coreattn.indexer_topk``'s block mode (the same math: raw q . k,
  block max, the local blocks forced, ``key_hi = position + 1`` as the model's ``token_future``,
  per head), never the ``[B, H, S, T]`` scores; on any other it runs as transformers wrote it;
- the attention function runs ``coreattn.sparse_padded_attn(..., block_size=index_block_size)`` on
  the bshd views with the block indices (a kv head's row per index head) and the mask's bounds: each
  named block's keys read as contiguous rows, memory O(S x blocks), never a ``[B, H, S, T]`` mask.
  The vision tower's attention (bidirectional, no mask) takes coreattn's dense path.

Wrapped and restated (sha256 of their source, transformers 5.25.0, the same in 5.24.0):
``MiniMaxM3VLIndexer.forward`` (restated) and ``MiniMaxM3VLAttention.forward`` (its order: the indexer,
then the attention call with ``block_indices``; ``build_block_mask`` for eager and SDPA only).
``check_source`` refuses the model under a transformers whose methods differ.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import sys

import torch

from coreattn.layers.dsa.indexer import indexer_topk
from coreattn.layers.dsa.sparse_attn import sparse_padded_attn

MODEL_TYPES = ("minimax_m3_vl_text", "minimax_m3_vl")
MODULE = "transformers.models.minimax_m3_vl.modeling_minimax_m3_vl"
KNOWN_SOURCES = {
    "MiniMaxM3VLIndexer.forward": "83606351ef7f4edcb9d3ec56e0f9861f34fb85c1065dfb5ba95c013d24dfad8a",
    "MiniMaxM3VLAttention.forward": "513b464442143bf9550df42483eec40702c194362bff3685783a7833aca324c8",
}
# attn_implementation names registered by coreattn -> the sparse backend pin their indexer takes
_NAMES: dict[str, object] = {}
BOUNDS = "bounds"  # BlockMask.dense for a static cache: the dense layers take the bounds too (dense_attention)


class BlockMask:
    """The mask coreattn builds for MiniMax-M3: query token (b, s) of a sparse layer sees the key positions
    ``lo[b, s] <= j < hi[b, s]`` (int32 ``[B, S]``; ``lo == hi``: a padded query) of the blocks it names;
    the dense layers take ``dense``: the ``[B, kv_length]`` keep mask or None, as for any model, or
    ``BOUNDS`` under a static cache (whose unwritten slots the padding mask does not cover): every key of
    ``[lo, hi)``.
    ``backend``: the coreattn backend pinned by ``register(backend=...)`` for the sparse attention."""

    __slots__ = ("lo", "hi", "dense", "backend")

    def __init__(self, lo: torch.Tensor, hi: torch.Tensor, dense: torch.Tensor | None, backend=None):
        self.lo, self.hi, self.dense, self.backend = lo, hi, dense, backend

    def __repr__(self) -> str:
        return f"BlockMask(batch={self.lo.shape[0]}, queries={self.lo.shape[1]}, backend={self.backend!r})"


def _source_hash(cls, name: str) -> str:
    method = getattr(cls, name)
    return hashlib.sha256(inspect.getsource(getattr(method, "coreattn_wrapped", method)).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def check_source() -> str | None:
    """None if this transformers' MiniMax-M3 methods are the ones this module was written against, else why not."""
    import importlib

    module = importlib.import_module(MODULE)
    for qualname, want in KNOWN_SOURCES.items():
        cls_name, method = qualname.split(".")
        if _source_hash(getattr(module, cls_name), method) != want:
            return (f"{qualname} differs from the transformers release (5.25.0) coreattn's MiniMax-M3 path was "
                    "checked against")
    return None


def _heads_for(indices: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """(indices [B, S, Hkv', K], key, value) with one index row per kv head: an index head serving several
    kv heads is repeated (eager repeats it over their q heads); kv heads serving several index heads are
    repeated instead (each q head keeps its own index head, as eager's mask gives it)."""
    heads_idx, heads_kv = indices.shape[1], key.shape[1]
    rows = indices.permute(0, 2, 1, 3)  # [B, S, Hidx, K], a view
    if heads_idx == heads_kv:
        return rows, key, value
    if heads_kv % heads_idx == 0:
        return rows.repeat_interleave(heads_kv // heads_idx, dim=2), key, value
    if heads_idx % heads_kv == 0:
        rep = heads_idx // heads_kv
        return rows, key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    raise NotImplementedError(f"MiniMax-M3 with {heads_idx} index heads and {heads_kv} kv heads (neither divides the "
                              "other) is not supported by coreattn; use attn_implementation='eager' or 'sdpa'")


def block_sparse_attention(module, query, key, value, mask: BlockMask, block_indices, scaling, dropout: float):
    """A sparse layer's attention: ``[B, S, Hq, Dv]`` through ``coreattn.sparse_padded_attn`` in block mode."""
    if dropout:
        raise NotImplementedError(f"attention dropout ({dropout}) is not supported by coreattn's block-sparse "
                                  "attention; set config.attention_dropout=0.0 or use attn_implementation='eager'")
    if not isinstance(block_indices, torch.Tensor) or block_indices.dim() != 4:
        raise ValueError("block_indices must be the indexer's [batch, index heads, seq, topk] tensor, got "
                         f"{tuple(block_indices.shape) if isinstance(block_indices, torch.Tensor) else block_indices}")
    indices, key, value = _heads_for(block_indices, key, value)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, S, H, D] views
    return sparse_padded_attn(q, k, v, indices, layout="bshd", key_bounds=(mask.lo, mask.hi), causal=False,
                              softmax_scale=scaling, backend=mask.backend, block_size=module.indexer.block_size)


def dense_attention(module, query, key, value, mask: BlockMask, scaling, dropout: float):
    """A dense layer's attention within the mask's bounds (``dense`` is ``BOUNDS``): the sparse op's block
    mode with one block of every key per token, ``[B, S, Hq, Dv]``; memory O(S), never S x S."""
    if dropout:
        raise NotImplementedError(f"attention dropout ({dropout}) is not supported by coreattn under a static "
                                  "cache for MiniMax-M3; set config.attention_dropout=0.0")
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, S, H, D] views
    whole = torch.zeros(*q.shape[:2], 1, dtype=torch.int32, device=q.device)  # block 0 = keys [0, Sk)
    return sparse_padded_attn(q, k, v, whole, layout="bshd", key_bounds=(mask.lo, mask.hi), causal=False,
                              softmax_scale=scaling, backend=mask.backend, block_size=max(k.shape[1], 1))


def _indexer_blocks(indexer, rope, hidden_states, position_embeddings, cache, position_ids, backend):
    """``MiniMaxM3VLIndexer.forward``'s block indices ``[B, Hidx, S, K]`` with the model's own projections,
    norms, RoPE and cache, scored by ``coreattn.indexer_topk``'s block mode."""
    batch, q_len, _ = hidden_states.shape
    dim = indexer.head_dim
    q = indexer.q_norm(indexer.q_proj(hidden_states).view(batch, q_len, -1, dim))  # [B, S, Hidx, D]
    k = indexer.k_norm(indexer.k_proj(hidden_states).view(batch, q_len, 1, dim))  # [B, S, 1, D]
    cos, sin = position_embeddings
    q, k = rope(q, k, cos[..., :dim], sin[..., :dim], unsqueeze_dim=2)
    k = k.transpose(1, 2)  # [B, 1, S, D]: the cache's layout
    if cache is not None:
        k = cache.layers[indexer.layer_idx].update_index(k)  # [B, 1, T, D]
    k = k[:, 0]  # [B, T, D]
    # the model's token_future: key slot j is visible to a query at position p iff j <= p
    hi = (position_ids.to(torch.int64) + 1).clamp(0, k.shape[1]).expand(batch, q_len)
    lo = torch.zeros_like(hi)
    top = indexer_topk(q, k, None, indexer.topk_blocks, layout="bshd", key_bounds=(lo, hi), relu=False,
                       block_size=indexer.block_size, local_blocks=indexer.local_blocks, backend=backend)
    return top.indices.permute(0, 2, 1, 3)  # [B, Hidx, S, K], as the model's


def _wrap(forward):
    @functools.wraps(forward)
    def indexer_forward(self, hidden_states, position_embeddings, cache=None, position_ids=None, **kwargs):
        implementation = getattr(self.config, "_attn_implementation", None)
        cache = kwargs.pop("past_key_values", cache)
        if implementation not in _NAMES:
            return indexer_forward.coreattn_wrapped(self, hidden_states, position_embeddings, cache, position_ids,
                                                    **kwargs)
        if kwargs:
            raise TypeError(f"{type(self).__name__}.forward got unexpected arguments {sorted(kwargs)}")
        rope = getattr(sys.modules[type(self).__module__], "apply_rotary_pos_emb")
        with torch.no_grad():
            return _indexer_blocks(self, rope, hidden_states, position_embeddings, cache, position_ids,
                                   _NAMES[implementation])

    indexer_forward.coreattn_wrapped = forward
    return indexer_forward


def install(name: str, backend=None) -> bool:
    """Wrap MiniMax-M3's indexer (idempotent) and mark ``name`` as coreattn's implementation, its indexer
    pinned to ``backend``; False when this transformers has no MiniMax-M3."""
    import importlib

    try:
        cls = importlib.import_module(MODULE).MiniMaxM3VLIndexer
    except (ImportError, AttributeError):
        return False
    if not hasattr(cls.forward, "coreattn_wrapped"):
        cls.forward = _wrap(cls.forward)
    _NAMES[name] = backend
    return True
