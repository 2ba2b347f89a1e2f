"""The attention custom operators: forward and backward over one backend's pair, with autograd.

Every backend that coreattn differentiates itself implements the same pair (an ``AttnImpl``):

- ``fwd(q, k, v, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params, rng_state, softmax_offset,
  return_max_logit, bias=None) -> (out, lse, max_logit or None)``: lse float32 includes the softmax
  offset's sink term; max_logit float32 [Hq] when asked for; ``bias`` an additive bias computed in
  registers (a ``TableBias``, coreattn/kernels/attn_common.py);
- ``bwd(dout, q, k, v, out, lse, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params, rng_state,
  softmax_offset, bias=None) -> (dq, dk, dv, d_offset)`` from the saved out and lse; d_offset is None
  without a softmax offset; with a bias also ``d_table, d_coef`` (fp32; d_coef None without
  coefficients). Additive over key sets that share one lse (a context-parallel ring sums them).

Backends: Triton (the kernels' launchers) and torch (coreattn/layers/torch_backend/). The
softmax offset's gradient is the same torch reduction for both (``softmax_offset_grad``) over
per-row sums of P * dP that each backend accumulates in fp32 (float64 for float64 inputs).

The pair is exposed as PyTorch custom operators, so ``torch.compile`` traces a call as one opaque
node (no graph break) and eager runs the very same code:

- ``coreattn::attn_fwd(q, k, v, fmt, <q layout>, <k layout>, max_seqlen_q, max_seqlen_k,
  softmax_scale, window_left, window_right, bottom_right, dropout_p, rng_state?, softmax_offset?,
  return_max_logit, backend, validate, bias_table?, bias_coef?, bias_lo, bias_clamp) -> (out, lse,
  max_logit)``: the bias's four are a ``TableBias``'s fields (no bias: ``bias_table`` None);
- ``coreattn::attn_bwd(dout, q, k, v, out, lse, fmt, <q layout>, <k layout>, ...) -> (dq, dk, dv,
  d_offset, d_table, d_coef)``, each of the last three an empty ``[0]`` placeholder without its input;
- ``coreattn::rng_state(q) -> int64 [3]``: the dropout RNG state, drawn from the generator of
  q's device when the op runs, so a compiled graph draws exactly what eager draws (Inductor would
  otherwise replace a traced ``randint`` with its own RNG).

A side's layout is four tensors ``seq, lens?, keep?, gid?`` (``coreattn.kernels.packing.Packing``
without its format), read according to ``fmt``:

- ``"thd"``: ``seq`` cu_seqlens int32 ``[B+1]``; with ``lens``, either span starts ``[B]`` or the
  cu_seqlens ``[B+1]`` whose slots hold ``lens[b]`` used tokens (flash-attn 3's seqused): span
  starts are ``seq[:B]``;
- ``"bshd"`` / ``"sbhd"``: ``seq``/``lens`` the int32 ``[B]`` spans; ``keep`` a ``[B, S]`` bool or
  0/1 integer keep mask as the caller gave it (converted to the kernels' uint8 in the op);
- ``"thd_position_ids"``: packed thd tokens ``[T, H, D]`` whose sequences are given by ``seq``,
  position ids ``[rows, S]`` or ``[S]`` (any integer dtype; T = rows * S, or one row standing for
  every row of a batch of T / S rows): a sequence starts at
  each row's first token and wherever the position id does not go up by one (transformers'
  packed-sequence rule: ``DataCollatorWithFlattening``'s restarting ids, or plain per-row
  positions). The op derives cu_seqlens from them when it runs (``cu_seqlens_from_position_ids``:
  on a device a fixed capacity of T + 1 entries, no host sync), so neither traced code nor a CUDA
  graph needs the number of sequences.

Everything that reads tensor values runs inside the ops: the public functions' value checks
(``validate=True``, coreattn.layers.checks.check_layout_values), the backend choice (``backend``:
an override name or "" for the per-device default, resolved with
coreattn.layers.backends.select_backend when the op runs, so ``COREATTN_BACKEND`` keeps working
under compile) and the torch backend's length reads. The fake (meta) implementations give the
exact shapes, dtypes and strides from the input shapes alone: out ``q.shape[:-1] + (Dv,)``
contiguous in q's dtype, lse ``[Hq, T]`` (thd) or ``[B, Hq, S]`` float32 (float64 for float64
inputs), max_logit ``[Hq]`` of the same dtype when asked for, else an empty ``[0]`` placeholder.
"""

from __future__ import annotations

import inspect
from typing import Callable, NamedTuple, Optional

import torch

from coreattn.layers.backends import Backend, select_backend
from coreattn.kernels import varlen_attn_bwd, varlen_attn_fwd
from coreattn.kernels.attn_common import TableBias
from coreattn.kernels.packing import Packing, new_rowstat
from coreattn.kernels import dropout
from coreattn.layers.checks import KERNEL_DTYPES, VarlenParams, check_layout_values, keep_as_uint8, reads_values
from coreattn.kernels.softmax_offset import softmax_offset_grad
from coreattn.layers.torch_backend import attn_torch_bwd, attn_torch_fwd

POSITION_IDS = "thd_position_ids"


class AttnImpl(NamedTuple):
    name: str
    fwd: Callable
    bwd: Callable


def _triton_fwd(q, k, v, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params: VarlenParams, rng_state,
                softmax_offset, return_max_logit, bias=None):
    res = varlen_attn_fwd(q, k, v, q_pack, k_pack, max_seqlen_q, params.softmax_scale, params.window_left,
                          params.window_right, params.bottom_right, dropout_p=params.dropout_p, rng_state=rng_state,
                          softmax_offset=softmax_offset, return_max_logit=return_max_logit, bias=bias)
    return res if return_max_logit else (*res, None)


def _triton_bwd(dout, q, k, v, out, lse, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params: VarlenParams,
                rng_state, softmax_offset, bias=None):
    rowsum = None if softmax_offset is None else new_rowstat(q, q_pack, fill=0.0)
    grads = varlen_attn_bwd(dout, q, k, v, out, lse, q_pack, k_pack, max_seqlen_q, max_seqlen_k,
                            params.softmax_scale, params.window_left, params.window_right, params.bottom_right,
                            dropout_p=params.dropout_p, rng_state=rng_state, sink_rowsum=rowsum, bias=bias)
    d_offset = None if softmax_offset is None else softmax_offset_grad(softmax_offset, lse, rowsum, q_pack)
    return (*grads[:3], d_offset, *grads[3:])


TRITON = AttnImpl("triton", _triton_fwd, _triton_bwd)
TORCH = AttnImpl("torch", attn_torch_fwd, attn_torch_bwd)


def _table_bias(table, coef, lo: int, clamp: bool) -> TableBias | None:
    """The op's bias arguments as the backends take them (None without a table)."""
    return None if table is None else TableBias(table, coef, lo, clamp)


def _stat_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _impl(q: torch.Tensor, backend: str) -> AttnImpl:
    """The backend for q's device (``backend``: an override name, "" for the default), chosen when
    the op runs."""
    chosen = select_backend(q.device, backend or None)
    if chosen is Backend.TORCH:
        return TORCH
    if chosen is not Backend.TRITON:
        raise RuntimeError(f"the {chosen.value} backend does not run through the coreattn attention op "
                           "(coreattn.layers.dispatch.run_attention calls it directly)")
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; the Triton backend supports float16, bfloat16, float32")
    return TRITON


def cu_seqlens_from_position_ids(position_ids: torch.Tensor, tokens: int, compact: bool | None = None) -> torch.Tensor:
    """int32 cu_seqlens of ``tokens`` packed tokens given as rows of ``position_ids`` (``[rows, S]``
    or ``[S]``; one row stands for every row when tokens > rows * S): a sequence starts at each
    row's first token and wherever the position id does not go up by one (transformers'
    packed-sequence rule).

    On a device the number of sequences is not read back (no host sync: the path can be captured
    in a CUDA graph and replayed with other position ids): the result has a fixed capacity of
    ``tokens + 1`` entries, the sequences followed by zero-length ones (the kernels' tile maps give
    those no tiles: one idle program per head each). On CPU, where reading is free
    (``coreattn.layers.checks.reads_values``), it holds the sequences only (``compact``: force
    either form). Nothing is cached: each call computes from the values the tensor holds now."""
    rows = position_ids.reshape(-1, position_ids.shape[-1]) if position_ids.dim() else position_ids.reshape(1, 1)
    if rows.numel() != tokens:
        if rows.shape[0] != 1 or tokens % rows.shape[1]:
            raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} do not cover the {tokens} tokens")
        rows = rows.expand(tokens // rows.shape[1], -1)
    starts = torch.ones_like(rows, dtype=torch.bool)
    starts[:, 1:] = rows[:, 1:] - rows[:, :-1] != 1
    starts = starts.reshape(-1)
    end = torch.full((1,), tokens, dtype=torch.int32, device=position_ids.device)
    if reads_values(position_ids) if compact is None else compact:
        return torch.cat([starts.nonzero().view(-1).to(torch.int32), end])
    # sequence number (from 1) of each token; cu[b] = the number of tokens in sequences 1..b
    seq_of_token = starts.cumsum(0, dtype=torch.int32)
    slots = torch.arange(tokens + 1, dtype=torch.int32, device=position_ids.device)
    return torch.searchsorted(seq_of_token, slots, right=True).to(torch.int32)


def _packings(fmt, q_seq, q_lens, q_keep, q_gid, k_seq, k_lens, k_keep, k_gid, tokens_q: int,
              tokens_k: int) -> tuple[Packing, Packing]:
    """The kernels' Packings from the op's layout arguments (see the module docstring)."""
    if fmt == POSITION_IDS:
        cu_q = cu_seqlens_from_position_ids(q_seq, tokens_q)
        cu_k = cu_q if k_seq is q_seq and tokens_k == tokens_q else cu_seqlens_from_position_ids(k_seq, tokens_k)
        return Packing("thd", cu_q, gid=q_gid), Packing("thd", cu_k, gid=k_gid)

    def one(seq, lens, keep, gid):
        if lens is not None and seq.numel() != lens.numel():
            seq = seq[:lens.numel()]  # cu_seqlens slots with seqused counts: starts are cu[:-1]
        return Packing(fmt, seq, lens, keep_as_uint8(keep), gid)

    return one(q_seq, q_lens, q_keep, q_gid), one(k_seq, k_lens, k_keep, k_gid)


def _tokens(x: torch.Tensor, fmt: str) -> int:
    return x.shape[1] if fmt == "bshd" else x.shape[0]


@torch.library.custom_op("coreattn::attn_fwd", mutates_args=())
def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str,
             q_seq: torch.Tensor, q_lens: Optional[torch.Tensor], q_keep: Optional[torch.Tensor],
             q_gid: Optional[torch.Tensor], k_seq: torch.Tensor, k_lens: Optional[torch.Tensor],
             k_keep: Optional[torch.Tensor], k_gid: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
             softmax_scale: float, window_left: int, window_right: int, bottom_right: bool, dropout_p: float,
             rng_state: Optional[torch.Tensor], softmax_offset: Optional[torch.Tensor], return_max_logit: bool,
             backend: str, validate: bool, bias_table: Optional[torch.Tensor] = None,
             bias_coef: Optional[torch.Tensor] = None, bias_lo: int = 0,
             bias_clamp: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, max_logit); max_logit is an empty [0] tensor unless ``return_max_logit``."""
    if validate and fmt != POSITION_IDS:
        check_layout_values(fmt, q_seq, q_lens, q_keep, k_seq, k_lens, k_keep, _tokens(q, fmt), _tokens(k, fmt),
                            max_seqlen_q, max_seqlen_k)
    impl = _impl(q, backend)
    q_pack, k_pack = _packings(fmt, q_seq, q_lens, q_keep, q_gid, k_seq, k_lens, k_keep, k_gid, q.shape[0],
                               k.shape[0])
    params = VarlenParams(softmax_scale, window_left, window_right, bottom_right, dropout_p)
    out, lse, max_logit = impl.fwd(q, k, v, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params, rng_state,
                                   softmax_offset, return_max_logit,
                                   bias=_table_bias(bias_table, bias_coef, bias_lo, bias_clamp))
    if max_logit is None:
        max_logit = torch.empty(0, dtype=_stat_dtype(q), device=q.device)
    return out, lse, max_logit


def _lse_shape(q: torch.Tensor, fmt: str) -> tuple:
    heads = q.shape[-2]
    if fmt in ("thd", POSITION_IDS):
        return (heads, q.shape[0])
    batch, seqlen = (q.shape[0], q.shape[1]) if fmt == "bshd" else (q.shape[1], q.shape[0])
    return (batch, heads, seqlen)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, fmt, q_seq, q_lens, q_keep, q_gid, k_seq, k_lens, k_keep, k_gid, max_seqlen_q,
                   max_seqlen_k, softmax_scale, window_left, window_right, bottom_right, dropout_p, rng_state,
                   softmax_offset, return_max_logit, backend, validate, bias_table=None, bias_coef=None, bias_lo=0,
                   bias_clamp=False):
    stat = _stat_dtype(q)
    out = q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))
    lse = q.new_empty(_lse_shape(q, fmt), dtype=stat)
    max_logit = q.new_empty((q.shape[-2],) if return_max_logit else (0,), dtype=stat)
    return out, lse, max_logit


@torch.library.custom_op("coreattn::attn_bwd", mutates_args=())
def attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, fmt: str, q_seq: torch.Tensor, q_lens: Optional[torch.Tensor],
             q_keep: Optional[torch.Tensor], q_gid: Optional[torch.Tensor], k_seq: torch.Tensor,
             k_lens: Optional[torch.Tensor], k_keep: Optional[torch.Tensor], k_gid: Optional[torch.Tensor],
             max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
             bottom_right: bool, dropout_p: float, rng_state: Optional[torch.Tensor],
             softmax_offset: Optional[torch.Tensor], backend: str, bias_table: Optional[torch.Tensor] = None,
             bias_coef: Optional[torch.Tensor] = None, bias_lo: int = 0, bias_clamp: bool = False,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, d_offset, d_table, d_coef) from the forward's out and lse, in q, k, v's (and the
    offset's and bias's) shapes and dtypes (contiguous); each of the last three is an empty [0] tensor
    without its input. ``backend`` is resolved again: the forward's choice unless COREATTN_BACKEND
    changed in between."""
    impl = _impl(q, backend)
    q_pack, k_pack = _packings(fmt, q_seq, q_lens, q_keep, q_gid, k_seq, k_lens, k_keep, k_gid, q.shape[0],
                               k.shape[0])
    params = VarlenParams(softmax_scale, window_left, window_right, bottom_right, dropout_p)
    bias = _table_bias(bias_table, bias_coef, bias_lo, bias_clamp)
    grads = impl.bwd(dout, q, k, v, out, lse, q_pack, k_pack, max_seqlen_q, max_seqlen_k, params, rng_state,
                     softmax_offset, **({} if bias is None else dict(bias=bias)))
    dq, dk, dv, d_offset, d_table, d_coef = (*grads, None, None) if bias is None else grads
    def none():  # an empty placeholder of its own (a custom op's outputs may not alias each other)
        return torch.empty(0, dtype=_stat_dtype(q), device=q.device)

    d_table = none() if d_table is None else d_table.to(bias_table.dtype)
    d_coef = none() if d_coef is None else d_coef.to(bias_coef.dtype)
    d_offset = none() if d_offset is None else d_offset
    # a custom op's outputs are fresh tensors in the fake's (contiguous) layout
    return (dq.contiguous(), dk.contiguous(), dv.contiguous(), d_offset.contiguous(), d_table.contiguous(),
            d_coef.contiguous())


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, fmt, q_seq, q_lens, q_keep, q_gid, k_seq, k_lens, k_keep, k_gid,
                   max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, bottom_right, dropout_p,
                   rng_state, softmax_offset, backend, bias_table=None, bias_coef=None, bias_lo=0, bias_clamp=False):
    d_offset, d_table, d_coef = (q.new_empty((0,), dtype=_stat_dtype(q)) if t is None else t.new_empty(t.shape)
                                 for t in (softmax_offset, bias_table, bias_coef))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), d_offset, d_table, d_coef


_LAYOUT_ARGS = ("fmt", "q_seq", "q_lens", "q_keep", "q_gid", "k_seq", "k_lens", "k_keep", "k_gid",
                "max_seqlen_q", "max_seqlen_k", "softmax_scale", "window_left", "window_right", "bottom_right",
                "dropout_p")
_FWD_ARGS = ("q", "k", "v") + _LAYOUT_ARGS + ("rng_state", "softmax_offset", "return_max_logit", "backend", "validate",
                                             "bias_table", "bias_coef", "bias_lo", "bias_clamp")
_FWD_DEFAULTS = dict(bias_table=None, bias_coef=None, bias_lo=0, bias_clamp=False)
_SAVED = ("q", "k", "v", "q_seq", "q_lens", "q_keep", "q_gid", "k_seq", "k_lens", "k_keep", "k_gid", "rng_state",
          "softmax_offset", "bias_table", "bias_coef")


def _setup_context(ctx, inputs, output):
    """Saves only what flash attention saves: q, k, v, out, lse (O(T*H*D)), the small layout
    tensors, and the dropout RNG state and softmax offset when given."""
    args = {**_FWD_DEFAULTS, **dict(zip(_FWD_ARGS, inputs))}  # trailing defaults may be left out of inputs
    out, lse, max_logit = output
    ctx.save_for_backward(out, lse, *(args[name] for name in _SAVED))
    ctx.options = {name: args[name] for name in _LAYOUT_ARGS + ("bias_lo", "bias_clamp")
                   if not name.startswith(("q_", "k_"))}
    ctx.backend = args["backend"]
    ctx.mark_non_differentiable(lse, max_logit)


def _backward(ctx, dout, dlse, dmax_logit):
    # lse and max_logit are non-differentiable: their incoming gradients are ignored
    out, lse, *saved = ctx.saved_tensors
    t = dict(zip(_SAVED, saved))
    opts = ctx.options
    grads = {}
    # trailing arguments left at their defaults (no bias) may be missing from needs_input_grad
    needs = tuple(ctx.needs_input_grad) + (False,) * (len(_FWD_ARGS) - len(ctx.needs_input_grad))
    wants = {name: needs[_FWD_ARGS.index(name)] for name in ("softmax_offset", "bias_table", "bias_coef")}
    if any(ctx.needs_input_grad[:3]) or any(wants.values()):
        dq, dk, dv, d_offset, d_table, d_coef = attn_bwd(
            dout, t["q"], t["k"], t["v"], out, lse, opts["fmt"], *(t[name] for name in _SAVED[3:11]),
            opts["max_seqlen_q"], opts["max_seqlen_k"], opts["softmax_scale"], opts["window_left"],
            opts["window_right"], opts["bottom_right"], opts["dropout_p"], t["rng_state"], t["softmax_offset"],
            ctx.backend, t["bias_table"], t["bias_coef"], opts["bias_lo"], opts["bias_clamp"])
        grads = dict(q=dq, k=dk, v=dv)
        grads.update((name, g) for name, g in zip(wants, (d_offset, d_table, d_coef)) if wants[name])
    return tuple(grads.get(name) for name in _FWD_ARGS)


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


# tagged as a random op, as torch's own are, for the compiler passes that look for them (custom_op
# takes ``tags`` from torch 2.5 on)
_RANDOM = ({"tags": (torch.Tag.nondeterministic_seeded,)}
           if "tags" in inspect.signature(torch.library.custom_op).parameters else {})


@torch.library.custom_op("coreattn::rng_state", mutates_args=(), **_RANDOM)
def rng_state(q: torch.Tensor) -> torch.Tensor:
    """A fresh dropout RNG state (int64 [3]: seed, offset, head offset 0) from the default generator of
    q's device."""
    return dropout.rng_state(q.device)


@rng_state.register_fake
def _rng_state_fake(q):
    return torch.empty(3, dtype=torch.int64, device=q.device)


def attention(q, k, v, q_pack: Packing, k_pack: Packing, max_seqlen_q: int, max_seqlen_k: int, params: VarlenParams,
              backend: str = "", *, rng_state: torch.Tensor | None = None,
              softmax_offset: torch.Tensor | None = None, return_max_logit: bool = False, validate: bool = False,
              bias: TableBias | None = None):
    """(out, lse, max_logit or None) through ``coreattn::attn_fwd`` (differentiable in q, k, v,
    softmax_offset and the bias's table and coefficients). The packings carry the op's layout
    (``q_pack.fmt`` is the op's ``fmt``)."""
    if q_pack.fmt != k_pack.fmt:
        raise ValueError(f"q and k layouts differ: {q_pack.fmt!r} and {k_pack.fmt!r}")
    table, coef, lo, clamp = bias if bias is not None else (None, None, 0, False)
    out, lse, max_logit = attn_fwd(q, k, v, q_pack.fmt, q_pack.seq, q_pack.lens, q_pack.keep, q_pack.gid, k_pack.seq,
                                   k_pack.lens, k_pack.keep, k_pack.gid, max_seqlen_q, max_seqlen_k,
                                   params.softmax_scale, params.window_left, params.window_right, params.bottom_right,
                                   params.dropout_p, rng_state, softmax_offset, return_max_logit, backend, validate,
                                   table, coef, lo, clamp)
    return out, lse, (max_logit if return_max_logit else None)


def attn_torch(q, k, v, q_pack: Packing, k_pack: Packing, params: VarlenParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch backend as a differentiable function of q, k, v: (out, lse); dropout draws its RNG
    state from the device's generator."""
    state = rng_state(q) if params.dropout_p > 0 else None
    out, lse, _ = attention(q, k, v, q_pack, k_pack, 0, 0, params, Backend.TORCH.value, rng_state=state)
    return out, lse
