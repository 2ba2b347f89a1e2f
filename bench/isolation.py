"""The GPU sections in units, run in a worker process that a fault cannot take the suite down with.

A CUDA fault poisons its process: every later CUDA call there fails. So on a GPU (``--isolation
auto``, or ``process`` anywhere) the attention, context-parallel, layer and mask sections run as
units in a worker process (``python -m bench.isolation JOB EVENTS``): an attention unit is one
(dtype, config, provider, mode) row, a mask unit one (config, provider), a cp or layer unit one
(dtype, config). The worker writes each unit's rows to its events file as it finishes them. Inside
a unit, the inputs' construction and one untimed call are launch-traced (coreattn/selfcheck/
faults.py: each Triton launch recorded before it runs, with its config, and synced after it); the
timed calls are not. A unit that dies (a signal), hangs past ``--timeout``, or leaves the device
poisoned is recorded as a ``fault`` or ``timeout`` row naming the kernel launch it was in, and a
fresh worker goes on with the next unit. ``--time-limit`` starts no unit after that many seconds
(the rest are ``skipped``). ``--isolation none`` (the default on CPU) runs the same units in this
process.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import attention, configs, layer, masks
from bench import context_parallel as cp_bench
from bench.env import REPO_ROOT
from bench.timing import trace_untimed
from coreattn.selfcheck.faults import (Child, EventLog, child_env, device_healthy, inject, is_device_fault,
                                       launch_trace, short_error, traceback_tail, where)

POISONED = 3  # the worker's exit status after a device fault: its process cannot go on
DEFAULT_TIMEOUT = 600.0
SECTIONS = ("attention", "cp", "layer", "masks")


def plan(dtypes: list[str], run: dict, attn_cfgs, modes, providers, cp_cfgs, layer_cfgs, mask_cfgs,
         mask_providers) -> list[dict]:
    """The units, in the order the suite has always run them: per dtype attention, cp, layer; then masks."""
    units = []
    for dtype in dtypes:
        if run["attention"]:
            units += [dict(section="attention", dtype=dtype, config=c.id, provider=p, mode=m)
                      for c in attn_cfgs for p in providers for m in modes]
        if run["cp"]:
            units += [dict(section="cp", dtype=dtype, config=c.id) for c in cp_cfgs]
        if run["layer"]:
            units += [dict(section="layer", dtype=dtype, config=c.id) for c in layer_cfgs]
    if run["masks"]:
        units += [dict(section="masks", dtype=dtypes[0], config=c.id, provider=p) for c in mask_cfgs
                  for p in mask_providers]
    return units


def words(unit: dict) -> str:
    """The unit in words: ``attention bf16 hdim128x128-gqa4-causal-short-256 coreattn fwd``."""
    return " ".join(str(unit[k]) for k in ("section", "dtype", "config", "provider", "mode") if k in unit)


def _find(found, config_id: str):
    return next(c for c in found if c.id == config_id)


def run_unit(unit: dict, device: torch.device, quick: bool, progress=None) -> list[dict]:
    """One unit's rows, in this process."""
    on_gpu = device.type == "cuda"
    dtype = getattr(torch, configs.DTYPES[unit["dtype"]])
    section = unit["section"]
    if section == "attention":
        cfg = _find(configs.attention_configs(on_gpu, quick), unit["config"])
        return attention.run_attention([cfg], (unit["mode"],), [unit["provider"]], dtype, device, quick, progress)
    if section == "cp":
        return cp_bench.run_cp([_find(cp_bench.cp_configs(), unit["config"])], dtype, device, quick, progress)
    if section == "layer":
        cfg = _find(layer.layer_configs(on_gpu, quick), unit["config"])
        return layer.run_layer([cfg], dtype, device, quick, progress)
    cfg = _find(configs.mask_configs(on_gpu, quick), unit["config"])
    return masks.run_masks([cfg], [unit["provider"]], dtype, device, quick, progress)


def unit_rows(unit: dict, status: str, reason: str, fault: dict | None = None) -> list[dict]:
    """Rows standing for a unit that did not finish (``fault``, ``timeout``, ``error``) or did not
    start (``skipped``), shaped like the section's own rows."""
    dtype = configs.DTYPES[unit["dtype"]]
    base = {"kind": unit["section"], "config": unit["config"], "dtype": dtype, "status": status, "reason": reason}
    if fault:
        base["fault"] = fault
    section = unit["section"]
    if section == "attention":
        return [dict(base, provider=unit["provider"], mode=unit["mode"])]
    if section == "masks":
        return [dict(base, provider=unit["provider"], op=op.name) for op in masks.OPS]
    if section == "cp":
        return [dict(base, provider=cp_bench.PROVIDER, op="rank_fwdbwd", cp_size="*", comm="*")]
    return [dict(base, provider="*", mode="fwdbwd")]


def run_in_process(units: list[dict], device: torch.device, quick: bool, progress=None,
                   time_limit: float | None = None) -> list[dict]:
    deadline = time.monotonic() + time_limit if time_limit else None
    rows = []
    for unit in units:
        if deadline and time.monotonic() > deadline:
            rows += unit_rows(unit, "skipped", "not run: the --time-limit had passed")
            continue
        rows += run_unit(unit, device, quick, progress)
    return _dedupe(rows)


def _dedupe(rows: list[dict]) -> list[dict]:
    """One copy of identical section-wide rows (the mask section's "coreattn.masks is missing")."""
    out, seen = [], set()
    for r in rows:
        key = json.dumps(r, sort_keys=True, default=str) if r.get("config") == "*" else None
        if key is None or key not in seen:
            out.append(r)
            seen.add(key)
    return out


# ---- the worker

def worker_main(job_path: str, events_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    log = EventLog(events_path)
    device = torch.device(job["device"])
    log.write(event="ready", pid=os.getpid())
    for i in range(job["start"], len(job["units"])):
        unit = job["units"][i]
        site = f"bench {words(unit)}"
        log.write(event="unit", i=i)
        trace_untimed(lambda: launch_trace(log, sync=True, site=site))
        try:
            inject(site)
            rows = run_unit(unit, device, job["quick"])
        except Exception as exc:
            fault = is_device_fault(exc) or not device_healthy(device)
            log.write(event="unit-error", i=i, status="fault" if fault else "error", error=short_error(exc),
                      traceback=traceback_tail(exc))
            if fault:
                return POISONED
            continue
        poisoned = any(r.get("status") == "error" for r in rows) and not device_healthy(device)
        log.write(event="rows", i=i, rows=rows, poisoned=poisoned)
        if poisoned:
            return POISONED
    log.write(event="done")
    return 0


# ---- the parent

def _fault(unit: dict, status: str, how: str, events: list[dict], child: Child) -> dict:
    launch, at = where(events, untraced="the timed runs are not traced")
    return {"unit": words(unit), "status": status, "how": how, "launch": launch, "where": at,
            "output_tail": child.output_tail(1500)}


def run_isolated(units: list[dict], device: torch.device, quick: bool, progress=None, time_limit: float | None = None,
                 timeout: float | None = None, out=sys.stderr) -> list[dict]:
    """Runs the units in worker processes (a fresh one after each fault, death or timeout) and
    returns their rows in order, the failed units' as fault/timeout rows."""
    timeout = timeout or DEFAULT_TIMEOUT
    deadline = time.monotonic() + time_limit if time_limit else None
    results: dict[int, list[dict]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="coreattn-bench-"))
    env = child_env({"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))})
    start, workers = 0, 0
    try:
        while start < len(units):
            if deadline and time.monotonic() > deadline:
                break
            workers += 1
            job, events = tmp / f"job{workers}.json", tmp / f"events{workers}.jsonl"
            job.write_text(json.dumps({"units": units, "start": start, "device": device.type, "quick": quick}))
            child = Child([sys.executable, "-m", "bench.isolation", str(job), str(events)], events,
                          tmp / f"worker{workers}.log", env=env, cwd=REPO_ROOT, timeout=timeout)
            current, ready, unit_events = None, False, []
            while True:
                rc = child.poll(deadline)
                for ev in child.new_events():
                    kind = ev.get("event")
                    if kind == "ready":  # the import time does not count against the first unit
                        ready = True
                        child.touch()
                    elif kind == "unit":
                        current, unit_events = ev["i"], []
                        child.touch()
                    elif kind == "rows":
                        rows = ev["rows"]
                        if ev.get("poisoned"):
                            fault = _fault(units[ev["i"]], "fault", "the device was unusable after this unit",
                                           unit_events, child)
                            for r in rows:
                                if r.get("status") == "error":
                                    r.update(status="fault", fault=fault)
                        results[ev["i"]], current = rows, None
                        if progress is not None:
                            progress.update(len(rows))
                    elif kind == "unit-error":
                        fault = _fault(units[ev["i"]], ev["status"], ev["error"], unit_events, child)
                        reason = f"{ev['error']}; kernel launch: {fault['where']}"
                        results[ev["i"]] = unit_rows(units[ev["i"]], ev["status"], reason, fault)
                        current = None
                    else:
                        unit_events.append(ev)
                if rc is not None:
                    break
                time.sleep(0.05)
            done = [i for i in results if i >= start]
            if current is not None:  # died or hung inside a unit
                status = "timeout" if child.timed_out else "fault"
                how = child.reason() if child.timed_out else f"the worker died ({child.reason()})"
                if child.timed_out and deadline and time.monotonic() > deadline:
                    how = "killed at the --time-limit"
                fault = _fault(units[current], status, how, unit_events, child)
                results[current] = unit_rows(units[current], status, f"{how}; kernel launch: {fault['where']}", fault)
                print(f"bench: {status} in {words(units[current])}: {how}; kernel launch: {fault['where']}; "
                      "going on in a fresh process", file=out, flush=True)
            elif child.timed_out:  # killed at the --time-limit between units: the rest are skipped
                break
            elif not ready:
                raise RuntimeError(f"the bench worker did not start ({child.reason()}):\n{child.output_tail()}")
            elif rc != 0 and not done:  # died between units without finishing one: no progress to build on
                raise RuntimeError(f"the bench worker stopped ({child.reason()}):\n{child.output_tail()}")
            start = max([start - 1, *done, *([current] if current is not None else [])]) + 1
            if rc == 0 and start < len(units) and current is None:
                raise RuntimeError(f"the bench worker stopped early ({child.reason()}):\n{child.output_tail()}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for i, unit in enumerate(units):
        rows += results.get(i) or unit_rows(unit, "skipped", "not run: the --time-limit had passed")
    return _dedupe(rows)


if __name__ == "__main__":
    sys.exit(worker_main(*sys.argv[1:]))
