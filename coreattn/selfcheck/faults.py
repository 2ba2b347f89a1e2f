"""Work that may crash its process, run in child processes that say what they were launching.

A CUDA fault (an illegal memory access, say) poisons the process it happens in: every later CUDA
call there fails, so one bad kernel hides everything that runs after it. The self-check, the
benchmark suite (``bench/``) and the tuner therefore run their units of work in child processes,
and for a child that faulted, died or hung they name the Triton kernel it was launching and the
launch config. This module is what they share:

- **child side**: ``EventLog`` appends JSON lines to a file (flushed per line, so they survive the
  process); ``launch_trace`` records every Triton launch there *before* it runs (kernel, class,
  grid, block sizes, warps, stages and the config's source: shipped table or tuned file) and, with
  ``sync``, synchronizes after it, so that an asynchronous fault surfaces at the launch that caused
  it; ``is_device_fault`` and ``device_healthy`` tell a poisoned process from an ordinary error.
- **parent side**: ``Child`` runs a command with its output in a log file, its events file and a
  deadline; ``read_events`` and ``culprit`` find the launch that did not finish; ``exit_reason``
  and ``describe_launch`` put it in words; ``sanitizer_hint`` is the compute-sanitizer command line
  that reruns one unit alone.
- **test-only fault injection**: ``COREATTN_INJECT_FAULT=KIND@WHERE`` makes a child fault at a
  traced launch or a named site (``inject``), so the isolation is tested without a GPU.

Nothing here runs at import or touches CUDA unless a launch is traced on a CUDA device.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

KERNEL_NAMES = {"_varlen_attn_fwd_kernel": "fwd", "_attn_bwd_dkdv_kernel": "dkdv", "_attn_bwd_dq_kernel": "dq",
                "_attn_bwd_preprocess_kernel": "preprocess"}  # Triton function -> the config tables' kernel name
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg", "num_ctas")
SHOWN = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "maxnreg", "TMA", "WARP_SPEC", "PERSISTENT", "DK", "DV")
INJECT_ENV = "COREATTN_INJECT_FAULT"
INJECT_KINDS = ("abort", "segfault", "cuda-error", "hang")
# messages of the CUDA/HIP errors that leave the context unusable (sticky), as torch and Triton word them
STICKY = ("illegal memory access", "illegal address", "illegal instruction", "misaligned address",
          "unspecified launch failure", "device-side assert", "an illegal", "hardware exception",
          "Triton Error [CUDA]", "Triton Error [HIP]", "CUDA error: unknown error", "launch timed out")


class InjectedDeviceFault(RuntimeError):
    """Raised by ``inject`` for ``cuda-error``: stands for torch.AcceleratorError after a kernel fault."""


_POISONED_BY_INJECTION = False


# ---- child side

class EventLog:
    """Appends one JSON object per line to ``path``; each line is flushed as it is written, so a
    process that dies leaves every line it wrote."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file = open(self.path, "a", buffering=1)

    def write(self, **fields) -> None:
        self._file.write(json.dumps(fields, default=str) + "\n")
        self._file.flush()


def _plain(value):
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)


def _grid(grid):
    if isinstance(grid, tuple) and all(isinstance(g, int) for g in grid):
        return list(grid)
    return str(grid)


def _match_use(uses: dict, kernel: str | None, config: dict):
    """The ConfigUse the launcher picked for this launch: same kernel, tile and warps (the last one)."""
    found = None
    for use in uses.values():
        cfg = use.config
        if use.kernel == kernel and cfg.block_m == config.get("BLOCK_M") and cfg.num_warps == config.get("num_warps") \
                and (not cfg.block_n or cfg.block_n == config.get("BLOCK_N")):
            found = use
    return found


def describe(fn_name: str, grid, kwargs: dict, uses: dict) -> dict:
    """A launch as the events file records it: Triton function, the tables' kernel name, grid, the
    constexprs and launch options passed by name, and the picked config's class and source."""
    kernel = KERNEL_NAMES.get(fn_name)
    config = {k: _plain(v) for k, v in kwargs.items()
              if k in LAUNCH_OPTIONS or (k.isupper() and isinstance(v, (bool, int, str)))}
    use = _match_use(uses, kernel, config) if kernel else None
    return {"fn": fn_name, "kernel": kernel or fn_name, "class": use.cls if use else None, "grid": _grid(grid),
            "config": config, "source": use.source if use else None}


class Trace:
    """What ``launch_trace`` yields: the launch in flight (``current``), the last one begun, and
    two settings its owner may change as it goes: ``site`` (the place in words, for ``inject``) and
    ``enabled`` (False: launches pass untraced and unsynced, e.g. while the tuner times them)."""

    def __init__(self, site: str = ""):
        self.current: dict | None = None
        self.last: dict | None = None
        self.count = 0
        self.site = site
        self.enabled = True


def _kernel_classes():
    import triton.runtime.jit as jit

    classes = [jit.JITFunction]
    interpreter = sys.modules.get("triton.runtime.interpreter")  # loaded only under TRITON_INTERPRET=1
    if interpreter is not None:
        classes.append(interpreter.InterpretedFunction)
    return classes


@contextlib.contextmanager
def launch_trace(log: EventLog | None = None, sync: bool = True, site: str = ""):
    """Inside, every Triton launch (compiled or interpreted; not compile-only warmups) is recorded
    before it runs: written to ``log`` as a ``launch`` event, ``launch-done`` after it, or
    ``launch-error`` with the exception; ``sync`` synchronizes the device after each CUDA launch,
    so a fault raises at the launch that caused it (never on hot paths: only the self-check's,
    bench's and tuner's children trace). ``site`` words the place for ``inject`` (``<site> launch
    <kernel>``; the yielded ``Trace``'s ``site`` may change it later)."""
    from coreattn.kernels.configs.pick import record_configs

    trace = Trace(site)
    saved = [(cls, cls.__dict__.get("run")) for cls in _kernel_classes()]

    def wrap(real):
        def run(self, *args, grid, warmup, **kwargs):
            if warmup or not trace.enabled:
                return real(self, *args, grid=grid, warmup=warmup, **kwargs)
            launch = describe(self.__name__, grid, kwargs, uses)
            trace.count += 1
            launch["n"] = trace.count
            trace.current = trace.last = launch
            if log is not None:
                log.write(event="launch", **launch)
            try:
                inject(f"{trace.site} launch {launch['kernel']}")
                result = real(self, *args, grid=grid, warmup=warmup, **kwargs)
                if sync:
                    _synchronize(args, kwargs)
            except BaseException as exc:
                if log is not None:
                    log.write(event="launch-error", n=launch["n"], error=short_error(exc))
                raise
            trace.current = None
            if log is not None:
                log.write(event="launch-done", n=launch["n"])
            return result

        return run

    with record_configs() as uses:
        for cls, real in saved:
            cls.run = wrap(real if real is not None else cls.run)
        try:
            yield trace
        finally:
            for cls, real in saved:
                if real is None:
                    del cls.run
                else:
                    cls.run = real


def _synchronize(args, kwargs) -> None:
    import torch

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            if value.device.type == "cuda":
                torch.cuda.synchronize(value.device)
            return


def short_error(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:300]}"


def is_device_fault(exc: BaseException) -> bool:
    """A CUDA/HIP error that leaves the process's device context unusable (torch.AcceleratorError,
    Triton's CUDA errors, the sticky error messages), or one ``inject`` raised."""
    import torch

    if isinstance(exc, InjectedDeviceFault):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return any(s in text for s in STICKY)


def device_healthy(device) -> bool:
    """Can this process still use ``device``? After a CUDA fault every call fails, synchronize
    included (the check is a host sync: call it after an error, never on a hot path)."""
    if _POISONED_BY_INJECTION:
        return False
    if getattr(device, "type", device) != "cuda":
        return True
    import torch

    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
    except Exception:
        return False
    return True


def traceback_tail(exc: BaseException, lines: int = 12) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-lines:])


# ---- test-only fault injection

def inject(site: str) -> None:
    """Test-only: fault here if ``COREATTN_INJECT_FAULT`` says so: ``KIND@WHERE``, several separated
    by ``;``. WHERE's words must be words of ``site``, in the same order (e.g.
    ``abort@hdim64-causal-qk-lens-differ launch dkdv``); KIND is ``abort`` (SIGABRT, as a driver
    abort), ``segfault`` (SIGSEGV), ``cuda-error`` (raises InjectedDeviceFault and poisons the
    process for ``device_healthy``) or ``hang``."""
    spec = os.environ.get(INJECT_ENV)
    if not spec:
        return
    words = site.split()
    for one in filter(None, (s.strip() for s in spec.split(";"))):
        kind, _, where = one.partition("@")
        if kind not in INJECT_KINDS:
            raise ValueError(f"{INJECT_ENV}: kind {kind!r} is not one of {INJECT_KINDS}")
        if _in_order(where.split(), words):
            _fault(kind, site)


def _in_order(wanted: list[str], words: list[str]) -> bool:
    """Are ``wanted`` words of ``words``, in this order (not necessarily adjacent)?"""
    it = iter(words)
    return all(any(w == x for x in it) for w in wanted)


def _fault(kind: str, site: str) -> None:
    sys.stderr.write(f"{INJECT_ENV}: injecting {kind} at '{site}'\n")
    sys.stderr.flush()
    if kind == "abort":
        os.abort()
    elif kind == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(60)  # the signal is delivered on return to the interpreter
    elif kind == "hang":
        while True:
            time.sleep(3600)
    global _POISONED_BY_INJECTION
    _POISONED_BY_INJECTION = True
    raise InjectedDeviceFault(f"CUDA error: an illegal memory access was encountered (injected by {INJECT_ENV})")


# ---- parent side

def read_events(path: str | os.PathLike) -> list[dict]:
    """Every complete JSON line of an events file (a line cut short by a dying process is skipped)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return []
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def culprit(events: list[dict]) -> dict | None:
    """The launch a dead or faulted child was in: the one that raised, else the last one begun that
    did not finish; None if every launch finished (then ``last_launch`` names the last one)."""
    done, begun, failed = set(), {}, None
    for ev in events:
        if ev.get("event") == "launch":
            begun[ev["n"]] = ev
        elif ev.get("event") == "launch-done":
            done.add(ev["n"])
        elif ev.get("event") == "launch-error":
            failed = begun.get(ev["n"], failed)
    if failed is not None:
        return failed
    open_ = [ev for n, ev in begun.items() if n not in done]
    return open_[-1] if open_ else None


def last_launch(events: list[dict]) -> dict | None:
    launches = [ev for ev in events if ev.get("event") == "launch"]
    return launches[-1] if launches else None


def where(events: list[dict], untraced: str = "") -> tuple[dict | None, str]:
    """The launch a failed child was in (``culprit``) and, in words, which kernel launch that was:
    ``dkdv (...): BLOCK_M=...``, or that none was in flight (and the last one traced, if any).
    ``untraced`` says what ran untraced, if anything did (the bench's timed runs)."""
    launch = culprit(events)
    if launch:
        return launch, describe_launch(launch)
    last = last_launch(events)
    note = f" ({untraced})" if untraced else ""
    if last:
        return None, f"none in flight{note}; the last one traced: {describe_launch(last)}"
    return None, f"none traced yet{note}"


def describe_launch(launch: dict | None) -> str:
    """``dkdv (_attn_bwd_dkdv_kernel) hdim192x128-bf16-causal-gqa: BLOCK_M=32 BLOCK_N=64 num_warps=4
    num_stages=2 ..., grid [132, 2, 1]; shipped table (sm90)``."""
    if not launch:
        return "no kernel launch in flight"
    config = launch.get("config") or {}
    shown = " ".join(f"{k}={config[k]}" for k in SHOWN if k in config)
    cls = f" {launch['class']}" if launch.get("class") else ""
    source = f"; {launch['source']}" if launch.get("source") else ""
    return f"{launch['kernel']} ({launch['fn']}){cls}: {shown}, grid {launch.get('grid')}{source}"


def exit_reason(returncode: int | None, timed_out: bool = False, timeout: float | None = None) -> str:
    if timed_out:
        return f"timed out after {timeout:g} s (killed)" if timeout else "timed out (killed)"
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exit status {returncode}"


def sanitizer_hint(command: str) -> str:
    """The compute-sanitizer command line that reruns ``command`` (one unit, in one process)."""
    return f"compute-sanitizer --tool memcheck {command}"


def child_env(extra: dict | None = None, drop: tuple[str, ...] = ()) -> dict:
    """This process's environment for a child, with coreattn importable from the same place (a
    checkout on ``sys.path`` by cwd or PYTHONPATH is not always the child's)."""
    import site

    import coreattn

    env = {k: v for k, v in os.environ.items() if k not in drop}
    root = str(Path(coreattn.__file__).resolve().parents[1])
    installed = {str(Path(p).resolve()) for p in site.getsitepackages() + [site.getusersitepackages()]}
    if root not in installed:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


class Child:
    """A child process (``argv``) whose stdout and stderr go to ``log`` and whose events go to
    ``events``; ``poll`` kills it once ``timeout`` seconds have passed since it started (or since
    ``touch``)."""

    def __init__(self, argv: list[str], events: Path, log: Path, env: dict | None = None, cwd=None,
                 timeout: float | None = None):
        self.argv, self.events, self.log, self.timeout = argv, Path(events), Path(log), timeout
        self.events.touch()
        self._log = open(self.log, "wb")
        self.start = self.touched = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=cwd, start_new_session=True)
        self.timed_out = False
        self.wall_s = None
        self._offset = 0

    def touch(self) -> None:
        """Restart the timeout (a worker that reports progress is not hung)."""
        self.touched = time.monotonic()

    def poll(self, deadline: float | None = None) -> int | None:
        """The exit status once it has exited (killed on its timeout or at ``deadline``, a
        time.monotonic() value), else None."""
        rc = self.proc.poll()
        now = time.monotonic()
        if rc is None and ((self.timeout and now - self.touched > self.timeout) or (deadline and now > deadline)):
            self.kill()
            self.timed_out = True
            rc = self.proc.wait()
        if rc is not None and self.wall_s is None:
            self.wall_s = now - self.start
            self._log.close()
        return rc

    def wait(self, deadline: float | None = None, interval: float = 0.05) -> int:
        while (rc := self.poll(deadline)) is None:
            time.sleep(interval)
        return rc

    def kill(self) -> None:
        """SIGKILL to the child's process group (its own children too)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.proc.kill()

    def new_events(self) -> list[dict]:
        """Events written since the last call (complete lines only)."""
        try:
            with open(self.events, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def output_tail(self, chars: int = 2000) -> str:
        try:
            data = self.log.read_bytes()
        except OSError:
            return ""
        return data[-chars:].decode(errors="replace")

    def reason(self) -> str:
        return exit_reason(self.proc.returncode, self.timed_out, self.timeout)
