"""Context parallelism: ``cp_attn``, self-attention over a sequence split zig-zag across a cp group.

Owns: ``attention.py`` (``cp_attn``: argument checks, the per-rank plan and the all_gather
exchange; which stages a2a+p2p runs over which group), ``layout.py`` (Megatron's zig-zag chunk
layout, and the layout an a2a group of consecutive ranks holds together), ``ring.py`` (the p2p
ring, K/V chunks passed rank to rank, partial results merged through lse; also a2a+p2p's outer
stage), ``a2a.py`` (Ulysses all-to-all from sequence shards to head shards; also a2a+p2p's inner
stage), ``groups.py`` (the process groups each stage runs over, the cp size and rank).

May import: torch and torch.distributed, ``coreattn.kernels``, and from ``coreattn.layers`` the
argument checks, the backend registry, the attention ops and their dispatch, and the masks
package; nothing from adapters or the Megatron module.
"""

from coreattn.layers.context_parallel.attention import COMMS, DEFAULT_COMM, check_comm, cp_attn

__all__ = ["cp_attn", "check_comm", "COMMS", "DEFAULT_COMM"]
