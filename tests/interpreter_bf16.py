"""Test-only correction of bf16 in Triton's CPU interpreter, so the bf16 kernel paths run on CPU.

The interpreter (upstream triton 3.9 and triton-ascend 3.2.0 alike) keeps a bf16 tensor as its
uint16 bit patterns in numpy. Loads, stores, tl.where and bf16 -> fp32 casts move those bits
exactly, but two builder methods get bf16 wrong:
- ``create_dot`` hands the uint16 arrays to ``np.matmul``, which multiplies the bit patterns as
  integers (a result of ~1e10 for unit-scale inputs);
- ``cast_impl`` (``create_fp_trunc``: ``x.to(tl.bfloat16)``, bf16 constants) drops the low 16 bits
  of an fp32, rounding toward zero, where a GPU (``cvt.rn.bf16.f32``) rounds to nearest even;
  ``create_fp_to_fp``'s explicit "rtne" rounds half away from zero and loses the carry.
install() replaces these three for bf16 operands with what a GPU computes: bf16 inputs exactly,
fp32 accumulation, round-to-nearest-even into bf16. Other dtypes take the original code. bf16
arithmetic (``bf16 * bf16``, comparisons) is not corrected: the kernels do none.

tests/conftest.py installs it only when the kernels run under the interpreter; nothing in
coreattn imports it. tests/kernels/test_interpreter_bf16.py checks it against torch.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import triton.language as tl

_ORIGINAL: dict = {}


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32, exactly (bf16 is fp32's top half)."""
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray, round_to_nearest_even: bool = True) -> np.ndarray:
    """float32 -> uint16 bf16 bit patterns, round-to-nearest-even (else toward zero); NaN stays a
    quiet NaN, overflow past bf16's largest finite value gives inf, as on a GPU and in torch."""
    bits = np.asarray(x).astype(np.float32).view(np.uint32)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if round_to_nearest_even:
        # add half an ulp of bf16, minus one when the kept lsb is even, then truncate (no uint32 wrap:
        # the largest non-NaN pattern is 0xFF800000)
        rounded = bits + ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
        bits = np.where(nan, bits, rounded)
    out = (bits >> np.uint32(16)).astype(np.uint16)
    return np.where(nan, out | np.uint16(0x0040), out)


def _interpreter():
    from triton.runtime import interpreter

    return interpreter


def _create_dot(self, a, b, d, *args):
    if a.dtype.scalar != tl.bfloat16 and b.dtype.scalar != tl.bfloat16:
        return _ORIGINAL["create_dot"](self, a, b, d, *args)
    if d.dtype.scalar != tl.float32:
        raise NotImplementedError(f"interpreter_bf16: bf16 tl.dot into {d.dtype.scalar}, only fp32 is corrected")
    a32, b32 = (bf16_bits_to_f32(x.data) if x.dtype.scalar == tl.bfloat16 else x.data.astype(np.float32)
                for x in (a, b))
    # products of bf16 values are exact in fp32; np.matmul sums them in fp32 like the GPU's MMA
    return _interpreter().TensorHandle(np.matmul(a32, b32) + d.data, tl.float32)


def _cast_impl(self, src, dst_type):
    src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
    if src_ty == tl.bfloat16 and dst_ty == tl.float32:
        return _interpreter().TensorHandle(bf16_bits_to_f32(src.data), tl.float32)
    if src_ty == tl.float32 and dst_ty == tl.bfloat16:
        return _interpreter().TensorHandle(f32_to_bf16_bits(src.data), tl.bfloat16)
    if tl.bfloat16 in (src_ty, dst_ty):
        # triton's semantic routes fp16 <-> bf16 and bf16 -> fp64 through fp32; what is left (ints,
        # fp64 -> bf16) would need its own single rounding
        raise NotImplementedError(f"interpreter_bf16: {src_ty} -> {dst_ty} cast is not corrected")
    return _ORIGINAL["cast_impl"](self, src, dst_type)


def _create_fp_to_fp(self, src, dst_type, rounding_mode):
    src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
    if tl.bfloat16 not in (src_ty, dst_ty):
        return _ORIGINAL["create_fp_to_fp"](self, src, dst_type, rounding_mode)
    if src_ty == tl.bfloat16:  # bf16 -> fp16 (or fp32): exact to fp32, one numpy rounding
        return _interpreter().TensorHandle(bf16_bits_to_f32(src.data).astype(_np_dtype(dst_ty)), dst_ty)
    if src_ty in (tl.float32, tl.float16):  # fp16 -> fp32 is exact, so a single rounding either way
        rtne = rounding_mode == _interpreter()._ir.ROUNDING_MODE.RTNE
        return _interpreter().TensorHandle(f32_to_bf16_bits(src.data, rtne), tl.bfloat16)
    raise NotImplementedError(f"interpreter_bf16: {src_ty} -> {dst_ty} conversion is not corrected")


def _np_dtype(ty):
    return {tl.float16: np.float16, tl.float32: np.float32, tl.float64: np.float64}[ty]


_REPLACEMENTS = {"create_dot": _create_dot, "cast_impl": _cast_impl, "create_fp_to_fp": _create_fp_to_fp}


def install() -> None:
    """Patch the interpreter's builder class (idempotent). Refuses outside TRITON_INTERPRET=1."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("interpreter_bf16 corrects Triton's CPU interpreter only (TRITON_INTERPRET=1)")
    builder = _interpreter().InterpreterBuilder
    for name, fn in _REPLACEMENTS.items():
        _ORIGINAL.setdefault(name, getattr(builder, name))
        setattr(builder, name, fn)


def installed() -> bool:
    builder = _interpreter().InterpreterBuilder
    return all(getattr(builder, name) is fn for name, fn in _REPLACEMENTS.items())


@contextlib.contextmanager
def uncorrected():
    """The interpreter's own bf16 handling, for the tests that document what is being corrected."""
    builder = _interpreter().InterpreterBuilder
    was = installed()
    for name in _REPLACEMENTS:
        setattr(builder, name, _ORIGINAL.get(name, getattr(builder, name)))
    try:
        yield
    finally:
        if was:
            install()
