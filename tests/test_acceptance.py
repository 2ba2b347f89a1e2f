"""``python -m bench.acceptance`` (bench/acceptance.py): the one-command GPU check, in its degraded
quick mode on CPU, with a fault injected into its self-check; and its time limits."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import acceptance
from coreattn.selfcheck.faults import INJECT_ENV

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(acceptance.torch.cuda.is_available(), reason="the degraded quick mode runs without a GPU")
def test_cpu_quick_mode_writes_one_summary_naming_the_faulted_kernel(tmp_path):
    """The self-check's one row aborts in its dK/dV launch (test-only injection): the summary names the
    kernel launch, its config and the compute-sanitizer line; the test part still runs. (The bench part,
    a CPU bench unit in a worker, is left out here to keep CI short: its summary is read below.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env[INJECT_ENV] = "abort@selfcheck hdim64-causal-qk-lens-differ float16 launch dkdv"
    out = tmp_path / "acceptance_cpu.json"
    proc = subprocess.run([sys.executable, "-m", "bench.acceptance", "--out", str(out), "--parts", "selfcheck",
                           "gpu-tests", "cuda-tests"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    for key in ("device", "driver", "torch", "triton", "python", "coreattn", "git_commit", "budget_s", "wall_s"):
        assert key in doc
    assert not doc["gpu"] and doc["mode"].startswith("degraded") and not doc["passed"]
    parts = doc["parts"]
    assert list(parts) == ["selfcheck", "gpu-tests", "cuda-tests"]
    assert [parts[n]["status"] for n in parts] == ["fail", "skipped", "pass"]
    assert parts["selfcheck"]["counts"] == {"fault": 1} and parts["cuda-tests"]["counts"] == {"passed": 4}
    for name in ("selfcheck", "cuda-tests"):
        assert parts[name]["wall_s"] <= parts[name]["limit_s"] and parts[name]["command"]
    failure, = doc["failures"]
    assert failure["what"] == "hdim64-causal-qk-lens-differ/float16" and "SIGABRT" in failure["how"]
    assert failure["launch"]["kernel"] == "dkdv" and failure["launch"]["config"]["BLOCK_M"] == 16
    assert failure["kernel_launch"].startswith("dkdv (_attn_bwd_dkdv_kernel) hdim64x64-fp16-causal: BLOCK_M=16")
    rerun = "python -m coreattn.selfcheck --case hdim64-causal-qk-lens-differ --dtype fp16 --in-process"
    assert doc["sanitizer"] == [f"compute-sanitizer --tool memcheck {rerun}"]
    printed = proc.stdout[proc.stdout.index("coreattn acceptance on", 10):]
    assert "selfcheck   FAIL" in printed and "kernel launch: dkdv" in printed and rerun in printed
    assert f"wrote {out}" in printed


def test_a_part_is_interrupted_then_killed_at_its_limit(tmp_path):
    """A part that ignores SIGINT is killed at its limit, and the parts beside it finish on their own."""
    stubborn = acceptance.Part("stubborn", [sys.executable, "-c", "import signal, time; "
                                            "signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"], 4.0, None)
    quick = acceptance.Part("quick", [sys.executable, "-c", "print('done')"], 30.0, None)
    start = time.monotonic()
    raw = acceptance.run_parts([stubborn, quick], tmp_path, say=lambda line: None)
    assert time.monotonic() - start < 20
    assert raw["stubborn"]["timed_out"] and raw["stubborn"]["returncode"] == -signal.SIGKILL
    assert not raw["quick"]["timed_out"] and raw["quick"]["returncode"] == 0 and "done" in raw["quick"]["output_tail"]


def test_test_outcomes_are_read_per_test(tmp_path):
    """The JSON lines tests/conftest.py writes: a crashed xdist worker's test, a device fault with the last
    launch, setup errors and skips count once each."""
    report = tmp_path / "cuda-tests.jsonl"
    events = [
        {"event": "test", "nodeid": "t::a", "when": "call", "outcome": "passed"},
        {"event": "test", "nodeid": "t::b", "when": "setup", "outcome": "skipped", "message": "interpreter only: x"},
        {"event": "device-fault", "nodeid": "t::c", "error": "AcceleratorError: CUDA error: an illegal memory access",
         "last_launch": {"kernel": "dkdv"}, "last_launch_text": "dkdv (_attn_bwd_dkdv_kernel): BLOCK_M=32"},
        {"event": "test", "nodeid": "t::c", "when": "???", "outcome": "failed", "message": "worker 'gw1' crashed"},
        {"event": "test", "nodeid": "t::d", "when": "setup", "outcome": "failed", "message": "fixture broke"},
        {"event": "test", "nodeid": "t::e", "when": "call", "outcome": "failed", "message": "assert 1 == 2"},
        {"event": "test", "nodeid": "t::e", "when": "teardown", "outcome": "failed", "message": "and then"},
    ]
    report.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"cut sh')
    part = acceptance.Part("cuda-tests", [], 10.0, report)
    summary = acceptance.tests_summary(part, {"returncode": 1, "timed_out": False})
    assert summary["counts"] == {"passed": 1, "skipped": 1, "crashed": 1, "error": 2}
    assert summary["status"] == "fail" and summary["device_faults"] == 1
    assert summary["skip_reasons"] == ["interpreter only: x"]
    crashed = next(f for f in summary["failures"] if f["what"] == "t::c")
    assert crashed["status"] == "crashed" and crashed["kernel_launch"].startswith("dkdv")
    assert crashed["sanitizer"] == "compute-sanitizer --tool memcheck python -m pytest -p no:cacheprovider 't::c'"


def test_bench_results_are_summarized_with_their_faults(tmp_path):
    results = tmp_path / "results.json"
    rows = [{"config": "c", "mode": "fwd", "provider": "coreattn", "dtype": "bfloat16", "status": "ok", "ms": 1.5},
            {"config": "c", "mode": "fwdbwd", "provider": "coreattn", "dtype": "bfloat16", "status": "fault",
             "reason": "the worker died (killed by SIGSEGV); kernel launch: dkdv ...",
             "fault": {"where": "dkdv (_attn_bwd_dkdv_kernel): BLOCK_M=32", "launch": {"kernel": "dkdv"}}},
            {"config": "c", "mode": "fwd", "provider": "flex", "dtype": "bfloat16", "status": "skipped", "reason": "x"}]
    results.write_text(json.dumps({"meta": {"performance_data": True}, "results": rows}))
    part = acceptance.Part("bench", [], 60.0, results)
    summary = acceptance.bench_summary(part, {"returncode": 0, "timed_out": False})
    assert summary["status"] == "fail" and summary["counts"] == {"ok": 1, "fault": 1, "skipped": 1}
    failure, = summary["failures"]
    assert failure["what"] == "c coreattn fwdbwd bfloat16" and failure["kernel_launch"].startswith("dkdv")
    assert [r["ms"] for r in summary["rows"]] == [1.5, None, None]


@pytest.mark.parametrize("argv, name", [(["--budget", "0"], "--budget"), (["--parts", "lint"], "--parts"),
                                        (["--workers", "0"], "--workers")])
def test_bad_options_exit_2_naming_the_option(argv, name, capsys):
    with pytest.raises(SystemExit) as exc:
        acceptance.parse_args(argv)
    assert exc.value.code == 2 and name in capsys.readouterr().err


@pytest.mark.skipif(acceptance.torch.cuda.is_available(), reason="the DSA row's CPU shapes run without a GPU")
def test_dsa_row_runs_both_regimes_and_is_summarized(tmp_path):
    """bench/dsa_check.py's rows (tiny shapes under the interpreter here): the sparse kernels and dense
    attention, full and sparse regimes, each timed and the sparse one set against the dense one; the
    acceptance summary of its results file names the part and prints the ratios."""
    from bench import dsa_check

    rows = dsa_check.rows_for(acceptance.torch.device("cpu"), 600, say=lambda line: None)
    assert [(r["regime"], r["provider"], r["status"]) for r in rows] == [
        (regime, provider, "ok") for regime in ("full", "sparse") for provider in dsa_check.PROVIDERS]
    sparse_rows = [r for r in rows if r["provider"] == "coreattn-triton"]
    assert all(r["ratio_to_dense"] > 0 and r["pairs"] > 0 for r in sparse_rows)
    results = tmp_path / "dsa.json"
    results.write_text(json.dumps({"meta": {"performance_data": False},
                                   "results": rows + [dict(rows[0], status="error", reason="boom")]}))
    part = acceptance.dsa_part(60.0, tmp_path)
    assert part.name == "dsa-bench" and part.argv[1:3] == ["-m", "bench.dsa_check"]
    summary = acceptance.bench_summary(part._replace(result=results), {"returncode": 1, "timed_out": False})
    assert summary["status"] == "fail" and summary["failures"][0]["part"] == "dsa-bench"
    doc = {"device": "cpu", "driver": None, "torch": "t", "triton": "t", "python": "p", "git_commit": None,
           "git_dirty": False, "passed": False, "wall_s": 1.0, "budget_s": 2.0, "parts": {"dsa-bench": summary},
           "failures": summary["failures"], "sanitizer": []}
    assert "= " in acceptance.format_summary(doc) and "x dense varlen over the same tokens" in \
        acceptance.format_summary(doc)
