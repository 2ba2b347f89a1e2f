"""CoreDSAttention: Megatron-Core's DeepSeek Sparse Attention with its sparse attention and its
indexer's top-k and loss on coreattn.

``coreattn.adapters.megatron.use_coreattn(spec)`` puts it where a spec has Megatron's
``DSAttention``. It is a subclass of that ``DSAttention``: the indexer's parameters and projections,
the indexer loss's logging (``DSAIndexerLossLoggingHelper``) and scaling, index sharing across
layers (``dsa_indexer_topk_freq``, ``dsa_indexer_skip_topk_offset``), sbhd and thd batches, sequence
and context parallelism (gathering the keys, undoing the zig-zag order, each query row's key
bounds) and the V up-projection stay Megatron's. Two steps change, each selected per device as
:class:`~coreattn.layers.core_attention.CoreAttention` picks its backend (``backend=``,
``config.coreattn_backend``, ``COREATTN_BACKEND``):

- attending each query to its top-k keys. Megatron's own path for it (``dsa_kernel_backend="none"``,
  the only one off CUDA) builds dense ``[b, heads, sq, sk]`` scores and an S×S index mask; here it is
  :func:`coreattn.layers.dsa.sparse_attn.sparse_padded_attn`: memory O(tokens × top-k), a
  deterministic backward;
- (megatron-core 0.19) the indexer's scoring and top-k (``fused_qk_topk_naive``), its loss with the
  top-k (``FusedDSAIndexerLoss``) and its Hadamard rotation (``rotate_activation``: bf16 and a CUDA
  library there). Megatron's build ``[b, sq, sk]`` scores and, for the loss, per-head ``[sq, sk]``
  probabilities twice; here they are :mod:`coreattn.layers.dsa.indexer`'s ops, chunk by chunk, in
  memory O(tokens × top-k); their top-k indices are int32 (Megatron's are int64). Where Megatron
  hands the indexer an additive mask (a boolean ``attention_mask``) or explicit key positions,
  its own functions run (``INDEXER_ON_COREATTN`` is False, with ``INDEXER_REASON``, on a
  megatron-core without them, 0.16 to 0.18: the indexer is then Megatron's). Megatron's fused
  indexer hooks (``dsa_kernels.run_fused_qk_topk(_with_loss)``) are declined, so a layer's top-k
  comes from one place.

The seam: ``DSAttention.forward`` calls a module-level function of Megatron's ``dsa`` module for
that step, looked up by name when it runs:

- megatron-core 0.19: ``_run_sparse_attention(*, absorbed_mla, query, key, value, up_v_weight,
  topk_indices, softmax_scale, config, mask, varlen_starts, varlen_ends, key_positions,
  topk_length)``; absorbed MLA (query ``[sq, b, np, kv_lora_rank + rope]``, one latent key head,
  V = the key's first ``kv_lora_rank`` columns, then ``up_v_weight``) or per-head K and V;
- megatron-core 0.16 to 0.18: ``unfused_dsa_fn(query, key, value, topk_indices, softmax_scale)``,
  per-head K and V, top-left causal.

While a CoreDSAttention's forward runs, that name, the indexer's three (0.19), and the fully fused
``dsa_kernels.run_fused_dsa_attention`` (0.19, which would bypass them) resolve to dispatchers: calls
made inside a CoreDSAttention forward (a context variable: per thread and per asyncio task) go to
coreattn (or back to Megatron's function where coreattn's answers NotImplemented: the indexer under
an additive mask), or are declined for the fused hooks, so Megatron goes on with the indexer and then
calls the seam; every other call goes to Megatron's function. The dispatchers are set when the
first CoreDSAttention forward starts and Megatron's functions put back when the last one ends
(counted under a lock). Which seam this megatron-core has, and that it takes exactly the
parameters read here, is checked when this module is imported: an ImportError names the version
(for the indexer's functions, a mismatch leaves Megatron's indexer in place, ``INDEXER_REASON``).

Masks reach the seam as Megatron builds them: per query row key bounds ``[start, end)``
(``varlen_starts/ends``, identity key positions: passed to the kernels as they are), explicit
``key_positions`` or an additive ``[sq, sk]``/``[b, sq, sk]`` mask of 0 and -inf (from a boolean
``attention_mask``): both folded into the index list (an entry whose key is not visible becomes -1;
O(tokens × top-k)). The sparse op takes no bias (Megatron builds 0/-inf masks only): another finite
value at a selected key raises ValueError where coreattn reads values (``checks.reads_values``), else
makes the output NaN without a host sync (a device-side assert would kill the CUDA context).
The indexer's bounds are passed as key bounds too, except Megatron's plain causal bounds (no
packing, context parallelism or custom positions), which 0.19's mask builder
(``dsa_masking.build_dsattention_forward_mask``, run by Megatron and only observed here) marks as
such: they reach the indexer ops as top-left causal, the same keys in the form torch_npu's indexer
operators take, so an NPU runs the indexer there (docs/ascend.md).
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
from coreattn.layers.checks import reads_values
from coreattn.layers.core_attention import CONFIG_BACKEND_ATTR
from coreattn.layers.dsa import indexer as _indexer
from coreattn.layers.dsa.sparse_attn import sparse_padded_attn

MEGATRON_VERSION = getattr(megatron.core, "__version__", "unknown")


def _visible_topk(topk_indices, sq: int, b: int, skv: int, mask=None, starts=None, ends=None, key_positions=None):
    """What each query may attend, as coreattn's sparse op takes it on sbhd tensors: (indices
    ``[sq, b, K]``, key bounds ``([sq, b], [sq, b])`` or None, top-left causal or not, a 0-dim bool
    device tensor that is true where a mask was bad and could not be checked on the host, or None).

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
            return idx, (starts.expand(sq, b), ends.expand(sq, b)), False, None
        # bounds on key positions: test each named key's position, O(sq * b * K)
        pos = key_positions.to(device=idx.device)[idx.clamp(0, skv - 1)]  # [sq, b, K]
        seen = (idx >= 0) & (idx < skv) & (pos >= starts[..., None]) & (pos < ends[..., None])
        return torch.where(seen, idx, -1), None, False, None
    if mask is not None:
        if mask.dim() == 2:
            mask = mask.unsqueeze(0)
        if mask.dim() != 3 or tuple(mask.shape[1:]) != (sq, skv) or mask.shape[0] not in (1, b):
            raise ValueError(f"mask must be [sq, sk] or [b, sq, sk] = [{b}, {sq}, {skv}], got {tuple(mask.shape)}")
        safe = topk_indices.clamp(0, skv - 1).long()  # gather takes int64 (coreattn's indexer hands int32)
        picked = mask.expand(b, sq, skv).gather(-1, safe).transpose(0, 1)  # [sq, b, K]
        named = (idx >= 0) & (idx < skv)
        bad = ~((picked == 0) | (picked == float("-inf")) | ~named).all()  # 0-dim, on the mask's device
        if reads_values(bad):
            if bad:
                raise ValueError("DSAttention's attention mask has a finite bias other than 0 at a selected key: "
                                 "coreattn's DSAttention takes 0/-inf masks only (the sparse op has no bias)")
            bad = None
        return torch.where(named & (picked == 0), idx, -1), None, False, bad
    return idx, None, True, None


def _sparse(module, query, key, value, visible, softmax_scale, *, v_head_dim=None, topk_length=None):
    """coreattn's sparse op on sbhd tensors: ``[sq, b, np, dv]``."""
    idx, bounds, causal, bad = visible
    if topk_length is not None:  # Megatron's [b, sq] -> the op's token dims [sq, b]
        topk_length = topk_length.transpose(0, 1)
    out = sparse_padded_attn(query, key, value, idx, layout="sbhd", causal=causal, causal_alignment="top_left",
                             softmax_scale=softmax_scale, v_head_dim=v_head_dim, key_bounds=bounds,
                             topk_length=topk_length, backend=module.backend)
    return out if bad is None else out.masked_fill(bad, float("nan"))  # unchecked on the host: NaN if bad


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


def _indexer_keys(module, mask, varlen_starts, varlen_ends, key_positions):
    """The keys Megatron's indexer masks let each query see, as the indexer ops take them, or
    NotImplemented (then Megatron's own function runs): top-left causal where Megatron built its plain
    causal bounds (no packing, context parallelism or custom positions: it says so,
    ``_forward_mask``), key bounds per query row on key rows (the packed and context-parallel forms
    Megatron builds for a causal mask type), or every key (no mask). An additive mask (a boolean
    ``attention_mask``) or explicit key positions are Megatron's."""
    if mask is not None or key_positions is not None:
        return NotImplemented
    if varlen_starts is None and varlen_ends is None:
        return dict(causal=False)
    if varlen_starts is None or varlen_ends is None:
        return NotImplemented
    if varlen_starts is getattr(module, "_plain_causal_starts", None):
        # starts 0, ends min(s + 1, sk): the same keys, in a form torch_npu's indexer operators express
        return dict(causal=True, causal_alignment="top_left")
    return dict(key_bounds=(varlen_starts, varlen_ends))


_FORWARD_MASK = getattr(getattr(_dsa, "dsa_masking", None), "build_dsattention_forward_mask", None)


def _forward_mask(module, *args, **kwargs):
    """megatron-core 0.19's ``dsa_masking.build_dsattention_forward_mask``, noting on ``module`` the
    starts of the bounds it calls plain causal (its third result), which ``_indexer_keys`` recognises."""
    result = _FORWARD_MASK(*args, **kwargs)
    plain = isinstance(result, tuple) and len(result) == 3 and result[2] is True and result[1] is not None
    module._plain_causal_starts = result[1][0] if plain else None
    return result


def _fused_qk_topk(module, q, k, weights, index_topk, mask=None, varlen_starts=None, varlen_ends=None,
                   key_positions=None, use_relu=True):
    """megatron-core 0.19's ``dsa.fused_qk_topk_naive`` on coreattn: ``(None, topk_indices [b, sq, K])``.
    Megatron returns the full ``[b, sq, sk]`` scores first and DSAttention drops them; here there are none.
    The indices are int32, not Megatron's int64 (key positions fit; half the memory: 64 MiB, not 128, at
    8k tokens and top-k 2,048): DSAttention only hands them on to the sparse attention (coreattn's, which
    keeps int32) and to the index-sharing layers after it (CoreDSAttentions too)."""
    keys = _indexer_keys(module, mask, varlen_starts, varlen_ends, key_positions)
    if keys is NotImplemented or index_topk < 1:
        return NotImplemented
    got = _indexer.indexer_topk(q, k, weights, index_topk, layout="sbhd", relu=use_relu, backend=module.backend,
                                index_dtype=torch.int32, **keys)
    return None, got.indices.transpose(0, 1)  # [sq, b, K] view of a [b, sq, K] buffer: Megatron's, contiguous


def _indexer_loss(module, q, weights, k, query, key, softmax_scale, topk, loss_coeff, mask, sparse_loss,
                  pg_collection, varlen_starts=None, varlen_ends=None, key_positions=None, query_valid_rows=None,
                  calculate_per_token_loss=False, use_relu=True):
    """megatron-core 0.19's ``dsa.FusedDSAIndexerLoss.apply`` on coreattn: ``(topk_indices [b, sq, K] int32,
    loss)``, the loss differentiable in q, k and weights, computed chunk by chunk (no [b, sq, sk] tensor)."""
    keys = _indexer_keys(module, mask, varlen_starts, varlen_ends, key_positions)
    if keys is NotImplemented or topk < 1:
        return NotImplemented
    if key.dim() == 4 and key.shape[2] > 1 and key.stride(2) == 0:
        key = key[:, :, :1]  # Megatron expands the absorbed latent key over the heads: one head it is
    tp = getattr(pg_collection, "tp", None)
    rows = query_valid_rows
    if rows is not None:  # Megatron's [sq] or [b, sq] -> the token dims [sq, b]
        rows = rows.to(torch.bool)
        rows = (rows[:, None] if rows.dim() == 1 else rows.transpose(0, 1)).expand(q.shape[0], q.shape[1])
    indices, loss = _indexer.indexer_topk_and_loss(
        q, k, weights, query, key, topk, softmax_scale, loss_coeff, sparse=bool(sparse_loss), layout="sbhd",
        relu=use_relu, query_valid_rows=rows, calculate_per_token_loss=bool(calculate_per_token_loss),
        tp_group=tp if tp is not None and tp.size() > 1 else None, backend=module.backend, index_dtype=torch.int32,
        **keys)
    return indices.transpose(0, 1), loss


def _rotate_activation(module, x):
    """Megatron's ``dsa.rotate_activation`` (bf16 only, fast_hadamard_transform's CUDA kernel) on
    coreattn: any float dtype, any device."""
    return _indexer.rotate_activation(x, backend=module.backend)


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
# 0.19's fused (TileLang/cuDNN) indexer hooks, asked before the reference path when a fused DSA backend is
# configured: declined while the indexer runs on coreattn, so one layer's top-k comes from one place
_DECLINED_INDEXER = (("dsa_kernels", "run_fused_qk_topk"), ("dsa_kernels", "run_fused_qk_topk_with_loss"))


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


def _names(fn) -> set:
    """The globals and attributes ``fn`` looks up, in its nested functions too."""
    codes, names = [inspect.unwrap(fn).__code__], set()
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes += [c for c in code.co_consts if inspect.iscode(c)]
    return names


def _same_params(fn, replacement) -> bool:
    mine = list(inspect.signature(replacement).parameters)[1:]  # without ``module``
    return list(inspect.signature(fn).parameters) == mine


def _find_indexer_hooks() -> tuple[list, str | None]:
    """Megatron's indexer steps CoreDSAttention runs on coreattn, as (owner, name, replacement, is a
    Function) hooks, and None; or no hooks and why (then Megatron's indexer runs, S x S and all)."""
    loss = getattr(_dsa, "FusedDSAIndexerLoss", None)
    topk = getattr(_dsa, "fused_qk_topk_naive", None)
    rotate = getattr(_dsa, "rotate_activation", None)
    indexer = getattr(_dsa, "DSAIndexer", None)
    if loss is None or topk is None or rotate is None or indexer is None:
        return [], f"megatron-core {MEGATRON_VERSION} has no FusedDSAIndexerLoss / fused_qk_topk_naive (0.19's indexer)"
    forward = _names(_dsa.DSAttention.forward)
    loss_params = list(inspect.signature(loss.forward).parameters)[1:]  # without ``ctx``
    checks = [("FusedDSAIndexerLoss" in forward and loss_params == list(inspect.signature(_indexer_loss).parameters)[1:],
               "FusedDSAIndexerLoss"),
              ("fused_qk_topk_naive" in forward and _same_params(topk, _fused_qk_topk), "fused_qk_topk_naive"),
              ("rotate_activation" in _names(indexer.forward_before_topk) and _same_params(rotate, _rotate_activation),
               "rotate_activation")]
    wrong = [name for ok, name in checks if not ok]
    if wrong:
        return [], (f"megatron-core {MEGATRON_VERSION}: DSAttention's {', '.join(wrong)} is not what coreattn's "
                    "indexer replaces (megatron-core 0.19's)")
    hooks = [(_dsa, "FusedDSAIndexerLoss", _indexer_loss, True), (_dsa, "fused_qk_topk_naive", _fused_qk_topk, False),
             (_dsa, "rotate_activation", _rotate_activation, False)]
    if _FORWARD_MASK is not None and "build_dsattention_forward_mask" in forward:
        hooks.append((_dsa.dsa_masking, "build_dsattention_forward_mask", _forward_mask, False))
    return hooks, None


_INDEXER_HOOKS, INDEXER_REASON = _find_indexer_hooks()
INDEXER_ON_COREATTN = bool(_INDEXER_HOOKS)  # else Megatron's indexer runs (INDEXER_REASON says why)
_active: contextvars.ContextVar = contextvars.ContextVar("coreattn_dsattention", default=None)
_lock = threading.Lock()
_users = 0
_installed: list = []  # (owner, name, Megatron's function, dispatcher) while _users > 0


def _dispatch(original, replacement, args, kwargs):
    """``replacement(module, ...)`` inside a CoreDSAttention forward, unless it answers NotImplemented;
    Megatron's ``original`` everywhere else."""
    module = _active.get()
    if module is not None:
        out = replacement(module, *args, **kwargs)
        if out is not NotImplemented:
            return out
    return original(*args, **kwargs)


def _dispatcher(original, replacement):
    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        return _dispatch(original, replacement, args, kwargs)

    return dispatch


class _FunctionDispatcher:
    """Stands in for an autograd Function class whose ``apply`` Megatron calls (FusedDSAIndexerLoss);
    any other attribute is the class's."""

    def __init__(self, original, replacement):
        self.original, self.replacement = original, replacement

    def apply(self, *args, **kwargs):
        return _dispatch(self.original.apply, self.replacement, args, kwargs)

    def __getattr__(self, name):
        return getattr(self.original, name)


def _decline(module, *args, **kwargs):
    return None  # Megatron's "declined" answer for an optional fused hook


def _install() -> None:
    global _users
    with _lock:
        if _users == 0:
            hooks = [(_dsa, SEAM.name, SEAM.replacement, False)] + _INDEXER_HOOKS
            declined = _DECLINED + (_DECLINED_INDEXER if _INDEXER_HOOKS else ())
            hooks += [(getattr(_dsa, owner), name, _decline, False) for owner, name in declined
                      if hasattr(getattr(_dsa, owner, None), name)]
            for owner, name, replacement, function in hooks:
                original = getattr(owner, name)
                dispatch = (_FunctionDispatcher if function else _dispatcher)(original, replacement)
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
    ``COREATTN_BACKEND`` environment variable, in that order (``"npu_fused"``, one pin for a whole
    spec, leaves the DSA default, which on an NPU is torch_npu's DSA operators where a call fits
    them, else Triton or torch, per call). Parameters, buffers and state-dict keys are Megatron's:
    checkpoints move between the two unchanged.
    """

    def __init__(self, *args, backend: str | Backend | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        override = backend if backend is not None else getattr(self.config, CONFIG_BACKEND_ATTR, None)
        source = "backend" if backend is not None else f"config.{CONFIG_BACKEND_ATTR}"
        self.backend = None if override is None else parse_backend(override, source)
        if self.backend is Backend.NPU_FUSED:  # one pin for a whole spec or config (dense attention's choice):
            self.backend = None  # the DSA default, npu_fused per call where it fits, as COREATTN_BACKEND=npu_fused

    def forward(self, *args, **kwargs):
        self._plain_causal_starts = None  # set by Megatron's mask builder in this forward (_forward_mask)
        with routed(self):
            return super().forward(*args, **kwargs)


__all__ = ["CoreDSAttention", "SEAM", "MEGATRON_VERSION", "routed"]
