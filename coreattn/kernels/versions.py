"""Which Triton releases coreattn is tested with, and what Triton's CPU interpreter needs.

Users get the Triton their torch CUDA wheel pins: torch 2.11 -> triton 3.6.0, torch 2.12 and 2.13
-> 3.7.1, torch 2.14 -> 3.8.x, torch 2.15 -> 3.9.x; an unpinned ``pip install triton`` next to
torch's CPU build gets the newest (3.9.0). CI (.ci/run) runs the kernels under each of ``TESTED_TRITON``'s interpreters and
compiles them for sm90 with each; ``MIN_TRITON``, the oldest, is pyproject's floor.

- ``warn_if_old_triton()``, at ``import coreattn.kernels``: an upstream Triton older than
  ``MIN_TRITON`` gets one ``UnsupportedTritonWarning`` naming the tested range (a warning, not an
  error: the torch backend needs no particular Triton, and an older Triton may still work). Not
  for triton-ascend, which reports its base version (3.2) and has its own CI lane.
- ``check_interpreter()``, before the first interpreted launch (``target_of``,
  kernels/configs/targets.py): runs a one-loop probe kernel once per process. Triton 3.6's interpreter (and older ones) turns a scalar,
  which it keeps as a 1-element numpy array, into a Python int with ``int(array)``, for every
  ``range()`` over a runtime int; numpy 2.4 removed that conversion for arrays of ndim > 0
  (deprecated since 1.25), so every such loop raised ``TypeError: only 0-dimensional arrays can be
  converted to Python scalars`` from inside Triton. Triton 3.7 squeezes the array first. The probe
  turns that into a RuntimeError naming the fix (numpy<2.4, or Triton >= 3.7).
"""

from __future__ import annotations

import functools
import re
import sys
import warnings

import triton

MIN_TRITON = "3.6.0"
TESTED_TRITON = ("3.6.0", "3.7.1", "3.8.0", "3.9.0")  # the CI lanes' Triton releases (.ci/run)
NUMPY_FIX = "numpy<2.4"


class UnsupportedTritonWarning(UserWarning):
    """The installed Triton is older than any coreattn is tested with."""


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "3.7.1+git1234" -> (3, 7, 1), "3.10.0rc1" -> (3, 10, 0)."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if not match:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part or 0) for part in match.groups())


def tested_range() -> str:
    return f"Triton {MIN_TRITON} and newer (CI: {', '.join(TESTED_TRITON)})"


def old_triton_message(version: str, distribution: str | None) -> str | None:
    """The warning for Triton ``version`` from ``distribution``, or None when it is not older than
    MIN_TRITON (or is triton-ascend, or a version that does not parse)."""
    if distribution == "triton-ascend":
        return None
    try:
        if release(version) >= release(MIN_TRITON):
            return None
    except ValueError:
        return None
    return (f"coreattn is tested with {tested_range()}; this is Triton {version}, whose compiler and "
            f"interpreter may fail on coreattn's kernels or compile them differently (spills, shared memory). "
            f"Install triton>={MIN_TRITON} (torch 2.11's CUDA build pins 3.6.0, 2.13's 3.7.1), or use backend='torch'.")


def warn_if_old_triton() -> None:
    """One UnsupportedTritonWarning when the imported Triton is an upstream release older than MIN_TRITON."""
    version = getattr(triton, "__version__", "")
    if not version or old_triton_message(version, None) is None:
        return
    from coreattn.kernels.npu import triton_distribution  # only asked when the version is old

    message = old_triton_message(version, triton_distribution())
    if message:
        warnings.warn(message, UnsupportedTritonWarning, stacklevel=2)


@triton.jit(do_not_specialize=["n"])
def _range_probe(n):
    for _ in range(n):  # a loop over a runtime int: the construct Triton 3.6's interpreter fails on under numpy 2.4
        pass


def interpreter_failure_message(exc: BaseException, triton_version: str, numpy_version: str) -> str:
    """What to tell a user whose interpreter failed the probe with ``exc``."""
    if "0-dimensional arrays" in str(exc):
        return (f"Triton {triton_version}'s CPU interpreter cannot run coreattn's kernels with numpy {numpy_version}: "
                f"it converts its scalars (1-element numpy arrays) with int(), which numpy 2.4 and newer refuse "
                f"({exc}). Install {NUMPY_FIX} (pip install \"{NUMPY_FIX}\"), or Triton 3.7 or newer.")
    return (f"Triton {triton_version}'s CPU interpreter fails on a one-loop probe kernel with numpy {numpy_version} "
            f"({type(exc).__name__}: {exc}); coreattn's kernels cannot run under it. coreattn is tested with "
            f"{tested_range()}.")


@functools.lru_cache(maxsize=None)
def check_interpreter() -> None:
    """Under TRITON_INTERPRET=1: run the probe once; RuntimeError naming the fix when the interpreter
    cannot run a loop over a runtime int. A no-op for compiled kernels."""
    interpreter = sys.modules.get("triton.runtime.interpreter")  # loaded only when kernels are interpreted
    if interpreter is None or not isinstance(_range_probe, interpreter.InterpretedFunction):
        return
    try:
        _range_probe[(1,)](2)
    except Exception as exc:
        import numpy

        raise RuntimeError(interpreter_failure_message(exc, triton.__version__, numpy.__version__)) from exc
