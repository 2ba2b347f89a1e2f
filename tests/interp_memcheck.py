"""Test-only address check for Triton's CPU interpreter: a load or store outside every tensor the kernel
was given fails, with the kernel, the program id and the source line.

Why: on a GPU a pipelined loop's loads become asynchronous copies (cp.async) that Triton issues ahead:
a prologue that runs even when the loop runs zero times, prefetches past its last iteration. A
masked-off cp.async still takes its address, and one outside the tensor faults (issue 30, an H100).
The interpreter reads host memory and never faults; its masked loads skip masked-off lanes. So every
address a kernel's loop forms must lie inside a tensor argument for every lane, masked or not (rows
clamped, masks on values), and outside loops for every lane the mask lets through.

How: ``install()`` wraps the interpreter (TRITON_INTERPRET=1) so that each launch records the byte
ranges of its tensor arguments' storages (a TensorDescriptor's base too), and each masked load and
store checks its addresses against them (the whole element). Mode (``COREATTN_MEMCHECK``):

- ``loops`` (default): every lane of a load or store that runs inside a runtime loop of the kernel
  (``range``, ``tl.range``, ``while``: what the pipeliner may prefetch; a caller's loop counts, the
  callee is inlined; ``tl.static_range`` is unrolled, not a loop), the live lanes elsewhere;
- ``strict``: every lane of every load and store;
- ``masked``: the lanes the mask lets through only (what the interpreter itself would touch);
- ``off``: no check.

Tensor-descriptor (TMA) loads and stores are bounds-checked by the hardware: only their in-bounds
lanes are checked. Atomics are not checked (the kernels use none). ``COREATTN_MEMCHECK_REPORT=PATH``
collects each distinct violation as a JSON line in PATH (kernel, source line, tensor, lanes, test)
instead of raising, to list them all in one run.

What it cannot see: an iteration the interpreter does not run (a pipelined prologue of a loop that
runs zero times, a prefetch past the last iteration; coreattn/tune/hazards.py finds the division
hazard there in the compiled code), and an address inside some other tensor argument's storage.

tests/conftest.py installs it under the interpreter; tests/kernels/test_interp_memcheck.py checks it. It
reads the interpreter's internals (``GridExecutor._init_args_hst`` and ``__call__``,
``InterpreterBuilder.create_masked_load``/``create_masked_store``, ``interpreter_builder.grid_idx``);
where a Triton lacks one, ``install`` raises naming the version and the missing piece.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import json
import os
import sys
import threading

import numpy as np

MODES = ("loops", "strict", "masked", "off")
ENV_MODE = "COREATTN_MEMCHECK"
ENV_REPORT = "COREATTN_MEMCHECK_REPORT"


class OutOfBounds(RuntimeError):
    """A load or store outside every tensor argument of the launch."""


class _Launch:
    """One kernel launch: its name and its tensor arguments' storage byte ranges."""

    def __init__(self, name: str):
        self.name = name
        self.starts = np.zeros(0, dtype=np.uint64)
        self.ends = np.zeros(0, dtype=np.uint64)
        self.names: list[str] = []

    def set_ranges(self, ranges: dict) -> None:
        """ranges: (start, end) -> argument names, storages of distinct allocations never overlap."""
        items = sorted(ranges.items())
        self.starts = np.array([lo for (lo, _), _ in items], dtype=np.uint64)
        self.ends = np.array([hi for (_, hi), _ in items], dtype=np.uint64)
        self.names = ["/".join(names) for _, names in items]

    def inside(self, addr: np.ndarray, size: int) -> np.ndarray:
        """Per address: the whole element lies inside one tensor argument's storage."""
        if not len(self.starts):
            return np.zeros(addr.shape, dtype=bool)
        idx = np.searchsorted(self.starts, addr, side="right").astype(np.int64) - 1
        safe = np.maximum(idx, 0)
        return (idx >= 0) & (addr + np.uint64(size) <= self.ends[safe])

    def target(self, addr: np.ndarray, ok: np.ndarray, live: np.ndarray, bad_addr: int) -> tuple[str, str]:
        """(the tensor argument the access aims at, where ``bad_addr`` lies relative to it): the
        storage most of the in-bounds live lanes hit (else of the in-bounds lanes), else the one
        just below the address (an overrun)."""
        if not len(self.starts):
            return "?", "no tensor argument"
        hits = addr[ok & live] if (ok & live).any() else addr[ok]
        idx = np.searchsorted(self.starts, hits, side="right") - 1
        if idx.size:
            i = int(np.bincount(idx).argmax())
        else:
            i = max(int(np.searchsorted(self.starts, np.uint64(bad_addr), side="right")) - 1, 0)
        lo, hi = int(self.starts[i]), int(self.ends[i])
        where = (f"{lo - bad_addr} bytes before the start of" if bad_addr < lo else
                 f"{bad_addr - hi} bytes past the end of")
        return self.names[i], f"{where} {self.names[i]} (a {hi - lo}-byte storage)"


class _State(threading.local):
    def __init__(self):
        self.launches: list[_Launch] = []
        self.descriptor = 0  # inside a tensor-descriptor (TMA) load or store


_STATE = _State()
_CONFIG = dict(mode="loops", report=None)
_ORIGINAL: dict = {}
_REPORTED: set = set()


def _interpreter():
    from triton.runtime import interpreter

    return interpreter


def _triton_dirs() -> tuple[str, ...]:
    import triton

    return (os.path.dirname(os.path.abspath(triton.__file__)) + os.sep, os.path.abspath(__file__),
            os.path.dirname(os.path.abspath(np.__file__)) + os.sep)


@functools.lru_cache(maxsize=None)
def _loop_lines(filename: str) -> frozenset:
    """Lines of ``filename`` inside the body of a runtime loop (for over anything but
    ``static_range``, while)."""
    try:
        with open(filename) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.For):
            call = node.iter.func if isinstance(node.iter, ast.Call) else None
            name = getattr(call, "attr", None) or getattr(call, "id", None)
            if name == "static_range":
                continue
        elif not isinstance(node, ast.While):
            continue
        for stmt in node.body:
            lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return frozenset(lines)


def _kernel_frames() -> list[tuple[str, int]]:
    """(file, line) of the running kernel's frames, innermost first: those between the
    interpreter's launch and this check, outside Triton, numpy and this module."""
    skip, launcher = _triton_dirs(), _interpreter().__file__
    frames, f = [], sys._getframe(2)
    while f is not None:
        code = f.f_code
        if code.co_filename == launcher and code.co_name == "__call__" and "self" in f.f_locals \
                and type(f.f_locals["self"]).__name__ == "GridExecutor":
            break
        if not code.co_filename.startswith(skip[0]) and code.co_filename not in skip[1:] \
                and not code.co_filename.startswith(skip[2]):
            frames.append((code.co_filename, f.f_lineno))
        f = f.f_back
    return frames


def _lanes(bad: np.ndarray) -> str:
    """Which lanes of a block, per axis: ``rows 12-15 x cols 0-63``-like index ranges."""
    if bad.ndim == 0:
        return "the scalar"
    parts = []
    for axis, idx in enumerate(np.nonzero(bad)):
        values = sorted(set(idx.tolist()))
        runs, start = [], values[0]
        for a, b in zip(values, values[1:] + [None]):
            if b != a + 1:
                runs.append(f"{start}" if start == a else f"{start}-{a}")
                start = b
        parts.append(f"axis {axis}: {','.join(runs[:4])}{',...' if len(runs) > 4 else ''}")
    return "; ".join(parts) + f" of a {'x'.join(map(str, bad.shape))} block"


def _check(ptrs, mask, kind: str) -> None:
    mode = _CONFIG["mode"]
    if mode == "off" or not _STATE.launches:
        return
    launch = _STATE.launches[-1]
    addr = np.asarray(ptrs.data).astype(np.uint64)
    size = np.dtype(_interpreter()._get_np_dtype(ptrs.get_element_ty())).itemsize
    ok = launch.inside(addr, size)
    if ok.all():  # the common case: no frame walk
        return
    live = np.ones(addr.shape, dtype=bool) if mask is None else np.broadcast_to(np.asarray(mask.data, bool),
                                                                                  addr.shape)
    frames = _kernel_frames()
    in_loop = any(line in _loop_lines(file) for file, line in frames)
    every_lane = not _STATE.descriptor and (mode == "strict" or (mode == "loops" and in_loop))
    bad = ~ok & (True if every_lane else live)
    if not bad.any():
        return
    grid = getattr(_interpreter().interpreter_builder, "grid_idx", None)
    source = " < ".join(f"{os.path.basename(file)}:{line}" for file, line in frames[:4]) or "?"
    first = int(addr[bad].flat[0])
    n_live = int((bad & live).sum())
    where = "inside a loop" if in_loop else "outside any loop"
    tensor, position = launch.target(addr, ok, live, first)
    record = dict(kernel=launch.name, kind=kind, source=source, tensor=tensor, position=position, where=where,
                  bad_lanes=int(bad.sum()), lanes=int(bad.size), live_bad_lanes=n_live, which=_lanes(bad),
                  program=list(grid) if grid is not None else None, mode=mode)
    message = (f"{kind} outside every tensor argument in kernel {launch.name}, program {record['program']}, at "
               f"{source} ({where}, memcheck mode {mode}): {record['bad_lanes']} of {record['lanes']} lanes, "
               f"{n_live} of them let through by the mask; the first is {position}; lanes {record['which']}")
    if _CONFIG["report"]:
        key = (launch.name, kind, source, tensor, where, n_live > 0)
        if key not in _REPORTED:
            _REPORTED.add(key)
            record["test"] = os.environ.get("PYTEST_CURRENT_TEST", "")
            with open(_CONFIG["report"], "a") as f:
                f.write(json.dumps(record) + "\n")
        return
    raise OutOfBounds(message)


def _storage_range(arg):
    if hasattr(arg, "untyped_storage"):
        s = arg.untyped_storage()
        return (s.data_ptr(), s.data_ptr() + s.nbytes()) if s.nbytes() else None
    return None


def _init_args_hst(self, args_dev, kwargs):
    args_hst, kwargs_hst = _ORIGINAL["_init_args_hst"](self, args_dev, kwargs)
    ranges: dict = {}

    def visit(name, a):
        if isinstance(a, (tuple, list)):
            for i, x in enumerate(a):
                visit(f"{name}[{i}]", x)
        elif hasattr(a, "base") and hasattr(a, "block_shape"):  # a TensorDescriptor
            visit(name, a.base)
        else:
            r = _storage_range(a)
            if r is not None:
                ranges.setdefault(r, []).append(name)

    for name, a in zip(getattr(self, "arg_names", []), args_hst):
        visit(name, a)
    for name, a in kwargs_hst.items():
        visit(name, a)
    if _STATE.launches:
        _STATE.launches[-1].set_ranges(ranges)
    return args_hst, kwargs_hst


def _call(self, *args, **kwargs):
    _STATE.launches.append(_Launch(getattr(self.fn, "__name__", "?")))
    try:
        return _ORIGINAL["__call__"](self, *args, **kwargs)
    finally:
        _STATE.launches.pop()


def _masked_load(self, ptrs, mask, *args, **kwargs):
    _check(ptrs, mask, "load")
    return _ORIGINAL["create_masked_load"](self, ptrs, mask, *args, **kwargs)


def _masked_store(self, ptrs, value, mask, *args, **kwargs):
    _check(ptrs, mask, "store")
    return _ORIGINAL["create_masked_store"](self, ptrs, value, mask, *args, **kwargs)


def _unmasked(name: str, kind: str):
    def wrapper(self, ptr, *args, **kwargs):
        _check(ptr, None, kind)
        return _ORIGINAL[name](self, ptr, *args, **kwargs)
    return wrapper


def _descriptor(name: str):
    def wrapper(self, *args, **kwargs):
        _STATE.descriptor += 1
        try:
            return _ORIGINAL[name](self, *args, **kwargs)
        finally:
            _STATE.descriptor -= 1
    return wrapper


def _missing() -> list[str]:
    it = _interpreter()
    needed = [(it, "GridExecutor"), (it, "InterpreterBuilder"), (it, "interpreter_builder"), (it, "_get_np_dtype")]
    found = [f"{getattr(o, '__name__', o)}.{n}" for o, n in needed if not hasattr(o, n)]
    if found:
        return found
    for cls, name in ((it.GridExecutor, "_init_args_hst"), (it.GridExecutor, "__call__"),
                      (it.InterpreterBuilder, "create_masked_load"), (it.InterpreterBuilder, "create_masked_store")):
        if name not in vars(cls):
            found.append(f"{cls.__name__}.{name}")
    return found


def install(mode: str | None = None, report: str | None = None) -> None:
    """Wrap the interpreter (idempotent); ``mode``/``report`` default to the environment's
    (``COREATTN_MEMCHECK``, ``COREATTN_MEMCHECK_REPORT``). Raises where TRITON_INTERPRET is not 1,
    for an unknown mode, or when this Triton's interpreter lacks what the check wraps."""
    import triton

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("interp_memcheck checks Triton's CPU interpreter only (TRITON_INTERPRET=1)")
    set_mode(mode or os.environ.get(ENV_MODE) or "loops", report if report is not None else os.environ.get(ENV_REPORT))
    missing = _missing()
    if missing:
        raise RuntimeError(f"interp_memcheck: the interpreter of Triton {triton.__version__} has no "
                           f"{', '.join(missing)}: the address check cannot run there (set {ENV_MODE}=off)")
    if _ORIGINAL:
        return
    it = _interpreter()
    executor, builder = it.GridExecutor, it.InterpreterBuilder
    patches = [(executor, "_init_args_hst", _init_args_hst), (executor, "__call__", _call),
               (builder, "create_masked_load", _masked_load), (builder, "create_masked_store", _masked_store)]
    for name, kind in (("create_load", "load"), ("create_store", "store")):  # older interpreters: not masked
        fn = vars(builder).get(name)
        if fn is not None and "create_masked_" not in inspect.getsource(fn):
            patches.append((builder, name, _unmasked(name, kind)))
    for name in ("create_descriptor_load", "create_descriptor_store", "create_descriptor_gather",
                 "create_descriptor_scatter"):
        if name in vars(builder):
            patches.append((builder, name, _descriptor(name)))
    for owner, name, fn in patches:
        _ORIGINAL[name] = getattr(owner, name)
        setattr(owner, name, fn)
    _ORIGINAL["_owners"] = [(owner, name) for owner, name, _ in patches]


def installed() -> bool:
    return bool(_ORIGINAL)


def uninstall() -> None:
    """Restore the interpreter's own functions."""
    for owner, name in _ORIGINAL.pop("_owners", []):
        setattr(owner, name, _ORIGINAL.pop(name))
    _ORIGINAL.clear()


def set_mode(mode: str, report: str | None = None) -> None:
    mode = mode.strip().lower()
    mode = {"0": "off", "1": "loops", "": "loops"}.get(mode, mode)
    if mode not in MODES:
        raise ValueError(f"{ENV_MODE}={mode!r}: expected one of {MODES}")
    _CONFIG.update(mode=mode, report=report or None)


def mode() -> str:
    return _CONFIG["mode"]


@contextlib.contextmanager
def checking(mode: str, report: str | None = None):
    """Inside, the check runs in ``mode`` (collecting into ``report`` if given), installed for the
    duration if it was not."""
    saved, was = dict(_CONFIG), installed()
    install(mode, report or "")
    try:
        yield
    finally:
        _CONFIG.update(saved)
        if not was:
            uninstall()
