"""What the compiler makes of the kernels per CUDA and AMD CDNA architecture, without a device
(coreattn/tune/compiler.py): every kernel's shared memory fits its arch's per-block limit; on sm90
at head dims 64, 128 and 192/128 no kernel spills, every dot is a wgmma, no MMA is duplicated
across warps and the loops are pipelined (num_stages >= 2); elsewhere no spills where config.py's
tables achieve that. On gfx942 and gfx950 (AMD MI300, MI350) at 64, 128, 192/128 and 256, and on
gfx90a (MI250X) where its forward table differs from gfx942's: no VGPR spills and no scratch, LDS within the arch's limit, every dot an MFMA of the input type, none
duplicated across waves, at least 2 waves per SIMD.

One subprocess (TRITON_INTERPRET unset) compiles the CUDA archs once, bf16 causal (and fp32, whose one
small tile serves every arch, on sm90 and the 99 KB sm86); the tests read its rows. sm90 is compiled
at the dims it guarantees, the other archs at 256 and (see DIMS) 128. A second subprocess compiles
the CDNA archs, bf16 causal at the main dims; gfx90a (gfx942's tables and limits but for the
forward's) at 64, 128 and 256, and at 64 with max_logit, whose 128-key forward tile once spilled
there (the features at every dim are in the full report: ``python -m bench --what kernels --arch
gfx90a gfx942 gfx950``).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coreattn.tune.compiler import ARCHS, ATTENTION_KERNELS, CDNA_ARCHS

SCRIPT = Path(__file__).with_name("kernel_structure.py")
SM90_DIMS = ("64/64", "128/128", "192/128")
# 256: the largest tiles in shared memory; 128 too where an arch has a table of its own (sm89 shares
# sm86's and its limits, sm100 sm90's), which keeps the module near 3 minutes of compiling on one core
DIMS = {arch: ("128/128", "256/256") for arch in ARCHS}
DIMS.update(sm90=SM90_DIMS, sm89=("256/256",), sm100=("256/256",))
DIMS["sm90"] += ("128/128@fp32",)
DIMS["sm86"] += ("128/128@fp32",)
# (arch, dims) whose kernels config.py's tables keep spill-free (see its docstring for the rest)
SPILL_FREE = {(arch, dims) for arch in ARCHS for dims in DIMS[arch]}
CDNA_DIMS = {arch: ("64/64", "128/128", "192/128", "256/256") for arch in ("gfx942", "gfx950")}
CDNA_DIMS["gfx90a"] = ("64/64", "64/64+max_logit", "128/128", "256/256")


def _has_backend(name: str) -> bool:
    from triton.backends import backends

    return name in backends


pytestmark = pytest.mark.compiler_output  # Triton 3.9.0's registers, spills and MMAs (tests/conftest.py)
needs_nvidia = pytest.mark.skipif(not _has_backend("nvidia"),
                                  reason="upstream Triton's nvidia backend is not installed")
needs_amd = pytest.mark.skipif(not _has_backend("amd"), reason="upstream Triton's amd backend is not installed")


def _compile(dims: dict) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPT.parents[2]), env.get("PYTHONPATH")]))
    specs = [f"{arch}:{','.join(arch_dims)}" for arch, arch_dims in dims.items()]
    proc = subprocess.run([sys.executable, str(SCRIPT), *specs], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    for r in out:
        r["dims"] = f"{r['dim_qk']}/{r['dim_v']}" + ("@fp32" if r["dtype"] == "fp32" else "")
        r["dims"] += f"+{r['feature']}" if r.get("feature") else ""
    return out


@pytest.fixture(scope="module")
def rows():
    return _compile(DIMS)


@pytest.fixture(scope="module")
def cdna_rows():
    return _compile(CDNA_DIMS)


def _label(r: dict) -> str:
    return f"{r['arch']} {r['problem']} {r['kernel']} {r['block_m']}x{r['block_n']} w{r['num_warps']}"


@needs_nvidia
@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_kernel_compiled_and_fits_shared_memory(rows, arch):
    mine = [r for r in rows if r["arch"] == arch]
    kernels = {r["kernel"] for r in mine}
    assert {"fwd", "bwd_pre", "dkdv", "dq", "tile_scan", "tile_map"} <= kernels
    limit = ARCHS[arch].smem_per_block
    assert not [(_label(r), r["smem"]) for r in mine if r["smem"] > limit], f"over {limit} bytes of shared memory"
    assert all(r["ctas_per_sm"] >= 1 for r in mine)


@needs_nvidia
@pytest.mark.parametrize("dims", SM90_DIMS)
def test_sm90_spill_free_wgmma_unduplicated_pipelined(rows, dims):
    mine = [r for r in rows if r["arch"] == "sm90" and r["dims"] == dims]
    assert mine
    assert not [_label(r) for r in mine if r["spill_stores"] or r["spill_loads"]], "spills"
    mma = [r for r in mine if r["kernel"] in ATTENTION_KERNELS]
    assert not [(_label(r), r["dots"]) for r in mma if set(r["dots"]) != {"ttng.warp_group_dot"}], "dots not wgmma"
    assert not [(_label(r), r["mma"]) for r in mma if set(r["mma"]) != {"wgmma"}], "MMA other than wgmma in the PTX"
    assert not [(_label(r), r["mma_dup"]) for r in mma if r["mma_dup"] != 1], "MMA duplicated across warps"
    assert not [(_label(r), r["num_stages"]) for r in mma if r["num_stages"] < 2], "not pipelined"


@needs_nvidia
@pytest.mark.parametrize("arch", list(ARCHS))
def test_no_spills_where_the_tables_achieve_it(rows, arch):
    mine = [r for r in rows if r["arch"] == arch and (arch, r["dims"]) in SPILL_FREE]
    assert not [(_label(r), r["spill_stores"], r["spill_loads"]) for r in mine if r["spill_stores"] or r["spill_loads"]]
    assert not [(_label(r), r["mma_dup"]) for r in mine if r["mma_dup"] != 1], "MMA duplicated across warps"


@needs_amd
@pytest.mark.parametrize("arch", list(CDNA_DIMS))
def test_cdna_every_kernel_compiled_fits_lds_and_does_not_spill(cdna_rows, arch):
    mine = [r for r in cdna_rows if r["arch"] == arch]
    assert {"fwd", "bwd_pre", "dkdv", "dq"} <= {r["kernel"] for r in mine}
    assert {r["dims"] for r in mine} == set(CDNA_DIMS[arch])
    limit = CDNA_ARCHS[arch].lds_per_workgroup
    assert not [(_label(r), r["smem"]) for r in mine if r["smem"] > limit], f"over {limit} bytes of LDS"
    spilled = [(_label(r), r["vgpr_spills"], r["spill_stores"], r["spill_loads"], r["scratch"]) for r in mine
               if r["vgpr_spills"] or r["spill_stores"] or r["spill_loads"] or r["scratch"]]
    assert not spilled, "VGPR spills or scratch"
    assert not [(_label(r), r["waves_per_simd"]) for r in mine if r["waves_per_simd"] < 2], "under 2 waves per SIMD"


@needs_amd
@pytest.mark.parametrize("arch", list(CDNA_DIMS))
def test_cdna_every_dot_is_an_unduplicated_bf16_mfma(cdna_rows, arch):
    mma = [r for r in cdna_rows if r["arch"] == arch and r["kernel"] in ATTENTION_KERNELS]
    assert mma
    assert not [(_label(r), r["fma_dots"]) for r in mma if r["fma_dots"]], "dots without an MFMA layout"
    assert not [(_label(r), r["mma"]) for r in mma if not r["mma"] or not all(k.startswith("v_mfma_f32_") and
                                                                               "bf16" in k for k in r["mma"])]
    assert not [(_label(r), r["mma_dup"]) for r in mma if r["mma_dup"] != 1], "MFMA duplicated across waves"
