"""Timing: triton.testing.do_bench medians on GPU, a plain wall-clock median on CPU.

Callers pass several input sets; the timed function cycles through them so that a set is not
re-read straight from cache (do_bench also flushes L2 before every run).
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from typing import Callable, NamedTuple, Sequence

import torch

from coreattn.kernels.config import record_configs

_UNTIMED = [contextlib.nullcontext]  # what wraps an ``untimed`` block (bench/isolation.py's worker: a launch trace)


class Timing(NamedTuple):
    ms: float  # median
    ms_p20: float
    ms_p80: float
    method: str


def rotating(calls: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs ``calls[0]``, ``calls[1]``, ... in turn."""
    order = itertools.cycle(calls)
    return lambda: next(order)()


def time_gpu(fn: Callable[[], object], grad_to_none=None, quick: bool = False) -> Timing:
    from triton.testing import do_bench

    warmup, rep = (5, 20) if quick else (25, 100)
    p20, p50, p80 = do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, quantiles=[0.2, 0.5, 0.8])
    return Timing(p50, p20, p80, f"triton.testing.do_bench(warmup={warmup}ms, rep={rep}ms), median")


# CPU warm-up before timing: at least this many calls, and calls until this much time has passed. A
# process's first calls cost more than the rest for a while (lazy imports, the first custom-op call,
# heap growth, thread pools): one warm-up call left the first coreattn row of ``--quick`` (its
# forward) timed at 43.7 ms against 8.6 ms for forward + backward of the same config, whose mode
# happens to make more untimed calls first.
WARMUP_CALLS = 3
WARMUP_S = 0.25
WARMUP_MAX_CALLS = 100


def warm_up(fn: Callable[[], object], grad_to_none=None, min_calls: int = WARMUP_CALLS, min_s: float = WARMUP_S,
            max_calls: int = WARMUP_MAX_CALLS) -> int:
    """Calls ``fn`` at least ``min_calls`` times and until ``min_s`` seconds have passed (at most
    ``max_calls`` times); returns the number of calls."""
    start, calls = time.perf_counter(), 0
    while calls < min_calls or (time.perf_counter() - start < min_s and calls < max_calls):
        for t in grad_to_none or ():
            t.grad = None
        fn()
        calls += 1
    return calls


def time_cpu(fn: Callable[[], object], grad_to_none=None, quick: bool = False) -> Timing:
    reps = 3 if quick else 10
    warmups = warm_up(fn, grad_to_none)
    samples = []
    for _ in range(reps):
        for t in grad_to_none or ():
            t.grad = None
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    q = statistics.quantiles(samples, n=5, method="inclusive")
    return Timing(statistics.median(samples), q[0], q[3],
                  f"time.perf_counter, {reps} runs after {warmups} warm-up calls, median")


def time_fn(fn: Callable[[], object], device: torch.device, grad_to_none=None, quick: bool = False) -> Timing:
    if device.type == "cuda":
        return time_gpu(fn, grad_to_none, quick)
    return time_cpu(fn, grad_to_none, quick)


@contextlib.contextmanager
def kernel_configs(row: dict):
    """Inside, every launch config coreattn's Triton kernels pick is recorded into
    ``row["kernel_configs"]`` (kernel, launch class, config, source: shipped table or tuned file)."""
    with record_configs() as uses:
        try:
            yield
        finally:
            row["kernel_configs"] = [use.as_json() for use in uses.values()]


def trace_untimed(factory: Callable[[], contextlib.AbstractContextManager]) -> None:
    """From now on ``factory()`` wraps every ``untimed`` block (bench/isolation.py's worker passes a
    launch trace; contextlib.nullcontext restores the default)."""
    _UNTIMED[0] = factory


@contextlib.contextmanager
def untimed():
    """Around building a row's inputs and one untimed call of what is then timed: in an isolated
    worker (bench/isolation.py) every kernel launch in here is recorded before it runs and synced
    after it, so that a fault names its kernel and config. Timed calls are never traced."""
    with _UNTIMED[0]():
        yield
