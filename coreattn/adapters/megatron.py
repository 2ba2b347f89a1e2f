"""Megatron-Core glue: swap coreattn's CoreAttention into a model spec, and let MLA pass V unpadded.

    from coreattn.adapters.megatron import use_coreattn
    spec = use_coreattn(get_gpt_layer_local_spec(multi_latent_attention=True))
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging

from megatron.core.transformer.spec_utils import ModuleSpec

from coreattn.adapters.backends import Backend, parse_backend
from coreattn.layers.core_attention import CoreAttention

logger = logging.getLogger("coreattn")

_PATCH_MARK = "_coreattn_native_value_dim"


def _core_attention_entry(backend: Backend | None):
    if backend is None:
        return CoreAttention
    # A ModuleSpec both builds through build_module (MLA, megatron-core < 0.16) and is callable
    # (SelfAttention on >= 0.16 calls submodules.core_attention(...) directly).
    return ModuleSpec(module=CoreAttention, params={"backend": backend})


def _swap(node, entry, seen: dict):
    """Replace every ``core_attention`` field in a spec tree, in place on a private copy."""
    if id(node) in seen:
        return seen[id(node)]
    seen[id(node)] = node
    if isinstance(node, ModuleSpec):
        node.submodules = _swap(node.submodules, entry, seen)
        for key, value in list(node.params.items()):
            node.params[key] = _swap(value, entry, seen)
        return node
    if isinstance(node, (list, tuple)):
        swapped = [_swap(item, entry, seen) for item in node]
        return swapped if isinstance(node, list) else type(node)(swapped)
    if isinstance(node, dict):
        return {key: _swap(value, entry, seen) for key, value in node.items()}
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if f.name == "core_attention" and value is not None:
                setattr(node, f.name, entry)
            else:
                setattr(node, f.name, _swap(value, entry, seen))
    return node


def replace_core_attention(spec, core_attention):
    """Return a copy of ``spec`` with every ``core_attention`` field set to ``core_attention``
    (a module class or ModuleSpec); the input spec is not modified."""
    return _swap(copy.deepcopy(spec), core_attention, {})


def use_coreattn(spec, backend: str | Backend | None = None):
    """Return a copy of ``spec`` whose every core attention is :class:`CoreAttention`.

    Walks layer specs, decoder/MoE block specs (``layer_specs`` lists), MLA specs and MTP block
    specs: any submodules dataclass with a ``core_attention`` field gets CoreAttention. The input
    spec is not modified. ``backend`` pins the backend for these layers (else per device, see
    ``coreattn.adapters.backends``).
    """
    return replace_core_attention(spec, _core_attention_entry(None if backend is None else parse_backend(backend)))


def patch_mla_native_value_dim() -> bool:
    """Make Megatron's MLA pass V unpadded to CoreAttention on thd batches. Idempotent.

    megatron-core >= 0.18 zero-pads V from v_head_dim to the q head dim before calling core
    attention on thd (``_prepare_mla_core_attention_value``) and slices the output back, because
    flash-attn 2 needs equal head dims; CoreAttention does not, so the pad only costs FLOPs and
    memory. After this patch, MLA layers whose core attention is a CoreAttention skip the pad;
    other core attentions keep Megatron's behaviour. CoreAttention is correct either way.

    Returns True when the hook is installed (or already was), False when this megatron-core has
    no such pad (older releases pass V unpadded already).
    """
    from megatron.core.transformer import multi_latent_attention as mla

    prepare = getattr(mla, "_prepare_mla_core_attention_value", None)
    if prepare is None:
        logger.info("coreattn: this megatron-core does not pad MLA's V; nothing to patch")
        return False
    if getattr(prepare, _PATCH_MARK, False):
        return True

    @functools.wraps(prepare)
    def prepare_native(parallel_attention, query, value, packed_seq_params, *args, **kwargs):
        if isinstance(getattr(parallel_attention, "core_attention", None), CoreAttention) and value is not None:
            dim = value.shape[-1]
            return value, False, dim, dim
        return prepare(parallel_attention, query, value, packed_seq_params, *args, **kwargs)

    setattr(prepare_native, _PATCH_MARK, True)
    mla._prepare_mla_core_attention_value = prepare_native
    logger.info("coreattn: MLA passes V unpadded to CoreAttention")
    return True


__all__ = ["CoreAttention", "use_coreattn", "replace_core_attention", "patch_mla_native_value_dim"]
