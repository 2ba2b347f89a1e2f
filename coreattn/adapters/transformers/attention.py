"""coreattn's attention function for transformers (``AttentionInterface``) and the keyword arguments it takes.

Every keyword argument a model passes is in one of three tables: ``HONOURED`` (coreattn implements
it), ``IGNORED`` (it does not change the attention's result) and ``REJECTED`` (coreattn does not
implement it: ``NotImplementedError`` naming it whenever it is not None). Any other keyword argument
that is not None raises ``NotImplementedError`` too: an argument coreattn does not know may change
the result, and a silently different result is worse than an error. ``WITH_INDEX_ROWS`` holds the
arguments accepted only when the mask is coreattn's ``dsa.IndexRows`` (a layer that selected its
keys itself: the rows hold every key a query attends to, so the argument cannot change the result).
"""

from __future__ import annotations

import logging

import torch

from coreattn.adapters.transformers import dsa
from coreattn.adapters.transformers.models import PositionBias, deepseek_v4, inkling2, minimax_m3, t5
from coreattn.layers.bias import LowRankRelativeBias
from coreattn.layers.function import POSITION_IDS
from coreattn.layers.padded_attn import padded_attn
from coreattn.layers.varlen_attn import varlen_attn

logger = logging.getLogger("coreattn")
_warned: set[str] = set()
_USE_EAGER = "use attn_implementation='eager' or 'sdpa' for this model"

HONOURED = {
    "dropout": "attention dropout (coreattn's own RNG stream)",
    "scaling": "the softmax scale",
    "sliding_window": "a causal window of that many keys including the query (bidirectional: that many each side)",
    "is_causal": "causal or bidirectional attention",
    "s_aux": "per-head attention sinks (gpt-oss, Hy4, DeepSeek-V4), as a differentiable softmax_offset",
    "sinks": "per-token attention sinks [B, H, S, 1] (Inkling 2), as a differentiable softmax_offset",
    "position_bias": "Inkling 2's and the T5 family's relative position biases, as their factors (models/)",
    "cu_seq_lens_q": "packed sequences (with cu_seq_lens_k and max_length_q/k)",
    "cu_seq_lens_k": "packed sequences",
    "max_length_q": "packed sequences (bounds the argument checks only)",
    "max_length_k": "packed sequences (bounds the argument checks only)",
    "position_ids": "packed sequences where the ids do not go up by one",
    "indices": "a DSA indexer's top-k [B, S, K] (with coreattn's SparseMask: the DSA models of models/)",
    "block_indices": "MiniMax-M3's block selection [B, Hkv, S, blocks]: block-sparse attention",
    "output_attentions": "warns once: no attention weights are returned",
    "softcap": "raises unless None",
}
IGNORED = {
    "use_cache": "the cache is the model's",
    "cache_position": "the cache is the model's; the mask builder has the offsets",
    "output_router_logits": "MoE outputs",
    "output_hidden_states": "model outputs",
    "return_dict": "model outputs",
    "num_items_in_batch": "the loss's normalization",
    "seq_idx": "packed sequences come from position_ids or cu_seq_lens_q/k, as in transformers' flash path",
    "deterministic": "coreattn's forward and backward are deterministic",
}
WITH_INDEX_ROWS = {
    "input_ids": "the model's token ids (GLM-5.3-Flash's layers pass them on; the index rows stand for the mask)",
}
REJECTED = {
    "block_table": "paged attention (block_table)",
}


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def _model(module) -> str:
    config = getattr(module, "config", None)
    return getattr(config, "model_type", None) or type(module).__name__


def check_kwargs(module, softcap, kwargs, mask) -> None:
    """Raises ``NotImplementedError`` for what coreattn does not implement (with a ``dsa.SparseMask``
    ``indices`` is consumed; with ``dsa.IndexRows`` ``WITH_INDEX_ROWS`` is accepted)."""
    if softcap is not None:
        raise NotImplementedError(f"softcap={softcap} is not supported by coreattn ({_model(module)}); {_USE_EAGER}")
    for key, value in kwargs.items():
        if value is None or key in IGNORED or (key in WITH_INDEX_ROWS and isinstance(mask, dsa.IndexRows)):
            continue
        if key in REJECTED:
            raise NotImplementedError(f"{REJECTED[key]} is not supported by coreattn ({_model(module)}); {_USE_EAGER}")
        if key == "indices" and not isinstance(mask, dsa.SparseMask):
            from coreattn.adapters.transformers.models import SPARSE_MASK_TYPES

            raise NotImplementedError(f"indices (a sparse-attention top-k) passed without coreattn's DSA mask "
                                      f"({_model(module)}): coreattn serves DSA for {', '.join(SPARSE_MASK_TYPES)}; "
                                      f"{_USE_EAGER}")
        if key == "block_indices":  # consumed with coreattn's MiniMax-M3 mask (attention_forward)
            raise NotImplementedError(f"block_indices (block-sparse attention) passed without coreattn's MiniMax-M3 "
                                      f"mask ({_model(module)}): coreattn serves block-sparse attention for "
                                      f"{', '.join(minimax_m3.MODEL_TYPES)}; {_USE_EAGER}")
        if key not in HONOURED:
            raise NotImplementedError(f"coreattn does not implement the attention argument {key!r} "
                                      f"({_model(module)}; it may change the result); it takes "
                                      f"{', '.join(sorted(HONOURED))} and ignores {', '.join(sorted(IGNORED))}; "
                                      f"{_USE_EAGER}")
    if kwargs.get("output_attentions", False):
        _warn_once("output_attentions", "coreattn does not return attention weights (output_attentions=True): "
                                        "attn_weights is None")


def _window(sliding_window, causal: bool) -> tuple[int, int]:
    """transformers' sliding window: a causal query sees ``sliding_window`` keys including itself
    (flash path (sw - 1, sw - 1) with causal; masks ``kv > q - sw``); bidirectional, keys at most
    ``sliding_window`` away (its masks' ``abs(q - kv) <= sw``)."""
    if sliding_window is None:
        return (-1, -1)
    return (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)


def _keep_mask(mask: torch.Tensor, length: int, what: str) -> torch.Tensor:
    if mask.shape[-1] < length:
        raise ValueError(f"the attention mask has {mask.shape[-1]} columns, fewer than the {length} {what} (entries "
                         "appended to K/V after the mask was built are not supported)")
    return mask[:, mask.shape[-1] - length:]


def _packed_varlen(q, k, v, batch: int, kwargs, opts):
    """cu_seq_lens_q/k (flash attention's packed-sequence kwargs): q/k/v flattened to [T, H, D]."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None or cu_k is None:
        raise ValueError("packed sequences need both cu_seq_lens_q and cu_seq_lens_k")
    qf, kf, vf = (x.reshape(-1, *x.shape[-2:]) for x in (q, k, v))
    # max_length_* only bound the argument checks (the kernels size their grids by the token
    # count): ints and 0-dim tensors go to varlen_attn, which never reads a tensor; anything else
    # (None) becomes the token count
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    max_q = max_q if isinstance(max_q, (int, torch.SymInt, torch.Tensor)) else qf.shape[0]
    max_k = max_k if isinstance(max_k, (int, torch.SymInt, torch.Tensor)) else kf.shape[0]
    out = varlen_attn(qf, kf, vf, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, **_packed_opts(opts))
    return out.view(batch, -1, *out.shape[-2:])


def _packed_opts(opts: dict) -> dict:
    """The options of a padded [B, S] call for its packed [B * S] tokens: per-token sinks [B, H, S] ->
    [B * S, H], a low-rank bias's states [B, S, H, R] -> [B * S, H, R]."""
    offset, bias = opts.get("softmax_offset"), opts.get("bias")
    if offset is not None and offset.dim() == 3:
        offset = offset.transpose(1, 2).reshape(-1, offset.shape[1])
    if isinstance(bias, LowRankRelativeBias):
        bias = bias._replace(states=bias.states.reshape(-1, *bias.states.shape[2:]))
    return dict(opts, softmax_offset=offset, bias=bias)


def _packed_position_ids(q, k, v, position_ids: torch.Tensor, opts):
    """Sequences from position_ids (coreattn::attn_fwd's thd_position_ids layout)."""
    from coreattn.kernels.packing import Packing
    from coreattn.layers.bias import check_bias
    from coreattn.layers.checks import check_options, check_qkv, check_softmax_offset
    from coreattn.layers.dispatch import run_attention

    batch, seqlen = q.shape[:2]
    rows = position_ids.shape[0] if position_ids.dim() == 2 else 1
    if position_ids.shape[-1] != seqlen or rows not in (1, batch):
        raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} do not match the query's "
                         f"[{batch}, {seqlen}] tokens")
    qf, kf, vf = (x.reshape(-1, *x.shape[-2:]) for x in (q, k, v))
    check_qkv(qf, kf, vf, "thd")
    params = check_options(qf.shape[-1], opts["dropout_p"], opts["softmax_scale"], opts["causal"],
                           opts["window_size"], "bottom_right")
    pack = Packing(POSITION_IDS, position_ids)
    tokens = qf.shape[0]
    opts = _packed_opts(opts)
    out, _, _ = run_attention(qf, kf, vf, pack, pack, tokens, tokens, params, True, opts["backend"],
                              softmax_offset=check_softmax_offset(opts["softmax_offset"], qf),
                              bias=check_bias(opts["bias"], qf))
    return out.view(batch, seqlen, *out.shape[-2:])


def _position_bias(module, position_bias) -> tuple[object, bool]:
    """(the bias coreattn computes, or None; whether the call is a T5 cross-attention) from a model's
    ``position_bias``: a wrapped bias module's factors (models/), or the T5 family's all-zeros
    cross-attention bias (dropped). Any other, a materialized [B, H, S, T] tensor, raises."""
    if position_bias is None:
        return None, False
    if isinstance(position_bias, PositionBias):
        return position_bias.bias, False
    if t5.zero_bias(module, position_bias):
        return None, True
    raise NotImplementedError(f"position_bias as a materialized tensor ({_model(module)}) is not supported by "
                              f"coreattn: it computes the biases of {', '.join(tuple(inkling2.MODELS) + t5.MODEL_TYPES)} "
                              f"from their factors, never an [S, T] tensor; {_USE_EAGER}")


def _check_mask(module, attention_mask) -> None:
    if attention_mask is None or isinstance(attention_mask, (dsa.SparseMask, dsa.IndexRows, deepseek_v4.HybridMask,
                                                             minimax_m3.BlockMask)):
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"coreattn takes a [batch, seq] padding mask, got a {type(attention_mask).__name__} "
                         f"({_model(module)}: a mask built for another attention implementation?)")
    if attention_mask.dim() != 2:
        raise ValueError(f"coreattn takes a [batch, seq] padding mask, got a {attention_mask.dim()}D mask of shape "
                         f"{tuple(attention_mask.shape)} ({_model(module)}): custom 4D masks are not supported; "
                         f"{_USE_EAGER}")


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                      s_aux: torch.Tensor | None = None, backend=None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' AttentionInterface signature (see coreattn/adapters/transformers/__init__.py).
    ``backend``: a coreattn backend override (``register(backend=...)``); None follows the per-device
    default. Returns ``(attn_output [B, Sq, Hq, Dv], None)``."""
    if inkling2.is_residual(module):  # head dim = the hidden size over a few block states: a small torch path
        return inkling2.block_residual(module, query, key, value, attention_mask, scaling, dropout), None
    if isinstance(attention_mask, minimax_m3.BlockMask):
        block_indices = kwargs.pop("block_indices", None)
        if block_indices is None and attention_mask.dense is minimax_m3.BOUNDS:  # dense layers, a static cache
            check_kwargs(module, softcap, kwargs, attention_mask)
            return minimax_m3.dense_attention(module, query, key, value, attention_mask, scaling, dropout), None
        if block_indices is None:  # MiniMax-M3's dense layers: the padding mask, as any model's
            return attention_forward(module, query, key, value, attention_mask.dense, dropout, scaling, sliding_window,
                                     softcap, is_causal, s_aux, backend, **kwargs)
        check_kwargs(module, softcap, kwargs, attention_mask)
        for name, value_ in (("sliding_window", sliding_window), ("s_aux", s_aux)):
            if value_ is not None:
                raise NotImplementedError(f"{name} with block-sparse attention is not supported by coreattn "
                                          f"({_model(module)}); {_USE_EAGER}")
        out = minimax_m3.block_sparse_attention(module, query, key, value, attention_mask, block_indices, scaling,
                                                dropout)
        return out, None
    check_kwargs(module, softcap, kwargs, attention_mask)
    attention_mask = t5.padding_mask(module, attention_mask)
    bias, cross = _position_bias(module, kwargs.get("position_bias"))
    sinks = kwargs.get("sinks")
    if sinks is not None:
        if s_aux is not None:
            raise ValueError(f"both s_aux and sinks given ({_model(module)}): pass one set of sink logits")
        s_aux = sinks[..., 0] if sinks.dim() == 4 else sinks  # [B, H, S, 1] -> per token [B, H, S]
    _check_mask(module, attention_mask)
    if isinstance(attention_mask, deepseek_v4.HybridMask):
        out = deepseek_v4.hybrid_attention(query, key, attention_mask, scaling, dropout, sliding_window, s_aux)
        return out, None
    if (isinstance(attention_mask, dsa.SparseMask) and kwargs.get("indices") is None
            and getattr(module, "indexer", None) is None):
        attention_mask = attention_mask.keep  # a DSA model's layer without an indexer: dense attention
    elif isinstance(attention_mask, (dsa.SparseMask, dsa.IndexRows)):
        if sliding_window is not None:
            raise NotImplementedError(f"sliding_window with DSA sparse attention is not supported by coreattn "
                                      f"({_model(module)}); {_USE_EAGER}")
        if bias is not None:
            raise NotImplementedError(f"position_bias with DSA sparse attention is not supported by coreattn "
                                      f"({_model(module)}); {_USE_EAGER}")
        if isinstance(attention_mask, dsa.IndexRows):
            out = dsa.sparse_attention(query, key, value, attention_mask.indices, scaling, dropout, s_aux,
                                       backend=attention_mask.backend)
        else:
            out = dsa.sparse_attention(query, key, value, kwargs.get("indices"), scaling, dropout, s_aux,
                                       mask=attention_mask)
        return out, None
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    opts = dict(dropout_p=float(dropout), softmax_scale=scaling, causal=causal,
                window_size=_window(sliding_window, causal), softmax_offset=s_aux, backend=backend, bias=bias)
    # [B, S, H, D] views; copied where the head dim is strided (Inkling 2's float32 keys and values leave its
    # short convolution transposed), as the kernels read rows of unit stride
    q, k, v = (x.transpose(1, 2) if x.stride(-1) == 1 else x.transpose(1, 2).contiguous() for x in (query, key, value))
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    packed_kwargs = kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None
    if packed_kwargs:
        if attention_mask is not None:
            raise NotImplementedError("coreattn cannot combine a padding mask with packed sequences "
                                      "(cu_seq_lens_q/k); pass one or the other")
        out = _packed_varlen(q, k, v, batch, kwargs, opts)
    elif attention_mask is not None:
        keep = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
        # a cross-attention's mask is the encoder's padding: its queries (the decoder's) are not masked
        out = padded_attn(q, k, v, q_keep_mask=None if cross else _keep_mask(keep, seqlen_q, "queries"),
                          k_keep_mask=_keep_mask(keep, seqlen_k, "keys"), **opts)
    elif kwargs.get("position_ids") is not None and seqlen_q == seqlen_k:
        out = _packed_position_ids(q, k, v, kwargs["position_ids"], opts)
    else:
        out = padded_attn(q, k, v, **opts)
    return out, None
