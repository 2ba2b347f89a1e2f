"""The DSA indexer's kernels (fused top-k, Hadamard) as the compiler makes them, without a device: the
compile report's rows (bench/kernels.py ``indexer_rows``: DeepSeek-V3.2's 64 heads x 128 with top-k
2048, a 32-head one, top-k 512 in fp16, an fp32 one; the Hadamard at 64-256; MiniMax-M3's block-max
scores at 4 heads x 128 in bf16) have 0 spill bytes,
shared memory within the arch's limit and no pipelined-load hazard; on sm90 the 64-head top-k's
dot is a wgmma, on gfx942 every top-k dot an MFMA no two waves repeat.

Compiled in a subprocess (TRITON_INTERPRET unset), once per arch. sm90 holds for every Triton CI tests
(3.6.0 to 3.9.0: the main lane and the Triton lanes' ``-k sm90``), the CDNA rows for the release the
CDNA tables were checked with (test_kernel_structure.py's CDNA_CHECKED_TRITON).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from test_kernel_structure import CDNA_CHECKED_TRITON, needs_amd, needs_nvidia

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.compiler_output


@pytest.fixture(scope="module")
def compiled():
    cache = {}

    def rows(arch: str) -> list[dict]:
        if arch not in cache:
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
            code = (f"import json, sys; from bench.kernels import indexer_rows; "
                    f"json.dump(indexer_rows({arch!r}, blocks=1), sys.stdout, default=str)")
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
            assert proc.returncode == 0, proc.stderr[-4000:]
            cache[arch] = json.loads(proc.stdout)
        return cache[arch]

    return rows


@needs_nvidia
def test_sm90_indexer_kernels(compiled):
    rows = compiled("sm90")
    assert {r["kernel"] for r in rows} == {"indexer_topk", "hadamard", "indexer_block_scores"}
    for r in rows:
        where = f"{r['problem']} (Triton {triton.__version__})"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, where
        assert r["smem_fits"] and r["pipeline_hazards"] == 0, where
    assert all("wgmma" in r["mma"] for r in rows if r["problem"].startswith("indexer-h64"))


@needs_amd
@pytest.mark.skipif(triton.__version__ not in CDNA_CHECKED_TRITON,
                    reason=f"the CDNA tables hold for Triton {', '.join(CDNA_CHECKED_TRITON)}")
def test_gfx942_indexer_kernels(compiled):
    for r in compiled("gfx942"):
        where = f"{r['problem']} (Triton {triton.__version__})"
        assert r["vgpr_spills"] == 0 and r["spill_stores"] == 0 and r["scratch"] == 0, where
        assert r["smem_fits"] and r["mma_dup"] == 1, where
        if r["kernel"] in ("indexer_topk", "indexer_block_scores"):
            assert r["mma"] and r["fma_dots"] == 0, where
