"""The bottom layer: raw Triton kernels, their launchers, and what the launchers need to pick a launch.

Owns: ``attn_fwd.py`` / ``attn_bwd.py`` (the attention kernels and their launchers
``varlen_attn_fwd`` / ``varlen_attn_bwd``: configs, output allocation, grid), ``attn_common.py``
(the ``@triton.jit`` helpers both share: masks in registers, dropout, row loads and stores, an
additive bias's scores and its descriptor ``TableBias``), ``attn_bias.py`` (the bias table's
gradient kernel and launcher),
``tile_map.py`` (the per-call tile map: which sequence and rows each attention program works on,
and the one layout check per call),
``configs/`` (launch configs, one file per concern: ``targets.py``, which target a device is;
``base.py``, what a config is; ``dense.py``, the dense attention kernels' tables per target, one
table file per kernel family; ``space.py``, the tuner's candidate spaces; ``pick.py``, which config
a launch picks), ``tuned_cache.py`` (the tuned-config files: reading, writing, the
launchers' lookup), ``descriptors.py`` (TMA descriptors for the loop loads), ``packing.py`` (how a
side's tokens are laid out: packed, padded, spans, keep masks), ``masks.py`` (the mask
utilities' gather/scatter and token-id kernels), ``dropout.py`` (dropout's keep mask: the
Philox definition the kernels' ``tl.philox`` follows, in torch ops, and the RNG state),
``softmax_offset.py`` (the sink gradient's final reduction over the kernels' per-row sums),
``launch.py`` (the one launch seam: every grid fitted to its target's limits, looped or refused past them),
``npu.py`` (Ascend detection: triton-ascend's driver and core counts, torch_npu on first use),
``versions.py`` (the Triton releases CI tests, the warning for an older one, and the check that
Triton's interpreter can run the kernels), ``sparse_index.py`` / ``sparse_fwd.py`` / ``sparse_bwd.py``
(the sparse top-k attention of DeepSeek Sparse Attention: index preparation and the CSR by key,
the forward and the deterministic backward kernels and their launchers ``sparse_attn_fwd`` /
``sparse_attn_bwd``; their launch tables in ``configs/sparse.py``).
No autograd here: ``coreattn.layers`` wraps the launchers.

May import: torch and triton only; nothing from ``coreattn.layers``, ``coreattn.adapters``,
``coreattn.selfcheck`` or ``coreattn.tune`` (tests/test_layout.py checks it). Tuned configs reach the
launchers as JSON files, never by importing the tuner.
"""

import sys

from coreattn.kernels.attn_bwd import varlen_attn_bwd
from coreattn.kernels.attn_fwd import _varlen_attn_fwd_kernel, varlen_attn_fwd
from coreattn.kernels.versions import warn_if_old_triton

warn_if_old_triton()  # an upstream Triton older than the oldest CI tests: one UnsupportedTritonWarning


def runs_in_interpreter() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import).

    Triton loads its interpreter module (which needs numpy) only to build interpreted kernels, so
    when it is not loaded the kernels are compiled ones, and asking never imports it."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    return interpreter is not None and isinstance(_varlen_attn_fwd_kernel, interpreter.InterpretedFunction)


__all__ = ["varlen_attn_fwd", "varlen_attn_bwd", "runs_in_interpreter"]
