"""Public mask and packing utilities (keep masks: True = token takes part; Megatron masks: True = masked out).

See coreattn.layers.masks for the conventions and the host-sync rules; the context-parallel index
utilities come from coreattn.layers.context_parallel.indices.
"""

from coreattn.layers import masks as _masks
from coreattn.layers.context_parallel.indices import (  # noqa: F401 (exported through __all__)
    cp_partition_indices, cp_partition_indices_sbhd, cp_shard, cp_unshard)
from coreattn.layers.masks import *  # noqa: F401,F403 (the names in its __all__)

__all__ = sorted([*_masks.__all__, "cp_partition_indices", "cp_partition_indices_sbhd", "cp_shard", "cp_unshard"])
