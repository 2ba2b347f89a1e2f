"""tests/interp_memcheck.py, the interpreter's address check, on tiny kernels whose only tensor argument is
``x`` (so any address outside x is outside every argument): a masked-off lane past x inside a loop is
caught in the loops and strict modes, the same lane outside a loop only in strict mode, a lane the
mask lets through in every mode; clamped kernels pass in all of them; a caller's loop counts and a
static_range does not; collecting writes each violation once instead of raising."""

from __future__ import annotations

import json
import os

import pytest
import torch
import triton
import triton.language as tl

import conftest
import interp_memcheck
from conftest import INTERPRETED

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="checks Triton's CPU interpreter (TRITON_INTERPRET=1)")
N, BLOCK = 20, 16  # x has 20 elements; two blocks of 16 cover 32


@triton.jit
def _loop_kernel(x_ptr, n, BLOCK: tl.constexpr, CLAMP: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, n, BLOCK):
        idx = i + offs
        if CLAMP:
            idx = tl.minimum(idx, n - 1)  # every lane's address inside x, the mask on values
        acc += tl.load(x_ptr + idx, mask=i + offs < n, other=0.0)
    tl.store(x_ptr, tl.sum(acc, 0))


@triton.jit
def _straight_kernel(x_ptr, n, BLOCK: tl.constexpr, EXTRA: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + BLOCK + offs, mask=offs < n - BLOCK + EXTRA, other=0.0)  # EXTRA lanes past x let through
    tl.store(x_ptr, tl.sum(v, 0))


@triton.jit
def _store_loop_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for i in range(0, n, BLOCK):
        tl.store(x_ptr + i + offs, 1.0, mask=i + offs < n)


@triton.jit
def _load_tail(x_ptr, r0, n, BLOCK: tl.constexpr):
    offs = r0 + tl.arange(0, BLOCK)
    return tl.load(x_ptr + offs, mask=offs < n, other=0.0)


@triton.jit
def _helper_kernel(x_ptr, n, BLOCK: tl.constexpr, STATIC: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.float32)
    if STATIC:
        for i in tl.static_range(0, 2):  # unrolled when compiled: no loop for the pipeliner
            acc += _load_tail(x_ptr, i * BLOCK, n, BLOCK)
    else:
        for i in range(0, 2):
            acc += _load_tail(x_ptr, i * BLOCK, n, BLOCK)
    tl.store(x_ptr, tl.sum(acc, 0))


def _run(kernel, *args, **constexprs):
    x = torch.zeros(N, dtype=torch.float32)
    kernel[(1,)](x, N, *args, BLOCK=BLOCK, **constexprs)
    return x


def _raises(mode, kernel, **constexprs) -> str:
    with interp_memcheck.checking(mode), pytest.raises(Exception) as info:
        _run(kernel, **constexprs)
    assert "OutOfBounds" in repr(info.value) or isinstance(info.value, interp_memcheck.OutOfBounds), info.value
    return str(info.value)


def _passes(mode, kernel, **constexprs):
    with interp_memcheck.checking(mode):
        _run(kernel, **constexprs)


@pytest.mark.parametrize("mode", ["loops", "strict", "masked"])
def test_an_in_bounds_kernel_passes(mode):
    _passes(mode, _loop_kernel, CLAMP=True)


def test_a_masked_off_lane_inside_a_loop_is_caught():
    message = _raises("loops", _loop_kernel, CLAMP=False)
    assert "load outside every tensor argument in kernel _loop_kernel, program [0, 0, 0]" in message
    assert "test_interp_memcheck.py:" in message and "inside a loop" in message
    assert "12 of 16 lanes, 0 of them let through by the mask" in message  # lanes 20-31 of the second block
    assert "bytes past the end of x_ptr (a 80-byte storage)" in message
    assert "axis 0: 4-15 of a 16 block" in message
    _raises("strict", _loop_kernel, CLAMP=False)
    _passes("masked", _loop_kernel, CLAMP=False)
    _passes("off", _loop_kernel, CLAMP=False)


def test_a_masked_off_lane_outside_a_loop_fails_in_strict_mode_only():
    _passes("loops", _straight_kernel, EXTRA=0)
    _passes("masked", _straight_kernel, EXTRA=0)
    message = _raises("strict", _straight_kernel, EXTRA=0)
    assert "outside any loop" in message and "12 of 16 lanes" in message


def test_a_lane_the_mask_lets_through_is_caught_in_every_mode():
    for mode in ("loops", "strict", "masked"):
        message = _raises(mode, _straight_kernel, EXTRA=2)
        assert "2 of them let through by the mask" in message
    _passes("off", _straight_kernel, EXTRA=2)


def test_stores_inside_a_loop_are_checked():
    message = _raises("loops", _store_loop_kernel)
    assert message.startswith("store outside") or "store outside every tensor argument" in message


def test_a_callers_loop_counts_and_static_range_does_not():
    message = _raises("loops", _helper_kernel, STATIC=False)
    lines = message.split(" at ", 1)[1].split(" (", 1)[0].split(" < ")
    assert len(lines) == 2 and all(line.startswith("test_interp_memcheck.py:") for line in lines)  # callee < caller
    _passes("loops", _helper_kernel, STATIC=True)
    _raises("strict", _helper_kernel, STATIC=True)


def test_collecting_writes_each_violation_once_and_does_not_raise(tmp_path):
    report = tmp_path / "violations.jsonl"
    with interp_memcheck.checking("loops", str(report)):
        for _ in range(2):
            _run(_loop_kernel, CLAMP=False)
            _run(_straight_kernel, EXTRA=2)
    records = [json.loads(line) for line in report.read_text().splitlines()]
    assert [(r["kernel"], r["where"], r["live_bad_lanes"]) for r in records] == [
        ("_loop_kernel", "inside a loop", 0), ("_straight_kernel", "outside any loop", 2)]
    assert all(r["test"].startswith("tests/kernels/test_interp_memcheck.py::") for r in records)


def test_modes_and_the_environment():
    with interp_memcheck.checking("0"):
        assert interp_memcheck.mode() == "off"
    with pytest.raises(ValueError, match="expected one of"):
        interp_memcheck.set_mode("everything")


def test_the_suite_runs_under_the_memcheck():
    """tests/conftest.py installs it for every interpreted test unless COREATTN_MEMCHECK=off; a Triton
    whose interpreter it cannot wrap fails here, by name, rather than passing unchecked."""
    if os.environ.get(interp_memcheck.ENV_MODE, "").strip().lower() in ("off", "0"):
        pytest.skip(f"{interp_memcheck.ENV_MODE}=off")
    assert interp_memcheck.installed(), conftest.MEMCHECK
