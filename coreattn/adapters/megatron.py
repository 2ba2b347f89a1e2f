"""Megatron-Core glue: swap coreattn's CoreAttention (dense) and CoreDSAttention (DeepSeek Sparse
Attention) into a model spec, and let MLA pass V unpadded.

    from coreattn.adapters.megatron import use_coreattn
    spec = use_coreattn(get_gpt_layer_local_spec(multi_latent_attention=True))
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging

from megatron.core.transformer.spec_utils import ModuleSpec

from coreattn.layers.backends import Backend, parse_backend
from coreattn.layers.core_attention import CoreAttention

logger = logging.getLogger("coreattn")

_PATCH_MARK = "_coreattn_native_value_dim"
# Megatron's dense softmax core attentions (local, Transformer Engine), matched by class name so
# Transformer Engine need not be importable.
_DENSE_CORE_ATTENTIONS = ("DotProductAttention", "TEDotProductAttention", "CoreAttention")
# Megatron's DeepSeek Sparse Attention (and coreattn's subclass of it): swapped for CoreDSAttention,
# keeping its submodules (the indexer) and params. Other subclasses of DSAttention are kept.
_DSA_MODULE = "megatron.core.transformer.experimental_attention_variant.dsa"


def _core_attention_entry(backend: Backend | None):
    if backend is None:
        return CoreAttention
    # A ModuleSpec both builds through build_module (MLA, megatron-core < 0.16) and is callable
    # (SelfAttention on >= 0.16 calls submodules.core_attention(...) directly).
    return ModuleSpec(module=CoreAttention, params={"backend": backend})


def _module_of(entry):
    """The module class behind a spec entry: a class, a ModuleSpec or a functools.partial."""
    if isinstance(entry, ModuleSpec):
        return entry.module
    return entry.func if isinstance(entry, functools.partial) else entry


def _is_dense_core_attention(entry) -> bool:
    module = _module_of(entry)
    return isinstance(module, type) and any(c.__name__ in _DENSE_CORE_ATTENTIONS for c in module.__mro__)


def _is_dsattention(entry) -> bool:
    """Megatron's DSAttention itself, or coreattn's CoreDSAttention (matched without importing either)."""
    module = _module_of(entry)
    if not isinstance(module, type):
        return False
    if module.__name__ == "DSAttention" and module.__module__ == _DSA_MODULE:
        return True
    return module.__name__ == "CoreDSAttention" and module.__module__ == "coreattn.layers.dsa.core_dsa_attention"


def _dsa_entry(entry, backend: Backend | None):
    """CoreDSAttention in place of a DSAttention spec entry, with its submodules and params."""
    from coreattn.layers.dsa.core_dsa_attention import CoreDSAttention  # needs megatron-core's DSA: imported on demand

    if isinstance(entry, ModuleSpec):
        swapped = copy.copy(entry)
        swapped.module = CoreDSAttention
        swapped.params = dict(entry.params)
    elif isinstance(entry, functools.partial):
        swapped = ModuleSpec(module=CoreDSAttention, params=dict(entry.keywords))
    else:
        swapped = ModuleSpec(module=CoreDSAttention)
    if backend is not None:
        swapped.params["backend"] = backend
    return swapped


def _swap(node, replace, seen: dict, kept: list):
    """Set each ``core_attention`` field of a spec tree to ``replace(value)``, in place on a private
    copy; values it answers None for stay, and go to ``kept``."""
    if id(node) in seen:
        return seen[id(node)]
    seen[id(node)] = node
    if isinstance(node, ModuleSpec):
        node.submodules = _swap(node.submodules, replace, seen, kept)
        for key, value in list(node.params.items()):
            node.params[key] = _swap(value, replace, seen, kept)
        return node
    if isinstance(node, (list, tuple)):
        swapped = [_swap(item, replace, seen, kept) for item in node]
        return swapped if isinstance(node, list) else type(node)(swapped)
    if isinstance(node, dict):
        return {key: _swap(value, replace, seen, kept) for key, value in node.items()}
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if f.name == "core_attention" and value is not None:
                new = replace(value)
                if new is None:
                    kept.append(value)
                else:
                    setattr(node, f.name, new)
            else:
                setattr(node, f.name, _swap(value, replace, seen, kept))
    return node


def replace_core_attention(spec, core_attention):
    """Return a copy of ``spec`` with every ``core_attention`` field set to ``core_attention``
    (a module class or ModuleSpec); the input spec is not modified."""
    return _swap(copy.deepcopy(spec), lambda entry: core_attention, {}, [])


def use_coreattn(spec, backend: str | Backend | None = None):
    """Return a copy of ``spec`` whose core attentions run on coreattn.

    Walks layer specs, decoder/MoE block specs (``layer_specs`` lists), MLA and absorbed-MLA specs
    and MTP block specs: a ``core_attention`` field holding Megatron's dense attention
    (``DotProductAttention``, ``TEDotProductAttention``, as a class, ModuleSpec or partial) gets
    :class:`CoreAttention`; one holding Megatron's DeepSeek Sparse Attention (``DSAttention``,
    megatron-core 0.16 to 0.19) gets :class:`coreattn.layers.dsa.core_dsa_attention.CoreDSAttention` with the
    same submodules (the indexer) and params. Other core attentions are kept, with a warning. The
    input spec is not modified. ``backend`` pins the backend for these layers (else per device, see
    ``coreattn.layers.backends``).
    """
    pinned = None if backend is None else parse_backend(backend)
    dense = _core_attention_entry(pinned)

    def replace(entry):
        if _is_dsattention(entry):
            return _dsa_entry(entry, pinned)
        return dense if _is_dense_core_attention(entry) else None

    kept = []
    swapped = _swap(copy.deepcopy(spec), replace, {}, kept)
    if kept:
        names = sorted({getattr(_module_of(e), "__name__", repr(e)) for e in kept})
        logger.warning("coreattn: use_coreattn kept %d core attention(s) it has no replacement for: %s",
                       len(kept), ", ".join(names))
    return swapped


def patch_mla_native_value_dim() -> bool:
    """Make Megatron's MLA pass V unpadded to CoreAttention on thd batches. Idempotent.

    megatron-core >= 0.18 zero-pads V from v_head_dim to the q head dim before calling core
    attention on thd (``_prepare_mla_core_attention_value``) and slices the output back, because
    flash-attn 2 needs equal head dims; CoreAttention does not, so the pad only costs FLOPs and
    memory. After this patch, MLA layers whose core attention is a CoreAttention skip the pad;
    other core attentions, and MLA's latent-cache inference path (its own flash decode), keep
    Megatron's behaviour. CoreAttention is correct either way.

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
        # cache_mla_latents (inference) also pads V for its own flash decode, which is not CoreAttention
        native = (isinstance(getattr(parallel_attention, "core_attention", None), CoreAttention)
                  and not getattr(parallel_attention, "cache_mla_latents", False))
        if native and value is not None:
            dim = value.shape[-1]
            return value, False, dim, dim
        return prepare(parallel_attention, query, value, packed_seq_params, *args, **kwargs)

    setattr(prepare_native, _PATCH_MARK, True)
    mla._prepare_mla_core_attention_value = prepare_native
    logger.info("coreattn: MLA passes V unpadded to CoreAttention")
    return True


__all__ = ["CoreAttention", "use_coreattn", "replace_core_attention", "patch_mla_native_value_dim"]
