"""CoreDSAttention: Megatron-Core's DeepSeek Sparse Attention with its sparse attention on coreattn.

``coreattn.adapters.megatron.use_coreattn(spec)`` puts it where a spec has Megatron's
``DSAttention``. It is a subclass of that ``DSAttention``: the indexer and its parameters, the
top-k selection, the indexer loss and its logging (``DSAIndexerLossLoggingHelper``), index sharing
across layers (``dsa_indexer_topk_freq``, ``dsa_indexer_skip_topk_offset``), sbhd and thd batches,
sequence and context parallelism (gathering the keys, undoing the zig-zag order, each query row's
key bounds) and the V up-projection stay Megatron's. One step changes: attending each query to
its top-k keys. Megatron's own path for it (``dsa_kernel_backend="none"``, the only one off CUDA)
builds dense ``[b, heads, sq, sk]`` scores and an S×S index mask; here it is
:func:`coreattn.layers.dsa.sparse_attn.sparse_padded_attn`: memory O(tokens × top-k), a deterministic
backward, on the backend picked per device as :class:`~coreattn.layers.core_attention.CoreAttention`
picks it (``backend=``, ``config.coreattn_backend``, ``COREATTN_BACKEND``).

The seam: ``DSAttention.forward`` calls a module-level function of Megatron's ``dsa`` module for
that step, looked up by name when it runs:

- megatron-core 0.19: ``_run_sparse_attention(*, absorbed_mla, query, key, value, up_v_weight,
  topk_indices, softmax_scale, config, mask, varlen_starts, varlen_ends, key_positions,
  topk_length)``; absorbed MLA (query ``[sq, b, np, kv_lora_rank + rope]``, one latent key head,
  V = the key's first ``kv_lora_rank`` columns, then ``up_v_weight``) or per-head K and V;
- megatron-core 0.16 to 0.18: ``unfused_dsa_fn(query, key, value, topk_indices, softmax_scale)``,
  per-head K and V, top-left causal.

While a CoreDSAttention's forward runs, that name (and, on 0.19, the fully fused
``dsa_kernels.run_fused_dsa_attention``, which would bypass it) resolves to a dispatcher: calls made
inside a CoreDSAttention forward (a context variable: per thread and per asyncio task) go to
coreattn, or are declined for the fully fused hook, so Megatron goes on with its indexer and then
calls the seam; every other call goes to Megatron's function. The dispatchers are set when the
first CoreDSAttention forward starts and Megatron's functions put back when the last one ends
(counted under a lock). Which seam this megatron-core has, and that it takes exactly the
parameters read here, is checked when this module is imported: an ImportError names the version.

Masks reach the seam as Megatron builds them: per query row key bounds ``[start, end)``
(``varlen_starts/ends``, identity key positions: passed to the kernels as they are), explicit
``key_positions`` or an additive ``[sq, sk]``/``[b, sq, sk]`` mask of 0 and -inf (from a boolean
``attention_mask``): both folded into the index list (an entry whose key is not visible becomes -1;
O(tokens × top-k)), with a device-side assert, no host sync, that the mask holds no finite bias
other than 0 (Megatron only builds 0/-inf masks here; coreattn's sparse op takes no bias).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import threading

import torch
import megatron.core
from megatron.core.transformer.experimental_attention_variant import dsa as _dsa

from coreattn.layers.backends import Backend, parse_backend
from coreattn.layers.core_attention import CONFIG_BACKEND_ATTR
from coreattn.layers.dsa.sparse_attn import sparse_padded_attn

MEGATRON_VERSION = getattr(megatron.core, "__version__", "unknown")


def _visible_topk(topk_indices, sq: int, b: int, skv: int, mask=None, starts=None, ends=None, key_positions=None):
    """What each query may attend, as coreattn's sparse op takes it on sbhd tensors: (indices
    ``[sq, b, K]``, key bounds ``([sq, b], [sq, b])`` or None, top-left causal or not).

    Megatron hands ``topk_indices [b, sq, K]`` (key positions in the batch row, or rows of the
    packed stream for thd, where b = 1) with per-row bounds ``[sq]`` shared by the batch (on key
    rows, or on explicit key positions), an additive 0/-inf mask, or neither (top-left causal)."""
    if topk_indices.dim() != 3 or tuple(topk_indices.shape[:2]) != (b, sq):
        raise ValueError(f"topk_indices must be [b, sq, topk] = [{b}, {sq}, topk], got {tuple(topk_indices.shape)}")
    idx = topk_indices.transpose(0, 1)  # [sq, b, K], a view
    if starts is not None:
        if ends is None:
            raise ValueError("varlen_ends is required with varlen_starts")
        starts = starts.to(device=idx.device)[:, None]
        ends = ends.to(device=idx.device)[:, None]
        if key_positions is None:  # identity key positions: the bounds are key rows
            return idx, (starts.expand(sq, b), ends.expand(sq, b)), False
        # bounds on key positions: test each named key's position, O(sq * b * K)
        pos = key_positions.to(device=idx.device)[idx.clamp(0, skv - 1)]  # [sq, b, K]
        seen = (idx >= 0) & (idx < skv) & (pos >= starts[..., None]) & (pos < ends[..., None])
        return torch.where(seen, idx, -1), None, False
    if mask is not None:
        if mask.dim() == 2:
            mask = mask.unsqueeze(0)
        if mask.dim() != 3 or tuple(mask.shape[1:]) != (sq, skv) or mask.shape[0] not in (1, b):
            raise ValueError(f"mask must be [sq, sk] or [b, sq, sk] = [{b}, {sq}, {skv}], got {tuple(mask.shape)}")
        picked = mask.expand(b, sq, skv).gather(-1, topk_indices.clamp(0, skv - 1)).transpose(0, 1)  # [sq, b, K]
        named = (idx >= 0) & (idx < skv)
        torch._assert_async(((picked == 0) | (picked == float("-inf")) | ~named).all(),
                            "coreattn's DSAttention takes 0/-inf masks only (the sparse op has no additive bias)")
        return torch.where(named & (picked == 0), idx, -1), None, False
    return idx, None, True


def _sparse(module, query, key, value, visible, softmax_scale, *, v_head_dim=None, topk_length=None):
    """coreattn's sparse op on sbhd tensors: ``[sq, b, np, dv]``."""
    idx, bounds, causal = visible
    if topk_length is not None:  # Megatron's [b, sq] -> the op's token dims [sq, b]
        topk_length = topk_length.transpose(0, 1)
    return sparse_padded_attn(query, key, value, idx, layout="sbhd", causal=causal, causal_alignment="top_left",
                              softmax_scale=softmax_scale, v_head_dim=v_head_dim, key_bounds=bounds,
                              topk_length=topk_length, backend=module.backend)


def _run_sparse_attention_v019(module, *, absorbed_mla, query, key, value, up_v_weight, topk_indices,
                               softmax_scale, config, mask, varlen_starts, varlen_ends, key_positions,
                               topk_length=None):
    """megatron-core 0.19's ``dsa._run_sparse_attention`` on coreattn: ``[sq, b, np * v_head_dim]``."""
    sq, b = query.shape[:2]
    skv = key.shape[0]
    visible = _visible_topk(topk_indices, sq, b, skv, mask, varlen_starts, varlen_ends, key_positions)
    if not absorbed_mla:
        if value is None:
            raise RuntimeError("DSAttention's non-absorbed sparse attention needs a value tensor")
        if key.shape[2] != value.shape[2]:  # one side has a single head (MQA): give both every head
            heads = max(key.shape[2], value.shape[2])
            key = key.expand(*key.shape[:2], heads, key.shape[3]).contiguous()
            value = value.expand(*value.shape[:2], heads, value.shape[3]).contiguous()
        out = _sparse(module, query, key, value, visible, softmax_scale, topk_length=topk_length)
        return out.reshape(sq, b, -1)
    rank = int(getattr(config, "kv_lora_rank", 0) or 0)
    if rank <= 0:
        raise RuntimeError(f"absorbed DSAttention needs config.kv_lora_rank > 0, got {rank}")
    if up_v_weight is None or value is not None:
        raise RuntimeError("absorbed DSAttention takes value=None and an up_v_weight [np, v_head_dim, kv_lora_rank]")
    if key.shape[2] != 1 or key.shape[3] < rank:
        raise RuntimeError(f"absorbed DSAttention takes one latent key head of >= kv_lora_rank={rank} columns, "
                           f"got key {tuple(key.shape)}")
    latent = _sparse(module, query, key, None, visible, softmax_scale, v_head_dim=rank,
                     topk_length=topk_length)  # [sq, b, np, kv_lora_rank]
    out = torch.einsum("sbnr,nvr->sbnv", latent, up_v_weight)  # V up-projection per head n
    return out.reshape(sq, b, -1)


def _unfused_dsa_fn_v016(module, query, key, value, topk_indices, softmax_scale):
    """megatron-core 0.16-0.18's ``dsa.unfused_dsa_fn`` on coreattn: causal (top-left), per-head K
    and V; ``[sq, b, np * dv]``."""
    sq, b = query.shape[:2]
    visible = _visible_topk(topk_indices, sq, b, key.shape[0])
    return _sparse(module, query, key, value, visible, softmax_scale).reshape(sq, b, -1)


class _Seam:
    """One of Megatron's sparse-attention functions and what replaces it (see the module docstring)."""

    def __init__(self, name: str, replacement, keyword_only: bool):
        self.name = name
        self.replacement = replacement
        params = list(inspect.signature(replacement).parameters.values())[1:]  # without ``module``
        self.params = [p.name for p in params]
        self.required = {p.name for p in params if p.default is inspect.Parameter.empty}
        self.keyword_only = keyword_only

    def accepts(self, fn) -> bool:
        """True when Megatron's ``fn`` takes exactly what the replacement reads."""
        params = inspect.signature(fn).parameters
        if self.keyword_only:  # called with keywords: the names must be known, the required ones present
            return set(params) <= set(self.params) and self.required <= set(params)
        return list(params) == self.params


_SEAMS = (_Seam("_run_sparse_attention", _run_sparse_attention_v019, keyword_only=True),  # 0.19
          _Seam("unfused_dsa_fn", _unfused_dsa_fn_v016, keyword_only=False))  # 0.16 to 0.18
_DECLINED = (("dsa_kernels", "run_fused_dsa_attention"),)  # 0.19: fused indexer + attention, one call


def _find_seam() -> _Seam:
    forward = inspect.unwrap(_dsa.DSAttention.forward)  # through decorators to Megatron's own code
    called = set(forward.__code__.co_names)  # the globals and attributes forward looks up
    for seam in _SEAMS:
        fn = getattr(_dsa, seam.name, None)
        if seam.name not in called or not callable(fn):
            continue
        if not seam.accepts(fn):
            raise ImportError(f"megatron-core {MEGATRON_VERSION}: DSAttention's sparse attention "
                              f"{_dsa.__name__}.{seam.name}{inspect.signature(fn)} is not the one coreattn's "
                              f"CoreDSAttention replaces ({seam.name}({', '.join(seam.params)})); supported: "
                              "megatron-core 0.16 to 0.19")
        return seam
    names = " or ".join(s.name for s in _SEAMS)
    raise ImportError(f"megatron-core {MEGATRON_VERSION}: DSAttention.forward calls neither {names} "
                      "(coreattn's CoreDSAttention replaces that step); supported: megatron-core 0.16 to 0.19")


SEAM = _find_seam()
_active: contextvars.ContextVar = contextvars.ContextVar("coreattn_dsattention", default=None)
_lock = threading.Lock()
_users = 0
_installed: list = []  # (owner, name, Megatron's function, dispatcher) while _users > 0


def _dispatcher(original, replacement):
    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        module = _active.get()
        if module is None:  # not called from a CoreDSAttention forward
            return original(*args, **kwargs)
        return replacement(module, *args, **kwargs)

    return dispatch


def _decline(module, *args, **kwargs):
    return None  # Megatron's "declined" answer for an optional fused hook


def _install() -> None:
    global _users
    with _lock:
        if _users == 0:
            hooks = [(_dsa, SEAM.name, SEAM.replacement)]
            hooks += [(getattr(_dsa, owner), name, _decline) for owner, name in _DECLINED
                      if hasattr(getattr(_dsa, owner, None), name)]
            for owner, name, replacement in hooks:
                original = getattr(owner, name)
                dispatch = _dispatcher(original, replacement)
                setattr(owner, name, dispatch)
                _installed.append((owner, name, original, dispatch))
        _users += 1


def _uninstall() -> None:
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            while _installed:
                owner, name, original, dispatch = _installed.pop()
                if getattr(owner, name) is dispatch:  # else someone patched over it: leave theirs alone
                    setattr(owner, name, original)


@contextlib.contextmanager
def routed(module):
    """Within this context, calls of Megatron's sparse-attention seam in this thread or task run
    ``module``'s coreattn replacement."""
    token = _active.set(module)
    try:
        _install()
        try:
            yield
        finally:
            _uninstall()
    finally:
        _active.reset(token)


class CoreDSAttention(_dsa.DSAttention):
    """Megatron-Core's ``DSAttention`` whose sparse attention runs on coreattn (module docstring).

    Takes Megatron's constructor arguments, plus ``backend`` (``"triton"``/``"torch"``/``Backend``),
    which overrides the per-device choice; so do ``config.coreattn_backend`` and the
    ``COREATTN_BACKEND`` environment variable, in that order (``"npu_fused"``, dense attention's
    Ascend op, leaves the sparse default: torch on an NPU). Parameters, buffers and state-dict
    keys are Megatron's: checkpoints move between the two unchanged.
    """

    def __init__(self, *args, backend: str | Backend | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        override = backend if backend is not None else getattr(self.config, CONFIG_BACKEND_ATTR, None)
        source = "backend" if backend is not None else f"config.{CONFIG_BACKEND_ATTR}"
        self.backend = None if override is None else parse_backend(override, source)
        if self.backend is Backend.NPU_FUSED:  # dense attention's choice (one pin for a whole spec or config):
            self.backend = None  # sparse attention has no npu_fused; its default, as COREATTN_BACKEND=npu_fused

    def forward(self, *args, **kwargs):
        with routed(self):
            return super().forward(*args, **kwargs)


__all__ = ["CoreDSAttention", "SEAM", "MEGATRON_VERSION", "routed"]
