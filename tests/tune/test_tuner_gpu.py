"""The tuner and the candidate variants on a real GPU (skipped without CUDA): every candidate of the
forward, dK/dV and dQ kernels at head dim 64 that compiles spill-free passes the acceptance check
(correct to the flash criterion, bitwise repeatable), TMA and warp-specialized ones included; and
``python -m coreattn.tune --quick`` runs end to end and writes a cache file the launchers read."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
def test_every_spill_free_candidate_is_accepted(kernel):
    from coreattn.kernels.configs.targets import target_of
    from coreattn.kernels.tuned_cache import KernelClass
    from coreattn.tune.accept import accept
    from coreattn.tune.space import kernel_candidates, shipped_configs
    from coreattn.tune.tuner import compile_check, make_op
    from coreattn.tune.batches import Batch

    device = torch.device("cuda")
    cls = KernelClass(64, 64, "bf16", True, True)
    target = target_of(device)
    shipped = shipped_configs(target, cls)
    op = make_op(kernel, cls, Batch("small", (300, 17, 1000)), device)
    checked = 0
    for cfg in kernel_candidates(target, kernel, cls):
        if compile_check(kernel, op, dict(shipped, **{kernel: cfg})) is not None:
            continue  # spills or does not compile: the tuner would not time it
        verdict = accept(kernel, cls, cfg, shipped, device)
        assert verdict.passed, (cfg, verdict.note)
        checked += 1
    assert checked >= 1


def test_quick_tuner_run_writes_a_cache_the_launchers_read(tmp_path):
    out = tmp_path / "tuned.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["COREATTN_TUNE_CACHE"] = str(out)
    proc = subprocess.run([sys.executable, "-m", "coreattn.tune", "--quick", "--dims", "64", "--kernels", "fwd",
                           "preprocess", "--out", str(out)], capture_output=True, text=True, env=env, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Measured on" in proc.stdout and "speedup" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["key"]["gpu"] == torch.cuda.get_device_name() and doc["tuner"]["batches"]
    check = subprocess.run([sys.executable, "-m", "coreattn.selfcheck", "--quick"], capture_output=True, text=True,
                           env=env, timeout=1800)
    assert check.returncode == 0, check.stdout[-3000:]
    if doc["entries"]:
        assert f"tuned: {out}" in check.stdout
