"""The dry run: every candidate compiled for an architecture without a GPU (``--dry-run --arch``).

Each candidate is forced into the real launchers (kernels/configs/pick.py ``forced_configs``) inside
coreattn/tune/compiler.py's emulation of the arch, so it compiles exactly as a launch on that GPU
would, and is described: registers, spill bytes, shared memory against the arch's per-block
limit, MMA instructions by kind, warp-specialized regions and TMA loads in the compiled kernel.
``timed`` says whether the tuner would time it: it compiles, spills nothing and fits shared memory.
Static compiler output, not speed.
"""

from __future__ import annotations

import time

from coreattn.kernels.configs.pick import forced_configs
from coreattn.kernels.tuned_cache import config_to_json
from coreattn.tune import compiler
from coreattn.tune.space import kernel_candidates, kernel_classes

COMPILER_NAMES = {"fwd": "fwd", "dkdv": "dkdv", "dq": "dq", "preprocess": "bwd_pre"}


def problem_of(cls, group: int = 4) -> compiler.Problem:
    """The compile problem of a class (GQA: ``group`` q heads per kv head)."""
    return compiler.Problem(cls.dim_qk, cls.dim_v, cls.dtype, cls.causal, group if cls.gqa else 1,
                            cls.features[0] if cls.features else "")


def summarize(launches: list[dict]) -> dict:
    """One candidate's compiled kernels (two for a dK/dV kernel split in passes) as one row: the
    worst registers and shared memory, spills and MMA instructions summed."""
    mma: dict = {}
    for r in launches:
        for kind, n in r["mma"].items():
            mma[kind] = mma.get(kind, 0) + n
    spills = [(r["spill_stores"], r["spill_loads"]) for r in launches]
    return dict(regs=max((r["regs"] or 0) for r in launches),
                spill_stores=None if None in (s for s, _ in spills) else sum(s for s, _ in spills),
                spill_loads=None if None in (ld for _, ld in spills) else sum(ld for _, ld in spills),
                smem=max(r["smem"] for r in launches), smem_fits=all(r["smem_fits"] for r in launches),
                mma=mma, num_warps=max(r["num_warps"] for r in launches),
                ws_regions=max(r["ws_regions"] for r in launches), tma_loads=max(r["tma_loads"] for r in launches),
                passes=len(launches), ctas_per_sm=min(r.get("ctas_per_sm", 0) for r in launches))


def would_time(row: dict) -> bool:
    return row.get("error") is None and row["spill_stores"] == 0 and row["spill_loads"] == 0 and row["smem_fits"]


def dry_run(arch: str, user_classes, kernels=None, limit: int | None = None, progress=None) -> list[dict]:
    """One row per (kernel, class, candidate) on ``arch``: the issue's dry-run schema (arch, kernel,
    dim_qk, dim_v, dtype, config, regs, spill_stores, spill_loads, smem, smem_fits, mma,
    warp_specialize, tma, shipped, timed) plus class, ws_regions, tma_loads, num_warps (as
    compiled: warp specialization adds warps), passes, compile_s and error."""
    target = compiler.arch_target(arch)
    tasks = kernel_classes(user_classes, *([kernels] if kernels else []))
    rows = []
    with compiler.emulate(arch) as launches:
        for task in tasks:
            found = kernel_candidates(target, task.kernel, task.source, limit)
            for cfg in found:
                start = time.perf_counter()
                row = dict(arch=arch, kernel=task.kernel, dim_qk=task.cls.dim_qk, dim_v=task.cls.dim_v,
                           dtype=task.cls.dtype, **{"class": task.cls.id}, config=config_to_json(cfg),
                           warp_specialize=cfg.warp_specialize, tma=cfg.tma, shipped=cfg == found[0])
                try:
                    with forced_configs(**{task.kernel: cfg}):
                        described = compiler.compile_problem(problem_of(task.source), launches, arch,
                                                             kernels={COMPILER_NAMES[task.kernel]})
                    row.update(summarize(described), error=None)
                except Exception as exc:  # a candidate that does not compile is a result, not a crash
                    first = (str(exc).strip().splitlines() or [""])[-1][:300]
                    row.update(regs=None, spill_stores=None, spill_loads=None, smem=None, smem_fits=False, mma={},
                               error=f"{type(exc).__name__}: {first}")
                row.update(timed=would_time(row), compile_s=round(time.perf_counter() - start, 1))
                rows.append(row)
                if progress is not None:
                    progress(row)
    return rows


def count_table(rows: list[dict]) -> str:
    """Per arch, kernel and class: candidates, how many the tuner would time (spill-free, fitting),
    and how many of those are TMA / warp-specialized."""
    groups: dict = {}
    for r in rows:
        g = groups.setdefault((r["arch"], r["kernel"], r["class"]), [0, 0, 0, 0, 0])
        g[0] += 1
        g[1] += r["timed"]
        g[2] += r["timed"] and r["tma"]
        g[3] += r["timed"] and r["warp_specialize"]
        g[4] += r["error"] is not None
    lines = [f"{'arch':<6} {'kernel':<11} {'class':<28} {'cands':>5} {'timed':>5} {'tma':>4} {'ws':>3} {'fail':>4}"]
    for (arch, kernel, cls), (n, timed, tma, ws, fail) in groups.items():
        lines.append(f"{arch:<6} {kernel:<11} {cls:<28} {n:>5} {timed:>5} {tma:>4} {ws:>3} {fail:>4}")
    return "\n".join(lines)
