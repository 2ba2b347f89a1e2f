"""Context parallelism for self-attention over Megatron's cp_group: ``cp_attn`` and the all-gather exchange.

Layout (Megatron-Core ``get_batch_on_this_cp_rank`` / TE ``thd_get_partitioned_indices``): each
sequence, padded to L_b (a multiple of 2*cp), is cut into 2*cp chunks of c_b = L_b / (2*cp)
tokens; rank r holds chunks r and 2*cp-1-r. cu_seqlens stay global.

Exchanges (``comm``, Megatron's ``cp_comm_type``): ``"p2p"``, a ring passing K/V chunks
(ring.py); ``"a2a"``, all-to-all from sequence shards to head shards
(a2a.py); ``"a2a+p2p"``, hierarchical: all-to-all inside Megatron's inner cp group, then the ring
over the outer group on the chunks the inner group holds together (a2a.py, layout.py, ring.py);
``"all_gather"``, here:

K and V are all-gathered once (one autograd Function; its backward reduce-scatters dK/dV) and
reordered to global token order. Each local chunk j of sequence b then attends, in span mode, to
the global key prefix it may see: with bottom-right alignment, query i of the chunk sees keys
<= j*c_b + i, exactly global causal. The two local chunk sets run as two calls, so the key spans of
one call never overlap (the dK/dV kernel writes each sequence's key range once).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from coreattn.layers.backends import Backend, select_backend
from coreattn.kernels.packing import Packing
from coreattn.kernels import dropout
from coreattn.layers.checks import (VarlenParams, check_cu_seqlens, check_flag, check_max_seqlen, check_options,
                                    check_qkv, check_softmax_offset, reads_values)
from coreattn.layers.context_parallel.a2a import a2a_attn, whole_sequences
from coreattn.layers.context_parallel.groups import HIERARCHICAL, cp_groups
from coreattn.layers.context_parallel.layout import make_layout
from coreattn.layers.context_parallel.ring import ring_attention, ring_impl
from coreattn.layers.dispatch import run_attention
from coreattn.layers.context_parallel.indices import zigzag_positions

LAYOUTS = ("thd", "sbhd")
COMMS = ("p2p", "all_gather", "a2a", HIERARCHICAL)  # Megatron's cp_comm_type values that cp_attn runs
DEFAULT_COMM = "p2p"  # Megatron's default (cp_comm_type None runs p2p)

# Process-group backends whose reduce_scatter_tensor raised "unsupported" once (gloo before it
# gained one); dK/dV then go through all_reduce + slice, twice the traffic of a reduce-scatter.
_NO_REDUCE_SCATTER: set[str] = set()


class _Call(NamedTuple):
    """One attention call: the local chunk set with global chunk index j (per sequence)."""

    q_pack: Packing
    k_pack: Packing
    max_q: int
    max_k: int


class CPPlan(NamedTuple):
    """Everything a rank needs besides q/k/v: span descriptors and the K/V reorder indices."""

    cp_size: int
    cp_rank: int
    calls: tuple[_Call, ...]
    gather_order: torch.Tensor | None  # [T] int64: row of the rank-major gather buffer for each global token
    scatter_order: torch.Tensor | None  # [T] int64: global token of each row of the rank-major buffer


def check_comm(comm) -> str:
    """A Megatron ``cp_comm_type`` that cp_attn runs; anything else raises."""
    if not isinstance(comm, str):
        raise TypeError(f"comm must be a str (one of {COMMS}), got {type(comm).__name__}")
    if comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")
    return comm


def _window_is_causal(params: VarlenParams, window_size) -> bool:
    """True: causal (optionally a left window); False: full attention. Other windows raise."""
    if params.window_right == 0:
        return True
    if params.window_left == -1 and params.window_right == -1:
        return False
    raise NotImplementedError(
        f"window_size={tuple(window_size)!r} is not supported under context parallelism: only no window "
        "(-1, -1) or causal sliding windows (left >= 0 with causal=True, or right = 0) map onto the chunk layout")


def _lens(cu: torch.Tensor) -> torch.Tensor:
    return cu[1:] - cu[:-1]


def _first_bad(mask: torch.Tensor) -> int | None:
    return int(mask.nonzero()[0]) if bool(mask.any()) else None


def _check_values_thd(n_local: int, cp_size: int, cu_q, cu_kv, pad_q, pad_kv, pad_q_name: str,
                      max_seqlen_q: int, max_seqlen_kv: int) -> None:
    """Checks that read cu_seqlens' values: free on CPU, a host sync elsewhere."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_kv", cu_kv), (pad_q_name, pad_q)):
        if int(cu[0]) != 0:
            raise ValueError(f"{name} must start at 0, got {int(cu[0])}")
        if bool((_lens(cu) < 0).any()):
            raise ValueError(f"{name} must be non-decreasing, got {cu.tolist()}")
    if not (torch.equal(cu_q, cu_kv) and torch.equal(pad_q, pad_kv)):
        raise ValueError("self-attention under context parallelism: cu_seqlens_kv(_padded) must equal "
                         "cu_seqlens_q(_padded) (q, k and v share one token layout)")
    real, padded = _lens(cu_q), _lens(pad_q)
    if (i := _first_bad(real > padded)) is not None:
        raise ValueError(f"sequence {i} has {int(real[i])} real tokens but {pad_q_name} gives it only "
                         f"{int(padded[i])} (real tokens must fit in the padded sequence)")
    if cp_size > 1 and (i := _first_bad(padded % (2 * cp_size) != 0)) is not None:
        raise ValueError(f"{pad_q_name}: sequence {i} has length {int(padded[i])}, not a multiple of "
                         f"2 * cp_size = {2 * cp_size} (pad each sequence, e.g. with coreattn.masks.align_seqlens)")
    total = int(pad_q[-1])
    if total != n_local * cp_size:
        raise ValueError(f"q has {n_local} local tokens but {pad_q_name}[-1] = {total} global tokens / "
                         f"cp_size {cp_size} = {total / cp_size:g}")
    longest = int(padded.max())
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv)):
        if value < longest:
            raise ValueError(f"{name} = {value} is smaller than the longest (padded) sequence ({longest}); "
                             "pass the global maximum, as Megatron's PackedSeqParams does")


def _chunk_packs(fmt: str, j, chunk, real_q, real_k, causal: bool, q_base, k_base,
                 gid_base) -> tuple[Packing, Packing]:
    """Span packings of chunk j (an int or a [B] tensor) for every sequence: the chunk's real query
    tokens and the global key prefix they may see. Dropout token ids are global: sequence b's
    token i has id ``gid_base[b] + i`` in the global layout, so every cp degree draws the same mask."""
    zero = torch.zeros_like(real_q)
    q_len = torch.minimum(torch.maximum(real_q - j * chunk, zero), zero + chunk)
    k_len = torch.minimum(real_k, (j + 1) * chunk + zero) if causal else real_k
    k_len = torch.where(q_len > 0, k_len, zero)  # a chunk of padding does no work
    as32 = lambda t: t.to(torch.int32)  # noqa: E731
    return (Packing(fmt, as32(q_base), as32(q_len), gid=as32(gid_base + j * chunk)),
            Packing(fmt, as32(k_base + zero), as32(k_len), gid=as32(gid_base + zero)))


def build_cp_plan(layout: str, cp_size: int, cp_rank: int, n_local: int, causal: bool, *, batch: int = 1,
                  cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_kv: torch.Tensor | None = None,
                  cu_seqlens_padded: torch.Tensor | None = None, max_seqlen_q: int = 0, max_seqlen_kv: int = 0,
                  device: torch.device | None = None) -> CPPlan:
    """Span descriptors and reorder indices for one rank (inputs already checked; no host sync).

    thd: ``n_local`` local tokens; cu_seqlens_* global int32 [B+1] (cu_seqlens_padded: the padded
    layout). sbhd: ``n_local`` = local sequence length 2c, ``batch`` samples; cu_seqlens_q/kv
    (optional) hold the real lengths, every sample is padded to n_local * cp_size.
    """
    # cp 1: whole sequences, one call; otherwise 2*cp chunks and one call per local chunk set
    n_chunks = 2 * cp_size if cp_size > 1 else 1
    chunk_ids = (cp_rank, n_chunks - 1 - cp_rank) if cp_size > 1 else (0,)
    calls = []
    if layout == "thd":
        real_q, real_k = _lens(cu_seqlens_q).long(), _lens(cu_seqlens_kv).long()
        starts = cu_seqlens_padded[:-1].long()  # global; the local tokens of sequence b start at starts // cp
        chunk = _lens(cu_seqlens_padded).long() // n_chunks  # [B]
        chunk_max_q, chunk_max_k = math.ceil(max_seqlen_q / n_chunks), math.ceil(max_seqlen_kv / n_chunks)
        for half, j in enumerate(chunk_ids):
            packs = _chunk_packs("thd", j, chunk, real_q, real_k, causal, starts // cp_size + half * chunk, starts,
                                 starts)
            max_k = min(max_seqlen_kv, (j + 1) * chunk_max_k) if causal else max_seqlen_kv
            calls.append(_Call(*packs, chunk_max_q, max_k))
        positions = cu_seqlens_padded
    else:
        seqlen = n_local * cp_size
        chunk = seqlen // n_chunks
        full = torch.full((batch,), seqlen, dtype=torch.long, device=device)
        real_q = full if cu_seqlens_q is None else _lens(cu_seqlens_q).long()
        real_k = full if cu_seqlens_kv is None else _lens(cu_seqlens_kv).long()
        base = torch.zeros_like(full)
        sample_ids = torch.arange(batch, dtype=torch.long, device=device) * seqlen  # padded ids b * S + position
        for half, j in enumerate(chunk_ids):
            packs = _chunk_packs("sbhd", j, chunk, real_q, real_k, causal, base + half * chunk, base, sample_ids)
            max_k = min(seqlen, (j + 1) * chunk) if causal else seqlen
            calls.append(_Call(*packs, chunk, max_k))
        positions = torch.full((2,), seqlen, dtype=torch.int32, device=device)  # [0, S]: one sequence
        positions[0] = 0
    if cp_size == 1:
        return CPPlan(1, 0, tuple(calls), None, None)
    ranks = torch.arange(cp_size, device=positions.device)
    scatter_order = zigzag_positions(positions, cp_size, ranks, n_local).reshape(-1)  # buffer row -> global
    gather_order = torch.empty_like(scatter_order).scatter_(
        0, scatter_order, torch.arange(scatter_order.numel(), device=scatter_order.device))
    return CPPlan(cp_size, cp_rank, tuple(calls), gather_order, scatter_order)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter(full: torch.Tensor, cp_size: int, group) -> torch.Tensor:
    """Sum over ranks of ``full`` (rank-major rows), this rank's rows: reduce_scatter_tensor where the
    backend has it (NCCL; gloo in recent torch), else all_reduce + slice (2x the traffic)."""
    n = full.shape[0] // cp_size
    backend = str(dist.get_backend(group))
    if backend not in _NO_REDUCE_SCATTER:
        out = full.new_empty((n,) + tuple(full.shape[1:]))
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        try:
            fn(out, full, group=group)
            return out
        except (RuntimeError, NotImplementedError) as exc:  # raised before any data moves, on every rank alike
            if "support" not in str(exc).lower():
                raise
            _NO_REDUCE_SCATTER.add(backend)
    dist.all_reduce(full, group=group)
    rank = dist.get_rank(group)
    return full[rank * n:(rank + 1) * n]


class GatherKVFunction(torch.autograd.Function):
    """All-gather local K and V [n, (B,) H, D] into one global-order buffer [T, (B,) H*(Dqk+Dv)];
    the backward reduce-scatters dK/dV back to the local rows."""

    @staticmethod
    def forward(ctx, k, v, group, cp_size: int, gather_order, scatter_order):
        lead = tuple(k.shape[:-2])  # (n,) thd or (n, B) sbhd
        width_k = k.shape[-2] * k.shape[-1]
        send = torch.cat([k.reshape(lead + (width_k,)), v.reshape(lead + (-1,))], dim=-1)  # [n, (B,) W]
        buf = send.new_empty((cp_size * lead[0],) + tuple(send.shape[1:]))  # rank-major
        _all_gather(buf, send, group)
        ctx.save_for_backward(scatter_order)
        ctx.group, ctx.cp_size, ctx.width_k = group, cp_size, width_k
        ctx.k_shape, ctx.v_shape = tuple(k.shape), tuple(v.shape)
        return buf.index_select(0, gather_order)

    @staticmethod
    def backward(ctx, dkv):
        (scatter_order,) = ctx.saved_tensors
        dbuf = dkv.index_select(0, scatter_order)  # global order -> rank-major, a fresh contiguous tensor
        dlocal = _reduce_scatter(dbuf, ctx.cp_size, ctx.group)  # [n, (B,) W]
        dk = dlocal[..., :ctx.width_k].reshape(ctx.k_shape)
        dv = dlocal[..., ctx.width_k:].reshape(ctx.v_shape)
        return dk, dv, None, None, None, None


def _gathered_kv(k, v, plan: CPPlan, group) -> tuple[torch.Tensor, torch.Tensor]:
    kv = GatherKVFunction.apply(k, v, group, plan.cp_size, plan.gather_order, plan.scatter_order)
    width_k = k.shape[-2] * k.shape[-1]
    k_glob = kv[..., :width_k].unflatten(-1, tuple(k.shape[-2:]))  # views, last stride 1
    v_glob = kv[..., width_k:].unflatten(-1, tuple(v.shape[-2:]))
    return k_glob, v_glob


def attend_local(q, k_glob, v_glob, plan: CPPlan, params: VarlenParams, deterministic: bool = True,
                 backend: str | Backend | None = None, softmax_offset: torch.Tensor | None = None,
                 return_max_logit: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A rank's attention given global-order K/V: one span call per local chunk set, summed (each call
    is zero outside its query spans); (out, max_logit over the rank's queries or None). Every call
    shares one dropout RNG state, so the mask is that of one call over the global tokens."""
    rng_state = dropout.rng_state(q.device) if params.dropout_p > 0 and \
        select_backend(q.device, backend) is not Backend.NPU_FUSED else None
    out = max_logit = None
    for call in plan.calls:
        part, _, part_max = run_attention(q, k_glob, v_glob, call.q_pack, call.k_pack, call.max_q, call.max_k, params,
                                          deterministic, backend, softmax_offset=softmax_offset,
                                          return_max_logit=return_max_logit, rng_state=rng_state)
        out = part if out is None else out + part
        if return_max_logit:
            max_logit = part_max if max_logit is None else torch.maximum(max_logit, part_max)
    return out, max_logit


def cp_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_group, layout: str,
            cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_kv: torch.Tensor | None = None,
            cu_seqlens_q_padded: torch.Tensor | None = None, cu_seqlens_kv_padded: torch.Tensor | None = None,
            max_seqlen_q: int | None = None, max_seqlen_kv: int | None = None, causal: bool = False,
            softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
            deterministic: bool = True, dropout_p: float = 0.0, softmax_offset: torch.Tensor | None = None,
            return_max_logit: bool = False, backend: str | Backend | None = None, comm: str = DEFAULT_COMM):
    """Self-attention under Megatron context parallelism (zig-zag chunks over ``cp_group``).

    Args:
        q, k, v: this rank's tokens. ``layout="thd"``: q ``[t_local, Hq, Dqk]``, k ``[t_local, Hkv, Dqk]``,
            v ``[t_local, Hkv, Dv]``; sequence b's local tokens sit at offsets
            ``cu_seqlens_q_padded[b] / cp`` onwards: its chunk r, then its chunk 2*cp-1-r. ``"sbhd"``:
            ``[s_local, B, H, D]``, rows ``[0, s_local/2)`` chunk r and the rest chunk 2*cp-1-r of every
            sample. Prepare inputs with ``coreattn.masks.cp_partition_indices`` /
            ``cp_partition_indices_sbhd`` and ``cp_shard``, or Megatron's ``get_batch_on_this_cp_rank``.
            GQA (Hq a multiple of Hkv) and Dv != Dqk are fine.
        cp_group: the context-parallel ``ProcessGroup`` (cp_size and rank come from it); None means
            no context parallelism (one rank, no communication; ``comm`` is then only checked).
            With ``comm="a2a+p2p"``: ``[a2a_group, p2p_group]``, the two groups of Megatron's
            ``hierarchical_context_parallel_sizes`` [a, b] in the order
            ``parallel_state.get_hierarchical_context_parallel_groups()`` returns them (as Transformer
            Engine takes them): a2a groups of a consecutive cp ranks, p2p groups of the ranks a apart,
            so cp_size = a * b and this rank's cp rank (which chunks it holds) is
            ``p2p_rank * a + a2a_rank``.
        comm: the exchange, Megatron's ``cp_comm_type`` (default ``"p2p"``, as Megatron runs
            ``cp_comm_type=None``):
            ``"p2p"``: a ring passing K/V chunks (ring.py); each rank holds two
            local K/V buffers, sends and receives (cp-1) local K/V shares in the forward, and K/V
            plus dK/dV shares in the backward; sends overlap compute on GPUs. Needs a backend that
            returns the log-sum-exp (triton, torch; not npu_fused).
            ``"all_gather"``: K/V all-gathered (every rank holds the whole layer's K/V), dK/dV
            reduce-scattered; fewest messages, memory does not shrink with cp.
            ``"a2a"``: all-to-all to whole sequences of Hq/cp heads and back (a2a.py);
            needs Hq divisible by cp and Hkv divisible by cp (or cp by Hkv: K/V heads replicated);
            supports any window; dropout draws each head's cp = 1 mask (the RNG state's head offset).
            ``"a2a+p2p"``: hierarchical, an all-to-all inside the a2a group (the heads rules of a2a
            with a for cp) to Hq/a heads of the chunks the group holds together (the zig-zag
            layout at cp / a), then the p2p ring over the p2p group on those, and back; the
            windows and backends of p2p (any window when b = 1). a = 1 runs plain p2p over
            the p2p group, b = 1 plain a2a over the a2a group. Other values raise ValueError.
        cu_seqlens_q, cu_seqlens_kv: GLOBAL int32 ``[B+1]`` real lengths (Megatron's PackedSeqParams).
            Required for thd; optional for sbhd (per-sample real lengths, right padding; None: all
            tokens are real). kv defaults to q and must equal it (self-attention).
        cu_seqlens_q_padded, cu_seqlens_kv_padded: GLOBAL int32 ``[B+1]`` padded layout (thd only);
            each padded length a multiple of 2*cp. None: the real lengths are the layout (they must
            then be multiples of 2*cp). Real tokens sit at the start of each padded sequence.
        max_seqlen_q, max_seqlen_kv: ints >= the longest GLOBAL padded sequence (thd; what
            PackedSeqParams carries), or 0-dim integer tensors, which are never read (the global
            token count stands in for them: nothing is sized by max_seqlen). None: the longest
            sequence where reading is free (CPU), else the global token count (no host sync).
            Ignored for sbhd (the padded length is s_local * cp).
        causal: global causal mask (top-left = bottom-right here: q and k are the same tokens).
        window_size: ``(left, 0)`` or ``(left, -1)`` with causal (sliding window) or ``(-1, -1)``;
            other windows raise NotImplementedError when cp_size > 1, except with ``comm="a2a"``
            (whole sequences: any window) and ``"a2a+p2p"`` with a p2p group of one rank.
        softmax_scale, deterministic, softmax_offset, backend: as in ``coreattn.varlen_attn``.
        dropout_p: as in ``coreattn.varlen_attn``, with global token ids (the position in the
            global padded layout: thd ``cu_seqlens_q_padded[b] + i``, sbhd ``b * S + i``), so for
            the same RNG state every cp degree drops what cp = 1 drops. One RNG state per call,
            drawn by each rank from its own generator: ranks seeded alike (as Megatron seeds
            context-parallel ranks) get the mask of cp = 1.
        return_max_logit: also return a float32 ``[Hq]`` max visible scaled logit per q head:
            p2p and all_gather over this rank's queries; a2a over every query of the heads this
            rank computed, -inf for the other heads; a2a+p2p over the queries of the rank's a2a
            group for the heads it computed, -inf for the others. Megatron's ``clip_qk`` all-reduces it with MAX
            over the data- and context-parallel group, which gives the layer's max either way.

    Returns:
        out ``[t_local, Hq, Dv]`` (thd) or ``[s_local, B, Hq, Dv]`` (sbhd), q's dtype; padding tokens
        output zeros and get zero gradients. Differentiable in q, k, v (and softmax_offset; each
        rank's d softmax_offset is its own part, to be summed over the cp group as Megatron's
        gradient reduction does). With ``return_max_logit``: ``(out, max_logit)``.

    Communication per layer and rank (n = T / cp local tokens; ``python -m bench --what cp``
    tabulates these): p2p forward (cp-1) local K/V shares sent and received, backward (cp-1) K/V
    and cp dK/dV shares; all_gather forward (cp-1) K/V shares received, backward the same in
    dK/dV (reduce-scatter; with gloo backends lacking reduce_scatter_tensor: all_reduce + slice,
    twice the traffic); a2a (cp-1)/cp of the local q, k, v and out, forward and backward;
    a2a+p2p (a-1)/a of them inside the a2a group, then p2p's volumes for b ranks on a*n tokens of
    Hkv/a K/V heads over the p2p group.

    Host syncs: none on device tensors (spans and reorder indices are built with vectorized torch
    ops; max_seqlen is never read). Value checks (lengths multiples of 2*cp, token counts, max_seqlen)
    run when cu_seqlens are on the CPU or with ``COREATTN_VALIDATE=1`` (a sync on GPU).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    comm = check_comm(comm)
    check_qkv(q, k, v, layout)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"self-attention under context parallelism: q has {q.shape[0]} local tokens/rows but k has "
                         f"{k.shape[0]}")
    params = check_options(q.shape[-1], dropout_p, softmax_scale, causal, window_size, "bottom_right")
    if isinstance(softmax_offset, torch.Tensor) and softmax_offset.dim() != 1:
        raise NotImplementedError(f"softmax_offset of shape {tuple(softmax_offset.shape)}: cp_attn takes one sink "
                                  "logit per q head ([Hq]); per-token sinks run in varlen_attn / padded_attn")
    softmax_offset = check_softmax_offset(softmax_offset, q)
    return_max_logit = check_flag("return_max_logit", return_max_logit)
    groups = cp_groups(cp_group, comm)
    cp_size, cp_rank = groups.size, groups.rank
    # one rank, or an all-to-all without a ring after it: whole sequences, exact for any window
    whole = cp_size == 1 or groups.p2p is None and comm in ("a2a", HIERARCHICAL)
    causal_like = params.window_right == 0 if whole else _window_is_causal(params, window_size)
    n_local = q.shape[0]
    check = None
    if cu_seqlens_kv is None:
        cu_seqlens_kv = cu_seqlens_q
    if cu_seqlens_kv_padded is None:
        cu_seqlens_kv_padded = cu_seqlens_q_padded
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv),
                     ("cu_seqlens_q_padded", cu_seqlens_q_padded), ("cu_seqlens_kv_padded", cu_seqlens_kv_padded)):
        if cu is not None:
            check_cu_seqlens(name, cu, q.device)
            check = cu if check is None else check
            if cu.numel() != check.numel():
                raise ValueError(f"{name} has {cu.numel()} entries but cu_seqlens_q has {check.numel()}")
    reads = reads_values(q)

    if layout == "thd":
        if cu_seqlens_q is None:
            raise ValueError("layout 'thd' needs cu_seqlens_q (global real lengths, int32 [B+1])")
        pad_name = "cu_seqlens_q_padded" if cu_seqlens_q_padded is not None else "cu_seqlens_q"
        pad_q = cu_seqlens_q_padded if cu_seqlens_q_padded is not None else cu_seqlens_q
        pad_kv = cu_seqlens_kv_padded if cu_seqlens_kv_padded is not None else cu_seqlens_kv
        if max_seqlen_q is None or max_seqlen_kv is None:
            # read where reading is free, else the global token count, which bounds every sequence
            # (max_seqlen sizes nothing: no host sync)
            longest = int(_lens(pad_q).max()) if reads else n_local * cp_size
            max_seqlen_q = longest if max_seqlen_q is None else max_seqlen_q
            max_seqlen_kv = longest if max_seqlen_kv is None else max_seqlen_kv
        # a 0-dim tensor is not read: the global token count bounds every sequence
        max_seqlen_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, n_local * cp_size)
        max_seqlen_kv = check_max_seqlen("max_seqlen_kv", max_seqlen_kv, n_local * cp_size)
        if reads:
            _check_values_thd(n_local, cp_size, cu_seqlens_q, cu_seqlens_kv, pad_q, pad_kv, pad_name,
                              max_seqlen_q, max_seqlen_kv)
        plan_args = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_padded=pad_q,
                         max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, device=q.device)
        layout_args = dict(real=_lens(cu_seqlens_q), cu_seqlens_padded=pad_q, max_seqlen=max(max_seqlen_q,
                                                                                              max_seqlen_kv))
    else:
        if cu_seqlens_q_padded is not None:
            raise ValueError("layout 'sbhd' takes no cu_seqlens_q_padded/cu_seqlens_kv_padded: every sample is "
                             "padded to s_local * cp_size")
        batch = q.shape[1]
        if cu_seqlens_q is not None and cu_seqlens_q.numel() != batch + 1:
            raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.numel()} entries but the batch has {batch} samples")
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv)):
            if value is not None:
                check_max_seqlen(name, value, n_local * cp_size)
        if cp_size > 1 and n_local % 2:
            raise ValueError(f"layout 'sbhd': the local sequence length {n_local} must be even (2 chunks of the "
                             f"global length, a multiple of 2 * cp_size = {2 * cp_size})")
        if reads and cu_seqlens_q is not None:
            seqlen = n_local * cp_size
            for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
                lens = _lens(cu)
                if int(cu[0]) != 0 or bool((lens < 0).any()) or bool((lens > seqlen).any()):
                    raise ValueError(f"{name} must start at 0 with lengths in [0, {seqlen}] (the padded "
                                     f"length s_local * cp_size), got {cu.tolist()}")
            if not torch.equal(cu_seqlens_q, cu_seqlens_kv):
                raise ValueError("self-attention under context parallelism: cu_seqlens_kv must equal cu_seqlens_q")
        plan_args = dict(batch=batch, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, device=q.device)
        real = (torch.full((batch,), n_local * cp_size, dtype=torch.long, device=q.device) if cu_seqlens_q is None
                else _lens(cu_seqlens_q))
        layout_args = dict(real=real, batch=batch)

    if cp_size == 1 or comm == "all_gather":
        plan = build_cp_plan(layout, cp_size, cp_rank, n_local, causal_like, **plan_args)
        if cp_size > 1:
            k, v = _gathered_kv(k, v, plan, groups.p2p)
        out, max_logit = attend_local(q, k, v, plan, params, deterministic, backend, softmax_offset, return_max_logit)
    else:
        cp_layout = make_layout(layout, cp_size, cp_rank, n_local, **layout_args)
        rng_state = dropout.rng_state(q.device) if params.dropout_p > 0 else None  # one mask for the whole call
        if groups.p2p is not None:  # p2p, or a2a+p2p's outer stage
            attend = ring_attention(groups.p2p, params, causal_like, ring_impl(q, backend), return_max_logit)
        else:
            attend = whole_sequences(params, deterministic, backend, return_max_logit)
        if groups.a2a is not None:  # a2a, or a2a+p2p's inner stage
            out, max_logit = a2a_attn(q, k, v, cp_layout, groups.a2a, softmax_offset, return_max_logit, rng_state,
                                      attend, comm)
        else:
            out, max_logit = attend(q, k, v, cp_layout, softmax_offset, rng_state)
    return (out, max_logit) if return_max_logit else out
