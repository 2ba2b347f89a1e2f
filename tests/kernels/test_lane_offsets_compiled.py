"""The INT64_LANES variant leaves no i32 stride product on a pointer offset, in any kernel class, without a device.

Issue 36: with an i32 stride, ``offs[:, None] * stride`` is an i32 multiply feeding the pointer add, and
it wraps once a tile's lanes times the stride reach 2**31. The launchers take the kernels' INT64_LANES
variant when a stride needs it (kernels/attn_common.py ``int64_lanes``). One subprocess
(tests/kernels/pipeline_hazards.py with ``int64-lanes``, TRITON_INTERPRET unset) compiles every kernel
class with that variant forced, through the real launchers with each arch's configs, and
coreattn/tune/offsets.py must find no i32 stride product on any pointer offset in the TTGIR (nor a
pipelined-load hazard):

- sm90 (wgmma): head dim 128 (MHA causal: the one-pass dK/dV); 192/128 with GQA 4 (dK and dV in two
  passes), a causal sliding window, dropout, a softmax offset (the dQ kernel's SINK_GRAD), max logit
  and a padded batch whose keep masks are strided views (position stride B: their lanes multiply);
  64 with dropout, whose dQ takes the variant's own tile (configs/dense.py ``_DQ_DROPOUT_INT64``); 128
  with GQA, Inkling 2's low-rank bias and per-token sinks, and 64 with T5's bias on a padded batch with
  strided keep masks (the bias table's gradient kernel in both forms). These
  sm90 kernels must not spill either, under the Triton releases CI tests;
- sm100 (tcgen05), sm80 (mma.sync) and gfx942 (CDNA3: Triton's HIP backend turns loads into buffer
  ops with i32 offsets, which the scan reads too): one case each with the keep masks and features;
- per arch the tile scan and map kernels and the mask utilities' kernels, which have no lane
  offsets of a runtime stride in either variant.

tests/kernels/test_pipeline_hazards.py shows the other side on its own compiles: in the default
(int32) variant every such product comes from ``_lane_offsets``, and a canary loads and stores rows
through the helpers in both variants. About 3 minutes of compiling on one core with an empty
Triton cache (sm90 alone, as the Triton lanes run it: under 2); seconds when cached.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from coreattn.kernels.versions import TESTED_TRITON

SCRIPT = Path(__file__).with_name("pipeline_hazards.py")
FEATURES = "gqa+window+dropout+sink+max_logit+keep_strided"
CASES = {
    "sm90": ("128", f"192/128+{FEATURES}", "64+dropout", "128+gqa+bias_rel+token_sink", "64+bias_t5+keep_strided"),
    "sm100": (f"128+{FEATURES}",),
    "sm80": (f"96/80+full+window+keep_strided",),
    "gfx942": (f"128+{FEATURES}",),
}
ATTENTION = ("fwd", "bwd_pre", "dkdv", "dq")
EVERY_KERNEL = {*ATTENTION, "tile_scan", "tile_map", "copy_rows", "token_ids"}


def _has_backend(name: str) -> bool:
    from triton.backends import backends

    return name in backends


pytestmark = pytest.mark.skipif(not _has_backend("nvidia"), reason="upstream Triton's nvidia backend is not installed")


@pytest.fixture(scope="module")
def compiled(request):
    """Every selected arch's cases in one subprocess, INT64_LANES forced (``-k sm90``: sm90 alone)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPT.parents[2]), env.get("PYTHONPATH")]))
    selected = {item.callspec.params.get("arch") for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    archs = [arch for arch in CASES if arch in selected] or list(CASES)
    specs = [f"{arch}:{','.join(CASES[arch])}" for arch in archs if not arch.startswith("gfx") or _has_backend("amd")]
    proc = subprocess.run([sys.executable, str(SCRIPT), "int64-lanes", *specs], capture_output=True, text=True,
                          env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def _label(row: dict) -> str:
    on = "+".join(k for k, v in row["flags"].items() if v is True)
    return f"{row['arch']} {row['kernel']} [{row['cases'][0]}; {on}]"


@pytest.mark.parametrize("arch", list(CASES))
def test_no_i32_stride_product_on_a_pointer_offset(compiled, arch):
    if arch.startswith("gfx") and not _has_backend("amd"):
        pytest.skip("upstream Triton's amd backend is not installed")
    assert not compiled["errors"], compiled["errors"]
    mine = [r for r in compiled["rows"] if r["arch"] == arch]
    kernels = {r["kernel"] for r in mine}
    every = EVERY_KERNEL | ({"bias_grad"} if any("bias" in c for c in CASES[arch]) else set())
    assert kernels == every, f"{arch}: not compiled: {sorted(every - kernels)}"
    attention = [r for r in mine if r["kernel"] in ATTENTION]
    assert all(r["flags"]["INT64_LANES"] is True for r in attention), [_label(r) for r in attention]
    assert all(r["flags"].get(f) for f in ("HAS_Q_KEEP", "HAS_K_KEEP") for r in attention if r["kernel"] != "bwd_pre"
               and "keep" in r["cases"][0]), "the keep-mask loads were not compiled"
    if arch == "sm90":  # both dK/dV passes and the one-pass kernel, the sink gradient's dQ
        dkdv = {(r["flags"]["DK"], r["flags"]["DV"]) for r in mine if r["kernel"] == "dkdv"}
        assert dkdv == {(True, True), (True, False), (False, True)}, dkdv
        assert any(r["flags"].get("SINK_GRAD") for r in mine if r["kernel"] == "dq")
    found = [f"{_label(r)}: {s}" for r in mine for s in r["i32_offsets"]]
    assert not found, f"i32 stride products on pointer offsets under INT64_LANES (Triton {compiled['triton']}):\n" \
        + "\n".join(found)
    assert not [h for r in mine for h in r["hazards"]]
    assert not [(_label(r), r["unresolved"]) for r in mine if r["unresolved"]]


@pytest.mark.compiler_output
@pytest.mark.parametrize("arch", ["sm90"])
def test_the_int64_variant_does_not_spill(compiled, arch):
    """sm90's INT64_LANES kernels stay within the register file (docs/compile-report.md has every
    class's registers in both variants, under each Triton CI tests)."""
    assert triton.__version__ in TESTED_TRITON
    mine = [r for r in compiled["rows"] if r["arch"] == arch]
    spilling = [f"{_label(r)}: {r['regs']} registers, {r['spill_stores']}/{r['spill_loads']} B" for r in mine
                if r["spill_stores"] or r["spill_loads"]]
    assert mine and not spilling, spilling
    dq64 = [r for r in mine if r["kernel"] == "dq" and r["cases"][0] == "64+dropout"]
    assert [(r["flags"]["BLOCK_M"], r["flags"]["BLOCK_N"]) for r in dq64] == [(128, 32)]  # _DQ_DROPOUT_INT64
