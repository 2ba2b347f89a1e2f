"""The self-check with one process per row: a fault in one case cannot hide the others.

Each (case, dtype) row, and on CUDA the no-recompile check, runs in a child process
(``python -m coreattn.selfcheck --child ROW --events FILE``). The child traces its kernel launches
(selfcheck/faults.py: each launch is written to the events file before it runs, with its config,
and the device is synchronized after it) and ends with a ``result`` event: pass, wrong (with the
error numbers), or fault/error with the exception. A child that dies (a signal, a CUDA abort) or
outlives ``--timeout`` leaves no result; the parent reports it as a fault or a timeout and names
the kernel launch it was in from the events. Without a GPU the children run the kernels under
Triton's interpreter (the parent sets TRITON_INTERPRET=1 for them).

Why a process per row rather than per kernel class: every row runs the forward and the three
backward kernels of one class, so a row is a class; and a row's process also owns that row's
memory, so an out-of-bounds write that does not fault cannot corrupt another row's tensors. The
cost is a process start per row (a few seconds: importing torch, a CUDA context, loading compiled
kernels from Triton's cache); ``--jobs`` runs several at once on a GPU.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from coreattn.kernels.configs.pick import record_configs
from coreattn.selfcheck import (CASES, STATUS, Check, case_dtypes, check_from_json, check_recompiles,
                                configs_report, dtype_arg, dtype_name, environment, preamble, recompile_line,
                                row_line, run_case, summarize, table_header)
from coreattn.selfcheck.faults import (Child, EventLog, child_env, device_healthy, is_device_fault, launch_trace,
                                       sanitizer_hint, short_error, traceback_tail, where)

RECOMPILE = "recompile"
DEFAULT_TIMEOUT = {"cuda": 300.0, "cpu": 1800.0}
DEFAULT_JOBS = {"cuda": 4, "cpu": min(2, os.cpu_count() or 1)}


def row_id(case_name: str, dtype: torch.dtype) -> str:
    return f"{case_name}/{dtype_name(dtype)}"


def parse_row(text: str):
    name, _, dname = text.partition("/")
    dtype = getattr(torch, dname, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a row id: {text!r}")
    if name == RECOMPILE:
        return None, dtype
    case = next((c for c in CASES if c.name == name), None)
    if case is None:
        raise ValueError(f"no case {name!r}")
    return case, dtype


def rerun_command(case_name: str, dtype: torch.dtype) -> str:
    """The command that runs one row alone, in one process (what compute-sanitizer wraps)."""
    return f"python -m coreattn.selfcheck --case {case_name} --dtype {dtype_arg(dtype)} --in-process"


# ---- the child: one row

def child_main(row: str, events: str) -> int:
    """Runs one row and writes its ``result`` event; exit status 0 whatever the row's outcome (the
    parent reads the events), 2 for a bad row id."""
    log = EventLog(events)
    try:
        case, dtype = parse_row(row)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() and not _interpreted() else "cpu")
    log.write(event="start", row=row, pid=os.getpid())
    site = f"selfcheck {case.name if case else RECOMPILE} {dtype_name(dtype)}"
    try:
        with record_configs() as uses, launch_trace(log, sync=True, site=site):
            if case is None:
                checks = [check_recompiles(device, dtype)]
            else:
                checks = run_case(case, dtype, device)
    except Exception as exc:
        fault = is_device_fault(exc) or not device_healthy(device)
        log.write(event="result", status="fault" if fault else "error", error=short_error(exc),
                  traceback=traceback_tail(exc), configs=[u.as_json() for u in uses.values()])
        return 0
    status = "pass" if all(c.passed for c in checks) else "wrong"
    log.write(event="result", status=status, checks=[c.as_json() for c in checks],
              configs=[u.as_json() for u in uses.values()])
    return 0


def _interpreted() -> bool:
    from coreattn.kernels import runs_in_interpreter

    return runs_in_interpreter()


# ---- the parent

def _outcome(child: Child | None, case_name: str, dtype: torch.dtype) -> dict:
    """A row's result from its child's events and exit: status, checks, configs and, for a fault,
    error or timeout, what happened and in which kernel launch."""
    if child is None:
        note = "not run: the --time-limit had passed"
        return {"status": "not-run", "checks": [Check("run", math.inf, 0.0, False, note).as_json()], "configs": [],
                "fault": None, "wall_s": None}
    events = child.new_events()
    result = next((e for e in reversed(events) if e.get("event") == "result"), None)
    configs = result.get("configs", []) if result else []
    wall = round(child.wall_s, 2) if child.wall_s is not None else None
    if result and result["status"] in ("pass", "wrong"):
        return {"status": result["status"], "checks": result["checks"], "configs": configs, "fault": None,
                "wall_s": wall}
    launch, at = where(events)
    if result:  # an exception the child caught: a device fault or an ordinary error
        status, how = result["status"], result["error"]
    elif child.timed_out:
        status, how = "timeout", child.reason()
    else:
        status, how = "fault", f"the process died ({child.reason()})"
    rerun = rerun_command(case_name, dtype) if case_name != RECOMPILE else "python -m coreattn.selfcheck"
    fault = {"row": row_id(case_name, dtype), "status": status, "how": how, "launch": launch, "where": at,
             "rerun": rerun, "sanitizer": sanitizer_hint(rerun), "output_tail": child.output_tail(1500),
             "traceback": result.get("traceback") if result else None}
    note = f"{how}; kernel launch: {at}"
    return {"status": status, "checks": [Check("run", math.inf, 0.0, False, note).as_json()], "configs": configs,
            "fault": fault, "wall_s": wall}


def run_isolated(rows, device: torch.device, quick: bool = False, recompile: bool = True, timeout: float | None = None,
                 jobs: int | None = None, time_limit: float | None = None, out=sys.stdout) -> dict:
    """Runs each (case, dtype) row, and on CUDA the no-recompile check, in its own child process,
    ``jobs`` at a time; prints the table as rows finish (in order) and returns the results document."""
    kind = device.type
    timeout = timeout or DEFAULT_TIMEOUT[kind]
    jobs = jobs or DEFAULT_JOBS[kind]
    deadline = time.monotonic() + time_limit if time_limit else None
    dtypes, skipped = case_dtypes(device)
    try:
        env = environment(device)
    except Exception as exc:  # the parent launches no kernel, but may still fail to ask the driver
        env = {k: None for k in ("device", "compute_capability", "torch", "cuda", "hip", "gcn_arch", "triton",
                                 "coreattn", "python")} | {"interpreter": kind == "cpu", "error": short_error(exc)}
    say = lambda line="": print(line, file=out, flush=True)  # noqa: E731
    isolation = (f"each row in its own process ({jobs} at a time, {timeout:g} s each"
                 + (f", none started after {time_limit:g} s" if time_limit else "") + ")")
    for line in preamble(env, quick, skipped, isolation):
        say(line)
    say()
    say(table_header())
    say("-" * len(table_header()))

    units = [(c.name, d) for c, d in rows] + ([(RECOMPILE, dtypes[0])] if recompile and kind == "cuda" else [])
    child_vars = {"TRITON_INTERPRET": "1"} if kind == "cpu" else {}
    env_vars = child_env(child_vars, drop=() if kind == "cpu" else ("TRITON_INTERPRET",))
    tmp = Path(tempfile.mkdtemp(prefix="coreattn-selfcheck-"))
    outcomes: dict[int, dict] = {}
    running: dict[int, Child] = {}
    printed = 0
    try:
        pending = list(range(len(units)))
        while pending or running:
            while pending and len(running) < jobs:
                i = pending.pop(0)
                name, dtype = units[i]
                if deadline and time.monotonic() > deadline:
                    outcomes[i] = _outcome(None, name, dtype)
                    continue
                argv = [sys.executable, "-m", "coreattn.selfcheck", "--child", row_id(name, dtype),
                        "--events", str(tmp / f"{i}.events")]
                running[i] = Child(argv, tmp / f"{i}.events", tmp / f"{i}.log", env=env_vars, timeout=timeout)
            for i, child in list(running.items()):
                if child.poll(deadline) is not None:
                    outcomes[i] = _outcome(child, *units[i])
                    del running[i]
            while printed < len(rows) and printed in outcomes:
                o, (name, dtype) = outcomes[printed], units[printed]
                say(row_line(name, dtype_name(dtype), [check_from_json(c) for c in o["checks"]], o["status"]))
                printed += 1
            if running:
                time.sleep(0.05)
    finally:
        for child in running.values():
            child.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    results = []
    for i, (case, dtype) in enumerate(rows):
        o = outcomes[i]
        results.append({"case": asdict(case), "dtype": dtype_name(dtype), "status": o["status"],
                        "passed": o["status"] == "pass", "checks": o["checks"], "configs": o["configs"],
                        "fault": o["fault"], "wall_s": o["wall_s"]})
    say()
    say(configs_report([u for r in results for u in r["configs"]]))
    recompile_faults = []
    if recompile and kind == "cuda":
        o = outcomes[len(rows)]
        check = o["checks"][0] if o["status"] in ("pass", "wrong") else {
            "name": "no recompiles", "err": None, "bound": 0.0, "passed": False,
            "note": f"{STATUS[o['status']]}: {o['checks'][0]['note']}"}
        recompile_faults = [o["fault"]] if o["fault"] else []
    else:
        note = "skipped: --case runs the named cases only" if kind == "cuda" else \
            "skipped: compile caches are not meaningful under the interpreter"
        check = Check("no recompiles", 0.0, 0.0, True, note).as_json()
    say()
    say(recompile_line(check))
    return summarize(results, check, env, skipped, quick, out, isolation, recompile_faults)
