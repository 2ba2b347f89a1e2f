"""Which process groups the exchanges of ``cp_attn`` run over, and the cp size and rank they give.

One group (``p2p``, ``all_gather``, ``a2a``) or Megatron's hierarchical pair (``a2a+p2p``:
``[a2a_group, p2p_group]``, as ``parallel_state.get_hierarchical_context_parallel_groups()``
returns them and Transformer Engine takes them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist

HIERARCHICAL = "a2a+p2p"  # cp_group is then [a2a_group, p2p_group]


class CPGroups(NamedTuple):
    """The cp size and rank (Megatron's zig-zag layout) and the groups each exchange stage runs over."""

    size: int
    rank: int
    a2a: dist.ProcessGroup | None  # the all-to-all stage (comm a2a: cp_group; a2a+p2p: cp_group[0] if > 1 rank)
    p2p: dist.ProcessGroup | None  # the ring or all-gather (p2p, all_gather: cp_group; a2a+p2p: cp_group[1] if > 1)


def _size_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def cp_groups(cp_group, comm: str) -> CPGroups:
    """comm 'a2a+p2p': cp_group = [a2a_group, p2p_group], ordered as Megatron's
    get_hierarchical_context_parallel_groups() returns them for hierarchical_context_parallel_sizes
    [a, b] (and as Transformer Engine takes them): the inner group holds a consecutive cp ranks, cp
    rank = p2p rank * a + a2a rank. A stage over one rank is dropped, so [1, b] is plain p2p over
    the p2p group and [a, 1] plain a2a over the a2a group."""
    if cp_group is None:
        return CPGroups(1, 0, None, None)
    if comm == HIERARCHICAL:
        if not (isinstance(cp_group, (list, tuple)) and len(cp_group) == 2
                and all(isinstance(g, dist.ProcessGroup) for g in cp_group)):
            got = type(cp_group).__name__ if not isinstance(cp_group, (list, tuple)) else \
                f"{type(cp_group).__name__} of {[type(g).__name__ for g in cp_group]}"
            raise TypeError("comm='a2a+p2p' takes cp_group as [a2a_group, p2p_group], two torch.distributed."
                            "ProcessGroups in the order of Megatron's get_hierarchical_context_parallel_groups() "
                            f"(or None), got {got}")
        (inner, rank_in), (outer, rank_out) = (_size_rank(g) for g in cp_group)
        return CPGroups(inner * outer, rank_out * inner + rank_in, cp_group[0] if inner > 1 else None,
                        cp_group[1] if outer > 1 else None)
    if not isinstance(cp_group, dist.ProcessGroup):
        raise TypeError(f"cp_group must be a torch.distributed.ProcessGroup or None (a list [a2a_group, p2p_group] "
                        f"only with comm='a2a+p2p'), got {type(cp_group).__name__}")
    size, rank = _size_rank(cp_group)
    return CPGroups(size, rank, cp_group if comm == "a2a" else None, None if comm == "a2a" else cp_group)


def hierarchical_sizes(sizes, cp_size: int, heads_q: int, heads_kv: int) -> tuple[int, int]:
    """Megatron's ``hierarchical_context_parallel_sizes`` [a2a size, p2p size] for cp_comm_type
    "a2a+p2p", checked against ``context_parallel_size`` and the heads of one tensor-parallel rank
    (the a2a stage splits them); errors name the config settings."""
    if not (isinstance(sizes, (list, tuple)) and len(sizes) == 2
            and all(isinstance(n, int) and n >= 1 for n in sizes)):
        raise ValueError("cp_comm_type='a2a+p2p' needs config.hierarchical_context_parallel_sizes = [a2a size, p2p "
                         f"size] (two positive ints whose product is context_parallel_size), got {sizes!r}")
    a2a, p2p = sizes
    if a2a * p2p != cp_size:
        raise ValueError(f"config.hierarchical_context_parallel_sizes = {list(sizes)} multiply to {a2a * p2p}, not "
                         f"context_parallel_size = {cp_size}")
    if heads_q % a2a:
        raise ValueError(f"cp_comm_type='a2a+p2p' splits the attention heads of each tensor-parallel rank over the "
                         f"a2a group: num_attention_heads / tensor parallel size = {heads_q} is not divisible by "
                         f"hierarchical_context_parallel_sizes[0] = {a2a}")
    if heads_kv % a2a and a2a % heads_kv:
        raise ValueError(f"cp_comm_type='a2a+p2p' splits the K/V heads of each tensor-parallel rank over the a2a "
                         f"group: num_query_groups / tensor parallel size = {heads_kv} and "
                         f"hierarchical_context_parallel_sizes[0] = {a2a} must divide one another")
    return a2a, p2p
