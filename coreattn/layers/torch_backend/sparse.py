"""Top-k sparse attention (DeepSeek Sparse Attention) in torch ops: the torch backend of the sparse pair.

``sparse_attn_torch_fwd`` / ``sparse_attn_torch_bwd`` take what the Triton launchers
``coreattn.kernels.sparse_fwd.sparse_attn_fwd`` / ``sparse_bwd.sparse_attn_bwd`` take, on the same
prepared inputs, and return the same results:

- q ``[.., Hq, Dqk]``, k ``[.., Hkv, Dqk]``, v ``[.., Hkv, Dv]`` or None (absorbed MLA: V is the
  first ``v_dim`` columns of k) in layout ``fmt``: ``"thd"`` (packed, one sample), ``"bshd"`` or
  ``"sbhd"`` (a padded batch); query token n is ``b * S + s`` (thd: the row);
- ``topk`` int32 ``[N, Hidx, K]`` as ``prepare_topk`` leaves it (-1 = unused; Hidx 1 = shared by
  every head, else one row per kv head), ``key_lo`` / ``key_hi`` int32 ``[N]``: token n sees key
  position j (a row of its sample: thd, of the packed stream) iff ``topk`` names j and
  ``key_lo[n] <= j < key_hi[n]`` (bounds are clipped to the sample's rows here);
- out in q's layout and dtype (last dim Dv), lse natural-log float32 (float64 for float64 inputs)
  ``[Hq, T]`` (thd) or ``[B, Hq, S]``; a token with no visible key gets out 0 and lse -inf, and
  every gradient through it is 0, never NaN.

How the work is split (``sparse_plan.py``): per (token, index head) *unit*, its key count and key
range are computed on the device. On CPU (``coreattn.layers.checks.reads_values``) they are read
to plan the work: consecutive tokens whose keys share a range run as one *block*, one product of
all their query rows against the range's keys (a slice of k: no gather), each token masking what
it does not name; a token that names its whole causal range (DSA's top-k while a sequence is
shorter than K) is exactly dense attention there. Where a block's tokens name few of the range's
keys, the union of their keys is gathered once for all of them, and where even that costs more,
each unit gathers its own keys, chunks of units as wide as their largest count (sorted by count):
slots a unit leaves unused cost nothing. On any other device nothing is read (no sync): every unit
gathers its own keys, chunks as wide as the keys a token can see at all (``min(K, Sk)``), valid
keys moved to the front.

Memory: a block holds ``[Hu, tokens * G, keys]`` float32 scores (and the backward's products)
within ``block_bytes`` (2x ``CHUNK_BYTES``), a chunk of units its gathered keys and
``[C, Hq, width]`` scores within ``chunk_bytes`` (``CHUNK_BYTES``: 8 MiB on CPU, where a chunk
then stays in the last-level cache between its gather and its products, 256 MiB on other devices;
or the ``COREATTN_SPARSE_TORCH_CHUNK_BYTES`` environment variable); nothing is S x S and nothing
gathers the whole sequence's ``[T, K, D]``. The forward keeps nothing but out and lse; the
backward recomputes scores from lse (P = exp(S - lse), dS = P (dP - delta), delta = rowsum(dO *
O)), writes each unit's dQ once, and adds dK/dV into float32 (float64) accumulators ``[rows, Hkv,
D]``: a block adds one product per key of its range (or of its union, with ``index_add_``), a
chunk of units its per-slot rows (``index_add_`` on CPU, sequential; ``index_put_(accumulate=True)``,
sort-based, elsewhere): deterministic, in the plan's fixed order. k and v are copied once per call
into ``[rows + 1, Hkv, D]`` sources in their own dtype (each gather is converted to the work dtype)
whose last row is zeros: a slot a unit cannot see reads that row (and adds its zero gradient there),
so a NaN or inf in a key the token must not see never reaches it. Total: O(T * H * D + T * K) plus
one block or chunk.
"""

from __future__ import annotations

import os

import torch

from coreattn.layers.checks import reads_values
from coreattn.layers.torch_backend.sparse_block_rows import BlockRows
from coreattn.layers.torch_backend.sparse_blocks import block_bwd, block_cost, block_fwd
from coreattn.layers.torch_backend.sparse_inputs import SparseProblem, by_sample, lse_by_sample, new_lse
from coreattn.layers.torch_backend.sparse_plan import Plan, UnitStats, plan_device, plan_host, static_width, unit_stats
from coreattn.layers.torch_backend.sparse_units import unit_bytes, units_bwd, units_fwd

__all__ = ["sparse_attn_torch_fwd", "sparse_attn_torch_bwd", "new_lse", "chunk_bytes", "ENV_CHUNK_BYTES"]

# working set of one chunk of units (gathers, scores, partial gradients), per device type
CHUNK_BYTES = {"cpu": 8 << 20}
DEFAULT_CHUNK_BYTES = 256 << 20
ENV_CHUNK_BYTES = "COREATTN_SPARSE_TORCH_CHUNK_BYTES"
BLOCK_SCALE = 2  # a block's working set, in chunks: its product is one GEMM, which wants more rows than fit in 8 MiB


def chunk_bytes(device: torch.device) -> int:
    value = os.environ.get(ENV_CHUNK_BYTES, "").strip()
    return max(1, int(value)) if value else CHUNK_BYTES.get(device.type, DEFAULT_CHUNK_BYTES)


def _plan(p: SparseProblem, k: torch.Tensor, backward: bool) -> tuple[UnitStats | None, Plan]:
    """The unit statistics (None where nothing is read) and the plan: read on the host where
    coreattn may read values (CPU), static elsewhere (no sync)."""
    device = p.topk.device
    budget = chunk_bytes(device)
    k_elt = k.element_size()
    if reads_values(device):
        stats = unit_stats(p.topk, p.key_lo, p.key_hi, p.seqlen_q, p.seqlen_k)
        plan = plan_host(p.topk, p.key_lo, p.key_hi, stats, seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k, group=p.group,
                         block_bytes=BLOCK_SCALE * budget, block_cost=block_cost(p), chunk_bytes=budget,
                         unit_bytes=lambda width: unit_bytes(p, width, backward, k_elt))
        return stats, plan
    width = static_width(p.topk_k, p.seqlen_k)
    return None, plan_device(p.units, width, unit_bytes(p, width, backward, k_elt), budget, device)


def _rows(topk, blocks):
    """The prepared rows as token rows: block mode's (``blocks``: the launchers' ``BlockLayout``) expanded
    per chunk by ``BlockRows``."""
    return topk if blocks is None else BlockRows(topk, blocks.size)


def sparse_attn_torch_fwd(q, k, v, topk, key_lo, key_hi, fmt: str, softmax_scale: float, *, v_dim: int | None = None,
                          out: torch.Tensor | None = None, lse: torch.Tensor | None = None, blocks=None):
    """(out, lse) of top-k sparse attention; ``out`` / ``lse`` may be given to be written in place;
    ``blocks``: the block mode (``topk`` holds the key rows of named blocks, sparse_block_rows.py)."""
    topk = _rows(topk, blocks)
    v_dim = v.shape[-1] if v is not None else v_dim
    p = SparseProblem(q, k, v, topk, key_lo, key_hi, fmt, softmax_scale, v_dim)
    out = q.new_empty(tuple(q.shape[:-1]) + (v_dim,)) if out is None else out
    lse = new_lse(q, fmt) if lse is None else lse
    out.zero_()  # units without keys are not computed: zeros and -inf
    lse.fill_(float("-inf"))
    out_bs, lse_bs = by_sample(out, fmt), lse_by_sample(lse, fmt)
    stats, plan = _plan(p, k, backward=False)
    for blk in plan.blocks:
        block_fwd(p, blk, stats, out_bs, lse_bs)
    for units, width in plan.rows:
        if width > 0:
            units_fwd(p, units, width, out_bs, lse_bs)
    return out, lse


def sparse_attn_torch_bwd(dout, q, k, v, out, lse, topk, key_lo, key_hi, fmt: str, softmax_scale: float, *,
                          v_dim: int | None = None, atomic: bool = False, blocks=None):
    """(dq, dk, dv or None) from the forward's out and lse; absorbed (v None): dV is folded into dk's
    first ``v_dim`` columns. ``atomic`` is the launcher's option and changes nothing here (this
    backward is always deterministic); ``blocks`` as for the forward."""
    topk = _rows(topk, blocks)
    v_dim = v.shape[-1] if v is not None else v_dim
    p = SparseProblem(q, k, v, topk, key_lo, key_hi, fmt, softmax_scale, v_dim)
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dq_bs, dout_bs, out_bs, lse_bs = by_sample(dq, fmt), by_sample(dout, fmt), by_sample(out, fmt), lse_by_sample(lse, fmt)
    dk_acc = p.accumulator(p.k_src)
    dv_acc = None if v is None else p.accumulator(p.v_src)
    stats, plan = _plan(p, k, backward=True)
    for blk in plan.blocks:
        block_bwd(p, blk, stats, dout_bs, out_bs, lse_bs, dq_bs, dk_acc, dv_acc)
    for units, width in plan.rows:
        if width > 0:
            units_bwd(p, units, width, dout_bs, out_bs, lse_bs, dq_bs, dk_acc, dv_acc)
    dk = p.finish(dk_acc, k)
    dv = None if v is None else p.finish(dv_acc, v)
    return dq, dk, dv
