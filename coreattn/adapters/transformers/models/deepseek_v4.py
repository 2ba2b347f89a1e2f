"""DeepSeek-V4's hybrid attention (``deepseek_v4``, ``DeepseekV4ForCausalLM``) under "coreattn".

Every V4 layer attends, in one softmax with a learnable per-head sink, to a sliding window of its
raw tokens and (CSA / HCA layers) to compressed KV entries the layer's compressor appends to the
shared K = V: on CSA layers the top-k of them its lightning indexer picks, on HCA layers every entry
whose window is complete (entry w for query t iff ``w < (t + 1) // rate``). transformers builds
that as a dense mask extended by a ``[B, 1, S, C]`` ``block_bias`` (and scores the CSA indexer as
``[B, S, C]``). Under coreattn:

- the mask builder hands V4 models a ``HybridMask``: per query token its column among the raw keys
  and the raw keys' bounds (causality, left or right padding, a cache's offsets);
- ``register()`` wraps the V4 attention layer, its two compressors and the CSA indexer. Handed a
  ``HybridMask``, the layer's compressor computes the compressed entries as the model does
  (``_compress``: the same projections, gated pooling, overlap of CSA's two series, norm, RoPE and
  cache updates) but returns no ``block_bias``: the CSA indexer scores with
  ``coreattn.indexer_topk`` (ReLU, the head weights, the scale: the model's math, without a
  ``[B, S, C]`` tensor) within each query's complete entries, and the selection waits for the
  attention call in a context variable scoped to the layer's forward;
- the attention function (``hybrid_attention``) runs ``coreattn.sparse_padded_attn`` over the
  concatenated K = V (``v=None``, ``v_head_dim`` = the head dim) with each query's window and
  compressed entries as one index row (``[B, S, W + K]``: the window's W raw keys, then the CSA top-k
  or the HCA entries), ``causal=False`` (the rows hold only visible keys), the sinks as
  ``softmax_offset``.

Memory: the index rows, O(S x (W + K)) on CSA layers and O(S x (W + S / rate)) on HCA layers (rate
128: 256 entries per token at 16k tokens), never S x S. Handed anything else, the wrapped methods
run transformers' code unchanged.

Wraps ``DeepseekV4Attention.forward``, ``DeepseekV4CSACompressor.forward`` and
``DeepseekV4HCACompressor.forward``; ``_compress`` and the indexer path restate transformers' math
(of those and of ``DeepseekV4Indexer.forward`` / ``DeepseekV4IndexerScorer.forward``).
``check_source`` compares these methods' source with the hashes below (transformers 5.24.0 and
5.25.0: the same sources) and the mask builder refuses V4 otherwise (a changed compressor would
otherwise give silently different results).
"""

from __future__ import annotations

import contextvars
import functools
from typing import NamedTuple

import torch

from coreattn.adapters.transformers import sources
from coreattn.layers.dsa.indexer import indexer_topk
from coreattn.layers.dsa.sparse_attn import sparse_padded_attn

NAME = "DeepSeek-V4"
MODEL_TYPE = "deepseek_v4"
MODEL_TYPES = (MODEL_TYPE,)
MODULE = "transformers.models.deepseek_v4.modeling_deepseek_v4"
# sha256 of the source of the methods whose math this module restates or whose order it relies on
# (transformers 5.24.0 and 5.25.0); another source makes check_source refuse the V4 path
KNOWN_SOURCES = {
    "DeepseekV4Attention.forward": "7e61a222ad0603b76b2d97582fe04d0cf1a62c7f9383a5cb35ed86faeee06e8c",
    "DeepseekV4CSACompressor.forward": "3644b0ea966e20d264a990cde2e85ea85ede5d7d645373531de26a0f39864725",
    "DeepseekV4HCACompressor.forward": "3fb94114cb4ed4939912f3aca766e4f3a0c626dc52d776259c0106bbd199e21c",
    "DeepseekV4Indexer.forward": "428c5223ef907ac90784edf2b9f9a79552e53a24d055662937f631a96370f79b",
    "DeepseekV4IndexerScorer.forward": "7e1489dad5000d0243a37d6d2bb97a4ee1017d13a63a01d7b941c947dcd4b092",
}


class HybridMask:
    """The mask coreattn builds for DeepSeek-V4: query token (b, s) is the raw key column ``col[b, s]``
    and may see raw keys ``j >= lo[b, s]`` (its packed sequence's start; int32 ``[B, S]``) that ``keep``
    ``[B, R]`` keeps (the padding mask over the raw keys, or None). Padded queries are computed as
    transformers computes them (they see compressed entries): the compressors pool every token.
    ``backend``: the coreattn backend pinned by ``register(backend=...)``."""

    __slots__ = ("lo", "col", "keep", "backend")

    def __init__(self, lo: torch.Tensor, col: torch.Tensor, keep: torch.Tensor | None, backend=None):
        self.lo, self.col, self.keep, self.backend = lo, col, keep, backend

    def __repr__(self) -> str:
        return f"HybridMask(batch={self.lo.shape[0]}, queries={self.lo.shape[1]}, backend={self.backend!r})"


class Selection(NamedTuple):
    """A compressor's output for the attention call: ``entries`` compressed entries, and either the
    CSA indexer's top-k ``indices`` [B, S, K] (-1 unused) or, HCA, ``complete`` [B, S]: how many
    entries each query may see."""

    entries: int
    indices: torch.Tensor | None
    complete: torch.Tensor | None


class _Call:
    """What one V4 attention layer's forward under coreattn passes between its parts."""

    def __init__(self, position_ids: torch.Tensor, backend):
        self.position_ids = position_ids
        self.backend = backend
        self.selection: Selection | None = None


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("coreattn_deepseek_v4_call", default=None)


@functools.lru_cache(maxsize=None)
def check_source(model_type: str) -> str | None:
    """None if this transformers' V4 methods are the ones coreattn's V4 path was written against,
    else why not."""
    return sources.check_sources(MODULE, KNOWN_SOURCES, NAME)


def _positions(position_ids: torch.Tensor, batch: int) -> torch.Tensor:
    return position_ids.expand(batch, -1) if position_ids.shape[0] != batch else position_ids


def _compress(m, hidden_states: torch.Tensor, cache, layer_idx: int, name: str, overlap: bool,
              head_dim: int) -> torch.Tensor:
    """The compressed entries ``[B, C, head_dim]`` of compressor (or indexer) ``m``, all of them so far
    with a cache: every ``rate`` tokens pooled by their softmax-gated projections (CSA, ``overlap``:
    entry w pools the previous window's first series and its own second one), normalized, rotated at
    the window's first position; the cache keeps the windows not yet complete."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    batch = hidden_states.shape[0]
    rate = m.compress_rate
    layer = cache.layers[layer_idx] if cache is not None else None
    kv, gate = m.kv_proj(hidden_states), m.gate_proj(hidden_states)
    if layer is None:
        usable = kv.shape[1] // rate * rate
        kv, gate, first = kv[:, :usable], gate[:, :usable], 0
    else:
        kv, gate, first = layer.store_compression_weights(name, kv, gate)
    windows = kv.shape[1] // rate
    if windows == 0:
        pooled = kv.new_zeros((batch, 0, head_dim))
    else:
        kv = kv.view(batch, windows, rate, -1)
        gate = gate.view(batch, windows, rate, -1) + m.position_bias
        if overlap:  # [B, windows, 2 * rate, D]: the previous window's first series, then this one's second
            prev_kv = kv.new_zeros((batch, windows, rate, head_dim))
            prev_gate = gate.new_full((batch, windows, rate, head_dim), float("-inf"))
            prev_kv[:, 1:], prev_gate[:, 1:] = kv[:, :-1, :, :head_dim], gate[:, :-1, :, :head_dim]
            if layer is not None:
                carried_kv, carried_gate = layer.update_overlap_state(name, kv, gate, head_dim)
                if carried_kv is not None:
                    prev_kv[:, 0], prev_gate[:, 0] = carried_kv.to(kv.dtype), carried_gate.to(gate.dtype)
            kv = torch.cat([prev_kv, kv[..., head_dim:]], dim=2)
            gate = torch.cat([prev_gate, gate[..., head_dim:]], dim=2)
        pooled = m.kv_norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
        starts = (torch.arange(windows, device=pooled.device) * rate + first)[None].expand(batch, -1)
        cos, sin = m.rotary_emb(pooled, position_ids=starts, layer_type=m.rope_layer_type)
        pooled = apply_rotary_pos_emb(pooled.unsqueeze(1), cos, sin).squeeze(1)
    if layer is not None:
        pooled = layer.update_compressor_states(name, pooled)
    return pooled


def _indexer_topk(indexer, hidden_states, q_residual, position_ids, cache, layer_idx, backend) -> torch.Tensor:
    """The CSA indexer's top-k [B, S, K] over its compressed keys (-1 unused), by coreattn.indexer_topk."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    batch, seqlen, _ = hidden_states.shape
    keys = _compress(indexer, hidden_states, cache, layer_idx, "indexer", True, indexer.head_dim)  # [B, C, D]
    positions = _positions(position_ids, batch)
    cos, sin = indexer.rotary_emb(hidden_states, position_ids=positions, layer_type=indexer.rope_layer_type)
    q = indexer.q_b_proj(q_residual).view(batch, seqlen, -1, indexer.head_dim).transpose(1, 2)
    q = apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)  # [B, S, H, D]
    scorer = indexer.scorer
    # relu(x) * scale * w = relu(x) * (w * scale): the scale joins the head weights
    weights = scorer.weights_proj(hidden_states).float() * (scorer.weights_scaling * scorer.softmax_scale)
    complete = (positions + 1) // indexer.compress_rate  # [B, S]: the entries a query may see
    topk = min(indexer.index_topk, keys.shape[1])
    return indexer_topk(q, keys, weights, topk, layout="bshd", key_bounds=(torch.zeros_like(complete), complete),
                        backend=backend).indices


def _compressor_forward(forward, select):
    """A compressor's forward that, inside a coreattn call (``_CALL`` set), returns the model's compressed
    entries without a ``block_bias`` and leaves the queries' selection (``select``) on the call; outside
    one, transformers' own."""
    @functools.wraps(forward)
    def compressor_forward(self, hidden_states, q_residual, position_ids, cache, layer_idx):
        call = _CALL.get()
        if call is None:
            return compressor_forward.coreattn_wrapped(self, hidden_states, q_residual, position_ids, cache, layer_idx)
        entries, call.selection = select(self, call, hidden_states, q_residual, cache, layer_idx)
        return entries.unsqueeze(1), None

    return compressor_forward


def _csa_select(self, call, hidden_states, q_residual, cache, layer_idx):
    """CSA: the entries and the indexer's top-k of them per query."""
    entries = _compress(self, hidden_states, cache, layer_idx, "compressor", True, self.head_dim)
    indices = _indexer_topk(self.indexer, hidden_states, q_residual, call.position_ids, cache, layer_idx,
                            call.backend)
    return entries, Selection(entries.shape[1], indices, None)


def _hca_select(self, call, hidden_states, q_residual, cache, layer_idx):
    """HCA: the entries and how many of them each query sees (those complete before it)."""
    entries = _compress(self, hidden_states, cache, layer_idx, "compressor", False, self.head_dim)
    positions = _positions(call.position_ids, hidden_states.shape[0])
    complete = (positions + 1) // self.compress_rate
    if positions.shape[1] == 1:  # one query (decoding): transformers shows it every entry
        complete = torch.full_like(complete, entries.shape[1])
    return entries, Selection(entries.shape[1], None, complete)


def _attention_forward(forward):
    @functools.wraps(forward)
    def attention_forward(self, hidden_states, position_embeddings, position_ids, attention_mask, cache=None,
                          **kwargs):
        if not isinstance(attention_mask, HybridMask):
            return attention_forward.coreattn_wrapped(self, hidden_states, position_embeddings, position_ids,
                                                      attention_mask, cache, **kwargs)
        token = _CALL.set(_Call(position_ids, attention_mask.backend))
        try:
            return attention_forward.coreattn_wrapped(self, hidden_states, position_embeddings, position_ids,
                                                      attention_mask, cache, **kwargs)
        finally:
            _CALL.reset(token)

    return attention_forward


def install() -> list[str]:
    """Wrap DeepSeek-V4's attention layer and compressors (idempotent); [] without the model."""
    import importlib

    try:
        module = importlib.import_module(MODULE)
    except ImportError:
        return []
    sources.wrap_method(module.DeepseekV4Attention, "forward", _attention_forward)
    sources.wrap_method(module.DeepseekV4CSACompressor, "forward", lambda f: _compressor_forward(f, _csa_select))
    sources.wrap_method(module.DeepseekV4HCACompressor, "forward", lambda f: _compressor_forward(f, _hca_select))
    return list(MODEL_TYPES)


def hybrid_attention(query, key_value, mask: HybridMask, scaling, dropout: float, sliding_window, s_aux):
    """One V4 layer's attention ``[B, S, H, D]``: ``query`` [B, H, S, D], ``key_value`` [B, 1, R + C, D]
    (R raw keys, then the layer's C compressed entries)."""
    if dropout:
        raise NotImplementedError(f"attention dropout ({dropout}) is not supported by coreattn's DeepSeek-V4 path")
    call = _CALL.get()
    selection = call.selection if call is not None else None
    entries = 0 if selection is None else selection.entries
    raw = key_value.shape[2] - entries
    window = int(sliding_window)
    col = mask.col.to(torch.int64)
    raw_keys = col[..., None] - torch.arange(window - 1, -1, -1, device=col.device)  # [B, S, W]: col - W + 1 .. col
    visible = (raw_keys >= mask.lo.to(torch.int64)[..., None]) & (raw_keys >= 0) & (raw_keys < raw)
    if mask.keep is not None:  # the padding mask over the raw keys
        visible &= mask.keep.gather(1, raw_keys.clamp(0, raw - 1).flatten(1)).view_as(raw_keys)
    rows = [torch.where(visible, raw_keys, -1)]
    if selection is not None and selection.indices is not None:
        rows.append(torch.where(selection.indices >= 0, selection.indices + raw, -1))
    elif selection is not None and entries:
        w = torch.arange(entries, device=col.device)
        rows.append(torch.where(w < selection.complete[..., None], w + raw, -1))
    indices = torch.cat(rows, dim=-1)  # every entry visible: no bounds beyond the sample
    q = query.transpose(1, 2)  # [B, S, H, D]
    kv = key_value.transpose(1, 2)  # [B, R + C, 1, D]
    return sparse_padded_attn(q, kv, None, indices, layout="bshd", causal=False,
                              softmax_scale=scaling, v_head_dim=kv.shape[-1], softmax_offset=s_aux,
                              backend=mask.backend)
