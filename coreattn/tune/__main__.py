"""``python -m coreattn.tune``: time coreattn's candidate launch configs on this GPU and cache the fastest.

    python -m coreattn.tune                          # the main head dims, bf16, causal
    python -m coreattn.tune --quick --dims 128,192/128 --features causal full dropout
    python -m coreattn.tune --dry-run --arch sm90 --json candidates.json   # no GPU: compile only

On a GPU it compile-checks, times and accepts candidates (coreattn/tune/tuner.py) and writes the
winners to the user cache (kernels/tuned_cache.py), which the kernels read from then on; it prints a
before/after table. It never runs implicitly: training only reads the cache.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

from coreattn.kernels import runs_in_interpreter, tuned_cache
from coreattn.kernels.configs.base import KERNELS
from coreattn.kernels.configs.targets import target_of
from coreattn.tune import batches as batch_defs
from coreattn.tune import space
from coreattn.tune.report import after_table, share_hint

NO_GPU = ("python -m coreattn.tune times kernels on a CUDA GPU, and this process sees none "
          "(torch.cuda.is_available() is False). Without a GPU, `python -m coreattn.tune --dry-run --arch sm90 "
          "--json candidates.json` compiles every candidate for an architecture and shows which the tuner would time.")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m coreattn.tune", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dims", default="64,128,192/128,256", help="head dims, DIM or QKDIM/VDIM, comma-separated")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--features", nargs="+", default=["causal"], choices=space.FEATURE_CHOICES,
                   help="masks (causal, full) and features (dropout, sink, max_logit), each tuned as its own class")
    p.add_argument("--gqa", action="store_true", help=f"tune GQA classes ({batch_defs.GQA_GROUP} q heads per kv head); "
                   "a lookup falls back between GQA and MHA entries")
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    p.add_argument("--quick", action="store_true", help="a quarter of each batch, shorter timing")
    p.add_argument("--min-speedup", type=float, default=None,
                   help="a candidate must beat the shipped config by this factor (default 1.02)")
    p.add_argument("--out", type=Path, help="the cache file to write (default: the user cache file for this GPU)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds a tuning step (a candidate's compile check, a timing, its acceptance) may take "
                        "before the worker is killed and that candidate dropped (default 600)")
    p.add_argument("--in-process", action="store_true",
                   help="tune in this process: a candidate that faults ends the run (by default the tasks run in a "
                        "worker process, and a faulting candidate is dropped: coreattn/tune/isolated.py)")
    p.add_argument("--dry-run", action="store_true", help="no GPU: compile every candidate for --arch and report")
    p.add_argument("--arch", nargs="+", default=["sm90"], help="--dry-run: CUDA architectures (sm80 ... sm120)")
    p.add_argument("--limit", type=int, help="--dry-run: at most this many candidates per kernel and class")
    p.add_argument("--json", type=Path, help="--dry-run: write the candidates' rows (a JSON list) here")
    return p.parse_args(argv)


def dry_run_line(row: dict) -> str:
    if row["error"]:
        state = row["error"]
    elif not row["smem_fits"]:
        state = "over shared memory"
    elif row["spill_stores"] or row["spill_loads"]:
        state = f"spills {row['spill_stores']}/{row['spill_loads']} B"
    else:
        state = "timed"
    cfg = space.describe_config(tuned_cache.config_from_json(row["config"]))
    return (f"  {row['arch']} {row['kernel']:<10} {row['class']:<28} {cfg:<22} regs {row['regs']} smem {row['smem']} "
            f"{row['compile_s']:>5.1f}s  {state}")


def dry_run_main(args, classes) -> int:
    from coreattn.tune.compiler import ARCHS
    from coreattn.tune.dryrun import count_table, dry_run

    if runs_in_interpreter():
        print("--dry-run compiles the kernels: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    unknown = [a for a in args.arch if a not in ARCHS]
    if unknown:
        print(f"--arch: unknown {unknown}; choose from {list(ARCHS)}", file=sys.stderr)
        return 2
    rows = []
    for arch in args.arch:
        rows += dry_run(arch, classes, args.kernels, args.limit,
                        progress=lambda row: print(dry_run_line(row), flush=True))
    print("\nSTATIC COMPILER OUTPUT for emulated targets (no GPU ran): timed = compiles, 0 spill bytes, fits shared "
          "memory (what the tuner would time); tma / ws count those among the timed.")
    print(count_table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {len(rows)} candidates to {args.json}")
    return 0


def _merge(path: Path, key, results) -> list[dict]:
    """Entries of an existing file for the same key, updated by this run's results (a task that
    kept its shipped config drops an older entry: this run measured it no better)."""
    entries = {}
    if path.is_file():
        try:
            old = tuned_cache.read(path)
        except ValueError:
            old = None
        if old is not None and old.key == key:
            entries = {(e["kernel"], e["class"]): e for e in old.raw["entries"]}
    for r in results:
        if r.failed:  # not measured: an older entry stays
            continue
        entries.pop((r.task.kernel, r.task.cls.id), None)
        if r.entry is not None:
            entries[(r.task.kernel, r.task.cls.id)] = r.entry
    return list(entries.values())


def check_numbers(args) -> None:
    """--limit counts candidates (>= 1); --min-speedup is a factor over the shipped config's time
    (>= 1: a smaller one would accept a slower config)."""
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit: at least 1 candidate per kernel and class, got {args.limit}")
    if args.min_speedup is not None and not args.min_speedup >= 1.0:
        raise ValueError(f"--min-speedup: a factor >= 1 over the shipped config, got {args.min_speedup}")
    if args.timeout is not None and not args.timeout > 0:
        raise ValueError(f"--timeout: seconds > 0, got {args.timeout}")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_numbers(args)
        classes = space.classes(space.parse_dims(args.dims), args.dtype, args.features, args.gqa)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run_main(args, classes)
    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    if runs_in_interpreter():
        print("TRITON_INTERPRET=1 is set: the tuner times compiled kernels; unset it", file=sys.stderr)
        return 2
    from coreattn.tune.tuner import gpu_timer

    device = torch.device("cuda", torch.cuda.current_device())
    if args.in_process:
        return tune(args, device, tuned_cache.device_key(device), gpu_timer(args.quick), argv)
    return tune(args, device, tuned_cache.device_key(device), None, argv,
                worker_timer={"kind": "gpu", "quick": args.quick})


def tune(args, device: torch.device, key, timer, argv=None, worker_timer: dict | None = None) -> int:
    """The tuner's run on ``device`` (a CUDA GPU; tests pass the CPU under the interpreter with an
    injected ``timer``): plan, estimate, tune every task, write the cache file, print the tables.
    ``worker_timer``: tune in worker processes with this timer spec (coreattn/tune/isolated.py),
    dropping candidates that fault; else in this process with ``timer``."""
    from coreattn.tune.tuner import MIN_SPEEDUP, Progress, estimate_seconds, steps, tune_task

    classes = space.classes(space.parse_dims(args.dims), args.dtype, args.features, args.gqa)
    target = target_of(device)
    out = args.out or tuned_cache.user_cache_file(key)
    tasks = space.kernel_classes(classes, args.kernels)
    cands = {t: space.kernel_candidates(target, t.kernel, t.source) for t in tasks}
    plan = {}
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 16 * 2**30
    for t in tasks:
        heads_kv = batch_defs.HEADS_Q // batch_defs.GQA_GROUP if t.source.gqa else batch_defs.HEADS_Q
        tokens = batch_defs.fit_tokens(free, t.source.dim_qk, t.source.dim_v, space.ELEMENT_BYTES[t.source.dtype],
                                       heads_kv)
        plan[t] = batch_defs.batches(args.quick, tokens)
    total = sum(steps(len(cands[t]), len(plan[t])) for t in tasks)
    guess = sum(estimate_seconds(len(cands[t]), len(plan[t]), args.quick) for t in tasks)
    print(f"coreattn tuner on {key.gpu} (compute capability {key.capability}, config family {target}), "
          f"triton {key.triton}, coreattn {key.coreattn}")
    print(f"classes: {', '.join(c.id for c in classes)}; kernels: {' '.join(args.kernels)}")
    print(f"batches: {'; '.join(b.id for b in plan[tasks[0]])} ({batch_defs.HEADS_Q} q heads)")
    print(f"{len(tasks)} kernel/class tasks, {sum(map(len, cands.values()))} candidates; estimated {guess / 60:.0f} min "
          "(compiling dominates; the progress bar refines it)", flush=True)
    progress = Progress(total)
    results = []
    try:
        if worker_timer is not None:
            from coreattn.tune.isolated import run_tasks

            results = run_tasks(tasks, cands, plan, device, worker_timer, args.min_speedup or MIN_SPEEDUP,
                                args.timeout, progress)
        else:
            for t in tasks:
                results.append(tune_task(t, device, plan[t], timer, candidates=cands[t], progress=progress,
                                         min_speedup=args.min_speedup or MIN_SPEEDUP))
    finally:
        progress.close()
    record = dict(created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                  tuner={"args": " ".join(sys.argv[1:] if argv is None else argv), "heads_q": batch_defs.HEADS_Q,
                         "batches": {f"{t.kernel} {t.cls.id}": [b.id for b in plan[t]] for t in tasks}})
    tuned_cache.write(out, key, target, _merge(out, key, results), **record)
    tuned_cache.reload()
    print(after_table(results, key))
    print(share_hint(out, key, sum(r.entry is not None for r in results)))
    return 0

if __name__ == "__main__":
    sys.exit(main())
