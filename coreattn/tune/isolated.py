"""The tuner's tasks in a worker process: a candidate that faults is dropped, not the whole run.

A candidate config can fault on the GPU (an illegal memory access in a tile nobody ran before),
and a CUDA fault poisons its process. So ``python -m coreattn.tune`` runs its (kernel, class)
tasks in a worker process (``python -m coreattn.tune.isolated JOB EVENTS``) that reports, before
each step, which candidate it is at and in which phase (the batch's setup at the shipped configs,
the compile check, a timing, the acceptance check), and traces the launches of every step but
the timings (coreattn/selfcheck/faults.py: each recorded before it runs and synced after it). When
the worker dies (a signal), outlives ``--timeout`` without news, raises a device fault or any other
error, the parent drops the candidate it was at (a note names the phase, what happened and the
kernel launch) and a fresh worker starts that task again without it; the tasks already finished are
kept. If it was at the shipped config, or at a batch's setup (which runs the shipped configs), the
task is recorded as failed (no entry written; an older entry for it is kept) and the next task goes
on.

The worker's timer comes from a spec: ``{"kind": "gpu", "quick": ...}`` (triton's do_bench), or,
for the tests on CPU, ``{"kind": "scripted", "ms": [[config, {batch: ms}], ...], "log": PATH}``
(scripted milliseconds, each timing asked for appended to PATH).
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

from coreattn.kernels.configs.base import AttnConfig
from coreattn.kernels.configs.targets import target_of
from coreattn.kernels.tuned_cache import KernelClass
from coreattn.selfcheck.faults import (Child, EventLog, child_env, device_healthy, inject, is_device_fault,
                                       launch_trace, short_error, traceback_tail, where)
from coreattn.tune.batches import Batch
from coreattn.tune.space import KernelTask, describe_config, shipped_configs
from coreattn.tune.tuner import TaskResult, gpu_timer, tune_task

POISONED = 3
DEFAULT_TIMEOUT = 600.0
PHASES = ("setup", "compile", "time", "accept")


def cfg_json(cfg: AttnConfig) -> dict:
    return cfg._asdict()


def cfg_from(obj: dict) -> AttnConfig:
    return AttnConfig(**obj)


def result_to_json(r: TaskResult) -> dict:
    return {"kernel": r.task.kernel, "cls": r.task.cls.id, "source": r.task.source.id, "shipped": cfg_json(r.shipped),
            "chosen": cfg_json(r.chosen), "speedup": r.speedup, "ms_shipped": r.ms_shipped, "ms_chosen": r.ms_chosen,
            "notes": r.notes, "failed": r.failed}


def result_from_json(d: dict) -> TaskResult:
    task = KernelTask(d["kernel"], KernelClass.parse(d["cls"]), KernelClass.parse(d["source"]))
    return TaskResult(task, cfg_from(d["shipped"]), cfg_from(d["chosen"]), d["speedup"], d["ms_shipped"],
                      d["ms_chosen"], list(d["notes"]), d.get("failed"))


def make_timer(spec: dict):
    if spec["kind"] == "gpu":
        return gpu_timer(spec.get("quick", False))
    if spec["kind"] == "scripted":  # the tests' timer (CPU): no speed is measured
        table = {cfg_from(c): ms for c, ms in spec["ms"]}

        def timer(fn, case):
            if spec.get("log"):
                with open(spec["log"], "a") as f:
                    f.write(json.dumps({"kernel": case.kernel, "config": cfg_json(case.config),
                                        "batch": case.batch}) + "\n")
            return table[case.config][case.batch]

        return timer
    raise ValueError(f"unknown timer spec {spec!r}")


def words(task_spec: dict, cfg: AttnConfig, phase: str) -> str:
    """``tune fwd hdim64x64-bf16-causal 64x64 w4 s3 compile``: the step in words (for ``inject``)."""
    return f"tune {task_spec['kernel']} {task_spec['cls']} {describe_config(cfg)} {phase}"


# ---- the worker

def worker_main(job_path: str, events_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    log = EventLog(events_path)
    device = torch.device("cuda", torch.cuda.current_device()) if job["device"] == "cuda" else torch.device("cpu")
    timer = make_timer(job["timer"])
    log.write(event="ready", pid=os.getpid())
    with launch_trace(log, sync=True) as trace:
        for i in range(job["start"], len(job["tasks"])):
            spec = job["tasks"][i]
            task = KernelTask(spec["kernel"], KernelClass.parse(spec["cls"]), KernelClass.parse(spec["source"]))
            batches = [Batch(name, tuple(lens)) for name, lens in spec["batches"]]
            log.write(event="task", i=i)

            def watch(phase, cfg, batch=None, spec=spec, i=i):
                trace.enabled = phase != "time"  # timings run untraced: tracing syncs after every launch
                trace.site = words(spec, cfg, phase)
                log.write(event="step", i=i, phase=phase, config=cfg_json(cfg), batch=batch)
                inject(trace.site)

            try:
                result = tune_task(task, device, batches, timer, candidates=[cfg_from(c) for c in spec["candidates"]],
                                   min_speedup=job["min_speedup"], watch=watch)
            except Exception as exc:
                fault = is_device_fault(exc) or not device_healthy(device)
                log.write(event="task-error", i=i, status="fault" if fault else "error", error=short_error(exc),
                          traceback=traceback_tail(exc))
                return POISONED if fault else 1
            finally:
                trace.enabled = True
            log.write(event="result", i=i, result=result_to_json(result))
    log.write(event="done")
    return 0


# ---- the parent

def run_tasks(tasks: list[KernelTask], cands: dict, plan: dict, device: torch.device, timer_spec: dict,
              min_speedup: float, timeout: float | None = None, progress=None, out=sys.stdout) -> list[TaskResult]:
    """Every task's result, tuned in worker processes (see the module docstring)."""
    timeout = timeout or DEFAULT_TIMEOUT
    target = target_of(device)
    specs = [{"kernel": t.kernel, "cls": t.cls.id, "source": t.source.id,
              "shipped": cfg_json(shipped_configs(target, t.source)[t.kernel]),
              "candidates": [cfg_json(c) for c in cands[t]], "batches": [[b.name, list(b.seqlens)] for b in plan[t]]}
             for t in tasks]
    dropped: dict[int, list[str]] = {i: [] for i in range(len(tasks))}
    results: dict[int, TaskResult] = {}
    tmp = Path(tempfile.mkdtemp(prefix="coreattn-tune-"))
    env = child_env({"TRITON_INTERPRET": "1"} if device.type == "cpu" else {},
                    drop=() if device.type == "cpu" else ("TRITON_INTERPRET",))
    step = progress or (lambda n=1, note="": None)
    start, workers = 0, 0
    try:
        while start < len(tasks):
            workers += 1
            job, events = tmp / f"job{workers}.json", tmp / f"events{workers}.jsonl"
            job.write_text(json.dumps({"tasks": specs, "start": start, "device": device.type, "timer": timer_spec,
                                       "min_speedup": min_speedup}))
            child = Child([sys.executable, "-m", "coreattn.tune.isolated", str(job), str(events)], events,
                          tmp / f"worker{workers}.log", env=env, timeout=timeout)
            ready, current, at, error, step_events = False, None, None, None, []
            while True:
                rc = child.poll()
                for ev in child.new_events():
                    kind = ev.get("event")
                    if kind in ("ready", "task", "step"):
                        child.touch()
                    if kind == "ready":
                        ready = True
                    elif kind == "task":
                        current, at = ev["i"], None
                    elif kind == "step":
                        at, step_events = ev, []
                        if ev["phase"] in ("compile", "time"):
                            step(1, f"{specs[ev['i']]['kernel']} {specs[ev['i']]['cls']}")
                    elif kind == "result":
                        r = result_from_json(ev["result"])
                        results[ev["i"]] = r._replace(notes=dropped[ev["i"]] + r.notes)
                        current, at = None, None
                    elif kind == "task-error":
                        error = ev
                    else:
                        step_events.append(ev)
                if rc is not None:
                    break
                time.sleep(0.05)
            if current is None:
                if not ready:
                    raise RuntimeError(f"the tuner's worker did not start ({child.reason()}):\n{child.output_tail()}")
                if rc != 0:
                    raise RuntimeError(f"the tuner's worker stopped ({child.reason()}):\n{child.output_tail()}")
                break
            start = current + 1 if _give_up(current, at, specs, error, child, step_events, dropped, results,
                                            out) else current
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [results[i] for i in range(len(tasks))]


def _give_up(i: int, at: dict | None, specs, error, child: Child, events, dropped, results, out) -> bool:
    """After a worker failed in task ``i`` at step ``at``: drop that candidate (False: run the task
    again without it) or, at the shipped config or a setup, record the task as failed (True)."""
    if error:
        status, how = error["status"], error["error"]
    else:
        status = "timeout" if child.timed_out else "fault"
        how = child.reason() if child.timed_out else f"the worker died ({child.reason()})"
    _, launch_text = where(events, untraced="timings are not traced" if at and at["phase"] == "time" else "")
    spec = specs[i]
    shipped = spec["shipped"]
    cfg = at["config"] if at else shipped
    phase = at["phase"] if at else "setup"
    text = f"{describe_config(cfg_from(cfg))}: {status} in its {phase} step: {how}; kernel launch: {launch_text}"
    print(f"tune: {spec['kernel']} {spec['cls']}: {text}", file=out, flush=True)
    if phase != "setup" and cfg != shipped:
        spec["candidates"] = [c for c in spec["candidates"] if c != cfg]
        dropped[i].append(text)
        return False
    ship = cfg_from(shipped)
    task = KernelTask(spec["kernel"], KernelClass.parse(spec["cls"]), KernelClass.parse(spec["source"]))
    failed = f"the shipped config {describe_config(ship)} ({phase} step) {status}: {how}; kernel launch: {launch_text}"
    results[i] = TaskResult(task, ship, ship, 1.0, {}, {}, dropped[i] + [f"task not tuned: {failed}"], failed)
    return True


if __name__ == "__main__":
    sys.exit(worker_main(*sys.argv[1:]))
