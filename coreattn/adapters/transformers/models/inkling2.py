"""Inkling 2 (transformers' ``inkling2``, ``inkling2_loop``) under "coreattn".

Written against transformers 5.25.0 (these methods' code is the same in 5.24.0); ``check_source``
refuses another release whose code here differs (``KNOWN_SOURCES``: sha256 of each method's
source). What each attention call of the model passes, and what coreattn does with it:

- ``relative_distance``: the text model (``Inkling2TextModel``, ``Inkling2LoopTextModel``) builds two
  ``[q_len, kv_len]`` int64 tensors per forward (``get_relative_distance``): inside a coreattn model
  call the wrapped function returns their offsets instead (``Distances``, computed as it computes
  them), so no S x S tensor is built outside the attention either.
- ``position_bias``: ``Inkling2RelativePositionBias`` (``Inkling2LoopRelativePositionBias``)
  builds ``[B, H, S, T]``: ``relative_states[b, i, h, :] . proj[:, i - j]`` for ``0 <= i - j <
  rel_extent``. ``install()`` wraps its ``forward``: inside a coreattn call of the attention layers
  (``Inkling2SlidingAttention``, ``Inkling2FullAttention`` and the Loop model's, wrapped to mark
  it) it computes the relative states as the model does (its ``linear`` and ``norm``) and returns
  them with ``proj`` (a ``PositionBias`` holding a ``coreattn.LowRankRelativeBias``): the kernels
  compute the bias in registers. i - j is counted along the causal diagonal (``i + Lk - Lq - j``),
  which is the model's ``get_relative_distance`` with and without a cache (checked from the
  ``Distances``). Outside a coreattn call the wrapped methods run unchanged.
- ``sinks`` ``[B, H, S, 1]``: one logit per token and head: ``softmax_offset`` ``[B, H, S]``.
- ``Inkling2BlockAttentionResidual`` (and the Loop model's ``...BlockAttentionResidual`` and
  ``...MessageAttentionResidual``) call the attention function with the hidden size as the head
  dim (4,608), over the few block states of each position: ``block_residual`` runs that in torch,
  exactly as eager (a softmax over at most a dozen entries per position).
"""

from __future__ import annotations

import contextvars
import functools

import torch

from coreattn.adapters.transformers.models import PositionBias, model_module, source_reason, uses_coreattn
from coreattn.layers.bias import LowRankRelativeBias
from coreattn.layers.checks import reads_values

NAME = "Inkling 2"
MODELS = {"inkling2": "Inkling2", "inkling2_loop": "Inkling2Loop"}  # model_type -> class prefix
# the configs that reach the mask builder and the attention layers: the language models' own
CONFIG_TYPES = {"inkling2": "inkling2", "inkling2_text": "inkling2", "inkling2_loop": "inkling2_loop",
                "inkling2_loop_text": "inkling2_loop"}
MODEL_TYPES = tuple(CONFIG_TYPES)
RESIDUALS = {"Inkling2BlockAttentionResidual", "Inkling2LoopBlockAttentionResidual",
             "Inkling2LoopMessageAttentionResidual"}
# sha256 of the (dedented) source of each method coreattn wraps, restates or relies on (transformers
# 5.25.0, the same in 5.24.0); the Loop model's methods have the same source as Inkling 2's
_SHARED = {
    "{p}RelativePositionBias.forward": "08da7bbe117137673b2a814a66c55696a640e0ff24a49e2e71779b72656ec054",
    "{p}SlidingAttention.forward": "14dd510353e47a52db16ecd186fd436389a0ae1b433556e062a0a3f0ae572188",
    "{p}FullAttention.forward": "1621a09d314214420c1bd63477cfc7efe145a029543d98d7ee8dfb6108c78615",
    "{p}BlockAttentionResidual.forward": "d2be507431a1701acfe64de472d21d4866913b41f80c3d5cc560c018cb105a4e",
    "eager_attention_forward": "e356c83147edb3b79a901134e147528f1e3f44bc54c0cb016a7a9bf2b245e6ba",
    "get_relative_distance": "704e9f25a591340a16cc096f7fe72c6418746616d1af5f7f709ddc578cba88cc",
}
KNOWN_SOURCES = {
    "inkling2": {name.format(p="Inkling2"): h for name, h in _SHARED.items()},
    "inkling2_loop": {**{name.format(p="Inkling2Loop"): h for name, h in _SHARED.items()},
                      "Inkling2LoopMessageAttentionResidual.forward":
                      "66d3990a7a4d6553c678603df5818ca8319adf5b4668d1be8b66bde64a464bdf"},
}
KNOWN_SOURCES["inkling2"]["Inkling2TextModel.forward"] = (
    "597ed4887a4313bf4b3a7f54edf191ef2458a7297a1e40cb547bafef0936b338")
KNOWN_SOURCES["inkling2_loop"]["Inkling2LoopTextModel.forward"] = (
    "0c485c09e1b024799cfa14531839eab0bfcbb3a4e3d1f537cec8088a76ed0b43")
_IN_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar("coreattn_inkling2_call", default=False)
_IN_MODEL: contextvars.ContextVar[bool] = contextvars.ContextVar("coreattn_inkling2_model", default=False)


class Distances:
    """What ``get_relative_distance`` returns inside a coreattn model call in place of its
    ``[q_len, kv_len]`` int64 tensor (two of them per forward: S x S each): the query positions'
    offset from the keys' (``q_offset - kv_offset``) and the shape. The bias module reads these."""

    __slots__ = ("offset", "shape")

    def __init__(self, offset: int, q_len: int, kv_len: int):
        self.offset, self.shape = offset, (q_len, kv_len)

    def __repr__(self) -> str:
        return f"Distances(offset={self.offset}, shape={self.shape})"


@functools.lru_cache(maxsize=None)
def check_source(model_type: str) -> str | None:
    """None if this transformers' Inkling 2 methods are the ones this module was written against,
    else why not (naming the method). ``model_type``: a config's (``CONFIG_TYPES``)."""
    model_type = CONFIG_TYPES[model_type]
    return source_reason(model_type, KNOWN_SOURCES[model_type])


def _flagging(forward, flag: contextvars.ContextVar):
    """``forward`` with ``flag`` set, while it runs, to whether its module's config uses coreattn."""
    @functools.wraps(forward)
    def wrapped(self, *args, **kwargs):
        token = flag.set(uses_coreattn(self.config))
        try:
            return wrapped.coreattn_wrapped(self, *args, **kwargs)
        finally:
            flag.reset(token)

    wrapped.coreattn_wrapped = forward
    return wrapped


def _distances(function):
    """The model's ``get_relative_distance``: inside a coreattn model call, ``Distances`` (its offsets,
    computed as it computes them) instead of the [q_len, kv_len] tensor."""
    @functools.wraps(function)
    def get_relative_distance(inputs_embeds, cache, is_sliding):
        if not _IN_MODEL.get():
            return get_relative_distance.coreattn_wrapped(inputs_embeds, cache, is_sliding)
        from transformers.masking_utils import find_first_full_attention_index

        q_length = inputs_embeds.shape[1]
        if cache is None:
            kv_length, kv_offset, q_offset = q_length, 0, 0
        else:
            if not is_sliding:
                layer_idx = find_first_full_attention_index(cache)
            elif True in cache.is_sliding:
                layer_idx = cache.is_sliding.index(True)
            else:
                layer_idx = 0
            kv_length, kv_offset = cache.get_mask_sizes(q_length, layer_idx)
            q_offset = cache.get_query_offset(layer_idx)
        return Distances(q_offset - kv_offset, q_length, kv_length)

    get_relative_distance.coreattn_wrapped = function
    return get_relative_distance


def _bias_forward(forward, model_type: str):
    @functools.wraps(forward)
    def bias_forward(self, hidden_states, relative_distance, position_ids):
        if not _IN_CALL.get():
            if isinstance(relative_distance, Distances):  # an eager attention layer inside a coreattn model
                relative_distance = _materialize(relative_distance, hidden_states.device)
            return bias_forward.coreattn_wrapped(self, hidden_states, relative_distance, position_ids)
        q_len = hidden_states.shape[1]
        k_len = relative_distance.shape[-1]
        # the model's distances are q_offset + i - (kv_offset + j); coreattn's i + (Lk - Lq) - j: the same
        # when the query block ends at the last key (a cache's offsets do)
        if isinstance(relative_distance, Distances):
            offset = relative_distance.offset
        else:  # a tensor handed by the caller: read where that is free
            offset = int(relative_distance[0, 0]) if reads_values(relative_distance) else k_len - q_len
        if offset != k_len - q_len:
            raise NotImplementedError(f"{model_type}: relative distances whose diagonal is not the keys' last "
                                      f"(offset {offset}, expected {k_len - q_len}) are not supported by coreattn; "
                                      "use attn_implementation='eager'")
        # the model's relative states, computed as its forward computes them: [B, S, H, d_rel]
        states = self.linear(hidden_states).view(*hidden_states.shape[:-1], self.num_heads, -1)
        states = self.norm(states, position_ids)
        return PositionBias(LowRankRelativeBias(states, self.proj), model_type)

    bias_forward.coreattn_wrapped = forward
    return bias_forward


def _materialize(distances: Distances, device) -> torch.Tensor:
    """The [q_len, kv_len] distances the model's own function would have returned."""
    q_len, kv_len = distances.shape
    return (torch.arange(q_len, device=device)[:, None] + distances.offset
            - torch.arange(kv_len, device=device)[None, :])


def install() -> list[str]:
    """Wrap the Inkling 2 models' bias modules and attention layers (idempotent); the model types
    this transformers has."""
    installed = []
    for model_type, prefix in MODELS.items():
        try:
            module = model_module(model_type)
        except ImportError:
            continue
        for name in ("SlidingAttention", "FullAttention"):
            cls = getattr(module, prefix + name)
            if not hasattr(cls.forward, "coreattn_wrapped"):
                cls.forward = _flagging(cls.forward, _IN_CALL)
        cls = getattr(module, prefix + "RelativePositionBias")
        if not hasattr(cls.forward, "coreattn_wrapped"):
            cls.forward = _bias_forward(cls.forward, model_type)
        cls = getattr(module, prefix + "TextModel")
        if not hasattr(cls.forward, "coreattn_wrapped"):
            cls.forward = _flagging(cls.forward, _IN_MODEL)
        if not hasattr(module.get_relative_distance, "coreattn_wrapped"):
            module.get_relative_distance = _distances(module.get_relative_distance)
        installed.append(model_type)
    return installed


def is_residual(module) -> bool:
    """A block-attention residual (head dim = the hidden size, a few block states per position)."""
    return type(module).__name__ in RESIDUALS


def block_residual(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The residuals' attention ``[B, S, Q, D]`` as eager computes it: query ``[B, S, Q, D]`` (the
    positions as eager's heads), key = value ``[B, S, N, D]`` (N block states), float32, no mask."""
    if attention_mask is not None or dropout:
        raise NotImplementedError(f"{type(module).__name__} with a mask or dropout is not supported by coreattn")
    weights = torch.softmax(torch.matmul(query, key.transpose(-1, -2)) * scaling, dim=-1, dtype=torch.float32)
    out = torch.matmul(weights.to(query.dtype), value)  # [B, S, Q, D]
    return out.transpose(1, 2).contiguous()
