"""No pipelined load's address divides by a value that may be zero, in any kernel class, without a device.

Issue 30: on an H100 the dK/dV kernel's ``head0 + step // n_blocks`` (``n_blocks`` 0 for an empty query
range) reached a cp.async that Triton's software pipeliner issues ahead of its loop, prologue
included, even when the loop runs zero times; a masked-off cp.async with a wild address faults.
coreattn/tune/hazards.py finds such divisions in the compiled TTGIR. One subprocess
(tests/kernels/pipeline_hazards.py, TRITON_INTERPRET unset) compiles, through the real launchers
with each arch's configs:

- sm90 (wgmma, TMA): head dim 128 as shipped (MHA, causal); 256/256 with GQA 4, a causal sliding
  window, dropout, a softmax offset (the dQ kernel's SINK_GRAD) and max logit (dK/dV in two passes);
  128 with GQA, a window, dropout, Inkling 2's low-rank bias and per-token sinks, and with T5's
  clamped bias (the bias table's gradient kernel with both);
  96/80 (a split q/k block, v columns masked past 80) on a padded batch with spans and keep masks,
  not causal, left window only; 192/128 with GQA and a window on the tuner's TMA loop variant;
- sm100 (tcgen05): 128 as shipped and 192/128 with GQA, window and dropout on the warp-specialized
  TMA loop variant;
- sm80 (mma.sync, 163 KB): 128 with GQA and every feature, and the padded 96/80 case; sm120 (the
  99 KB table with its own dropout tiles): 64 with GQA and every feature;
- gfx950 (CDNA3+, whose direct-to-LDS loads are asynchronous): 128 with GQA and every feature
  (CDNA's tables use num_stages 1: no loop is pipelined there today, the check holds if one is);
- the sparse (top-k) kernels (kernels/sparse_fwd.py, sparse_bwd.py: forward, dQ, both dK/dV variants,
  each of the three also in its range mode for full rows, the CSR reduce, the delta preprocess) on
  sm90, sm100 and gfx950 over the problems test_kernel_structure.py compiles there (absorbed MLA at
  576/512, V read from the gathered key block, with 8 heads, whose range tiles hold 2-4 tokens, and 128;
  per-head K/V at 576/512, a separate V; GQA 4 at 256/256 in fp16; per-head 256/256 in fp32) and
  DeepSeek-V4's 512/512 with K = V (one q/k block); on sm80 absorbed 576/512 with 128 heads and GQA 4
  at 192/128; and the DSA indexer's top-k (each dtype, ReLU or not, with its scores output) and
  Hadamard kernels on sm90, sm100 and gfx950 (the sweep, bench/compile_sweep.py, scans every
  configuration class for the same hazard);
- per arch the tile scan and map kernels of both layouts and the mask utilities' kernels;
- a canary: a small kernel with the dK/dV loop's shape, unclamped and clamped, which the scanner must
  flag and pass in this Triton's own output (the TTGIR text format differs between versions).

The same compiles feed the offset scan (coreattn/tune/offsets.py, issue 36): in these kernels, which
take the default int32 variant of the lane offsets, every i32 multiply of a runtime stride on a
pointer offset must be a lane offset of ``attn_common._lane_offsets``, the one place the
INT64_LANES variant widens (tests/kernels/test_lane_offsets_compiled.py compiles that variant and
finds none); a canary loads and stores rows through the helpers in both variants.

About 3 minutes of compiling on one core with an empty Triton cache; seconds when cached. What it
cannot see: addresses that are wild for other reasons (the interpreter memcheck's job,
tests/interp_memcheck.py) and configs other than those compiled here (the dry run compiles the
tuner's candidates: ``python -m coreattn.tune --dry-run``).
"""

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_kernel_structure import SPARSE_CDNA_DIMS, SPARSE_DIMS

SCRIPT = Path(__file__).with_name("pipeline_hazards.py")
SPARSE_CASES = ("s576/512a128", "s192/128g4")  # compiler.sparse_problem_of
# sm90, sm100 and CDNA: the sparse problems test_kernel_structure.py compiles there (the same compiled kernels,
# from Triton's cache when both modules run), 512/512 with K = V, and the indexer's kernels
CASES = {
    "sm90": ("128", "256+gqa+window+dropout+sink+max_logit", "96/80+full+keep+window", "192/128+gqa+window@tma",
             "128+gqa+window+dropout+bias_rel+token_sink", "128+bias_t5", *SPARSE_DIMS["sm90"], "s512/512a16",
             "indexer"),
    "sm100": ("128", "192/128+gqa+window+dropout@ws", *SPARSE_DIMS["sm100"], "s512/512a16@fp16", "indexer"),
    "sm80": ("128+gqa+window+dropout+sink+max_logit", "96/80+full+keep+window", *SPARSE_CASES),
    "sm120": ("64+gqa+window+dropout+sink+max_logit",),
    "gfx950": ("128+gqa+window+dropout+sink+max_logit", *SPARSE_CDNA_DIMS["gfx950"], "indexer"),
}
ATTENTION = ("fwd", "dkdv", "dq")
EVERY_KERNEL = {"fwd", "bwd_pre", "dkdv", "dq", "tile_scan", "tile_map", "copy_rows", "token_ids"}
FEATURES = {f"{k}:{f}" for k in ATTENTION for f in ("DROPOUT", "HAS_LEFT", "HAS_RIGHT", "gqa", "mha")}
PADDED = {f"{k}:{f}" for k in ATTENTION for f in ("HAS_Q_KEEP", "HAS_K_KEEP", "padded", "left-only")}
SPARSE = {"sparse_fwd", "sparse_fwd:V_IS_K", "sparse_dq", "sparse_dq:V_IS_K", "sparse_dkv", "sparse_dkv:V_IS_K",
          "sparse_dkv:ATOMIC", "sparse_reduce", "sparse_fwd:RANGE", "sparse_dq:RANGE", "sparse_dkv:RANGE"}
# the sweep's classes these cases add: a separate V per head, fp16 and fp32, the range mode's token rows
SPARSE_CLASSES = {f"{k}:{c}" for k in ("sparse_fwd", "sparse_dq", "sparse_dkv") for c in ("separate-v", "fp16", "fp32")}
INDEXER = {"indexer_topk", "indexer_topk:RELU", "indexer_topk:RETURN_SCORES", "hadamard"}
# the additive bias (low-rank with coefficients, T5's clamped table) and per-token sinks: the table-gradient kernel too
BIAS = {"bias_grad", "fwd:SINK_ROWS"} | {f"{k}:{f}" for k in ATTENTION for f in ("BIAS", "BIAS_COEF", "BIAS_CLAMP")} | {
    "dq:BIAS_GRAD", "bias_grad:BIAS_COEF", "bias_grad:BIAS_CLAMP"}
# the classes each arch must have compiled: every kernel, and each variant that changes a loop body
REQUIRED = {
    "sm90": EVERY_KERNEL | FEATURES | PADDED | {f"{k}:TMA" for k in ATTENTION} | {
        "fwd:HAS_SINK", "fwd:RETURN_MAX", "dq:SINK_GRAD", "dkdv:dK-pass", "dkdv:dV-pass", "tile_scan:SPANS",
        "tile_map:SPANS", "copy_rows:GATHER", "copy_rows:scatter", "token_ids:WRITE_POS", "token_ids:WRITE_SEQ"}
    | SPARSE | SPARSE_CLASSES | {f"{k}:token-rows" for k in ("sparse_fwd", "sparse_dq", "sparse_dkv")} | INDEXER | BIAS,
    "sm100": EVERY_KERNEL | {f"{k}:{f}" for k in ATTENTION for f in ("WARP_SPEC", "TMA", "gqa", "mha", "DROPOUT")}
    | SPARSE | {c for c in SPARSE_CLASSES if not c.endswith("fp32")} | INDEXER,
    "sm80": EVERY_KERNEL | FEATURES - {f"{k}:mha" for k in ATTENTION} | PADDED | {"dq:SINK_GRAD"} | SPARSE,
    "sm120": EVERY_KERNEL | FEATURES - {f"{k}:mha" for k in ATTENTION} | {"dq:SINK_GRAD", "fwd:RETURN_MAX"},
    "gfx950": {"fwd", "dkdv", "dq", "dkdv:gqa", "dq:SINK_GRAD"} | SPARSE
    | {c for c in SPARSE_CLASSES if not c.endswith("fp16")} | INDEXER,
}


def _has_backend(name: str) -> bool:
    from triton.backends import backends

    return name in backends


pytestmark = pytest.mark.skipif(not _has_backend("nvidia"), reason="upstream Triton's nvidia backend is not installed")


@pytest.fixture(scope="module")
def compiled(request):
    """Every arch's cases and the canary in one subprocess; only the archs of the selected tests
    (``-k sm90`` compiles sm90 alone, as the Triton lanes of .ci/run run it), all when none names one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPT.parents[2]), env.get("PYTHONPATH")]))
    selected = {item.callspec.params.get("arch") for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    archs = [arch for arch in CASES if arch in selected] or list(CASES)
    specs = [f"{arch}:{','.join(CASES[arch])}" for arch in archs if not arch.startswith("gfx") or _has_backend("amd")]
    proc = subprocess.run([sys.executable, str(SCRIPT), "canary", *specs], capture_output=True, text=True, env=env,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def _classes(row: dict) -> set:
    """The kernel and the variant labels of one compiled kernel (``dkdv:DROPOUT``, ``fwd:left-only``, ...)."""
    kernel, flags = row["kernel"], row["flags"]
    labels = {kernel} | {f"{kernel}:{flag}" for flag, on in flags.items() if on is True}
    if kernel == "dkdv" and flags["DK"] != flags["DV"]:
        labels.add("dkdv:dK-pass" if flags["DK"] else "dkdv:dV-pass")
    if kernel in ATTENTION:
        labels.add(f"{kernel}:gqa" if any("+gqa" in c for c in row["cases"]) else f"{kernel}:mha")
        labels |= {f"{kernel}:padded"} if not flags["PACKED"] else set()
        labels |= {f"{kernel}:left-only"} if flags["HAS_LEFT"] and not flags["HAS_RIGHT"] else set()
    if kernel == "copy_rows" and not flags["GATHER"]:
        labels.add("copy_rows:scatter")
    if kernel in ("sparse_fwd", "sparse_dq", "sparse_dkv"):
        cases = row["cases"]
        labels |= {f"{kernel}:separate-v"} if any(re.search(r"[gp]\d", c) for c in cases) else set()
        labels |= {f"{kernel}:{d}" for d in ("fp16", "fp32") if any(c.endswith("@" + d) for c in cases)}
        labels |= {f"{kernel}:token-rows"} if flags.get("BLOCK_T", 1) > 1 else set()
    return labels


def _label(row: dict) -> str:
    on = "+".join(k for k, v in row["flags"].items() if v is True)
    return f"{row['arch']} {row['kernel']} [{row['cases'][0]}; {on}; {row['num_stages']} stages]"


def test_the_canary_is_flagged_unclamped_and_passes_clamped(compiled):
    """The scanner reads this Triton's TTGIR: the dK/dV loop's shape is found, its clamp recognised."""
    canary = {row["flags"]["CLAMP"]: row for row in compiled["rows"] if row["kernel"] == "canary"}
    assert canary[False]["async_loads"] > 0 and canary[True]["async_loads"] > 0, "the canary's load is not pipelined"
    found = canary[False]["hazards"]
    assert any(h.startswith("arith.divsi by %n") for h in found) and any(h.startswith("arith.remsi by %n")
                                                                         for h in found), found
    assert all("pipeline_hazards.py:" in h for h in found), found
    assert canary[True]["hazards"] == []


def test_the_shipped_configs_compile(compiled):
    failed = [e for e in compiled["errors"] if "@" not in e["case"]]
    assert not failed, failed


def test_the_loop_variants_compile(compiled):
    """The tuner's TMA and warp-specialized variants: one that this Triton cannot compile is not a
    candidate there (the tuner drops it; configs/space.py's _VARIANTS are what Triton 3.9 compiles), so it
    is skipped here, by name; its classes are then not required below."""
    failed = [e for e in compiled["errors"] if "@" in e["case"]]
    if failed:
        pytest.skip(f"Triton {compiled['triton']} does not compile: "
                    + "; ".join(f"{e['arch']} {e['case']} {'/'.join(e['kernels'])}: {e['error']}" for e in failed))


@pytest.mark.parametrize("arch", list(CASES))
def test_every_kernel_class_is_compiled(compiled, arch):
    if arch.startswith("gfx") and not _has_backend("amd"):
        pytest.skip("upstream Triton's amd backend is not installed")
    seen = set().union(*(_classes(r) for r in compiled["rows"] if r["arch"] == arch))
    variant_flags = {"tma": ("TMA",), "ws": ("TMA", "WARP_SPEC")}
    uncompiled = {f"{k}:{flag}" for e in compiled["errors"] if e["arch"] == arch and "@" in e["case"]
                  for k in e["kernels"] for flag in variant_flags[e["case"].partition("@")[2]]}
    missing = REQUIRED[arch] - seen - uncompiled
    assert not missing, f"{arch}: not compiled: {sorted(missing)}"


def test_the_scanner_reads_every_name(compiled):
    """Every operand the scanner reads resolves to a definition it parsed: a change in how this
    Triton prints TTGIR (a new region syntax, a new name form) shows here, not as a silent pass."""
    assert not [(_label(r), r["unresolved"]) for r in compiled["rows"] if r["unresolved"]]


@pytest.mark.parametrize("arch", [a for a in CASES if not a.startswith("gfx")])
def test_loops_are_pipelined_into_asynchronous_loads(compiled, arch):
    """Not a vacuous pass: every CUDA arch's forward and its pointer-loop dK/dV kernels at 2 or more
    stages have asynchronous loads for the scanner to check (an op renamed by a new Triton would
    show here)."""
    mine = [r for r in compiled["rows"] if r["arch"] == arch and r["kernel"] in ("fwd", "dkdv")
            and not r["flags"].get("TMA") and r["num_stages"] >= 2]
    assert {r["kernel"] for r in mine} >= ({"fwd", "dkdv"} if arch != "sm120" else {"fwd"})
    assert not [_label(r) for r in mine if r["async_loads"] == 0], "pipelined loops without asynchronous loads"


@pytest.mark.parametrize("arch", [a for a in CASES if not a.startswith("gfx") and any(c.startswith("s") for c in CASES[a])])
def test_the_sparse_loops_are_pipelined_into_asynchronous_loads(compiled, arch):
    """The sparse kernels' slot and key loops (and the reduce's entry loop) issue asynchronous loads
    wherever their config pipelines them: the scan below checks their gathers' addresses. (The slot-mode
    dK/dV of per-head K/V, whose head loop has one step, is configured with one stage: configs/sparse.py.)"""
    mine = [r for r in compiled["rows"] if r["arch"] == arch and r["kernel"].startswith("sparse_")
            and r["num_stages"] >= 2]
    assert {r["kernel"] for r in mine} >= {"sparse_fwd", "sparse_dq", "sparse_dkv"}
    assert not [_label(r) for r in mine if r["kernel"] != "sparse_reduce" and r["async_loads"] == 0]


@pytest.mark.parametrize("arch", list(CASES))
def test_no_pipelined_load_address_divides_by_a_maybe_zero_value(compiled, arch):
    if arch.startswith("gfx") and not _has_backend("amd"):
        pytest.skip("upstream Triton's amd backend is not installed")
    mine = [r for r in compiled["rows"] if r["arch"] == arch and r["kernel"] != "canary"]
    assert mine
    found = [(r, h) for r in mine for h in r["hazards"]]
    # one line per division in the source (its op, divisor and innermost line), then every site
    summary = sorted({re.sub(r"by %([A-Za-z_]\w*?)(?:_\d+)? at", r"by \1 at",
                             f"{r['fn']}: {h.split(' (TTGIR')[0].split(' < ')[0]}") for r, h in found})
    assert not found, (f"{len(found)} division sites on pipelined-load addresses in {len({r['hash'] for r, _ in found})} "
                       f"compiled kernels (Triton {compiled['triton']}), from:\n  " + "\n  ".join(summary)
                       + "\nevery site:\n" + "\n".join(f"{_label(r)}: {h}" for r, h in found))


def test_the_lanes_canary_is_flagged_in_int32_and_clean_in_int64(compiled):
    """The offset scan reads this Triton's TTGIR: rows loaded and stored through the kernels' helpers
    are i32 stride products in the int32 variant (loads, keep mask, store) and none in INT64_LANES."""
    canary = {row["flags"]["INT64_LANES"]: row for row in compiled["rows"] if row["kernel"] == "lanes_canary"}
    found = canary[False]["i32_offsets"]
    assert len(found) >= 3 and all("attn_common.py:" in s for s in found), found
    assert any("* stride_t [" in s for s in found) and any("* stride_s [" in s for s in found), found
    assert canary[True]["i32_offsets"] == []


def _lane_offsets_lines() -> set:
    """(file name, line) of ``_lane_offsets``' body."""
    from coreattn.kernels.attn_common import _lane_offsets

    lines, first = inspect.getsourcelines(_lane_offsets.fn)
    return {("attn_common.py", n) for n in range(first, first + len(lines))}


@pytest.mark.parametrize("arch", list(CASES))
def test_every_i32_stride_offset_is_a_lane_offset(compiled, arch):
    """In the default (int32) variant the i32 stride products on pointer offsets all come from
    ``_lane_offsets`` (which INT64_LANES widens), and the tile map and mask kernels have none. CUDA
    only for the location: Triton's HIP backend rebuilds a buffer op's offsets at the load's line."""
    if arch.startswith("gfx") and not _has_backend("amd"):
        pytest.skip("upstream Triton's amd backend is not installed")
    mine = [r for r in compiled["rows"] if r["arch"] == arch and "canary" not in r["kernel"]]
    assert mine and not any(r["flags"].get("INT64_LANES") for r in mine)
    lines = _lane_offsets_lines()
    elsewhere = []
    for r in mine:
        for site in r["i32_offsets"]:
            m = re.search(r" at (\w+\.py):(\d+)", site)
            if not (m and (m.group(1), int(m.group(2))) in lines) and not arch.startswith("gfx"):
                elsewhere.append(f"{_label(r)}: {site}")
    assert not elsewhere, "i32 stride products outside _lane_offsets:\n" + "\n".join(elsewhere)
    lanes = ATTENTION + ("bwd_pre", "bias_grad")  # the kernels with lane offsets (an INT64_LANES flag)
    assert all(r["i32_offsets"] for r in mine if r["kernel"] in lanes), "no lane offsets seen"
    assert not [r for r in mine if r["kernel"] not in lanes and r["i32_offsets"]]
