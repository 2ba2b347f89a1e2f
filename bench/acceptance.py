"""``python -m bench.acceptance``: one command that checks coreattn on a GPU and diagnoses itself.

Run from a checkout on a GPU machine, it runs, each part in its own processes and under its own
time limit (shares of ``--budget``, 450 s by default, so the whole ends within 8 minutes even if
something hangs; time a part leaves unused goes to the parts after it):

1. ``selfcheck``: ``python -m coreattn.selfcheck``, each case row in its own process, so that a
   kernel fault is reported with the kernel launch and its config, and the rows after it still run;
2. ``gpu-tests``: the GPU-marked tests (``pytest -m gpu``: CUDA graph replay, no host syncs, no
   recompiles, the tuner on the GPU, Megatron's attention), with pytest-xdist and pytest-timeout
   where installed; and at the same time
3. ``cuda-tests``: the test files that run the kernels on CUDA (forward, backward, features,
   padded batches, tile maps, dropout's RNG, Megatron's CoreAttention, bad inputs), with
   pytest-xdist: each worker is its own process, and a worker whose CUDA a test poisoned exits
   (tests/conftest.py), so xdist reports that test as crashed and goes on in a fresh worker;
4. ``bench``: a short ``python -m bench --what attention --quick`` (coreattn, torch's varlen_attn
   and padded SDPA), each unit in an isolated worker (bench/isolation.py); alone, since it times;
5. ``dsa-bench``: ``python -m bench.dsa_check``, DeepSeek Sparse Attention's row: the sparse Triton
   kernels against dense varlen attention over the same tokens, forward + backward, where every
   row is full (top-k past the sequence) and where most are sparse; alone, after the bench.

The CUDA tests include the sparse-attention kernels' and the public sparse functions' tests, the
relative biases' and per-token sinks' (``tests/test_bias.py``, ``tests/test_token_sinks.py``: the
bias kernels compiled, against the float64 oracle), and
the GPU tests (tests/test_gpu.py) the DSA indexer's kernels and the sparse kernels' full and mixed
rows against float64 references, their determinism and their recompiles on CUDA.

It then writes ONE JSON summary (device, driver, versions, commit, per part: status, counts, wall
time, and every failure with its kernel launch and config where known) to
``bench/results/acceptance_<device>_<date>.json`` and prints a short table, with a
compute-sanitizer command line for each faulted self-check case. Exit status 0 only if every part
passed. Without a GPU it runs a degraded quick mode (one self-check row under the interpreter, a
few kernel tests, a tiny CPU bench; the GPU-marked tests are skipped) so CI can run it; that
summary goes to ``bench/local/`` (the DSA row then runs tiny shapes under the interpreter: its
code path, not performance data).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

from bench.cli import positive_number
from bench.env import REPO_ROOT, device_slug, run_metadata
from coreattn.selfcheck.faults import Child, child_env, sanitizer_hint

PARTS = ("selfcheck", "gpu-tests", "cuda-tests", "bench", "dsa-bench")
DEFAULT_BUDGET = 450.0  # seconds; 8 minutes minus what starting Python and writing the summary take
# gpu-tests and cuda-tests run together; the DSA row's sparse kernels are compiled (and cached) by cuda-tests
SHARES = {"selfcheck": 0.27, "tests": 0.45, "bench": 0.13, "dsa-bench": 0.1}
GPU_TEST_FILES = ("tests/test_gpu.py", "tests/tune/test_tuner_gpu.py", "tests/megatron/test_gpu_megatron.py",
                  "tests/masks/test_masks.py")
CUDA_TEST_FILES = ("tests/test_varlen_fwd.py", "tests/test_varlen_bwd.py", "tests/test_attn_features.py",
                   "tests/test_padded_attn.py", "tests/kernels/test_tile_map.py", "tests/kernels/test_dropout_rng.py",
                   "tests/megatron/test_core_attention.py", "tests/test_bad_input.py",
                   "tests/kernels/test_sparse_kernels.py", "tests/test_sparse_attn.py",
                   "tests/test_sparse_bad_input.py", "tests/test_bias.py", "tests/test_token_sinks.py")
CPU_TESTS = ("tests/kernels/test_dropout_rng.py", "-k", "philox")  # a Triton kernel under the interpreter
CPU_SELFCHECK = ("--case", "hdim64-causal-qk-lens-differ", "--dtype", "fp16")
GPU_BENCH = ("--quick", "--what", "attention", "--configs", "hdim128x128", "--providers", "coreattn", "torch-varlen",
             "sdpa-padded")
CPU_BENCH = ("--quick", "--what", "attention", "--device", "cpu", "--isolation", "process", "--configs",
             "hdim128x128-gqa4-causal-short-256-sink", "--providers", "coreattn", "--modes", "fwd")
INTERRUPT_GRACE_S = 20.0  # a part is interrupted (SIGINT) this long (at most a quarter of it) before its limit


class Part(NamedTuple):
    name: str
    argv: list[str]
    limit: float
    result: Path | None  # the JSON (selfcheck, bench) or JSON-lines (tests) file the part writes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.acceptance", description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=positive_number, default=DEFAULT_BUDGET, metavar="SECONDS",
                   help="wall time of all parts together (shares: " + ", ".join(
                       f"{name} {int(100 * share)}%%" for name, share in SHARES.items()) + "; gpu-tests and cuda-tests "
                        "run side by side in theirs; the rest is headroom)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="run only these parts")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="pytest-xdist workers of cuda-tests (default: the CPU count, at most 12; gpu-tests get 4)")
    p.add_argument("--out", type=Path, help="the summary file, or a directory for it (default: bench/results/ on a "
                                           "GPU, bench/local/ without one; named acceptance_<device>_<date>.json)")
    args = p.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        p.error(f"argument --workers: at least 1, got {args.workers}")
    return args


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# ---- the parts' commands

def _own_limit(limit: float) -> str:
    """The --time-limit of a part that keeps its own: it stops (killing what runs) and writes its
    results before the part is interrupted."""
    return str(int(max(1, limit - INTERRUPT_GRACE_S - 10)))


def selfcheck_part(on_gpu: bool, limit: float, tmp: Path) -> Part:
    out = tmp / "selfcheck.json"
    # on a GPU every row at once: their first compiles (minutes of CPU in all) then share the cores
    extra = ["--jobs", "16", "--timeout", str(int(limit))] if on_gpu else list(CPU_SELFCHECK)
    argv = [sys.executable, "-m", "coreattn.selfcheck", "--json", str(out), "--time-limit", _own_limit(limit), *extra]
    return Part("selfcheck", argv, limit, out)


def pytest_part(name: str, on_gpu: bool, limit: float, tmp: Path, workers: int | None) -> Part:
    out = tmp / f"{name}.jsonl"
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE"]
    if name == "gpu-tests":
        argv += ["-m", "gpu", *GPU_TEST_FILES]
        n = 4
    else:
        argv += ["-m", "not gpu", *(CUDA_TEST_FILES if on_gpu else CPU_TESTS)]
        n = workers or min(12, os.cpu_count() or 1)
    if has("xdist") and on_gpu:
        argv += ["-n", str(n), "--max-worker-restart", "1000"]
    if has("pytest_timeout"):  # thread: a hung CUDA call never returns to Python; the worker exits instead
        per_test = max(10, limit - INTERRUPT_GRACE_S - 10) if name == "gpu-tests" else min(120, limit)
        argv += ["--timeout", str(int(per_test)), "--timeout-method", "thread"]
    return Part(name, argv, limit, out)


def dsa_part(limit: float, tmp: Path) -> Part:
    out = tmp / "dsa.json"
    argv = [sys.executable, "-m", "bench.dsa_check", "--out", str(out), "--time-limit", _own_limit(limit)]
    return Part("dsa-bench", argv, limit, out)


def bench_part(on_gpu: bool, limit: float, tmp: Path) -> Part:
    out = tmp / "bench"
    argv = [sys.executable, "-m", "bench", *(GPU_BENCH if on_gpu else CPU_BENCH), "--no-plots", "--out", str(out),
            "--timeout", "60", "--time-limit", _own_limit(limit)]
    return Part("bench", argv, limit, out / "results.json")


# ---- running them

def start(part: Part, tmp: Path) -> Child:
    env = child_env({"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))})
    if part.result is not None and part.name.endswith("tests"):
        env["COREATTN_TEST_REPORT"] = str(part.result)
    return Child(part.argv, tmp / f"{part.name}.events", tmp / f"{part.name}.log", env=env, cwd=REPO_ROOT)


def run_parts(parts: list[Part], tmp: Path, say=print) -> dict[str, dict]:
    """Runs ``parts`` at the same time; each is interrupted (SIGINT: pytest still reports) shortly
    before its limit and killed at it. Returns each part's raw outcome."""
    children = {p.name: (p, start(p, tmp), time.monotonic()) for p in parts}
    for p in parts:
        say(f"[acceptance] {p.name}: started (limit {p.limit:.0f} s): {' '.join(_short(a) for a in p.argv[1:])}")
    outcome, interrupted = {}, set()
    try:
        while len(outcome) < len(children):
            for name, (part, child, t0) in children.items():
                if name in outcome:
                    continue
                elapsed = time.monotonic() - t0
                grace = min(INTERRUPT_GRACE_S, part.limit / 4)
                if child.proc.poll() is None and elapsed > part.limit - grace and name not in interrupted:
                    interrupted.add(name)
                    _signal(child, signal.SIGINT)
                rc = child.poll(deadline=t0 + part.limit)
                if rc is not None:
                    outcome[name] = {"returncode": rc, "wall_s": round(time.monotonic() - t0, 1),
                                     "timed_out": child.timed_out or name in interrupted,
                                     "output_tail": child.output_tail(3000)}
                    say(f"[acceptance] {name}: done in {outcome[name]['wall_s']:.0f} s ({child.reason()}"
                        + (", interrupted at its time limit" if name in interrupted else "") + ")")
            time.sleep(0.2)
    finally:
        for _, child, _ in children.values():
            if child.proc.poll() is None:
                child.kill()
    return outcome


def _signal(child: Child, sig: int) -> None:
    try:
        os.killpg(child.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _short(arg: str) -> str:
    return "<tmp>/" + Path(arg).name if arg.startswith(tempfile.gettempdir()) else arg


# ---- reading what they wrote

def selfcheck_summary(part: Part, raw: dict) -> dict:
    try:
        doc = json.loads(part.result.read_text())
    except (OSError, ValueError):
        return {"status": "timeout" if raw["timed_out"] else "error", "counts": {}, "failures": [],
                "note": "the self-check wrote no results"}
    counts: dict = {}
    for row in doc["rows"]:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    failures = []
    for row in doc["rows"]:
        if row["status"] in ("pass", "not-run"):
            continue
        failure = {"part": "selfcheck", "what": f"{row['case']['name']}/{row['dtype']}", "status": row["status"]}
        if row.get("fault"):
            f = row["fault"]
            failure.update(how=f["how"], kernel_launch=f["where"], launch=f["launch"], rerun=f["rerun"],
                           sanitizer=f["sanitizer"])
        else:
            failure["how"] = "; ".join(f"{c['name']}: {c['note']}" for c in row["checks"] if not c["passed"])
        failures.append(failure)
    if not doc["recompile"]["passed"]:
        failure = {"part": "selfcheck", "what": "no recompiles", "status": "fail", "how": doc["recompile"]["note"]}
        for f in doc.get("faults", []):
            if f.get("row", "").startswith("recompile/"):
                failure.update(status=f["status"], kernel_launch=f["where"], launch=f["launch"])
        failures.append(failure)
    status = "pass" if doc["passed"] else "timeout" if raw["timed_out"] else "fail"
    return {"status": status, "counts": counts, "failures": failures, "recompile": doc["recompile"],
            "environment": doc["environment"]}


def tests_summary(part: Part, raw: dict) -> dict:
    """Per test: passed, failed, error (setup/teardown), crashed (its xdist worker died), skipped."""
    outcome, messages, faults = {}, {}, {}
    try:
        lines = part.result.read_text().splitlines()
    except OSError:
        lines = []
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3, "crashed": 4}
    for line in lines:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "device-fault":
            faults[ev["nodeid"]] = ev
            continue
        if ev.get("event") != "test":
            continue
        kind = ev["outcome"]
        if kind not in ("passed", "skipped"):  # xdist reports a test whose worker died as failed "???"
            kind = "failed" if ev["when"] == "call" else "crashed" if ev["when"] == "???" else "error"
        if rank[kind] >= rank.get(outcome.get(ev["nodeid"]), -1):
            outcome[ev["nodeid"]] = kind
            if ev.get("message"):
                messages[ev["nodeid"]] = ev["message"]
    counts: dict = {}
    for kind in outcome.values():
        counts[kind] = counts.get(kind, 0) + 1
    failures = []
    for nodeid, kind in outcome.items():
        if kind in ("passed", "skipped"):
            continue
        how = _tail(messages.get(nodeid, ""))
        if kind == "crashed":
            how += " (its xdist worker died: a device fault, a signal, or pytest-timeout's --timeout; see output_tail)"
        failure = {"part": part.name, "what": nodeid, "status": kind, "how": how}
        fault = faults.get(nodeid)
        if fault:
            failure.update(how=fault["error"], kernel_launch=fault.get("last_launch_text"),
                           launch=fault.get("last_launch"),
                           sanitizer=sanitizer_hint(f"python -m pytest -p no:cacheprovider '{nodeid}'"))
        failures.append(failure)
    ran = bool(outcome)
    if raw["timed_out"]:
        status = "timeout"
    elif raw["returncode"] == 0 or (raw["returncode"] == 5 and not failures):  # 5: nothing collected/selected
        status = "pass"
    else:
        status = "fail" if ran else "error"
    skipped = sorted({messages[n] for n, k in outcome.items() if k == "skipped" and n in messages})
    return {"status": status, "counts": counts, "failures": failures, "skip_reasons": skipped[:40],
            "device_faults": len(faults), "note": None if ran else "pytest reported no test"}


def bench_summary(part: Part, raw: dict) -> dict:
    try:
        doc = json.loads(part.result.read_text())
    except (OSError, ValueError):
        return {"status": "timeout" if raw["timed_out"] else "error", "counts": {}, "failures": [],
                "note": "the bench wrote no results"}
    counts: dict = {}
    rows, failures = [], []
    for r in doc["results"]:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
        rows.append({k: r.get(k) for k in ("config", "mode", "provider", "dtype", "status", "ms", "tflops",
                                           "speedup_of_coreattn", "ratio_to_dense", "reason")})
        if r["status"] in ("error", "fault", "timeout"):
            f = r.get("fault") or {}
            failures.append({"part": part.name, "what": " ".join(str(r.get(k)) for k in ("config", "provider", "mode",
                                                                                      "dtype")),
                             "status": r["status"], "how": r.get("reason"), "kernel_launch": f.get("where"),
                             "launch": f.get("launch")})
    status = "pass" if not failures and raw["returncode"] == 0 else "timeout" if raw["timed_out"] else "fail"
    return {"status": status, "counts": counts, "failures": failures, "rows": rows,
            "performance_data": doc["meta"]["performance_data"]}


def _tail(text: str, lines: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


SUMMARIES = {"selfcheck": selfcheck_summary, "gpu-tests": tests_summary, "cuda-tests": tests_summary,
             "bench": bench_summary, "dsa-bench": bench_summary}


# ---- the command

def default_out(device: torch.device, parent: Path | None = None) -> Path:
    parent = parent or REPO_ROOT / "bench" / ("results" if device.type == "cuda" else "local")
    base = parent / f"acceptance_{device_slug(device)}_{datetime.date.today().isoformat()}"
    out, n = base.with_suffix(".json"), 2
    while out.exists():
        out, n = base.with_name(f"{base.name}_{n}.json"), n + 1
    return out


def plan(args) -> list[list[tuple[str, float]]]:
    """The phases (the parts of a phase run at the same time), each part with its share of the budget."""
    phases = [[("selfcheck", SHARES["selfcheck"])], [(n, SHARES["tests"]) for n in ("gpu-tests", "cuda-tests")],
              [("bench", SHARES["bench"])], [("dsa-bench", SHARES["dsa-bench"])]]
    return [[(n, share * args.budget) for n, share in phase if n in args.parts] for phase in phases]


def make_part(name: str, on_gpu: bool, limit: float, tmp: Path, args) -> Part:
    if name == "selfcheck":
        return selfcheck_part(on_gpu, limit, tmp)
    if name == "bench":
        return bench_part(on_gpu, limit, tmp)
    if name == "dsa-bench":
        return dsa_part(limit, tmp)
    return pytest_part(name, on_gpu, limit, tmp, args.workers)


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    started = time.monotonic()
    meta = run_metadata(device)
    out = default_out(device, args.out) if args.out is None or args.out.is_dir() else args.out
    if meta["git_commit"] is None:  # a copy of the checkout without .git: the commit as the caller says
        meta["git_commit"] = os.environ.get("COREATTN_COMMIT")
    tmp = Path(tempfile.mkdtemp(prefix="coreattn-acceptance-"))
    say = lambda line="": print(line, flush=True)  # noqa: E731
    say(f"coreattn acceptance on {meta['device']}: budget {args.budget:.0f} s; "
        f"pytest-xdist {'yes' if has('xdist') else 'no'}, pytest-timeout {'yes' if has('pytest_timeout') else 'no'}"
        + ("" if on_gpu else "; no GPU: the degraded quick mode (interpreter self-check row, a few kernel tests, a "
                             "tiny CPU bench; the GPU-marked tests are skipped)"))
    parts: dict[str, dict] = {}
    carry = 0.0
    try:
        for phase in plan(args):
            left = args.budget - (time.monotonic() - started)
            runnable = []
            for name, share in phase:
                limit = min(share + carry, left)
                if name == "gpu-tests" and not on_gpu:
                    parts[name] = {"status": "skipped", "note": "no CUDA device: the GPU-marked tests need one",
                                   "counts": {}, "failures": []}
                elif limit < 5:
                    parts[name] = {"status": "skipped", "note": f"no time left of the {args.budget:.0f} s budget",
                                   "counts": {}, "failures": []}
                else:
                    runnable.append(make_part(name, on_gpu, limit, tmp, args))
            if not runnable:
                continue
            t0 = time.monotonic()
            raw = run_parts(runnable, tmp, say)
            for part in runnable:
                summary = SUMMARIES[part.name](part, raw[part.name])
                summary.update(command=" ".join(_short(a) for a in part.argv[1:]), limit_s=round(part.limit),
                               wall_s=raw[part.name]["wall_s"], returncode=raw[part.name]["returncode"],
                               output_tail=raw[part.name]["output_tail"][-2000:])
                parts[part.name] = summary
            carry = max(0.0, max(p.limit for p in runnable) - (time.monotonic() - t0))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc = summary_document(meta, args, parts, time.monotonic() - started, on_gpu)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    say()
    say(format_summary(doc))
    say(f"\nwrote {out}")
    return 0 if doc["passed"] else 1


def summary_document(meta: dict, args, parts: dict, wall: float, on_gpu: bool) -> dict:
    ordered = {name: parts[name] for name in PARTS if name in parts}
    failures = [f for p in ordered.values() for f in p.get("failures", [])]
    return {
        "kind": "coreattn acceptance (python -m bench.acceptance)",
        "device": meta["device"], "driver": meta.get("driver"), "capability": meta.get("capability"),
        "device_memory_gib": meta.get("device_memory_gib"), "torch": meta["torch"], "cuda": meta.get("cuda"),
        "hip": meta.get("hip"), "triton": meta["triton"], "python": meta["python"], "coreattn": meta["coreattn"],
        "git_commit": meta["git_commit"], "git_dirty": meta["git_dirty"], "date": meta["date"],
        "gpu": on_gpu, "mode": "full" if on_gpu else "degraded quick mode (no GPU)",
        "plugins": {"pytest-xdist": has("xdist"), "pytest-timeout": has("pytest_timeout")},
        "budget_s": args.budget, "wall_s": round(wall, 1),
        "passed": all(p["status"] in ("pass", "skipped") for p in ordered.values())
        and any(p["status"] == "pass" for p in ordered.values()),
        "parts": ordered,
        "failures": failures,
        "sanitizer": sorted({f["sanitizer"] for f in failures if f.get("sanitizer")}),
    }


def _counts(counts: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "-"


def format_summary(doc: dict, max_failures: int = 25) -> str:
    lines = [f"coreattn acceptance on {doc['device']} (driver {doc['driver']}, torch {doc['torch']}, triton "
             f"{doc['triton']}, python {doc['python']}, commit {(doc['git_commit'] or '?')[:12]}"
             f"{' dirty' if doc['git_dirty'] else ''}): {'PASSED' if doc['passed'] else 'FAILED'} in "
             f"{doc['wall_s']:.0f} s of {doc['budget_s']:.0f}",
             f"{'part':<11} {'status':<8} {'wall s':>7} {'limit s':>8}  counts"]
    for name, p in doc["parts"].items():
        lines.append(f"{name:<11} {p['status'].upper():<8} {p.get('wall_s', '-')!s:>7} {p.get('limit_s', '-')!s:>8}  "
                     f"{_counts(p.get('counts', {}))}" + (f"  ({p['note']})" if p.get("note") else ""))
    for row in doc["parts"].get("dsa-bench", {}).get("rows", []):
        if row.get("ratio_to_dense") is not None:
            lines.append(f"  dsa {row['config']}: coreattn-triton sparse {row['ms']:.2f} ms = "
                         f"{row['ratio_to_dense']:.2f}x dense varlen over the same tokens")
    if doc["failures"]:
        lines.append(f"failures ({len(doc['failures'])}; all in the JSON):")
        for f in doc["failures"][:max_failures]:
            how = (f.get("how") or "").splitlines()[-1:] or [""]
            lines.append(f"  {f['part']} {f['what']}: {f['status'].upper()} {how[0][:200]}")
            if f.get("kernel_launch"):
                lines.append(f"    kernel launch: {f['kernel_launch'][:300]}")
    if doc["sanitizer"]:
        lines.append("rerun a faulted case alone under compute-sanitizer:")
        lines += [f"  {line}" for line in doc["sanitizer"][:10]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
