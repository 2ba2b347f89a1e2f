"""CPU attention: coreattn's torch backend against PyTorch's own CPU attention, time and peak memory.

Unlike the suite's other CPU rows (tiny shapes that check the suite), these are performance
data for the CPU backend: fp32, 8 heads, causal, one 4k and one 16k sequence and packed 16k
batches at head dims 64/64 and 192/128, forward and forward+backward, plus a 32k-token
forward+backward memory check. Providers:

- ``coreattn``: ``coreattn.varlen_attn(..., backend="torch")`` on the packed ``[T, H, D]`` batch;
- ``sdpa-loop``: ``F.scaled_dot_product_attention`` per sequence on ``[1, H, L, D]`` views (its fused
  CPU kernel; with Dv != Dqk SDPA takes its math path, O(L^2) memory);
- ``sdpa-loop-padv``: the same with V zero-padded to Dqk inside the timed call and the output
  sliced (the MLA workaround; Dv < Dqk only);
- ``sdpa-padded``: SDPA on the zero-padded ``[B, H, S, D]`` batch with a ``[B, 1, S, S]`` mask
  (packed batches only);
- ``flex``: compiled FlexAttention with a document mask, forward only (it has no CPU backward).

``fwd`` is a training forward (inputs require grad, autograd records the graph), except for flex,
which runs under no_grad; ``fwdbwd`` adds the backward of a fixed output gradient. All fp32.

Every (case, mode, provider) runs in its own subprocess (``python -m bench.cpu_attention SPEC``):
inputs are built and the call warmed up (compiled, for flex) first; then the peak RSS is reset
(``/proc/self/clear_refs``) and the timed calls run; ``peak_rss`` is the process's peak resident
memory over them (what a user sees, inputs and the Python process included) and ``extra`` that
peak minus the resident memory before them (the call's own working memory). Each row runs twice:
its time under the default allocator (what users get), its memory in a second worker (one call)
where glibc is told to return freed memory at once (``MEMORY_ENV``) so that RSS follows what is
live; those settings slow code that allocates per chunk (every large block a fresh mmap faulted in
anew), so no time is taken there.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Callable, Iterable, NamedTuple

import torch
import torch.nn.functional as F

from bench.env import REPO_ROOT
from bench.report import MEMORY_LIMIT_GIB
from bench.seqlens import draw_seqlens

HEADS = 8
DIMS = ((64, 64), (192, 128))
PROVIDERS = ("coreattn", "sdpa-loop", "sdpa-loop-padv", "sdpa-padded", "flex")
BASELINES = PROVIDERS[1:]
MODES = ("fwd", "fwdbwd")
# baselines whose estimated score/mask buffers exceed this are skipped (the machine has to survive)
BASELINE_BUDGET = 6 << 30
# timed repetitions: at least `reps` (3; 1 with --quick) unless they pass TIME_BUDGET_S, more (up to
# MAX_REPS) while they stay under MORE_REPS_S
TIME_BUDGET_S = 60.0
MORE_REPS_S = 10.0
MAX_REPS = 10
SUBPROCESS_TIMEOUT_S = 3600
ELT = 4  # bytes per fp32 element


class CpuCase(NamedTuple):
    name: str  # "1x4k", "uniform-16k", ...
    seqlens: tuple[int, ...]
    head_dim_qk: int
    head_dim_v: int
    heads: int = HEADS
    causal: bool = True
    memory_check: bool = False  # the 32k case: forward+backward of coreattn (and sdpa-loop) only

    @property
    def id(self) -> str:
        return f"hdim{self.head_dim_qk}x{self.head_dim_v}-{self.name}"


def _named(total: int) -> str:
    return f"{total // 1024}k" if total % 1024 == 0 else str(total)


def cpu_cases(quick: bool) -> list[CpuCase]:
    """The full matrix, or (quick) tiny shapes that exercise every provider in seconds."""
    if quick:
        shapes = [("1x256", (256,)), ("packed-384", (96, 160, 128))]
        return [CpuCase(name, lens, dqk, dv, heads=2) for dqk, dv in DIMS for name, lens in shapes] + \
               [CpuCase("1x512", (512,), 64, 64, heads=2, memory_check=True)]
    shapes = [("1x4k", (4096,)), ("1x16k", (16384,))]
    shapes += [(f"{dist}-{_named(16384)}", tuple(draw_seqlens(dist, 16384))) for dist in ("uniform", "short")]
    return [CpuCase(name, lens, dqk, dv) for dqk, dv in DIMS for name, lens in shapes] + \
           [CpuCase("1x32k", (32768,), 64, 64, memory_check=True)]


def skip_reason(case: CpuCase, provider: str, mode: str) -> str | None:
    lens, h = case.seqlens, case.heads
    if case.memory_check and provider not in ("coreattn", "sdpa-loop"):
        return "memory check: coreattn and sdpa-loop only"
    if case.memory_check and mode != "fwdbwd":
        return "memory check: forward+backward only"
    if provider == "flex":
        if mode != "fwd":
            return "FlexAttention has no backward on CPU"
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError as exc:
            return f"FlexAttention cannot be imported ({exc})"
    if provider == "sdpa-loop" and case.head_dim_qk != case.head_dim_v:
        # SDPA's fused CPU kernel needs equal head dims: the math path keeps [H, L, L] scores,
        # their softmax and (backward) their gradient
        need = 3 * h * max(lens) ** 2 * ELT
        if need > BASELINE_BUDGET:
            return f"math path (Dv != Dqk) needs about {need / 2**30:.0f} GiB of [H, L, L] buffers"
    if provider == "sdpa-loop-padv" and case.head_dim_qk <= case.head_dim_v:
        return "applies only when Dqk > Dv"
    if provider == "sdpa-padded":
        if len(lens) == 1:
            return "one sequence: the same call as sdpa-loop"
        b, s = len(lens), max(lens)
        need = b * s * s * (1 + ELT) * (1 if case.head_dim_qk == case.head_dim_v else 3 * h)
        if need > BASELINE_BUDGET:
            return f"the [B, 1, S, S] mask (and math-path scores) need about {need / 2**30:.0f} GiB"
    return None


# ---- the worker: one (case, mode, provider) in this process


def _inputs(case: CpuCase, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(case.seqlens)

    def randn(h, d):
        return torch.randn(t, h, d, generator=gen).requires_grad_()

    q, k, v = randn(case.heads, case.head_dim_qk), randn(case.heads, case.head_dim_qk), randn(case.heads, case.head_dim_v)
    cu = torch.zeros(len(case.seqlens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(case.seqlens).cumsum(0)
    return q, k, v, cu


def _per_sequence(x: torch.Tensor, lens) -> list[torch.Tensor]:
    """[T, H, D] -> [1, H, L, D] views per sequence (split: one concatenating backward)."""
    return [t.transpose(0, 1).unsqueeze(0) for t in torch.split(x, list(lens))]


def _build(case: CpuCase, provider: str, q, k, v, cu) -> tuple[Callable[[], torch.Tensor], dict]:
    """The forward closure of a provider, returning [T, H, Dv] (flex: [1, H, T, Dv])."""
    lens, scale, causal = case.seqlens, 1.0 / math.sqrt(case.head_dim_qk), case.causal
    if provider == "coreattn":
        import coreattn

        return lambda: coreattn.varlen_attn(q, k, v, cu, cu, max(lens), max(lens), softmax_scale=scale,
                                            causal=causal, backend="torch"), {}
    if provider in ("sdpa-loop", "sdpa-loop-padv"):
        pad = case.head_dim_qk - case.head_dim_v if provider == "sdpa-loop-padv" else 0

        def loop():
            outs = []
            for qi, ki, vi in zip(_per_sequence(q, lens), _per_sequence(k, lens), _per_sequence(v, lens)):
                o = F.scaled_dot_product_attention(qi, ki, F.pad(vi, (0, pad)) if pad else vi, is_causal=causal,
                                                   scale=scale)
                outs.append(o[0, ..., :case.head_dim_v].transpose(0, 1))
            return torch.cat(outs)

        return loop, {}
    if provider == "sdpa-padded":
        b, s = len(lens), max(lens)
        pos = torch.arange(s)
        real = pos[None, :] < torch.tensor(lens)[:, None]  # [B, S]
        # padded keys are masked out; padded query rows keep their keys so no row is empty
        mask = real[:, None, None, :] & (pos[None, :] <= pos[:, None])[None, None] if causal else \
            real[:, None, None, :].expand(b, 1, s, s)
        mask = mask.contiguous()
        idx = real.reshape(-1).nonzero().squeeze(1)

        def padded():
            def pad(x):
                out = x.new_zeros(b * s, *x.shape[1:]).index_copy(0, idx, x)
                return out.view(b, s, *x.shape[1:]).transpose(1, 2)

            o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask, scale=scale)
            return o.transpose(1, 2).reshape(b * s, case.heads, -1).index_select(0, idx)

        return padded, {"mask": "[B, 1, S, S] bool", "padded_tokens": b * s}
    if provider == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))

        def document(b, h, qi, ki):
            same = doc[qi] == doc[ki]
            return same & (qi >= ki) if causal else same

        t = sum(lens)
        block_mask = create_block_mask(document, None, None, t, t, device="cpu")
        compiled = torch.compile(flex_attention, dynamic=False)
        qf, kf, vf = (x.detach().transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        return lambda: compiled(qf, kf, vf, block_mask=block_mask, scale=scale), {"compiled": True}
    raise ValueError(f"unknown provider {provider!r}")


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def run_worker(spec: dict) -> dict:
    import coreattn  # noqa: F401 (every worker holds the same modules, so RSS differences are the calls)

    case = CpuCase(**{**spec["case"], "seqlens": tuple(spec["case"]["seqlens"])})
    provider, mode, reps = spec["provider"], spec["mode"], spec["reps"]
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    q, k, v, cu = _inputs(case)
    fn, info = _build(case, provider, q, k, v, cu)
    leaves = [q, k, v]
    dout = torch.randn(sum(case.seqlens), case.heads, case.head_dim_v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")

        def call():
            for t in leaves:
                t.grad = None
            if mode == "fwd":
                with torch.no_grad() if provider == "flex" else torch.enable_grad():
                    fn()
            else:
                fn().backward(dout)

        call()  # warm-up (flex compiles here)
        for t in leaves:
            t.grad = None
        gc.collect()
        base = _status_kib("VmRSS")
        exact = _reset_peak()
        times = []
        start = time.perf_counter()
        while not times or len(times) < MAX_REPS:
            elapsed = time.perf_counter() - start
            if len(times) >= reps and elapsed >= MORE_REPS_S or elapsed >= TIME_BUDGET_S or (spec["quick"] and times):
                break
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
        peak = _status_kib("VmHWM")
    return {"ms": statistics.median(times), "ms_min": min(times), "ms_all": times,
            "peak_rss_mib": peak / 1024 if peak else None,
            "base_rss_mib": base / 1024 if base else None,
            "extra_mib": (peak - base) / 1024 if peak and base else None, "peak_reset": exact,
            "threads": torch.get_num_threads(), "info": info}


# ---- the parent: one subprocess per row


# glibc: blocks of 64 KiB and more are mmapped (returned to the system on free) and the heap is
# trimmed at every free, so the peak RSS follows what is live
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
# what a row keeps from its memory run (the time run gives the rest)
MEMORY_FIELDS = ("peak_rss_mib", "base_rss_mib", "extra_mib", "peak_reset", "peak_mib", "base_mib", "memory")


def child_env(memory: bool) -> dict:
    """A worker's environment: the checkout on PYTHONPATH and, for a memory run, ``MEMORY_ENV``; a
    time run gets the default allocator (the caller's own MALLOC_* settings removed). Under
    ``MEMORY_ENV`` every large allocation is a fresh mmap whose pages fault in anew: the sparse torch
    backend, which allocates per chunk, ran 3.4x slower under it, Megatron's few large buffers 1.4x."""
    env = {name: value for name, value in os.environ.items() if name not in MEMORY_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    if memory:
        env.update(MEMORY_ENV)
    return env


def worker_json(args: list[str], timeout: float, memory: bool) -> dict:
    """The last JSON line ``python ARGS`` printed in a fresh process, or {"error": its stderr's last line}."""
    try:
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO_ROOT,
                              env=child_env(memory), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"worker exit {proc.returncode}: {tail[:300]}"}
    return json.loads(lines[-1])


def worker_row(args: list[str], row: dict, timeout: float = 3600, memory_args: list[str] | None = None) -> dict:
    """``row`` with the result of ``python ARGS`` run twice in fresh processes: its time under the
    default allocator, its memory fields (``MEMORY_FIELDS``) from a second run (``memory_args``, by
    default the same) under ``MEMORY_ENV``. Status "ok", or "error" with the reason."""
    timed = worker_json(args, timeout, memory=False)
    if "error" in timed:
        return dict(row, status="error", reason=timed["error"])
    measured = worker_json(memory_args or args, timeout, memory=True)
    if "error" in measured:
        return dict(row, status="ok", memory_error=measured["error"],
                    **{k: v for k, v in timed.items() if k not in MEMORY_FIELDS})
    return dict(row, status="ok", **{k: v for k, v in timed.items() if k not in MEMORY_FIELDS},
                **{k: v for k, v in measured.items() if k in MEMORY_FIELDS})


def _run_child(spec: dict) -> dict:
    """A row's time (default allocator) and memory (``MEMORY_ENV``, one call) from two workers."""
    args = ["-m", "bench.cpu_attention", json.dumps(spec)]
    memory_args = ["-m", "bench.cpu_attention", json.dumps(dict(spec, reps=1, quick=True))]
    row = worker_row(args, {}, SUBPROCESS_TIMEOUT_S, memory_args)
    if row["status"] != "ok":
        raise RuntimeError(row["reason"])
    return {k: v for k, v in row.items() if k != "status"}


def run_cpu(cases: Iterable[CpuCase], providers: list[str], quick: bool, progress=None, modes=MODES,
            threads: int | None = None) -> list[dict]:
    """One row per (case, mode, provider); ``threads`` sets torch's thread count in the workers
    (default: torch's own choice)."""
    rows = []
    for case in cases:
        base = {"kind": "cpu", "config": case.id, "num_seqs": len(case.seqlens), "max_seqlen": max(case.seqlens),
                "total_tokens": sum(case.seqlens), "head_dim_qk": case.head_dim_qk, "head_dim_v": case.head_dim_v,
                "heads": case.heads, "causal": case.causal, "dtype": "float32", "memory_check": case.memory_check}
        for mode in modes:
            for provider in providers:
                reason = skip_reason(case, provider, mode)
                row = dict(base, mode=mode, provider=provider)
                if reason:
                    if not case.memory_check:  # the memory check runs two rows; it lists no skips
                        rows.append(dict(row, status="skipped", reason=reason))
                    continue
                spec = {"case": case._asdict(), "provider": provider, "mode": mode, "reps": 1 if quick else 3,
                        "quick": quick, "threads": threads}
                try:
                    row.update(status="ok", **_run_child(spec))
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    row.update(status="error", reason=str(exc).splitlines()[0][:300])
                rows.append(row)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix_str(f"cpu {case.id} {mode} {provider}"[:60], refresh=False)
    add_ratios(rows)
    return rows


def count(cases: Iterable[CpuCase], providers: list[str], modes=MODES) -> int:
    return sum(1 for c in cases for m in modes for p in providers if skip_reason(c, p, m) is None)


def add_ratios(rows: list[dict]) -> None:
    """On each coreattn row: the fastest PyTorch path of the same case and mode, and coreattn's
    time and peak-memory ratios to it (the issue's targets: both <= 1.5)."""
    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        if r["provider"] != "coreattn":
            continue
        if r["memory_check"] and r.get("peak_rss_mib"):
            r["under_memory_limit"] = r["peak_rss_mib"] < MEMORY_LIMIT_GIB * 1024
        rivals = [o for o in ok if o["config"] == r["config"] and o["mode"] == r["mode"] and o["provider"] in BASELINES]
        if not rivals:
            continue
        best = min(rivals, key=lambda o: o["ms"])
        r.update(best_pytorch=best["provider"], time_ratio=r["ms"] / best["ms"])
        if r.get("peak_rss_mib") and best.get("peak_rss_mib"):
            r["mem_ratio"] = r["peak_rss_mib"] / best["peak_rss_mib"]
            if r.get("extra_mib") and best.get("extra_mib"):
                r["extra_ratio"] = r["extra_mib"] / best["extra_mib"]


def main(argv: list[str]) -> int:
    print(json.dumps(run_worker(json.loads(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
