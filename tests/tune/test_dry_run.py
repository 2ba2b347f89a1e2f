"""``python -m coreattn.tune --dry-run`` on sm80, sm90 and sm100 without a GPU: a representative subset
(head dim 64; on sm80 the forward's first two candidates, on sm90 the dK/dV kernel's shipped config
and its TMA variant, on sm100 the forward's shipped config, its TMA and its warp-specialized TMA
variants), about a minute of compiling on one core. The full dry run is the command itself:
``python -m coreattn.tune --dry-run --arch sm90 --json f.json``.

Which Triton: every candidate here compiles under Triton 3.9.0; under 3.7.1 (the main CI lane's)
sm100's warp-specialized TMA forward fails in Triton's pass manager ("PassManager::run failed"),
which the dry run records as that row's error (the tuner drops such a candidate). 3.6.0 and 3.8.0
were not checked here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from coreattn.kernels.versions import release

ROOT = Path(__file__).resolve().parents[2]
SUBSET = {"sm80": ("fwd", 2), "sm90": ("dkdv", 2), "sm100": ("fwd", 3)}
WS_COMPILES = release(triton.__version__) >= (3, 9)  # sm100's warp-specialized TMA loop (see above)
FIELDS = {"arch": str, "kernel": str, "dim_qk": int, "dim_v": int, "dtype": str, "config": dict, "regs": int,
          "spill_stores": int, "spill_loads": int, "smem": int, "smem_fits": bool, "mma": dict,
          "warp_specialize": bool, "tma": bool, "shipped": bool, "timed": bool}


def _has_nvidia_backend() -> bool:
    from triton.backends import backends

    return "nvidia" in backends


pytestmark = [pytest.mark.skipif(not _has_nvidia_backend(), reason="upstream Triton's nvidia backend is not installed"),
              pytest.mark.compiler_output]  # e.g. Triton 3.9's warp-specialized regions on sm100


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = []
    for arch, (kernel, limit) in SUBSET.items():
        path = tmp_path_factory.mktemp("dry") / f"{arch}.json"
        proc = subprocess.run([sys.executable, "-m", "coreattn.tune", "--dry-run", "--arch", arch, "--dims", "64",
                               "--kernels", kernel, "--limit", str(limit), "--json", str(path)],
                              capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        assert "STATIC COMPILER OUTPUT" in proc.stdout and "timed" in proc.stdout
        out += json.loads(path.read_text())
    return out


def test_rows_follow_the_schema(rows):
    assert len(rows) == sum(limit for _, limit in SUBSET.values())
    for r in rows:
        if r["error"] is not None:  # a candidate that failed to compile: never timed, no figures
            assert not WS_COMPILES and (r["arch"], r["warp_specialize"]) == ("sm100", True), r
            assert not r["timed"] and r["regs"] is None and r["error"].startswith("RuntimeError"), r
            continue
        for name, kind in FIELDS.items():
            assert isinstance(r[name], kind), (name, r)
        assert r["timed"] == (r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["smem_fits"])
        assert r["config"]["tma"] == r["tma"] and r["config"]["warp_specialize"] == r["warp_specialize"]


def test_shipped_config_first_and_timed(rows):
    for arch, (kernel, limit) in SUBSET.items():
        mine = [r for r in rows if r["arch"] == arch]
        assert [r["shipped"] for r in mine] == [True] + [False] * (limit - 1)
        assert mine[0]["kernel"] == kernel and mine[0]["timed"], mine[0]


def test_variants_compile_as_asked(rows):
    by = {(r["arch"], r["tma"], r["warp_specialize"]): r for r in rows}
    assert set(by[("sm80", False, False)]["mma"]) == {"mma.sync"}
    tma90 = by[("sm90", True, False)]
    assert tma90["tma_loads"] > 0 and set(tma90["mma"]) == {"wgmma"} and tma90["timed"]
    assert by[("sm90", False, False)]["tma_loads"] == 0
    assert by[("sm100", True, False)]["tma_loads"] > 0 and set(by[("sm100", True, False)]["mma"]) == {"tcgen05"}
    ws = by[("sm100", True, True)]
    if WS_COMPILES:
        assert ws["error"] is None and ws["ws_regions"] > 0  # Triton 3.9 warp-specializes the TMA loops on sm100
    else:
        assert "PassManager::run failed" in ws["error"], ws  # Triton 3.7.1
