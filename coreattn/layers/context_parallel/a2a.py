"""Context parallelism, all-to-all exchange (Megatron's ``cp_comm_type="a2a"``, DeepSpeed-Ulysses), also
the first stage of ``"a2a+p2p"``.

One all-to-all turns each rank's sequence shard of q, k and v (all heads) into a slice of the
heads over the tokens its a2a group holds together: rank i of a group of a gets q heads
[i*Hq/a, (i+1)*Hq/a) and the K/V heads they read. For ``"a2a"`` the group is the whole cp group
and those tokens are whole sequences: the single-device kernel runs on them (any window works).
For ``"a2a+p2p"`` the group is Megatron's inner (a2a) group of consecutive cp ranks, whose chunks
form the zig-zag layout at cp / a (layout.py, ``group_layout``); the p2p ring (ring.py) then runs
over the outer group on that layout. A second all-to-all returns the output to sequence shards.
The backward is the same two all-to-alls in reverse around the attention's own backward.

Heads: Hq must be divisible by the group size a. K/V heads are split likewise when Hkv is
divisible by a; with fewer K/V heads than ranks (a divisible by Hkv) each K/V head is replicated
a/Hkv times first (its gradient sums the copies), so each rank receives the one head its q heads
share. Other head counts raise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from einops import rearrange

from coreattn.kernels.packing import Packing
from coreattn.kernels import dropout
from coreattn.layers.checks import VarlenParams
from coreattn.layers.context_parallel.layout import CPLayout, global_orders, group_layout
from coreattn.layers.dispatch import run_attention


def check_heads(heads_q: int, heads_kv: int, size: int, comm: str = "a2a") -> None:
    """The head rules of an all-to-all over ``size`` ranks (the cp group for comm 'a2a', the a2a
    group cp_group[0] for 'a2a+p2p')."""
    where, name = (("the cp ranks", "cp_size") if comm == "a2a" else
                   ("the ranks of its a2a group (cp_group[0])", "the a2a group's size"))
    if heads_q % size:
        raise ValueError(f"comm={comm!r} splits the q heads over {where}: Hq = {heads_q} is not divisible by "
                         f"{name} = {size} (use comm='p2p' or 'all_gather')")
    if heads_kv % size and size % heads_kv:
        raise ValueError(f"comm={comm!r} needs the K/V heads divisible by {name} or {name} divisible by them "
                         f"(Hkv = {heads_kv}, {name} = {size}); use comm='p2p' or 'all_gather'")


def _to_heads(xs, cp: int, gather_order: torch.Tensor, group) -> list[torch.Tensor]:
    """Sequence shards [n, (B,) H, D] -> the tokens of the ``cp`` ranks of ``group`` [cp*n, (B,) H/cp, D]
    in their layout's order (whole sequences in global order when the group is the whole cp group);
    one all-to-all for all tensors (each is cut into cp head groups, group p goes to rank p)."""
    blocks = [rearrange(x, "n ... (p h) d -> p n ... (h d)", p=cp) for x in xs]  # [cp, n, (B,) h*D]
    send = torch.cat(blocks, dim=-1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # [cp, n, (B,) W]: rank p's tokens, our heads
    full = recv.flatten(0, 1).index_select(0, gather_order)  # [cp*n, (B,) W]
    outs, offset = [], 0
    for x in xs:
        heads, dim = x.shape[-2] // cp, x.shape[-1]
        outs.append(full[..., offset:offset + heads * dim].unflatten(-1, (heads, dim)))
        offset += heads * dim
    return outs


def _to_seq(ys, cp: int, scatter_order: torch.Tensor, group) -> list[torch.Tensor]:
    """The inverse: the group's tokens [cp*n, (B,) h, D] of our heads -> our sequence shard [n, (B,) h*cp, D]."""
    send = torch.cat([y.flatten(-2) for y in ys], dim=-1).index_select(0, scatter_order)  # rank-major [cp*n, (B,) W]
    send = send.unflatten(0, (cp, -1))  # [cp, n, (B,) W]: rank p's tokens
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # [cp, n, (B,) W]: our tokens, head group p
    outs, offset = [], 0
    for y in ys:
        heads, dim = y.shape[-2:]
        block = recv[..., offset:offset + heads * dim].unflatten(-1, (heads, dim))  # [cp, n, (B,) h, D]
        outs.append(block.movedim(0, -3).flatten(-3, -2).contiguous())  # [n, (B,) cp*h, D]
        offset += heads * dim
    return outs


class SeqToHeadsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, cp: int, gather_order, scatter_order, *xs):
        ctx.group, ctx.cp = group, cp
        ctx.save_for_backward(scatter_order)
        return tuple(_to_heads(xs, cp, gather_order, group))

    @staticmethod
    def backward(ctx, *grads):
        (scatter_order,) = ctx.saved_tensors
        return (None, None, None, None, *_to_seq([g.contiguous() for g in grads], ctx.cp, scatter_order, ctx.group))


class HeadsToSeqFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, cp: int, gather_order, scatter_order, y):
        ctx.group, ctx.cp = group, cp
        ctx.save_for_backward(gather_order)
        return _to_seq([y], cp, scatter_order, group)[0]

    @staticmethod
    def backward(ctx, grad):
        (gather_order,) = ctx.saved_tensors
        return None, None, None, None, _to_heads([grad.contiguous()], ctx.cp, gather_order, ctx.group)[0]


def whole_sequences(params: VarlenParams, deterministic: bool, backend, return_max_logit: bool):
    """comm 'a2a': the single-device attention on whole sequences (the layout at cp 1)."""

    def attend(q, k, v, layout: CPLayout, softmax_offset, rng_state):
        pack = Packing(layout.fmt, layout.global_start.to(torch.int32), layout.real.to(torch.int32))  # global ids
        out, _, part_max = run_attention(q, k, v, pack, pack, layout.max_seqlen, layout.max_seqlen, params,
                                         deterministic, backend, softmax_offset=softmax_offset,
                                         return_max_logit=return_max_logit, rng_state=rng_state)
        return out, part_max

    return attend


def a2a_attn(q, k, v, layout: CPLayout, group, softmax_offset: torch.Tensor | None, return_max_logit: bool,
             rng_state: torch.Tensor | None, attend, comm: str = "a2a"):
    """(out [n, (B,) Hq, Dv], max_logit [Hq] or None): this rank's rows of the attention that
    ``attend(q, k, v, group_layout, softmax_offset, rng_state) -> (out, max_logit)`` computes for
    its head slice over the tokens its a2a ``group`` (consecutive cp ranks) holds; max_logit holds
    -inf for the other ranks' heads."""
    size = group.size()
    rank = layout.cp_rank % size
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    check_heads(heads_q, heads_kv, size, comm)
    if heads_kv < size:
        k, v = (t.repeat_interleave(size // heads_kv, dim=-2) for t in (k, v))
    gather_order, scatter_order = global_orders(layout, size)
    qh, kh, vh = SeqToHeadsFunction.apply(group, size, gather_order, scatter_order, q, k, v)
    heads = slice(rank * heads_q // size, (rank + 1) * heads_q // size)
    if rng_state is not None:  # this rank's heads draw the mask they have in the whole layer
        rng_state = dropout.with_head_offset(rng_state, heads.start)
    offset = None if softmax_offset is None else softmax_offset[heads]
    out, part_max = attend(qh, kh, vh, group_layout(layout, size), offset, rng_state)
    out = HeadsToSeqFunction.apply(group, size, gather_order, scatter_order, out)
    max_logit = None
    if return_max_logit:
        max_logit = part_max.new_full((heads_q,), float("-inf"))
        max_logit[heads] = part_max
    return out, max_logit
