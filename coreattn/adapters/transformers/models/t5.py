"""The T5 family (transformers' ``t5``, ``mt5``, ``umt5``, ``longt5``, ``switch_transformers``) under "coreattn".

Written against transformers 5.25.0 (these methods' code is the same in 5.24.0); ``check_source``
refuses another release whose code here differs (``KNOWN_SOURCES``). Each model's attention
(``T5Attention``, ``MT5Attention``, ``UMT5Attention``, ``LongT5Attention``,
``SwitchTransformersAttention``) adds ``position_bias`` to its scores:

- self-attention: ``compute_bias`` builds ``[1, H, Sq, Sk]`` = ``relative_attention_bias.weight[
  bucket(j - i - past), h]``. ``install()`` wraps ``compute_bias``: when the model's attention
  implementation is coreattn's it returns the embedding and the model's own buckets of the
  relative positions -max_distance..max_distance (its ``_relative_position_bucket``; positions
  beyond share the end buckets) as a ``PositionBias`` holding a ``coreattn.BucketedRelativeBias``:
  the kernels look the bias up in registers. T5 computes it in the first layer and shares it with
  the others, UMT5 in every layer; both pass through unchanged. ``past`` must be the keys before
  the queries (``Sk - Sq``: no cache or a dynamic one); a static cache's tensor offset is refused.
- Switch Transformers' encoder hands its padding mask as the additive ``[B, 1, 1, S]`` tensor
  ``(1 - mask) * finfo.min`` (not through the mask builder): ``padding_mask`` reads it back as the
  ``[B, S]`` keep mask (0 where kept).
- cross-attention passes an all-zeros ``[1, H, Sq, Sk]`` (``has_relative_attention_bias`` False):
  ``zero_bias`` recognizes it (a plain tensor from such a module: by this module's source check,
  only that zeros tensor) and the call runs without a bias and without query masking (the
  decoder's queries against the encoder's keys and its padding mask).

LongT5's encoder layers (``local`` and ``transient-global``) compute their attention themselves
(blocks of ``local_radius`` keys, not the attention function) and are left to the model.
"""

from __future__ import annotations

import functools

import torch

from coreattn.adapters.transformers.models import PositionBias, model_module, source_reason, uses_coreattn
from coreattn.layers.bias import BucketedRelativeBias

# model_type -> the attention class that calls the attention function with position_bias
NAME = "T5"
MODELS = {"t5": "T5Attention", "mt5": "MT5Attention", "umt5": "UMT5Attention", "longt5": "LongT5Attention",
          "switch_transformers": "SwitchTransformersAttention"}
MODEL_TYPES = tuple(MODELS)
_T5 = {  # sha256 of the dedented source (transformers 5.25.0, the same in 5.24.0)
    "forward": "e8b34f4b98efb7c3249414052cf6022ecaf20c0623ea7ff44132dffc07bc36bc",
    "compute_bias": "e29454d4bb4541fa3744981f846355fe32fc11bccb7bb8cb51f829d7ffef88ab",
    "_relative_position_bucket": "9776a8bb18bb7f61f0e85c2d0e1d324b497143f9279a1a5cdfafe4651072ea03",
}
_EAGER = "20b91a87ef7f69f17a13fe937e1e1a08c45e8b17d302a9e55b68c05021d69c16"
KNOWN_SOURCES = {model: {**{f"{cls}.{m}": h for m, h in _T5.items()}, "eager_attention_forward": _EAGER}
                 for model, cls in MODELS.items() if model != "umt5"}
# Switch Transformers' encoder builds its padding mask itself, additive [B, 1, 1, S]: (1 - mask) * finfo.min
KNOWN_SOURCES["switch_transformers"]["SwitchTransformersStack.forward"] = (
    "d7205c5f4284e3e30b97d8016e11676cd1059e1ef6157d9bed242e6f7441da80")
KNOWN_SOURCES["umt5"] = {
    "UMT5Attention.forward": "6098064f5003f9e6332ebf3a45def0b3ab0f8ca2103db71ac8fcda0d656d995f",
    "UMT5Attention.compute_bias": "d203681b2f66443987621f0170c1062e9f74ec535a37f7eda7e47aa4404af444",
    "UMT5Attention._relative_position_bucket": "72e0168820cc2a346a25e6aefb03b5f1df7288013a95b456a300d3b8025ae919",
    "eager_attention_forward": _EAGER,
}


@functools.lru_cache(maxsize=None)
def check_source(model_type: str) -> str | None:
    """None if this transformers' attention methods of ``model_type`` are the ones this module was
    written against, else why not (naming the method)."""
    return source_reason(model_type, KNOWN_SOURCES[model_type])


def _buckets(module, model_type: str, max_distance: int, bidirectional: bool, device) -> torch.Tensor:
    """The model's own bucket of each relative position j - i = -max_distance .. max_distance."""
    rel = torch.arange(-max_distance, max_distance + 1, dtype=torch.long, device=device)
    if model_type == "umt5":  # a method reading the module's own settings
        return module._relative_position_bucket(rel)
    return module._relative_position_bucket(rel, bidirectional=bidirectional,
                                            num_buckets=module.relative_attention_num_buckets,
                                            max_distance=max_distance)


def _compute_bias(compute_bias, model_type: str):
    @functools.wraps(compute_bias)
    def wrapped(self, query_length, key_length, device=None, past_seen_tokens=0):
        if not uses_coreattn(self.config):
            return wrapped.coreattn_wrapped(self, query_length, key_length, device, past_seen_tokens)
        if isinstance(past_seen_tokens, torch.Tensor) or past_seen_tokens != key_length - query_length:
            raise NotImplementedError(f"{model_type}'s relative position bias with {past_seen_tokens!r} past tokens "
                                      f"for {query_length} queries and {key_length} keys (a static cache?) is not "
                                      "supported by coreattn: the queries must end at the last key; use "
                                      "attn_implementation='eager' or a dynamic cache")
        weight = self.relative_attention_bias.weight  # [num_buckets, H]
        max_distance = self.relative_attention_max_distance
        bidirectional = not self.is_decoder
        buckets = _buckets(self, model_type, max_distance, bidirectional, weight.device)
        return PositionBias(BucketedRelativeBias(weight, bidirectional, max_distance, buckets), model_type)

    wrapped.coreattn_wrapped = compute_bias
    return wrapped


def install() -> list[str]:
    """Wrap the T5 family's ``compute_bias`` (idempotent); the model types this transformers has."""
    installed = []
    for model_type, cls_name in MODELS.items():
        try:
            cls = getattr(model_module(model_type), cls_name)
        except ImportError:
            continue
        if not hasattr(cls.compute_bias, "coreattn_wrapped"):
            cls.compute_bias = _compute_bias(cls.compute_bias, model_type)
        installed.append(model_type)
    return installed


def zero_bias(module, position_bias) -> bool:
    """The T5 family's all-zeros cross-attention bias: a plain tensor handed by an attention of these
    models that has no relative bias of its own (``check_source`` keeps that the zeros' only source)."""
    cls_names = set(MODELS.values())
    return (isinstance(position_bias, torch.Tensor) and type(module).__name__ in cls_names
            and not getattr(module, "has_relative_attention_bias", True))


def padding_mask(module, attention_mask):
    """Switch Transformers' encoder's additive ``[B, 1, 1, S]`` padding mask as the ``[B, S]`` keep mask
    (its entries are 0 where kept, finfo.min elsewhere: ``check_source`` keeps that its only form);
    any other mask unchanged."""
    if (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
            and attention_mask.dtype.is_floating_point and attention_mask.shape[1:3] == (1, 1)
            and type(module).__name__ == MODELS["switch_transformers"] and not module.is_decoder):
        return attention_mask[:, 0, 0, :] == 0
    return attention_mask
