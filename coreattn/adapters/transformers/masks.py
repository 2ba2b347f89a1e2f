"""coreattn's mask builder for transformers (``AttentionMaskInterface``), and what it refuses.

``padding_mask`` runs once per model forward (per layer type). It hands the attention function a
``[B, kv_length]`` bool keep mask, or None when nothing is padded; the DSA models whose attention
layers run their indexer on it (``models.SPARSE_MASK_TYPES``) get a ``dsa.SparseMask`` (their
sliding-window layers, dots3-note's, the keep mask), DeepSeek-V4 a ``deepseek_v4.HybridMask`` and
MiniMax-M3 a ``minimax_m3.BlockMask``.
It raises, naming the feature, for mask patterns coreattn cannot run and for models whose layers
change K/V or the mask after it was built (``unsupported_model``), among them a served model under a
transformers whose wrapped methods differ from those its module was written against.
"""

from __future__ import annotations

import torch

from coreattn.adapters.transformers import dsa, models
from coreattn.adapters.transformers.models import deepseek_v4, minimax_m3

_SUPPORTED_PARTS = {
    "sliding_window_overlay.<locals>.inner_mask": "sliding window",
    "sliding_window_bidirectional_overlay.<locals>.inner_mask": "sliding window",
    "packed_sequence_mask_function.<locals>.inner_mask": "packed sequences",
    "padding_mask_function.<locals>.inner_mask": "padding",
}
_UNSUPPORTED_PARTS = {
    "chunked_overlay.<locals>.inner_mask": "chunked attention (attention_chunk_size, Llama 4)",
    "blockwise_overlay.<locals>.inner_mask": "blockwise overlays (block_sequence_ids, e.g. bidirectional image tokens)",
    "or_masks.<locals>.or_mask": "or_mask_function overlays",
}
_SEQUENCE_IDS = "packed_sequence_mask_function.<locals>.inner_mask"
_WINDOWS = ("sliding_window_overlay.<locals>.inner_mask", "sliding_window_bidirectional_overlay.<locals>.inner_mask")
_USE_EAGER = "use attn_implementation='sdpa' or 'eager' for this model"


def _closure(fn) -> dict:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in (fn.__closure__ or ()))))


def _parts(fn) -> list:
    """The mask functions an and_masks / packed-sequence remap combines (transformers' combinators)."""
    name = getattr(fn, "__qualname__", repr(fn))
    if name == "and_masks.<locals>.and_mask":
        return [part for inner in _closure(fn).get("mask_functions", ()) for part in _parts(inner)]
    if name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        return _parts(_closure(fn)["mask_function"])
    return [fn]


def _unsupported_parts(fn) -> list[str]:
    """What of a transformers mask function coreattn cannot run (empty: causal or bidirectional,
    with sliding windows, padding and packing only)."""
    from transformers import masking_utils as mu

    found = []
    for part in _parts(fn):
        name = getattr(part, "__qualname__", repr(part))
        if part in (mu.causal_mask_function, mu.bidirectional_mask_function) or name in _SUPPORTED_PARTS:
            continue
        found.append(_UNSUPPORTED_PARTS.get(name, f"a custom mask function ({name})"))
    return found


def unsupported_model(config) -> str | None:
    """Why coreattn cannot run this model's attention (None: it can): a model coreattn serves by wrapping
    its methods under a transformers whose methods differ from those its module restates, and the
    sparse-attention models coreattn does not serve (any other config with ``index_topk``)."""
    if config is None:
        return None
    model_type = getattr(config, "model_type", "")
    family = models.family(model_type)
    if family is not None:
        reason = family.check_source(model_type)
        if reason is None:
            return None
        if family in (models.inkling2, models.t5):
            return f"{family.NAME}'s attention ({model_type}) with this transformers: {reason}"
        if family is deepseek_v4:
            return (f"DeepSeek-V4's hybrid attention with this transformers: {reason} (its compressed layers append "
                    "entries to K/V after the mask is built)")
        return f"{family.NAME}'s sparse attention ({model_type}) with this transformers: {reason}"
    if getattr(config, "index_topk", None) is not None:
        return (f"the sparse attention of {model_type!r} (its indexer is not one coreattn restates: the layer would "
                f"select keys on its own [B, S, T] scores); coreattn serves DSA for "
                f"{', '.join(models.SPARSE_MASK_TYPES + models.glm5_next.MODEL_TYPES)}")
    return None


def _bounds_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, config,
                 backend, device):
    """A ``dsa.SparseMask`` (DSA models) or a ``deepseek_v4.HybridMask`` (DeepSeek-V4, whose sliding
    window the attention call adds): per query the keys it sees as bounds, built on the device."""
    from transformers import masking_utils as mu

    parts = _parts(mask_function) if mask_function is not None else [mu.causal_mask_function]
    names = [getattr(p, "__qualname__", "") for p in parts]
    hybrid = config.model_type == deepseek_v4.MODEL_TYPE
    if any(name in _WINDOWS for name in names) and not hybrid:  # the DSA models' window layers never come here
        raise NotImplementedError(f"coreattn's sparse path has no sliding window ({config.model_type}); {_USE_EAGER}")
    sequence_ids = next((_closure(p)["packed_sequence_mask"] for p, n in zip(parts, names) if n == _SEQUENCE_IDS),
                        None)
    causal = mu.bidirectional_mask_function not in parts
    keep = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(f"coreattn expects a [batch, seq] padding mask, got shape {tuple(attention_mask.shape)}")
        keep = attention_mask[:, -kv_length:].to(torch.bool)
        # the DSA bounds take each row's keys as one range: a mask with holes cannot be served (one read per
        # model forward, as the dense path's; under torch.compile or CUDA-graph capture it is not checked)
        if not hybrid and not _capturing_or_tracing(keep) and bool(dsa.has_holes(keep)):
            raise NotImplementedError(f"coreattn's DSA path takes left or right padding; this attention mask has "
                                      f"holes (more than one run of kept tokens in a row) ({config.model_type}); "
                                      f"{_USE_EAGER}")
    if attention_mask is not None:
        device = attention_mask.device
    lo, hi = dsa.key_bounds(batch_size, q_length, kv_length, q_offset, kv_offset, causal, keep, sequence_ids, device)
    if hybrid:
        col = (q_offset + torch.arange(q_length, device=device) - kv_offset)[None].expand(batch_size, -1)
        start = dsa.key_bounds(batch_size, q_length, kv_length, q_offset, kv_offset, causal, None, sequence_ids,
                               device)[0]
        return deepseek_v4.HybridMask(start, col.to(torch.int32), keep, backend)
    return dsa.SparseMask(lo, hi, backend, keep)


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask: torch.Tensor | None = None, use_vmap: bool = False, config=None, backend=None,
                 **kwargs):
    """transformers' mask builder for coreattn: the ``[B, kv_length]`` bool keep mask (its last
    kv_length columns, as for flash attention), or None without padding (no mask given, or one
    that keeps every token: read once per forward, except under torch.compile or CUDA-graph capture,
    which keep the mask). Never expanded to ``[B, 1, Sq, Sk]``; causal and window patterns come from
    the attention call itself. DSA models get a ``SparseMask`` (``backend``: the pin it carries to
    their indexer). Mask patterns and models coreattn cannot run raise here (see the module docstring)."""
    reason = unsupported_model(config)
    if reason:
        raise NotImplementedError(f"coreattn cannot run {reason}; {_USE_EAGER}")
    local_size = kwargs.get("local_size")
    if use_vmap:
        raise NotImplementedError("coreattn cannot run or_mask_function/and_mask_function mask overlays (custom "
                                  f"mask patterns); {_USE_EAGER}")
    if torch.compiler.is_compiling():
        if local_size is not None and local_size != getattr(config, "sliding_window", None):
            raise NotImplementedError(f"coreattn cannot run chunked attention masks (attention_chunk_size); {_USE_EAGER}")
    elif mask_function is not None:
        parts = _unsupported_parts(mask_function)
        if parts:
            raise NotImplementedError(f"coreattn cannot run this mask pattern: {', '.join(parts)}; {_USE_EAGER}")
    model_type = getattr(config, "model_type", None)
    if model_type in minimax_m3.MODEL_TYPES:  # bounds for its sparse layers, the padding mask (as any model's)
        # for its dense ones
        bounds = _bounds_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                              config, sparse_backend(backend), kwargs.get("device") or torch.device("cpu"))
        dense = minimax_m3.BOUNDS  # a static cache (a mask narrower than its keys): the bounds serve them too
        if attention_mask is None or attention_mask.shape[-1] >= kv_length:
            dense = padding_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                                 use_vmap, None, backend, **kwargs)
        return minimax_m3.BlockMask(bounds.lo, bounds.hi, dense, bounds.backend)
    model_type = getattr(config, "model_type", None)
    if model_type == deepseek_v4.MODEL_TYPE or (model_type in models.SPARSE_MASK_TYPES
                                                and not _has_window(mask_function)):
        return _bounds_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, config,
                            sparse_backend(backend), kwargs.get("device") or torch.device("cpu"))
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"coreattn expects a [batch, seq] padding mask, got shape {tuple(attention_mask.shape)}")
    keep = attention_mask[:, -kv_length:].to(torch.bool)
    if attention_mask.shape[1] != kv_length or _capturing_or_tracing(keep):
        return keep
    # Nothing padded: no keep mask, so no layer takes the kernels' masked path for every key block.
    # One read of the mask per model forward (this builder runs once for all layers), as transformers'
    # own flash-attention builder reads it; never while torch.compile traces or a CUDA graph captures.
    return None if bool(keep.all()) else keep


def _has_window(mask_function) -> bool:
    """Whether transformers' mask function has a sliding window (a DSA model's sliding layers: dots3-note's)."""
    return mask_function is not None and any(getattr(p, "__qualname__", "") in _WINDOWS for p in _parts(mask_function))


def sparse_backend(backend):
    """The pin the sparse attention and the indexer take: a dense-only pin (``npu_fused``, dense
    attention's torch_npu operator) leaves them at their per-call default, as CoreDSAttention does."""
    from coreattn.layers.backends import Backend, parse_backend

    return None if backend is None or parse_backend(backend) is Backend.NPU_FUSED else backend


def _capturing_or_tracing(x: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return True
    return x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
