"""GLM-5.3-Flash (``glm5_next``; its text model ``glm5_next_text``, ``Glm5NextForConditionalGeneration``)
under "coreattn".

Its NoPE ``indexed_attention`` layers (between linear-attention layers) run a pooled indexer and
build their own mask: the indexer pools every ``index_kpool`` keys, from the row's first real token,
into one key (a per-channel softmax-gated mean), scores the pools with the DSA formula, keeps the
``index_topk / index_kpool`` best pools whose last token the query sees, expands them back to token
positions and appends the query's incomplete tail pool (``[B, S, index_topk + index_kpool - 1]``
rows, -1 unused); the layer then scatters the rows into a ``[B, 1, S, T]`` mask for the attention
call. The model never calls a mask builder (its ``[B, S]`` padding mask reaches the layers as is).

Wrapped, each running transformers' code unless the model's attention implementation is one
``register()`` added:

- ``Glm5NextTextIndexer.forward``: the model's projections, ``k_norm``, gate and pooling (as
  ``get_pooled_states`` computes them, without dropping pools no row uses: the same selection),
  the pools scored by ``coreattn.indexer_topk`` with key bounds in pool space (the pools complete
  and visible to the query: a pool counts once its last token is visible), the chosen pools and the
  tail expanded to the same index rows as transformers' (``append_visible_tail``'s tail), in
  O(S x rows) memory: no ``[B, S, T]`` visibility or ``[B, S, pools]`` score tensor. Pools that hold
  a padded token never count, padding with holes included, as in transformers'.
- ``Glm5NextTextAttention.build_attention_mask_from_topk``: returns ``dsa.IndexRows`` (the rows)
  instead of the ``[B, 1, S, T]`` mask; the attention function runs ``dsa.sparse_attention`` on them
  (a key named twice counts once, as in the mask). Shared layers (``indexer_types="shared"``) pass
  the previous layer's rows the same way.

The layers pass ``input_ids`` (and ``position_ids``) to the attention function: it accepts them
with ``IndexRows`` only, where the rows already hold every key a query attends to.

Refused (``NotImplementedError``): ``index_kpool_always_select_tail=False`` with pools of more than
one token: a query with no complete visible pool then selects no key, and transformers' mask row is
all masked, which eager turns into attention to every key of the row (later ones included) and
coreattn's sparse attention into zeros. Written against transformers 5.25.0 (the same sources as
5.24.0): the hashes below; another source makes the layers refuse.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from coreattn.adapters.transformers import dsa, sources
from coreattn.layers.dsa.indexer import indexer_topk

NAME = "GLM-5.3-Flash"
MODULE = "transformers.models.glm5_next.modeling_glm5_next"
MODEL_TYPES = ("glm5_next_text",)
KNOWN_SOURCES = {
    "Glm5NextTextIndexer.forward": "66575baacb826ee20f2f25beaa1a54fe208250f7fa6ddb9aa3dacc9cf109cd3e",
    "Glm5NextTextIndexer.get_visible_tokens": "2d358ffd8853f0e748603a7af430fd155bddf0b99d80a22fbfa9aa040e557539",
    "Glm5NextTextIndexer.get_pooled_states": "8a0258cf96aac4cbf0694241c2878d54345f40e72cd0c08880886f5b4f5862b5",
    "Glm5NextTextIndexer.append_visible_tail": "ec91f9f01889665f73ec3515ae64330c2e8086bcc0b3bb50536c1b20b3f7ee5a",
    "Glm5NextTextAttention.build_attention_mask_from_topk":
        "ec33b58c76890c6dacfda983391901fcb80e25ed9e6b437ed33cbb069496c897",
}


@functools.lru_cache(maxsize=None)
def check_source(model_type: str) -> str | None:
    return sources.check_sources(MODULE, KNOWN_SOURCES, NAME)


def _refuse_unserved(config) -> None:
    reason = check_source(config.model_type)
    if reason is None and not config.index_kpool_always_select_tail and config.index_kpool > 1:
        reason = ("index_kpool_always_select_tail=False: a query with no complete visible pool selects no key, which "
                  "eager attends as every key of the row and coreattn's sparse attention as zeros")
    if reason:
        raise NotImplementedError(f"coreattn cannot run {NAME}'s pooled sparse attention ({config.model_type}): "
                                  f"{reason}; use attn_implementation='eager' or 'sdpa' for this model")


def _pools(indexer, keys, gates, valid):
    """Pooled keys ``[B, P, D]`` (P = ceil(T / index_kpool)), each pool's first token ``[B]`` and
    whether it is complete ``[B, P]``, as ``get_pooled_states`` builds them."""
    batch, total, _ = keys.shape
    size = indexer.index_kpool
    n_pools = (total + size - 1) // size
    device = keys.device
    first = torch.where(valid.any(-1), valid.long().argmax(-1), torch.full((batch,), total, device=device))  # [B]
    tokens = first[:, None, None] + torch.arange(n_pools * size, device=device).view(1, n_pools, size)
    safe = tokens.clamp(0, total - 1)  # [B, P, size]
    rows = torch.arange(batch, device=device)[:, None, None]
    in_pool = valid[rows, safe] & (tokens < total)
    logits = gates[rows, safe].float() + indexer.index_kpool_compress_ape.float()[None, None]
    logits = logits.masked_fill(~in_pool[..., None], float("-inf"))
    weights = torch.nan_to_num(logits.softmax(dim=2)).to(keys.dtype)  # an empty pool: zeros
    return (weights * keys[rows, safe]).sum(dim=2), first, in_pool.all(-1)


def _compact(pool_keys, complete):
    """The complete pools first, in order: their keys ``[B, P, D]`` (zeros after them) and pool ids
    ``[B, P]`` (-1 after them); the complete pools before each pool's id ``[B, P + 1]``."""
    batch, n_pools, dim = pool_keys.shape
    before = torch.cat([complete.new_zeros(batch, 1, dtype=torch.long), complete.long().cumsum(-1)], dim=1)
    slot = torch.where(complete, before[:, :-1], n_pools)  # incomplete pools to a slot dropped below
    keys = pool_keys.new_zeros(batch, n_pools + 1, dim).scatter_(1, slot[..., None].expand(-1, -1, dim), pool_keys)
    ids = torch.arange(n_pools, device=pool_keys.device).expand(batch, -1)
    pool_ids = torch.full((batch, n_pools + 1), -1, dtype=torch.long, device=pool_keys.device).scatter_(1, slot, ids)
    return keys[:, :n_pools], pool_ids[:, :n_pools], before


def _tail(indexer, first, seen, positions, valid):
    """``append_visible_tail``'s rows ``[B, S, index_kpool - 1]``: the tokens of the query's incomplete
    pool (``seen`` ``[B, S]``: the real tokens it sees; ``positions`` ``[S]``: its key position)."""
    size, total = indexer.index_kpool, valid.shape[1]
    count = seen.remainder(size)
    offsets = torch.arange(size - 1, device=valid.device)
    tail = (first[:, None] + seen - count)[..., None] + offsets  # [B, S, size - 1]
    safe = tail.clamp(0, total - 1)
    visible = (safe <= positions[None, :, None]) & valid.gather(1, safe.flatten(1)).view_as(safe)
    return tail.masked_fill(~((offsets < count[..., None]) & (tail < total) & visible), -1)


def _index_rows(indexer, hidden_states, q_resid, attention_mask, cache, backend) -> torch.Tensor:
    """``Glm5NextTextIndexer.forward``'s rows ``[B, S, W]`` int32 without S x T tensors."""
    batch, seqlen = hidden_states.shape[:2]
    dim, size = indexer.head_dim, indexer.index_kpool
    q = indexer.wq_b(q_resid).view(batch, seqlen, -1, dim)  # [B, S, H, D]
    k = indexer.k_norm(indexer.wk(hidden_states)).view(batch, seqlen, -1, dim).squeeze(2)  # [B, S, D]
    gates = F.linear(hidden_states, indexer.index_kpool_compress_gate)
    packed = torch.cat([k, gates, attention_mask.to(k.dtype)[..., None]], dim=-1)  # the cache's layout
    current = seqlen
    if cache is not None:
        packed = cache.update_indexer(packed, indexer.layer_idx)
        current = cache.layers[indexer.layer_idx].get_seq_length()
    keys, gates, valid = torch.split(packed, [dim, dim, 1], dim=-1)
    valid = valid.squeeze(-1).bool()  # [B, T]
    total = keys.shape[1]
    pool_keys, first, complete = _pools(indexer, keys, gates, valid)
    compact, pool_ids, before = _compact(pool_keys, complete)
    positions = current - seqlen + torch.arange(seqlen, device=keys.device)  # [S]: each query's key position
    seen = torch.cat([valid.new_zeros(batch, 1, dtype=torch.long), valid.long().cumsum(-1)], dim=1)
    seen = seen.gather(1, (positions + 1).clamp(0, total)[None].expand(batch, -1))  # [B, S] real keys seen
    # pools whose last token the query sees: ids below (position - first + 1) // size
    reached = torch.div(positions[None] - first[:, None] + 1, size, rounding_mode="floor").clamp(0, pool_ids.shape[1])
    hi = torch.where(attention_mask, before.gather(1, reached), 0)  # [B, S] complete visible pools
    chosen = indexer_topk(q, compact, dsa.head_weights(indexer, hidden_states), indexer.index_topk // size,
                          layout="bshd", key_bounds=(torch.zeros_like(hi), hi), index_dtype=torch.int32,
                          backend=backend).indices  # [B, S, K] compact pool ranks, -1 unused
    pool = torch.where(chosen >= 0, pool_ids.gather(1, chosen.clamp(min=0).flatten(1).long()).view_as(chosen), -1)
    tail = indexer.index_kpool_always_select_tail and size > 1
    # the rows: K chosen pools of `size` tokens, then the tail; -1 elsewhere (transformers' rows hold the same
    # keys, the tail right after the pools: a set, as the mask it scatters them into)
    rows = torch.full((batch, seqlen, indexer.index_topk + (size - 1 if tail else 0)), -1, dtype=torch.int32,
                      device=keys.device)
    tokens = (first[:, None, None].to(torch.int32) + pool.to(torch.int32) * size)[..., None]
    tokens = tokens + torch.arange(size, dtype=torch.int32, device=keys.device)  # [B, S, K, size]
    rows[..., :chosen.shape[-1] * size] = tokens.masked_fill_(pool[..., None] < 0, -1).flatten(-2)
    if tail:
        rows[..., indexer.index_topk:] = _tail(indexer, first, seen, positions, valid)
    return rows.masked_fill_(~attention_mask[..., None], -1)


def _wrap_indexer(forward):
    signature = inspect.signature(forward)

    @functools.wraps(forward)
    def indexer_forward(self, *args, **kwargs):
        served, backend = dsa.attention_backend(self.config)
        if not served:
            return indexer_forward.coreattn_wrapped(self, *args, **kwargs)
        _refuse_unserved(self.config)
        if "past_key_values" in kwargs and "cache" not in kwargs:  # transformers' deprecated name
            kwargs["cache"] = kwargs.pop("past_key_values")
        a = signature.bind(self, *args, **kwargs).arguments
        with torch.no_grad():
            return _index_rows(self, a["hidden_states"], a["q_resid"], a["attention_mask"], a.get("cache"), backend)

    return indexer_forward


def _wrap_mask(build):
    @functools.wraps(build)
    def build_attention_mask_from_topk(self, topk_indices, query_states, kv_length):
        served, backend = dsa.attention_backend(self.config)
        if not served:
            return build_attention_mask_from_topk.coreattn_wrapped(self, topk_indices, query_states, kv_length)
        _refuse_unserved(self.config)
        return dsa.IndexRows(topk_indices, backend)

    return build_attention_mask_from_topk


def install() -> list[str]:
    """Wrap GLM-5.3-Flash's indexer and mask construction (idempotent); [] without the model."""
    import importlib

    try:
        module = importlib.import_module(MODULE)
    except ImportError:
        return []
    sources.wrap_method(module.Glm5NextTextIndexer, "forward", _wrap_indexer)
    sources.wrap_method(module.Glm5NextTextAttention, "build_attention_mask_from_topk", _wrap_mask)
    return list(MODEL_TYPES)
