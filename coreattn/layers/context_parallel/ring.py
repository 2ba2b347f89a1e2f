"""Context parallelism, ring exchange (Megatron's ``cp_comm_type="p2p"``, and the outer stage of
``"a2a+p2p"``, where the ranks are the a2a groups and the layout the one each group holds).

The cp ranks form a ring (rank r sends to r+1, receives from r-1). At step i = 0 .. cp-1 rank r
holds the K/V of rank s = r - i (chunks s and 2cp-1-s of every sequence, one packed buffer) and,
while it attends to them, already sends them on and receives the next rank's: K/V memory is two
local buffers, never the whole sequence. With NCCL the sends run on the communicator's stream, so
they overlap the attention of the current step; with gloo on CPU they are merely asynchronous.

Causal load balance (Transformer Engine's schedule): local queries are chunks r and 2cp-1-r.
- step 0 (s = r): one causal call over the rank's own 2c tokens (local order is global order);
- s < r: both query chunks see all of chunk s and none of chunk 2cp-1-s: all queries against the
  first half of the buffer, no mask;
- s > r: only query chunk 2cp-1-r sees anything, and it sees both chunks fully: the second half of
  the queries against the whole buffer, no mask.
Every step does c x 2c of unmasked work (step 0: a causal 2c x 2c), so the ranks stay balanced.
Dropout (its token ids must be globally contiguous within a span) and causal sliding windows
(the window's reach depends on the global distance between chunks) run block by block instead:
each (query chunk, key chunk) pair is its own call, a diagonal pair causal with the window, an
earlier key chunk either unmasked or, under a window, split into the rows that see the whole
chunk and the rest with a top-left aligned (0, -1) window on shifted spans.

Each call returns a partial output and its log-sum-exp; partials are merged in float32 (float64
for float64 inputs): lse = logaddexp(lse, lse_i), out = out * exp(lse_old - lse) + out_i *
exp(lse_i - lse). A softmax offset (sink) enters once, after the last step, on rows that saw a
key. The backward runs the ring again: every step calls the backend's backward with the MERGED
out and lse (P = exp(S - lse) is then the true probability), accumulates dQ locally and adds its
dK/dV to an accumulator that travels with the K/V chunks and arrives, after cp hops, at the
rank that owns them. Fixed order everywhere: deterministic for a fixed cp and backend.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from coreattn.layers.backends import Backend, select_backend
from coreattn.kernels.packing import Packing
from coreattn.layers.checks import KERNEL_DTYPES, VarlenParams
from coreattn.layers.context_parallel.layout import CPLayout
from coreattn.layers.dispatch import TORCH, TRITON
from coreattn.layers.function import AttnImpl


class Part(NamedTuple):
    """One attention call of a ring step: query spans on the local q, key spans on the K/V buffer."""

    q_pack: Packing
    k_pack: Packing
    max_q: int
    max_k: int
    params: VarlenParams


def _part(layout: CPLayout, q_half: int, q_chunk: int, q_off, q_len, k_half: int, k_chunk: int, k_off, k_len,
          params: VarlenParams) -> Part:
    """Spans start ``off`` tokens into local half ``half`` (global chunk ``chunk``) of each sequence."""
    c = layout.chunk
    k_len = torch.where(q_len > 0, k_len, torch.zeros_like(k_len))  # rows that are all padding do no work
    as32 = lambda t: t.to(torch.int32)  # noqa: E731
    q_pack = Packing(layout.fmt, as32(layout.local_start + q_half * c + q_off), as32(q_len),
                     gid=as32(layout.gid_start + q_chunk * c + q_off))
    k_pack = Packing(layout.fmt, as32(layout.local_start + k_half * c + k_off), as32(k_len),
                     gid=as32(layout.gid_start + k_chunk * c + k_off))
    bound = 2 * layout.max_chunk
    return Part(q_pack, k_pack, bound, bound, params)


def _windowed_pair(layout: CPLayout, qh: int, jq: int, rq, kh: int, jk: int, rk, params: VarlenParams) -> list[Part]:
    """Query chunk jq against an earlier key chunk jk under a causal window of ``params.window_left``:
    query i (chunk-local) sees key t iff t >= i - lim, lim = left - (jq - jk) * c_b, a per-sequence
    shift no scalar window expresses. Rows i <= lim see the whole chunk (no mask); rows from
    i0 = clamp(lim + 1) see keys from t0 = i0 - lim on: top-left (0, -1) on those spans."""
    zero = torch.zeros_like(rq)
    lim = params.window_left - (jq - jk) * layout.chunk
    i0 = torch.minimum((lim + 1).clamp(min=0), rq)
    t0 = torch.minimum((i0 - lim).clamp(min=0), rk)
    full = params._replace(window_left=-1, window_right=-1)
    band = params._replace(window_left=0, window_right=-1, bottom_right=False)
    return [_part(layout, qh, jq, zero, i0, kh, jk, zero, rk, full),
            _part(layout, qh, jq, i0, rq - i0, kh, jk, t0, rk - t0, band)]


def step_parts(layout: CPLayout, source: int, params: VarlenParams, causal: bool) -> list[Part]:
    """The calls of the ring step at which this rank holds rank ``source``'s K/V."""
    n, r = layout.cp_size, layout.cp_rank
    jq, jk = (r, 2 * n - 1 - r), (source, 2 * n - 1 - source)
    rq = [layout.chunk_real(j) for j in jq]
    rk = [layout.chunk_real(j) for j in jk]
    zero = torch.zeros_like(layout.chunk)
    full = params._replace(window_left=-1, window_right=-1)
    windowed = causal and params.window_left >= 0
    if params.dropout_p == 0 and not windowed:
        # real local tokens are a prefix of the 2c local rows: one span covers both chunks
        q_all, k_all = rq[0] + rq[1], rk[0] + rk[1]
        if not causal:
            return [_part(layout, 0, jq[0], zero, q_all, 0, jk[0], zero, k_all, full)]
        if source == r:
            return [_part(layout, 0, jq[0], zero, q_all, 0, jk[0], zero, k_all, params)]
        if source < r:
            return [_part(layout, 0, jq[0], zero, q_all, 0, jk[0], zero, rk[0], full)]
        return [_part(layout, 1, jq[1], zero, rq[1], 0, jk[0], zero, k_all, full)]
    parts = []
    for qh in (0, 1):
        for kh in (0, 1):
            if causal and jq[qh] < jk[kh]:
                continue
            if not causal:
                parts.append(_part(layout, qh, jq[qh], zero, rq[qh], kh, jk[kh], zero, rk[kh], full))
            elif jq[qh] == jk[kh]:  # a chunk against itself: causal (and the window), equal lengths
                parts.append(_part(layout, qh, jq[qh], zero, rq[qh], kh, jk[kh], zero, rk[kh], params))
            elif not windowed:
                parts.append(_part(layout, qh, jq[qh], zero, rq[qh], kh, jk[kh], zero, rk[kh], full))
            else:
                parts += _windowed_pair(layout, qh, jq[qh], rq[qh], kh, jk[kh], rk[kh], params)
    return parts


def ring_impl(q: torch.Tensor, backend) -> AttnImpl:
    """The backend's forward/backward pair; npu_fused returns no lse to merge and raises."""
    chosen = select_backend(q.device, backend)
    if chosen is Backend.NPU_FUSED:
        raise NotImplementedError("comm='p2p' merges partial results through their log-sum-exp, which the npu_fused "
                                  "backend does not return; use comm='all_gather' or 'a2a', or backend='triton'")
    if chosen is Backend.TORCH:
        return TORCH
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; the Triton backend supports float16, bfloat16, float32")
    return TRITON


class Ring:
    """The ring over ``group`` and every step's calls (built once, used by forward and backward)."""

    def __init__(self, group, layout: CPLayout, params: VarlenParams, causal: bool):
        n, r = layout.cp_size, layout.cp_rank
        self.group, self.layout = group, layout
        self.next = dist.get_global_rank(group, (r + 1) % n)
        self.prev = dist.get_global_rank(group, (r - 1) % n)
        self.steps = [step_parts(layout, (r - i) % n, params, causal) for i in range(n)]

    def start(self, send: torch.Tensor):
        """Send ``send`` to the next rank and receive the previous rank's into a new buffer:
        (buffer, works); wait on the works before reading the buffer or freeing ``send``."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(pending):
        recv, works = pending
        for work in works:
            work.wait()
        return recv


class LocalRing(Ring):
    """The ring's compute on one process, for benchmarks: every step attends this rank's own K/V
    buffer (same shapes as the chunks it would receive) and nothing is sent."""

    def __init__(self, layout: CPLayout, params: VarlenParams, causal: bool):
        n, r = layout.cp_size, layout.cp_rank
        self.group, self.layout, self.next, self.prev = None, layout, r, r
        self.steps = [step_parts(layout, (r - i) % n, params, causal) for i in range(n)]

    def start(self, send: torch.Tensor):
        return send, ()


def _pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[n, (B,) Hkv * (Dqk + Dv)]: one buffer, one send per step."""
    return torch.cat([k.flatten(-2), v.flatten(-2)], dim=-1)


def _unpack_kv(kv: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    width_k = k_shape[-2] * k_shape[-1]
    return kv[..., :width_k].unflatten(-1, tuple(k_shape[-2:])), kv[..., width_k:].unflatten(-1, tuple(v_shape[-2:]))


def _rows(stat: torch.Tensor, fmt: str) -> torch.Tensor:
    """A row statistic in lse's layout ([H, T] or [B, H, S]) as [T, H, 1] / [S, B, H, 1] (out's rows)."""
    return (stat.t() if fmt == "thd" else stat.permute(2, 0, 1))[..., None]


def _merge(acc, part, fmt: str):
    """Fold (out_i, lse_i) into the running (out, lse); rows where both are empty stay 0 / -inf."""
    if acc is None:
        out, lse = part
        return out.to(torch.float64 if out.dtype == torch.float64 else torch.float32), lse
    (out, lse), (out_i, lse_i) = acc, part
    lse_i = lse_i.to(lse.dtype)
    new = torch.logaddexp(lse, lse_i)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    out = out * _rows(torch.exp(lse - safe), fmt) + out_i.to(out.dtype) * _rows(torch.exp(lse_i - safe), fmt)
    return out, new


def _add_sink(out, lse, softmax_offset: torch.Tensor, fmt: str):
    """The sink logit in each row's softmax, once: rows that saw a key (finite lse) only, as a
    single device leaves rows outside every span (padding) at 0 / -inf."""
    sink = softmax_offset.to(lse.dtype)
    sink = sink[:, None] if fmt == "thd" else sink[None, :, None]
    new = torch.where(torch.isfinite(lse), torch.logaddexp(lse, sink), lse)
    scale = torch.where(torch.isfinite(lse), torch.exp(lse - new), torch.zeros_like(lse))
    return out * _rows(scale, fmt).to(out.dtype), new


class RingAttnFunction(torch.autograd.Function):
    """Ring attention over the cp group; saves only the local q, k, v, the merged out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_offset, ring: Ring, impl: AttnImpl, rng_state, return_max_logit: bool):
        fmt = ring.layout.fmt
        acc = max_logit = None
        pending = None
        kv = _pack_kv(k, v)
        for i, parts in enumerate(ring.steps):
            if i + 1 < len(ring.steps):
                pending = ring.start(kv)  # the next step's K/V moves while this step computes
            k_buf, v_buf = _unpack_kv(kv, k.shape, v.shape)
            for part in parts:
                out_i, lse_i, max_i = impl.fwd(q, k_buf, v_buf, part.q_pack, part.k_pack, part.max_q, part.max_k,
                                               part.params, rng_state, None, return_max_logit)
                acc = _merge(acc, (out_i, lse_i), fmt)
                if return_max_logit:
                    max_logit = max_i if max_logit is None else torch.maximum(max_logit, max_i)
            if i + 1 < len(ring.steps):
                kv = Ring.finish(pending)
        out, lse = acc
        if softmax_offset is not None:
            out, lse = _add_sink(out, lse, softmax_offset, fmt)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, softmax_offset, rng_state)
        ctx.ring, ctx.impl = ring, impl
        if max_logit is not None:
            ctx.mark_non_differentiable(max_logit)
        return out, max_logit

    @staticmethod
    def backward(ctx, dout, dmax_logit):
        q, k, v, out, lse, softmax_offset, rng_state = ctx.saved_tensors
        ring, impl = ctx.ring, ctx.impl
        dout = dout.contiguous()
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        dq = torch.zeros(q.shape, dtype=work, device=q.device)
        d_offset = None
        kv = _pack_kv(k, v)
        width_k = k.shape[-2] * k.shape[-1]
        pending_kv = pending_dkv = None
        for i, parts in enumerate(ring.steps):
            last = i + 1 == len(ring.steps)
            if not last:
                pending_kv = ring.start(kv)
            k_buf, v_buf = _unpack_kv(kv, k.shape, v.shape)
            dkv = torch.zeros(kv.shape, dtype=work, device=kv.device)  # this step's dK/dV of the buffer
            dk_acc, dv_acc = _unpack_kv(dkv, k.shape, v.shape)
            for part in parts:
                # each part's sink gradient covers its keys' share of rowsum(P * dP): they add up
                dq_i, dk_i, dv_i, do_i = impl.bwd(dout, q, k_buf, v_buf, out, lse, part.q_pack, part.k_pack,
                                                  part.max_q, part.max_k, part.params, rng_state, softmax_offset)
                if do_i is not None:
                    d_offset = do_i if d_offset is None else d_offset + do_i
                dq += dq_i
                dk_acc += dk_i
                dv_acc += dv_i
            if pending_dkv is not None:  # the sum so far from the ranks that held these chunks before
                dkv += Ring.finish(pending_dkv)
            # the accumulator travels in K/V's dtype; after the last step it reaches the chunks' owner
            pending_dkv = ring.start(dkv.to(kv.dtype))
            if not last:
                kv = Ring.finish(pending_kv)
        dkv = Ring.finish(pending_dkv)
        dk = dkv[..., :width_k].unflatten(-1, tuple(k.shape[-2:])).to(k.dtype)
        dv = dkv[..., width_k:].unflatten(-1, tuple(v.shape[-2:])).to(v.dtype)
        return dq.to(q.dtype), dk.contiguous(), dv.contiguous(), d_offset, None, None, None, None


def ring_attention(group, params: VarlenParams, causal: bool, impl: AttnImpl, return_max_logit: bool):
    """``attend(q, k, v, layout, softmax_offset, rng_state) -> (out, max_logit or None)``: the ring over
    ``group`` on ``layout`` (comm 'p2p': the cp layout; 'a2a+p2p': the layout of the a2a group)."""

    def attend(q, k, v, layout: CPLayout, softmax_offset, rng_state):
        ring = Ring(group, layout, params, causal)
        return RingAttnFunction.apply(q, k, v, softmax_offset, ring, impl, rng_state, return_max_logit)

    return attend
