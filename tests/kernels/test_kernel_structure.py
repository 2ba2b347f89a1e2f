"""What the compiler makes of the kernels per CUDA and AMD CDNA architecture, without a device
(coreattn/tune/compiler.py): every kernel's shared memory fits its arch's per-block limit; on sm90
at head dims 64, 128, 192/128 and 256 no kernel spills, every dot is a wgmma, no MMA is duplicated
across warps and the loops are pipelined (num_stages >= 2); elsewhere no spills where configs/dense.py's
tables achieve that. On gfx942 and gfx950 (AMD MI300, MI350) at 64, 128, 192/128 and 256, and on
gfx90a (MI250X) where its forward table differs from gfx942's: no VGPR spills and no scratch, LDS within the arch's limit, every dot an MFMA of the input type, none
duplicated across waves, at least 2 waves per SIMD.

Which Triton: compiler output differs by release (sm90's dQ at 256 spilled 4 B under Triton 3.6.0
and 3.7.1 with a tile 3.9.0 compiled spill-free), so these assertions hold for the releases in
coreattn/kernels/versions.py ``TESTED_TRITON`` (3.6.0, 3.7.1, 3.8.0, 3.9.0): the main CI lane runs
this module under 3.7.1, the Triton lanes its sm90 tests (``-k sm90``) under the others; a failure
names the Triton that compiled. The CDNA checks hold for Triton 3.9.0 only (``CDNA_CHECKED_TRITON``)
and run in the Triton 3.9.0 lane.

The sparse (top-k) kernels (kernels/sparse_fwd.py, sparse_bwd.py; configs/sparse.py), a subset of the
configuration classes the sparse sweep compiles (bench/compile_sweep.py: every class on sm90, sm100 and
CDNA, run by hand per release, docs/compile-report.md): on sm90 absorbed MLA at 576/512 with 8, 16 and
128 q heads, per-head K/V at 576/512, GQA 4 at 128 and at 256/256 in fp16, per-head 256/256 in fp32 and
the block mode at MiniMax-M3's dims; on sm100 the 128-head and per-head 576/512 problems (the main lane
only); under 3.9.0 on gfx942 and gfx950 the 128-head, per-head 576/512, GQA 4 and fp32 problems (and the
block mode on gfx942): every kernel of the forward and both backward variants compiled in both modes
(slot, and range for full rows; the block mode's own), no spills, shared memory (LDS) within the limit,
every 16-bit dot an MMA (wgmma, mma.sync or tcgen05; MFMA) of the input type (fp32: FMA loops on CUDA,
fp32 MFMAs on CDNA), the loops pipelined on sm90 and sm100 (but the one-stage range dK/dV of configs/
sparse.py), no pipelined-load hazard and no i32 stride product on a pointer offset. Their 16- to 64-row
tiles duplicate the score dots across warps (configs/sparse.py says why), which is shown in the compile
report, not asserted here.

Compiling happens in subprocesses (TRITON_INTERPRET unset), once per module for every arch a
selected test needs (``-k sm90`` compiles sm90 alone); the tests read the rows. The CUDA archs are
compiled bf16 causal (and fp32, whose one small tile serves every arch, on sm90 and the 99 KB
sm86); sm90 at the dims it guarantees, the other archs at 256 and (see DIMS) 128. The CDNA archs,
bf16 causal at the main dims; gfx90a (gfx942's tables and limits but for the
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
import triton

from coreattn.kernels.versions import TESTED_TRITON
from coreattn.tune.compiler import ARCHS, ATTENTION_KERNELS, CDNA_ARCHS, SPARSE_MMA_KERNELS, mfma_input

SCRIPT = Path(__file__).with_name("kernel_structure.py")
SM90_DIMS = ("64/64", "128/128", "192/128", "256/256")
# 256: the largest tiles in shared memory; 128 too where an arch has a table of its own (sm89 shares
# sm86's and its limits, sm100 sm90's), which keeps the module near 3 minutes of compiling on one core
DIMS = {arch: ("128/128", "256/256") for arch in ARCHS}
DIMS.update(sm90=SM90_DIMS, sm89=("256/256",), sm100=("256/256",))
DIMS["sm90"] += ("128/128@fp32", "128/128+bias_rel", "192/128+bias_t5")
DIMS["sm100"] += ("128/128+bias_rel",)
BIAS_DIMS = ("128/128+bias_rel", "192/128+bias_t5")  # the additive bias's kernels (the table gradient's too)
DIMS["sm86"] += ("128/128@fp32",)
# (arch, dims) whose kernels configs/dense.py's tables keep spill-free (see its docstring for the rest)
SPILL_FREE = {(arch, dims) for arch in ARCHS for dims in DIMS[arch]}
CDNA_DIMS = {arch: ("64/64", "128/128", "192/128", "256/256") for arch in ("gfx942", "gfx950")}
CDNA_DIMS["gfx90a"] = ("64/64", "64/64+max_logit", "128/128", "256/256")
CDNA_DIMS["gfx950"] += ("128/128+bias_rel",)  # the bias tiles (CDNA's 16-key steps; gfx950's dK/dV on gfx942's)
# the sparse kernels (tests/kernels/kernel_structure.py's ``s`` specs: compiler.sparse_problem_of), a subset of the
# sweep's configuration classes (bench/compile_sweep.py: every class, run by hand per release): absorbed 576/512 with
# 8 q heads (16-row slot tiles, range tiles of 4 tokens x 8 heads), 16 and 128 (32- and 64-row tiles), per-head K/V
# at 576/512 (a separate 512-wide V), GQA 4 at 128 and at 256/256 in fp16, per-head 256/256 in fp32 (the widest fp32
# the tables run: configs/sparse.py FP32_MAX_WIDTH), and the block mode at MiniMax-M3's dims (64 q heads of 128 on 4
# kv heads, blocks of 128) on sm90 and gfx942: the sweep has the other archs, dims and releases
SPARSE_DIMS = {"sm90": ("s576/512a8", "s576/512a16", "s576/512a128", "s576/512p16", "s128/128g4", "s256/256g4@fp16",
                        "s256/256p16@fp32", "s128/128g16b128"),
               "sm100": ("s576/512a128", "s576/512p16")}
SPARSE_CDNA_DIMS = {arch: ("s576/512a128", "s576/512p16", "s128/128g4", "s256/256p16@fp32")
                    for arch in ("gfx942", "gfx950")}
SPARSE_CDNA_DIMS["gfx942"] += ("s128/128g16b128",)
MMA_INPUTS = {"bf16": {"bf16", "kind::f16"}, "fp16": {"f16", "kind::f16"}}  # PTX operand types of a 16-bit MMA
SPARSE_KERNELS = {"sparse_fwd", "sparse_pre", "sparse_dq", "sparse_dkv", "sparse_dkv[atomic]", "sparse_reduce",
                  "sparse_fwd[range]", "sparse_dq[range]", "sparse_dkv[range]"}
BLOCK_KERNELS = {"sparse_fwd[block]", "sparse_pre", "sparse_dq[block]", "sparse_dkv[block]"}


def _has_backend(name: str) -> bool:
    from triton.backends import backends

    return name in backends


pytestmark = pytest.mark.compiler_output  # skipped under a Triton CI does not test (tests/conftest.py)
needs_nvidia = pytest.mark.skipif(not _has_backend("nvidia"),
                                  reason="upstream Triton's nvidia backend is not installed")
needs_amd = pytest.mark.skipif(not _has_backend("amd"), reason="upstream Triton's amd backend is not installed")
# The CDNA tables were chosen and checked with Triton 3.9.0 only; Triton 3.7.1 compiles two of their
# kernels differently (gfx942's dQ at 192/128 spills a VGPR, gfx90a's dK pass at 256 takes 266
# registers: one wave per SIMD), so these checks run under 3.9.0 (CI: the Triton 3.9.0 lane)
CDNA_CHECKED_TRITON = ("3.9.0",)
cdna_triton = pytest.mark.skipif(triton.__version__ not in CDNA_CHECKED_TRITON,
                                 reason=f"the CDNA tables hold for Triton {', '.join(CDNA_CHECKED_TRITON)} "
                                        f"(this is {triton.__version__}): see CDNA_CHECKED_TRITON")


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


class _Compiled:
    """Rows per arch, compiled on first use: the archs of every selected test of this module in one
    subprocess (so ``-k sm90`` compiles sm90 alone)."""

    def __init__(self, dims: dict, request, fixture: str):
        items = [i for i in request.session.items if i.module is request.module and fixture in i.fixturenames]
        self.dims, self.rows = dims, {}
        self.wanted = [arch for arch in dims if any(_arch_of(item) == arch for item in items)]

    def __call__(self, arch: str) -> list[dict]:
        if arch not in self.rows:
            todo = [a for a in self.wanted if a not in self.rows and a != arch] + [arch]
            out = _compile({a: self.dims[a] for a in todo})
            self.rows.update({a: [r for r in out if r["arch"] == a] for a in todo})
        return self.rows[arch]


def _arch_of(item) -> str | None:
    params = item.callspec.params if hasattr(item, "callspec") else {}
    return params.get("arch", "sm90" if item.originalname.startswith("test_sm90_") else None)


@pytest.fixture(scope="module")
def rows(request):
    return _Compiled(DIMS, request, "rows")


@pytest.fixture(scope="module")
def cdna_rows(request):
    return _Compiled(CDNA_DIMS, request, "cdna_rows")


@pytest.fixture(scope="module")
def sparse_rows(request):
    return _Compiled({**SPARSE_DIMS, **SPARSE_CDNA_DIMS}, request, "sparse_rows")


def _sparse_kernel(r: dict) -> str:
    return r["kernel"] + ("[atomic]" if r.get("atomic") else "[range]" if r.get("range") else
                          "[block]" if r.get("blocks") else "")


def _where() -> str:
    return f" (compiled by Triton {triton.__version__}; these assertions hold for Triton {', '.join(TESTED_TRITON)})"


def _label(r: dict) -> str:
    return f"{r['arch']} {r['problem']} {r['kernel']} {r['block_m']}x{r['block_n']} w{r['num_warps']}"


@needs_nvidia
@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_kernel_compiled_and_fits_shared_memory(rows, arch):
    mine = rows(arch)
    kernels = {r["kernel"] for r in mine}
    assert {"fwd", "bwd_pre", "dkdv", "dq", "tile_scan", "tile_map"} <= kernels
    assert {r["triton"] for r in mine} == {triton.__version__}  # every row names the Triton that compiled it
    limit = ARCHS[arch].smem_per_block
    over = [(_label(r), r["smem"]) for r in mine if r["smem"] > limit]
    assert not over, f"over {limit} bytes of shared memory" + _where()
    assert all(r["ctas_per_sm"] >= 1 for r in mine)


@needs_nvidia
@pytest.mark.parametrize("dims", SM90_DIMS)
def test_sm90_spill_free_wgmma_unduplicated_pipelined(rows, dims):
    mine = [r for r in rows("sm90") if r["dims"] == dims]
    assert mine
    spills = [(_label(r), r["spill_stores"], r["spill_loads"]) for r in mine if r["spill_stores"] or r["spill_loads"]]
    assert not spills, "spills" + _where()
    mma = [r for r in mine if r["kernel"] in ATTENTION_KERNELS]
    not_wgmma = [(_label(r), r["dots"]) for r in mma if set(r["dots"]) != {"ttng.warp_group_dot"}]
    assert not not_wgmma, "dots not wgmma" + _where()
    assert not [(_label(r), r["mma"]) for r in mma if set(r["mma"]) != {"wgmma"}], \
        "MMA other than wgmma in the PTX" + _where()
    assert not [(_label(r), r["mma_dup"]) for r in mma if r["mma_dup"] != 1], "MMA duplicated across warps" + _where()
    assert not [(_label(r), r["num_stages"]) for r in mma if r["num_stages"] < 2], "not pipelined" + _where()


@needs_nvidia
def test_sm90_bias_kernels_spill_free_wgmma_pipelined(rows):
    """The bias variants (Inkling 2's low-rank at 128, T5's at 192/128): every kernel compiled without
    spills, the attention kernels' dots wgmma and pipelined; the table-gradient kernel compiled."""
    mine = [r for r in rows("sm90") if r["dims"] in BIAS_DIMS]
    assert {(r["dims"], r["kernel"]) for r in mine} >= {(d, k) for d in BIAS_DIMS for k in ("fwd", "dkdv", "dq",
                                                                                           "bias_grad")}
    spills = [(_label(r), r["spill_stores"], r["spill_loads"]) for r in mine if r["spill_stores"] or r["spill_loads"]]
    assert not spills, "spills" + _where()
    mma = [r for r in mine if r["kernel"] in ATTENTION_KERNELS]
    assert not [(_label(r), r["dots"]) for r in mma if set(r["dots"]) != {"ttng.warp_group_dot"}], "not wgmma" + _where()
    assert not [(_label(r), r["num_stages"]) for r in mma if r["num_stages"] < 2], "not pipelined" + _where()


@needs_nvidia
@pytest.mark.parametrize("arch", list(ARCHS))
def test_no_spills_where_the_tables_achieve_it(rows, arch):
    mine = [r for r in rows(arch) if (arch, r["dims"]) in SPILL_FREE]
    spills = [(_label(r), r["spill_stores"], r["spill_loads"]) for r in mine if r["spill_stores"] or r["spill_loads"]]
    assert not spills, "spills" + _where()
    assert not [(_label(r), r["mma_dup"]) for r in mine if r["mma_dup"] != 1], "MMA duplicated across warps" + _where()


@needs_amd
@cdna_triton
@pytest.mark.parametrize("arch", list(CDNA_DIMS))
def test_cdna_every_kernel_compiled_fits_lds_and_does_not_spill(cdna_rows, arch):
    mine = cdna_rows(arch)
    assert {"fwd", "bwd_pre", "dkdv", "dq"} <= {r["kernel"] for r in mine}
    assert {r["dims"] for r in mine} == set(CDNA_DIMS[arch])
    limit = CDNA_ARCHS[arch].lds_per_workgroup
    assert not [(_label(r), r["smem"]) for r in mine if r["smem"] > limit], f"over {limit} bytes of LDS" + _where()
    spilled = [(_label(r), r["vgpr_spills"], r["spill_stores"], r["spill_loads"], r["scratch"]) for r in mine
               if r["vgpr_spills"] or r["spill_stores"] or r["spill_loads"] or r["scratch"]]
    assert not spilled, "VGPR spills or scratch" + _where()
    low = [(_label(r), r["waves_per_simd"]) for r in mine if r["waves_per_simd"] < 2]
    assert not low, "under 2 waves per SIMD" + _where()


@needs_amd
@cdna_triton
@pytest.mark.parametrize("arch", list(CDNA_DIMS))
def test_cdna_every_dot_is_an_unduplicated_bf16_mfma(cdna_rows, arch):
    mma = [r for r in cdna_rows(arch) if r["kernel"] in ATTENTION_KERNELS]
    assert mma
    assert not [(_label(r), r["fma_dots"]) for r in mma if r["fma_dots"]], "dots without an MFMA layout" + _where()
    assert not [(_label(r), r["mma"]) for r in mma if not r["mma"] or not all(k.startswith("v_mfma_f32_") and
                                                                               "bf16" in k for k in r["mma"])]
    assert not [(_label(r), r["mma_dup"]) for r in mma if r["mma_dup"] != 1], "MFMA duplicated across waves" + _where()


@needs_nvidia
@pytest.mark.parametrize("arch", list(SPARSE_DIMS))
def test_sparse_kernels_spill_free_pipelined_mmas_of_the_input_type(sparse_rows, arch):
    mine = sparse_rows(arch)
    problems = {r["problem"] for r in mine}
    assert len(problems) == len(SPARSE_DIMS[arch])
    for problem in problems:
        want = BLOCK_KERNELS if "-blocks" in problem else SPARSE_KERNELS
        assert want <= {_sparse_kernel(r) for r in mine if r["problem"] == problem}, problem
    spills = [(_label(r), r["spill_stores"], r["spill_loads"]) for r in mine if r["spill_stores"] or r["spill_loads"]]
    assert not spills, "spills" + _where()
    limit = ARCHS[arch].smem_per_block
    assert not [(_label(r), r["smem"]) for r in mine if r["smem"] > limit], f"over {limit} bytes" + _where()
    assert all(r["ctas_per_sm"] >= 1 for r in mine)
    mma = [r for r in mine if r["kernel"] in SPARSE_MMA_KERNELS and r["dtype"] != "fp32"]  # fp32: FMA loops
    assert not [(_label(r), r["mma"], r["fma_dots"]) for r in mma
                if not r["mma"] or set(r["mma"]) - {"wgmma", "mma.sync", "tcgen05"} or r["fma_dots"]], \
        "dots not MMAs" + _where()
    assert not [(_label(r), r["mma_inputs"]) for r in mma if not r["mma_inputs"]
                or set(r["mma_inputs"]) - MMA_INPUTS[r["dtype"]]], "MMA inputs" + _where()
    # pipelined, but (configs/sparse.py: one stage) absorbed MLA's range dK/dV at 576/512 with under 16 heads and
    # the slot-mode dK/dV of per-head K/V (a head loop of one step)
    single = [r for r in mma if r["num_stages"] < 2
              and not (r["kernel"] == "sparse_dkv" and r["range"] and r["absorbed"] and r["heads_q"] < 16)
              and not (r["kernel"] == "sparse_dkv" and not r["range"] and r["heads_q"] == r["heads_kv"])]
    assert not [(_label(r), r["num_stages"]) for r in single], "not pipelined" + _where()
    _assert_sparse_addresses(mine)


def _assert_sparse_addresses(mine: list[dict]) -> None:
    """No division by a maybe-zero value on a pipelined load's address, no i32 stride product on a
    pointer offset (the sparse kernels form every offset in int64) but the preprocess kernel's lane
    offsets (the dense kernel's int32 variant: kernels/attn_common.py)."""
    assert not [(_label(r), r["pipeline_hazards"]) for r in mine if r["pipeline_hazards"]], "hazards" + _where()
    assert not [(_label(r), r["i32_offsets"]) for r in mine if r["kernel"] != "sparse_pre" and r["i32_offsets"]], \
        "i32 stride products" + _where()


@needs_amd
@cdna_triton
@pytest.mark.parametrize("arch", list(SPARSE_CDNA_DIMS))
def test_cdna_sparse_kernels_fit_without_spills_and_use_mfma_of_the_input_type(sparse_rows, arch):
    mine = sparse_rows(arch)
    assert SPARSE_KERNELS <= {_sparse_kernel(r) for r in mine}
    assert arch != "gfx942" or BLOCK_KERNELS <= {_sparse_kernel(r) for r in mine}
    limit = CDNA_ARCHS[arch].lds_per_workgroup
    assert not [(_label(r), r["smem"]) for r in mine if r["smem"] > limit], f"over {limit} bytes of LDS" + _where()
    spilled = [(_label(r), r["vgpr_spills"], r["spill_stores"], r["scratch"]) for r in mine
               if r["vgpr_spills"] or r["spill_stores"] or r["spill_loads"] or r["scratch"]]
    assert not spilled, "VGPR spills or scratch" + _where()
    assert all(r["waves_per_simd"] >= 1 for r in mine)
    mma = [r for r in mine if r["kernel"] in SPARSE_MMA_KERNELS]
    assert mma and not [(_label(r), r["fma_dots"]) for r in mma if r["fma_dots"]], "dots without MFMA" + _where()
    _assert_sparse_addresses(mine)
    kind = {"bf16": "bf16", "fp16": "f16", "fp32": "f32"}  # fp32: CDNA's fp32 MFMA (IEEE)
    assert not [(_label(r), r["mma"]) for r in mma if not r["mma"] or any(
        mfma_input(k) != kind[r["dtype"]] for k in r["mma"])], "MFMAs not of the input type" + _where()
