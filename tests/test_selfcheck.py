"""The user-facing self-check (`python -m coreattn.selfcheck`): it runs, reports and fails when it should."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coreattn.selfcheck import (CPU_MESSAGE, band_mask, compare, environment, environment_keys, naive_attention,
                                zero_rows)
from coreattn.selfcheck.faults import INJECT_ENV

ROOT = Path(__file__).resolve().parents[1]


def test_quick_selfcheck_passes_on_this_machine(tmp_path):
    """The module as a user runs it, in a fresh process (on CPU it re-runs itself under the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the module must set it itself
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    report = tmp_path / "selfcheck.json"
    proc = subprocess.run([sys.executable, "-m", "coreattn.selfcheck", "--quick", "--json", str(report)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for column in ("case", "dtype", "out", "dq", "dk", "dv", "result"):
        assert column in out
    assert "hdim192x128-causal-gqa4" in out and "PASSED" in out and "FAIL" not in out
    results = json.loads(report.read_text())
    assert results["passed"] and all(row["passed"] for row in results["rows"])
    assert all(r["status"] == "pass" and r["fault"] is None for r in results["rows"]) and not results["faults"]
    assert "each row in its own process" in out and results["isolation"].startswith("each row in its own process")
    # the launch configs the cases ran, and where each came from
    assert "launch configs the kernels used" in out
    sources = {use["source"] for row in results["rows"] for use in row["configs"]}
    kernels = {use["kernel"] for row in results["rows"] for use in row["configs"]}
    assert kernels == {"fwd", "dkdv", "dq", "preprocess"} and sources
    if not torch.cuda.is_available():
        assert sources == {"shipped table (interpreter)"} and "(shipped table (interpreter))" in out
    if not torch.cuda.is_available():
        assert CPU_MESSAGE in out and "bf16 skipped on CPU" in out
        assert {row["dtype"] for row in results["rows"]} == {"float16", "float32"}


def test_environment_names_hip_and_the_gcn_arch_on_rocm(monkeypatch):
    """ROCm's PyTorch (faked): AMD GPUs are cuda devices, torch.version.cuda is None."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.version, "hip", "6.4.43482-0f2d60242")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "AMD Instinct MI300X")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-"))
    env = environment(torch.device("cuda", 0))
    assert env["hip"] == "6.4.43482-0f2d60242" and env["gcn_arch"] == "gfx942:sramecc+:xnack-"
    assert env["device"] == "AMD Instinct MI300X"
    keys = environment_keys(env)
    assert "hip" in keys and "gcn_arch" in keys and "cuda" not in keys
    monkeypatch.setattr(torch.version, "hip", None)
    assert "cuda" in environment_keys(environment(torch.device("cpu")))


def test_wrong_output_is_reported():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, 2, 16, generator=gen).half() for _ in range(3))
    mask = band_mask(9, 9, causal=True, window=(-1, -1))
    ref = naive_attention(q, k, v, mask)
    naive = naive_attention(q, k, v, mask, exact=False)
    assert compare("out", ref.half(), naive, ref).passed
    wrong = ref.half().clone()
    wrong[4, 1, 3] += 0.05
    check = compare("out", wrong, naive, ref)
    assert not check.passed and "error" in check.note
    nan = ref.half().clone()
    nan[0, 0, 0] = float("nan")
    assert not compare("out", nan, naive, ref).passed


def test_nonzero_row_without_keys_is_reported():
    mask = band_mask(3, 2, causal=True, window=(-1, -1))  # bottom-right: query 0 sees no key
    blind = ~mask.any(-1)
    assert blind.tolist() == [True, False, False]
    out = torch.ones(3, 2, 4)
    assert not zero_rows("zero rows (out)", out, blind).passed
    out[0] = 0
    assert zero_rows("zero rows (out)", out, blind).passed


def test_asking_whether_kernels_are_interpreted_never_loads_the_interpreter():
    """Triton's interpreter imports numpy, which coreattn does not require: a GPU user's process (no
    TRITON_INTERPRET) must be able to ask without it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    script = ("import sys, coreattn.kernels as k; assert not k.runs_in_interpreter(); "
              "assert 'triton.runtime.interpreter' not in sys.modules, 'interpreter loaded'")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_cpu_selfcheck_without_numpy_says_what_to_install(monkeypatch, capsys):
    import importlib.util

    import coreattn.selfcheck as selfcheck

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(selfcheck, "runs_in_interpreter", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "numpy" else real_find_spec(name, *a))
    assert selfcheck.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert "numpy" in err and selfcheck.NUMPY_HINT in err


def _selfcheck(tmp_path, *args, inject=None, timeout=900):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", INJECT_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if inject:
        env[INJECT_ENV] = inject
    report = tmp_path / "selfcheck.json"
    proc = subprocess.run([sys.executable, "-m", "coreattn.selfcheck", *args, "--json", str(report)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    return proc, json.loads(report.read_text())


@pytest.mark.interpreter_only("a CPU test of the isolation: the interpreter's configs, and a --timeout that a "
                              "GPU's first compile could exceed")
def test_a_faulting_or_hanging_case_is_reported_and_the_others_still_run(tmp_path):
    """Each row runs in its own process: one hangs at its forward launch (killed at --timeout) while the
    others run beside it, one aborts in its dK/dV kernel, one raises a CUDA-like error in its dQ kernel
    after its other kernels ran (all injected, test-only: COREATTN_INJECT_FAULT); each failure names
    the kernel launch it happened in, with its config and source, and how to rerun it alone under
    compute-sanitizer."""
    inject = ("hang@hdim64-causal-qk-lens-differ launch fwd;abort@hdim192x128-causal-gqa4 launch dkdv;"
              "cuda-error@hdim128-padded-keepmask-causal launch dq")
    cases = ["hdim64-causal-qk-lens-differ", "hdim192x128-causal-gqa4", "hdim128-padded-keepmask-causal"]
    proc, doc = _selfcheck(tmp_path, "--case", *cases, "--dtype", "fp16", "--jobs", "2", "--timeout", "20",
                           inject=inject)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {r["case"]["name"]: r for r in doc["rows"]}
    assert {name: r["status"] for name, r in rows.items()} == {
        "hdim64-causal-qk-lens-differ": "timeout", "hdim192x128-causal-gqa4": "fault",
        "hdim128-padded-keepmask-causal": "fault"}
    expected = {"hdim64-causal-qk-lens-differ": ("fwd", "timed out after 20 s"),
                "hdim192x128-causal-gqa4": ("dkdv", "killed by SIGABRT"),
                "hdim128-padded-keepmask-causal": ("dq", "illegal memory access")}
    for name, (kernel, how) in expected.items():
        fault = rows[name]["fault"]
        assert how in fault["how"] and fault["launch"]["kernel"] == kernel, fault
        assert fault["launch"]["config"]["BLOCK_M"] == 16 and fault["launch"]["config"]["num_warps"] == 1
        assert fault["launch"]["source"] == "shipped table (interpreter)"
        rerun = f"python -m coreattn.selfcheck --case {name} --dtype fp16 --in-process"
        assert fault["rerun"] == rerun and fault["sanitizer"] == f"compute-sanitizer --tool memcheck {rerun}"
        assert f"{fault['status'].upper()} {name}/float16" in proc.stdout and rerun in proc.stdout
    assert not doc["passed"] and len(doc["faults"]) == 3
    dkdv = "kernel launch: dkdv (_attn_bwd_dkdv_kernel) hdim192x128-fp16-causal-gqa: BLOCK_M=16 BLOCK_N=32"
    assert dkdv in proc.stdout
    launched = {u["kernel"] for u in rows["hdim128-padded-keepmask-causal"]["configs"]}
    assert launched == {"fwd", "preprocess", "dkdv", "dq"}  # its other kernels ran before dQ faulted


def test_rows_not_started_before_the_time_limit_are_reported(tmp_path, capsys):
    import coreattn.selfcheck as selfcheck

    report = tmp_path / "selfcheck.json"
    assert selfcheck.main(["--quick", "--time-limit", "1e-9", "--json", str(report)]) == 1
    doc = json.loads(report.read_text())
    assert doc["rows"] and {r["status"] for r in doc["rows"]} == {"not-run"} and not doc["passed"]
    assert "NOT RUN" in capsys.readouterr().out


@pytest.mark.parametrize("argv, name", [(["--case", "hdim999"], "--case"), (["--timeout", "0"], "--timeout"),
                                        (["--jobs", "-1"], "--jobs"), (["--time-limit", "x"], "--time-limit")])
def test_bad_options_exit_2_naming_the_option(argv, name, capsys):
    import coreattn.selfcheck as selfcheck

    try:
        code = selfcheck.main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2 and name in capsys.readouterr().err
