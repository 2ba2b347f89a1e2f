"""Tuning on the local GPU: compile-check, time, rank, accept, and write the cache.

For each (kernel, class) task (coreattn/tune/space.py) every candidate is launched once through
the real launchers with its config forced; one that fails to compile, spills registers (the
compiled kernel's ``n_spills``) or does not fit shared memory is dropped. The rest are timed on
every batch (coreattn/tune/batches.py) by the injected ``timer``, each with the other kernels held
at their shipped configs: the forward op for the forward's candidates, the backward op (preprocess,
dK/dV and dQ kernels) for the backward's, so a time is an op's time. Candidates are ranked by the
geometric mean over the batches of their time ratio to the shipped config; from the best down,
the first that beats the shipped config by ``min_speedup`` and passes the acceptance check
(coreattn/tune/accept.py) is the class's entry. None: the shipped config stays, and no entry is
written. ``select`` is that ranking alone (pure; tests give it times).
"""

from __future__ import annotations

import math
import time
from typing import Callable, NamedTuple

import torch

from coreattn.kernels import varlen_attn_bwd, varlen_attn_fwd
from coreattn.kernels.configs.base import AttnConfig
from coreattn.kernels.configs.pick import forced_configs
from coreattn.kernels.configs.targets import target_of
from coreattn.kernels.dropout import rng_state
from coreattn.kernels.tuned_cache import KernelClass, config_to_json
from coreattn.selfcheck.faults import KERNEL_NAMES, device_healthy, is_device_fault
from coreattn.tune import compiler
from coreattn.tune.accept import DTYPES, accept
from coreattn.tune.batches import GQA_GROUP, HEADS_Q, Batch, make_tensors
from coreattn.tune.space import KernelTask, describe_config, kernel_candidates, shipped_configs

KERNEL_FNS = {kernel: fn for fn, kernel in KERNEL_NAMES.items()}
MIN_SPEEDUP = 1.02  # below this a "win" is within the timing noise of a median


class TimingCase(NamedTuple):
    """What a timer is asked to time (an injected test timer reads it; the GPU timer ignores it)."""
    kernel: str
    cls: str
    config: AttnConfig
    batch: str


Timer = Callable[[Callable[[], object], TimingCase], float]  # returns milliseconds


def gpu_timer(quick: bool = False) -> Timer:
    """triton.testing.do_bench's median (it flushes L2 between runs)."""
    from triton.testing import do_bench

    warmup, rep = (10, 40) if quick else (25, 100)
    return lambda fn, case: do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


class Ranked(NamedTuple):
    config: AttnConfig
    speedup: float  # over the shipped config: geometric mean over batches of shipped ms / candidate ms
    ms: dict  # batch -> ms


def select(times: dict, shipped: AttnConfig) -> list[Ranked]:
    """Candidates (``times``: config -> {batch: ms}, the shipped one included) ranked best first by
    their geometric-mean speedup over ``shipped`` on the batches both were timed on."""
    base = times[shipped]
    ranked = []
    for cfg, ms in times.items():
        common = [b for b in base if b in ms and ms[b] > 0 and base[b] > 0]
        if not common:
            continue
        speedup = math.exp(sum(math.log(base[b] / ms[b]) for b in common) / len(common))
        ranked.append(Ranked(cfg, speedup, dict(ms)))
    return sorted(ranked, key=lambda r: (-r.speedup, r.config != shipped))


class TaskResult(NamedTuple):
    task: KernelTask
    shipped: AttnConfig
    chosen: AttnConfig  # == shipped when no candidate qualified
    speedup: float
    ms_shipped: dict
    ms_chosen: dict
    notes: list  # why candidates were dropped or rejected
    failed: str | None = None  # why the task could not be tuned (its shipped config faulted): no entry, keep old ones

    @property
    def entry(self) -> dict | None:
        """The cache file's entry (None: keep the shipped config)."""
        if self.chosen == self.shipped:
            return None
        return {"kernel": self.task.kernel, "class": self.task.cls.id, "config": config_to_json(self.chosen),
                "shipped": config_to_json(self.shipped), "speedup": round(self.speedup, 4),
                "ms": {b: round(t, 5) for b, t in self.ms_chosen.items()},
                "ms_shipped": {b: round(t, 5) for b, t in self.ms_shipped.items()}}


def make_op(kernel: str, cls: KernelClass, batch: Batch, device: torch.device) -> Callable[[], object]:
    """The op a candidate of ``kernel`` is timed in on ``batch``: the forward, or the backward on the
    forward's outputs (computed once, at the shipped configs)."""
    heads_kv = HEADS_Q // GQA_GROUP if cls.gqa else HEADS_Q
    t = make_tensors(batch, cls.dim_qk, cls.dim_v, DTYPES[cls.dtype], heads_kv, device)
    scale, right = cls.dim_qk ** -0.5, 0 if cls.causal else -1
    extra = dict(dropout_p=0.1, rng_state=rng_state(device)) if "dropout" in cls.features else {}
    offset = torch.zeros(HEADS_Q, device=device) if "sink" in cls.features else None

    def forward():
        return varlen_attn_fwd(t.q, t.k, t.v, t.pack, t.pack, t.max_seqlen, scale, -1, right, True, **extra,
                               softmax_offset=offset, return_max_logit="max_logit" in cls.features)

    if kernel == "fwd":
        return forward
    with forced_configs(**shipped_configs(target_of(device), cls)):
        out, lse, *_ = forward()
    rowsum = torch.zeros_like(lse) if offset is not None else None

    def backward():
        if rowsum is not None:
            rowsum.zero_()
        return varlen_attn_bwd(t.dout, t.q, t.k, t.v, out, lse, t.pack, t.pack, t.max_seqlen, t.max_seqlen, scale, -1,
                               right, True, **extra, sink_rowsum=rowsum)

    return backward


def compile_check(kernel: str, op: Callable[[], object], configs: dict) -> str | None:
    """Launch ``op`` once with ``configs`` forced; why ``kernel``'s candidate is unusable (does not
    compile or load, spills), or None. On a GPU the compiled kernel knows its spills."""
    try:
        with compiler.captured_launches() as launches, forced_configs(**configs):
            op()
    except Exception as exc:
        if is_device_fault(exc) or not device_healthy(_used_device()):
            raise  # not a compile failure: the process's device is unusable (coreattn/tune/isolated.py)
        return f"does not compile or load: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1][:160]}"
    spills = [getattr(launch["kernel"], "n_spills", 0) or 0 for launch in launches
              if launch["fn"] == KERNEL_FNS[kernel]]
    if any(spills):
        return f"spills registers ({max(spills)} bytes)"
    return None


def _used_device() -> torch.device:
    """The device to check after a failed compile check: CUDA once this process has used it."""
    used = torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.device("cuda" if used else "cpu")


def tune_task(task: KernelTask, device: torch.device, batches: list[Batch], timer: Timer, *,
              candidates: list[AttnConfig] | None = None, min_speedup: float = MIN_SPEEDUP, accept_lens=None,
              progress=None, watch=None) -> TaskResult:
    """One (kernel, class): compile-check, time, rank and accept (see the module docstring).
    ``candidates``: the list to try (default: the target's space; the shipped config first). One
    batch's tensors are alive at a time. ``watch(phase, config, batch)`` is told before each step:
    ``setup`` (the batch's inputs, at the shipped configs), ``compile``, ``time``, ``accept``
    (coreattn/tune/isolated.py's worker reports it, so a fault drops the right candidate)."""
    target = target_of(device)
    shipped_all = shipped_configs(target, task.source)
    cands = candidates if candidates is not None else kernel_candidates(target, task.kernel, task.source)
    shipped = shipped_all[task.kernel]
    if shipped not in cands:
        cands = [shipped, *cands]
    notes, times = [], {cfg: {} for cfg in cands}
    step = progress or (lambda n=1, note="": None)
    watch = watch or (lambda phase, cfg, batch=None: None)
    for i, batch in enumerate(batches):
        watch("setup", shipped, batch.name)
        op = make_op(task.kernel, task.source, batch, device)
        for cfg in list(times):
            configs = dict(shipped_all, **{task.kernel: cfg})
            if i == 0:
                watch("compile", cfg, batch.name)
                why = compile_check(task.kernel, op, configs)
                step(1, f"{task.kernel} {task.cls.id}")
                if why is not None:
                    if cfg == shipped:
                        raise RuntimeError(f"{task.kernel} {task.cls.id}: the shipped config {describe_config(cfg)} "
                                           f"{why}")
                    notes.append(f"{describe_config(cfg)}: {why}")
                    del times[cfg]
                    step(len(batches))
                    continue
            watch("time", cfg, batch.name)
            with forced_configs(**configs):
                times[cfg][batch.name] = timer(op, TimingCase(task.kernel, task.cls.id, cfg, batch.name))
            step(1)
        del op
        if device.type == "cuda":
            torch.cuda.empty_cache()
    chosen, speedup = shipped, 1.0
    for ranked in select(times, shipped):
        if ranked.config == shipped or ranked.speedup < min_speedup:
            break
        watch("accept", ranked.config)
        verdict = accept(task.kernel, task.source, ranked.config, shipped_all, device, accept_lens)
        if verdict.passed:
            chosen, speedup = ranked.config, ranked.speedup
            break
        notes.append(f"{describe_config(ranked.config)} ({ranked.speedup:.2f}x) rejected: {verdict.note}")
    return TaskResult(task, shipped, chosen, speedup, times[shipped], times[chosen], notes)


def steps(n_candidates: int, n_batches: int) -> int:
    """Progress steps of a task: a compile check and a timing per batch for each candidate."""
    return n_candidates * (1 + n_batches)


def estimate_seconds(n_candidates: int, n_batches: int, quick: bool) -> float:
    """A first guess at the run time (the progress bar refines it): compiling a candidate takes a
    few seconds of CPU, timing one op on one batch about half a second (do_bench's warmup and rep)."""
    compile_s, time_s = 6.0, (0.15 if quick else 0.4)
    return n_candidates * (compile_s + n_batches * time_s)


class Progress:
    """tqdm when installed, else a line every ~10 s with the elapsed time and an estimate."""

    def __init__(self, total: int, desc: str = "tune"):
        self.total, self.done, self.start, self.last = total, 0, time.monotonic(), 0.0
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)

    def __call__(self, n: int = 1, note: str = ""):
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            if note:
                self.bar.set_postfix_str(note[:50], refresh=False)
            return
        now = time.monotonic()
        if now - self.last >= 10 or self.done >= self.total:
            self.last = now
            elapsed = now - self.start
            left = elapsed / max(self.done, 1) * (self.total - self.done)
            print(f"  [{self.done}/{self.total}] {elapsed / 60:.1f} min elapsed, about {left / 60:.1f} min left {note}",
                  flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
