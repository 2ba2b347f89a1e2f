"""coreattn as a Hugging Face transformers attention implementation.

    import coreattn.adapters.transformers as coreattn_hf
    coreattn_hf.register()                      # once, before building the model
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="coreattn")
    model.set_attn_implementation("coreattn")   # or switch an existing model

``register()`` adds ``attention_forward`` to transformers' ``AttentionInterface`` and
``padding_mask`` to its ``AttentionMaskInterface`` under the same name (an implementation with no
mask builder is handed ``attention_mask=None``). transformers is imported only by ``register()``.

What a call runs (q ``[B, Hq, Sq, Dqk]``, k ``[B, Hkv, Sk, Dqk]``, v ``[B, Hkv, Sk, Dv]`` as the
model passes them; GQA/MQA and Dv != Dqk natively, the inputs used in place as bshd views):

- a ``[B, S]`` padding mask (left, right or with holes): ``coreattn.padded_attn`` with it as the
  q and k keep masks, read in the kernels (no unpadding, no S×S mask); padded query rows output
  zeros, as with flash attention;
- packed sequences given as ``cu_seq_lens_q/k`` (+ ``max_length_q/k``; transformers'
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``): ``coreattn.varlen_attn``;
- no mask and ``position_ids`` (which transformers' models always pass): the sequences are where
  the position ids do not go up by one (transformers' own packed-sequence rule, so
  ``DataCollatorWithFlattening``'s restarting position ids and ordinary per-row positions both
  work); the op derives cu_seqlens from them when it runs (one host sync per new position_ids
  tensor on a device, shared by the layers of a forward and backward). With B > 1, q/k/v are
  copied into the packed layout;
- neither: ``coreattn.padded_attn`` on the whole rows.

``is_causal`` (or ``module.is_causal``), ``scaling``, ``sliding_window`` (a causal window of
``sliding_window`` tokens including the query, as transformers' masks and flash path define it;
``sliding_window`` tokens each side for bidirectional attention, as its masks define it),
``dropout`` (coreattn's dropout, its own RNG stream) and ``s_aux`` (gpt-oss sinks, as
``softmax_offset``, differentiable) are honoured. Causal attention with fewer queries than keys
(a KV cache) is bottom-right aligned, as transformers' masks are.

Raises (NotImplementedError or ValueError, naming the feature): ``softcap``, ``position_bias``,
paged attention (``block_table``), a 4D attention mask or BlockMask (a custom mask), a padding
mask together with packed sequences, and mask patterns other than causal / bidirectional /
sliding window / padding / packing: ``or_mask_function``/``and_mask_function`` overlays, chunked
attention (Llama 4) and blockwise overlays (``block_sequence_ids``, multimodal image tokens).
Under torch.compile the mask builder cannot inspect transformers' mask closures: it still rejects
overlays (``use_vmap``) and chunked masks (``local_size``), but a blockwise overlay is detected in
eager mode only. ``output_attentions=True`` logs a warning once and returns no weights.

Returns ``(attn_output [B, Sq, Hq, Dv], None)``, the layout the models reshape.
"""

from __future__ import annotations

import logging

import torch

from coreattn.layers.function import POSITION_IDS, attention
from coreattn.layers.padded_attn import padded_attn
from coreattn.layers.varlen_attn import varlen_attn

NAME = "coreattn"
logger = logging.getLogger("coreattn")

_warned: set[str] = set()
_REJECTED_KWARGS = {
    "position_bias": "position_bias (a learned additive attention bias)",
    "block_table": "paged attention (block_table)",
}


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


# --- mask builder ----------------------------------------------------------------------------------

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


def _closure(fn) -> dict:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in (fn.__closure__ or ()))))


def _unsupported_parts(fn) -> list[str]:
    """What of a transformers mask function coreattn cannot run (empty: causal or bidirectional,
    with sliding windows, padding and packing only). Walks transformers' mask combinators."""
    from transformers import masking_utils as mu

    if fn in (mu.causal_mask_function, mu.bidirectional_mask_function):
        return []
    name = getattr(fn, "__qualname__", repr(fn))
    if name == "and_masks.<locals>.and_mask":
        return [part for inner in _closure(fn).get("mask_functions", ()) for part in _unsupported_parts(inner)]
    if name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        return _unsupported_parts(_closure(fn)["mask_function"])
    if name in _SUPPORTED_PARTS:
        return []
    return [_UNSUPPORTED_PARTS.get(name, f"a custom mask function ({name})")]


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask: torch.Tensor | None = None, use_vmap: bool = False, config=None, **kwargs):
    """transformers' mask builder for coreattn: the ``[B, kv_length]`` bool keep mask (its last
    kv_length columns, as for flash attention), or None without padding (no mask given, or one
    that keeps every token: read once per forward, except under torch.compile or CUDA-graph capture,
    which keep the mask). Never expanded to
    ``[B, 1, Sq, Sk]``; causal and window patterns come from the attention call itself. Mask
    patterns coreattn cannot run raise here (see the module docstring)."""
    local_size = kwargs.get("local_size")
    if use_vmap:
        raise NotImplementedError("coreattn cannot run or_mask_function/and_mask_function mask overlays (custom "
                                  "mask patterns); use attn_implementation='sdpa' or 'eager' for this model")
    if torch.compiler.is_compiling():
        if local_size is not None and local_size != getattr(config, "sliding_window", None):
            raise NotImplementedError("coreattn cannot run chunked attention masks (attention_chunk_size); use "
                                      "attn_implementation='sdpa' or 'eager'")
    elif mask_function is not None:
        parts = _unsupported_parts(mask_function)
        if parts:
            raise NotImplementedError(f"coreattn cannot run this mask pattern: {', '.join(parts)}; use "
                                      "attn_implementation='sdpa' or 'eager' for this model")
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


def _capturing_or_tracing(x: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return True
    return x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# --- attention -------------------------------------------------------------------------------------

def _check_kwargs(softcap, kwargs) -> None:
    if softcap is not None:
        raise NotImplementedError(f"softcap={softcap} is not supported by coreattn; use attn_implementation='eager'")
    for key, what in _REJECTED_KWARGS.items():
        if kwargs.get(key) is not None:
            raise NotImplementedError(f"{what} is not supported by coreattn")
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
        raise ValueError(f"the attention mask has {mask.shape[-1]} columns, fewer than the {length} {what}")
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
    out = varlen_attn(qf, kf, vf, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, **opts)
    return out.view(batch, -1, *out.shape[-2:])


def _packed_position_ids(q, k, v, position_ids: torch.Tensor, opts):
    """Sequences from position_ids (coreattn::attn_fwd's thd_position_ids layout)."""
    from coreattn.kernels.packing import Packing
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
    out, _, _ = run_attention(qf, kf, vf, pack, pack, tokens, tokens, params, True, opts["backend"],
                              softmax_offset=check_softmax_offset(opts["softmax_offset"], qf))
    return out.view(batch, seqlen, *out.shape[-2:])


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                      s_aux: torch.Tensor | None = None, backend=None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' AttentionInterface signature (see the module docstring). ``backend``: a coreattn
    backend override (``register(backend=...)``); None follows the per-device default."""
    _check_kwargs(softcap, kwargs)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    opts = dict(dropout_p=float(dropout), softmax_scale=scaling, causal=causal,
                window_size=_window(sliding_window, causal), softmax_offset=s_aux, backend=backend)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, S, H, D] views
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"coreattn takes a [batch, seq] padding mask, got a {type(attention_mask).__name__} "
                         "(a mask built for another attention implementation?)")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"coreattn takes a [batch, seq] padding mask, got a {attention_mask.dim()}D mask of shape "
                         f"{tuple(attention_mask.shape)}: custom 4D masks are not supported (use "
                         "attn_implementation='sdpa' or 'eager')")
    packed_kwargs = kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None
    if packed_kwargs:
        if attention_mask is not None:
            raise NotImplementedError("coreattn cannot combine a padding mask with packed sequences "
                                      "(cu_seq_lens_q/k); pass one or the other")
        out = _packed_varlen(q, k, v, batch, kwargs, opts)
    elif attention_mask is not None:
        keep = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
        out = padded_attn(q, k, v, q_keep_mask=_keep_mask(keep, seqlen_q, "queries"),
                          k_keep_mask=_keep_mask(keep, seqlen_k, "keys"), **opts)
    elif kwargs.get("position_ids") is not None and seqlen_q == seqlen_k:
        out = _packed_position_ids(q, k, v, kwargs["position_ids"], opts)
    else:
        out = padded_attn(q, k, v, **opts)
    return out, None


def register(name: str = NAME, *, backend=None) -> str:
    """Register coreattn with transformers as ``attn_implementation=name`` (attention function and
    mask builder); ``backend`` pins a coreattn backend ("triton", "torch"; None: per device).
    Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def coreattn_attention(module, query, key, value, attention_mask, **kwargs):
        return attention_forward(module, query, key, value, attention_mask, backend=backend, **kwargs)

    AttentionInterface.register(name, coreattn_attention)
    AttentionMaskInterface.register(name, padding_mask)
    return name


__all__ = ["NAME", "attention_forward", "padding_mask", "register"]
