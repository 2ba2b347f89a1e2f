"""Launch plans at production scale, checked on CPU (bench/plan.py): every public op's host path at up to
128k tokens (and context parallelism's gathered key rows), 128 heads, Hkv 1/8/128, top-k 2,048, B up to
256 and every layout, planned for sm90, sm100, gfx942 and Ascend on meta tensors with every Triton
launch recorded instead of run (nothing compiled or executed; a host read would fail on a meta tensor).

- every launch's grid is within its target's limits: CUDA's x <= 2**31 - 1 and y/z <= 65,535, HIP's
  programs x 64 x num_warps < 2**32 per dispatch, Ascend's 65,535 programs;
- launches and launched programs per op grow at most linearly in tokens x top-k x heads: at most 4x
  (plus rounding) from 32k to 128k tokens;
- the device memory an op's host side allocates (forward + backward, its inputs not counted) stays
  below the formula ``bench.plan.memory_bound`` states (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses

import pytest

from bench import plan as planner
from bench.plan import ABSORBED, PER_HEAD, Shape
from coreattn.kernels.sparse_bwd import ENV_PARTIAL_BUDGET

ARCHS = ("sm90", "sm100", "gfx942", "ascend")
K128, K32 = 131072, 32768
GQA = dict(heads_kv=8, dim_qk=192, dim_v=128, absorbed=False)
DENSE_MHA = dict(heads_kv=128, dim_qk=128, dim_v=128, absorbed=False)

# The deterministic sparse backward's partial buffer: 16 GiB here, not the default 1 GiB, so that planning its
# chunks (each a few dozen torch ops on meta tensors, about a millisecond each on CPU) takes seconds: 37 chunks of
# absorbed MLA at 128k tokens instead of 578. Every property checked holds at any budget; `python -m bench.plan`
# plans the default.
PLAN_BUDGET = 16 << 30
_PLANS: dict = {}


@pytest.fixture(autouse=True)
def _budget(monkeypatch):
    monkeypatch.setenv(ENV_PARTIAL_BUDGET, str(PLAN_BUDGET))


def _plan(op: str, shape: Shape, arch: str = "sm90") -> planner.OpPlan:
    key = (op, shape, arch)
    if key not in _PLANS:
        _PLANS[key] = planner.plan_op(op, shape, arch)
    return _PLANS[key]


# (op, shape) at production scale: dense and sparse in every layout, B up to 256, Hkv 1/8/128, CP-gathered keys
CASES = {
    "dense-thd-gqa": ("dense", Shape(tokens=K128, batch=64, **GQA)),
    "dense-bshd-b256": ("dense", Shape(tokens=K128, batch=256, layout="bshd", **DENSE_MHA)),
    "dense-sbhd-cpkeys": ("dense", Shape(tokens=K32, batch=2, layout="sbhd", key_rows=K128 // 2, **GQA)),
    "sparse-thd-absorbed": ("sparse", Shape(tokens=K128, **ABSORBED)),
    "sparse-thd-perhead": ("sparse", Shape(tokens=K128, **PER_HEAD)),
    "sparse-thd-perhead-cpkeys": ("sparse", Shape(tokens=8192, key_rows=K128, **PER_HEAD)),
    "sparse-bshd-b256-gqa": ("sparse", Shape(tokens=K32, batch=256, layout="bshd", **GQA)),
    "sparse-sbhd-absorbed-cpkeys": ("sparse", Shape(tokens=K32, batch=2, layout="sbhd", key_rows=K128 // 2,
                                                    **ABSORBED)),
    "sparse_atomic-thd-perhead": ("sparse_atomic", Shape(tokens=K128, **PER_HEAD)),
    "sparse_atomic-thd-absorbed": ("sparse_atomic", Shape(tokens=2 * K128, **ABSORBED)),
    "indexer_topk": ("indexer_topk", Shape(tokens=K128)),
    "indexer_topk-cpkeys": ("indexer_topk", Shape(tokens=8192, key_rows=K128)),
    "rotate_activation": ("rotate_activation", Shape(tokens=K128)),
    "masks-b256": ("masks", Shape(tokens=K128, batch=256)),
    "core_attention-thd": ("core_attention", Shape(tokens=K128, batch=64, **GQA)),  # Megatron-Core's slot
    "core_attention-sbhd": ("core_attention", Shape(tokens=K32, batch=4, layout="sbhd", **DENSE_MHA)),
    # the loss runs in torch ops, a few tokens per chunk at this width: planned smaller (see docs/benchmarks.md)
    "indexer_loss": ("indexer_loss", Shape(tokens=2048, topk=256)),
}


# the cases whose host paths take seconds to plan (the index rows of 128k-256k tokens x 2,048 slots prepared a
# chunk at a time) on the archs whose limits or tables they test: CUDA's and HIP's (gfx942: 2**24 programs at
# 4 waves), Ascend's grid
ARCHS_OF = {"sparse-thd-absorbed": ("sm90", "gfx942", "ascend"), "sparse_atomic-thd-absorbed": ("sm90", "gfx942"),
            "sparse_atomic-thd-perhead": ("sm100", "gfx942"), "sparse-thd-perhead": ("sm90", "gfx942", "ascend")}


@pytest.mark.parametrize("case, arch", [(case, arch) for case in CASES for arch in ARCHS_OF.get(case, ARCHS)])
def test_every_launch_fits_its_target(case, arch):
    op, shape = CASES[case]
    plan = _plan(op, shape, arch)
    if plan.skipped:
        pytest.skip(plan.skipped)
    assert plan.launches, "nothing launched"
    over = {f"{launch.kernel} grid={launch.grid} warps={launch.num_warps}": why
            for launch in plan.launches if (why := planner.within_limits(launch, arch))}
    assert not over, f"{case} on {arch}: launches past the target's limits: {over}"


# 32k -> 128k tokens: launches and programs at most 4x (the sparse backward's chunks, 1 GiB of partials each, grow
# with the tokens; everything else is one launch per kernel)
GROWTH = {
    "dense-thd": ("dense", dict(batch=8, **GQA)),
    "dense-bshd": ("dense", dict(batch=8, layout="bshd", **DENSE_MHA)),
    "sparse-absorbed": ("sparse", ABSORBED),
    "sparse-perhead": ("sparse", PER_HEAD),
    "sparse-gqa-sbhd": ("sparse", dict(batch=4, layout="sbhd", **dict(GQA, heads=32))),  # groups of 4
    "sparse_atomic-absorbed": ("sparse_atomic", ABSORBED),
    "indexer_topk": ("indexer_topk", {}),
    "rotate_activation": ("rotate_activation", {}),
    "masks": ("masks", dict(batch=8)),
}
GROWTH_SLACK = 1.02  # block rounding


@pytest.mark.parametrize("case", list(GROWTH))
def test_launches_and_programs_grow_linearly(case):
    op, kw = GROWTH[case]
    small, large = (_plan(op, Shape(tokens=tokens, **kw)) for tokens in (K32, K128))
    ratio = K128 / K32
    assert len(large.launches) <= ratio * len(small.launches), \
        f"{case}: {len(small.launches):,} launches at 32k tokens, {len(large.launches):,} at 128k"
    assert large.programs <= ratio * GROWTH_SLACK * small.programs, \
        f"{case}: {small.programs:,} programs at 32k tokens, {large.programs:,} at 128k"
    assert large.torch_ops <= ratio * GROWTH_SLACK * small.torch_ops + 64, \
        f"{case}: {small.torch_ops:,} torch ops at 32k tokens, {large.torch_ops:,} at 128k"


def test_sparse_backward_programs_are_linear_in_entries():
    """The deterministic backward's launched programs per (token, kv head, slot) stay bounded (the reduce is
    sized by the chunk's entries, not by every key row), at 8k, 32k and 128k tokens, absorbed and per-head."""
    for kv in (ABSORBED, PER_HEAD):
        per_entry = []
        for tokens in (8192, K32, K128):
            shape = Shape(tokens=tokens, **kv)
            summary = planner.sparse_bwd_summary(_plan("sparse", shape))
            per_entry.append(summary["programs"] / (tokens * shape.heads_kv * shape.topk))
        assert max(per_entry) <= 1.1 * min(per_entry) + 0.01, f"{kv}: programs per entry {per_entry}"


@pytest.mark.parametrize("case", [c for c in CASES if c != "indexer_loss"])
def test_allocated_bytes_below_the_formula(case):
    op, shape = CASES[case]
    plan = _plan(op, shape)
    if plan.skipped:
        pytest.skip(plan.skipped)
    bound = planner.memory_bound(op, shape)
    assert plan.peak_bytes <= bound, f"{case}: {plan.peak_bytes:,} B allocated at peak, formula {bound:,} B"


def test_the_window_expansion_is_chunked():
    """A key window adds W entries to every index row; the forward joins them a chunk of tokens at a time: beyond
    the forward without it, only the W int32 entries per row it keeps for the backward and O(chunk) transients
    (not an int64 [N, Hidx, K + W] copy of the indices, 570 MB at 32k tokens)."""
    shape = Shape(tokens=K32, **ABSORBED)
    plain, windowed = _plan("sparse_fwd", shape), _plan("sparse_window_fwd", shape)
    added = shape.tokens * planner.WINDOW * 4
    assert windowed.peak_bytes <= plain.peak_bytes + added + 64 * 2**20, \
        f"{windowed.peak_bytes:,} B with the window, {plain.peak_bytes:,} B without"


def test_command_prints_a_plan(capsys):
    assert planner.main(["--op", "sparse", "--tokens", "4k", "--heads", "16", "--arch", "sm90", "gfx942"]) == 0
    out = capsys.readouterr().out
    assert "_sparse_attn_fwd_kernel" in out and "gfx942" in out and "partial" in out


def test_shape_label_and_keys():
    shape = Shape(tokens=K32, batch=4, layout="bshd", key_rows=16384)
    assert (shape.seqlen, shape.keys, shape.total_keys) == (8192, 16384, 65536)
    assert dataclasses.replace(shape, layout="thd", key_rows=None).keys == K32
