"""tests/interpreter_bf16.py, the interpreter's bf16 correction, against torch: tl.dot of bf16 blocks
(plain and into an accumulator) equals an fp32-accumulated matmul of the bf16 values, and casts to
bf16 equal torch's bitwise. Also pins down what the uncorrected interpreter does."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import interpreter_bf16
from conftest import INTERPRETED

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="corrects Triton's CPU interpreter (TRITON_INTERPRET=1)")


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, ACC: tl.constexpr):
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])  # [M, K]
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])  # [K, N]
    c_ptrs = c_ptr + rm[:, None] * N + rn[None, :]
    if ACC:
        c = tl.dot(a, b, tl.load(c_ptrs))
    else:
        c = tl.dot(a, b)
    tl.store(c_ptrs, c)


@triton.jit
def _cast_kernel(x_ptr, y_ptr, up_ptr, n, RTZ: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    if RTZ:
        y = x.to(tl.bfloat16, fp_downcast_rounding="rtz")
    else:
        y = x.to(tl.bfloat16)
    tl.store(y_ptr + offs, y, mask=ok)
    tl.store(up_ptr + offs, tl.load(y_ptr + offs, mask=ok, other=0.0).to(tl.float32), mask=ok)


def _bf16(*shape, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def _dot(a, b, c=None):
    m, k = a.shape
    n = b.shape[1]
    out = c.clone() if c is not None else torch.empty(m, n)
    _dot_kernel[(1,)](a, b, out, m, n, k, c is not None)
    return out


@pytest.mark.parametrize("m, n, k", [(16, 16, 16), (32, 64, 128), (64, 16, 32)], ids=lambda x: str(x))
@pytest.mark.parametrize("acc", [False, True], ids=["dot", "dot-acc"])
def test_dot_matches_fp32_accumulated_matmul(m, n, k, acc):
    a, b = _bf16(m, k, seed=1, scale=3.0), _bf16(k, n, seed=2)
    c = torch.randn(m, n, generator=torch.Generator().manual_seed(3)) if acc else None
    want = a.float() @ b.float() + (c if acc else 0)  # bf16 values exactly, fp32 accumulation
    exact = a.double() @ b.double() + (c.double() if acc else 0)
    got = _dot(a, b, c)
    # both sums are fp32 in some order: each within k ulps of the exact sum of |terms|
    bound = k * torch.finfo(torch.float32).eps * ((a.double().abs() @ b.double().abs()) + (c.abs().double() if acc else 0))
    assert ((got.double() - exact).abs() <= bound).all() and ((want.double() - exact).abs() <= bound).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _cast(x, rtz=False):
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    up = torch.empty(x.shape)
    block = 1024
    _cast_kernel[(triton.cdiv(x.numel(), block),)](x, y, up, x.numel(), rtz, block)
    return y, up


def _cast_inputs():
    gen = torch.Generator().manual_seed(0)
    bf16_ulp_at_1 = 2.0 ** -7
    ties = torch.tensor([1 + bf16_ulp_at_1 / 2, 1 + 1.5 * bf16_ulp_at_1, -(1 + bf16_ulp_at_1 / 2), 3 * 2.0 ** -134])
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.4e38, -3.4e38, 1e-40, -1e-39,
                            torch.finfo(torch.float32).tiny, torch.finfo(torch.bfloat16).max])
    random_bits = torch.randint(-2**31, 2**31, (20000,), generator=gen, dtype=torch.int64).to(torch.int32)
    finite = random_bits.view(torch.float32)
    finite = finite[torch.isfinite(finite)]
    return torch.cat([ties, special, torch.randn(5000, generator=gen) * 10, finite])


def test_cast_to_bf16_rounds_to_nearest_even_bitwise():
    x = _cast_inputs()
    y, up = _cast(x)
    want = x.to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    assert torch.equal(up.view(torch.int32), want.float().view(torch.int32))  # bf16 -> fp32 is exact
    assert y[:4].tolist() == [1.0, 1 + 2 * 2.0 ** -7, -1.0, 2.0 ** -132]  # ties to even, subnormal tie


def test_cast_fp16_to_bf16_bitwise():
    x = _cast_inputs().half()
    y, _ = _cast(x)
    assert torch.equal(y.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


def test_cast_to_bf16_toward_zero_bitwise():
    x = _cast_inputs()
    y, _ = _cast(x, rtz=True)
    truncated = (x.view(torch.int32) >> 16).to(torch.int16)
    assert torch.equal(y.view(torch.int16), truncated)


def test_cast_to_bf16_keeps_nan():
    x = torch.tensor([float("nan"), -float("nan"), torch.tensor(0x7F800001, dtype=torch.int32).view(torch.float32)])
    for rtz in (False, True):
        y, up = _cast(x, rtz)
        assert y.isnan().all() and up.isnan().all()


def test_uncorrected_interpreter_multiplies_bit_patterns_and_truncates():
    """The root cause, pinned: should Triton fix its interpreter, this fails and the correction can go."""
    a, b = _bf16(16, 16, seed=1), _bf16(16, 16, seed=2)
    x = torch.tensor([1 + 2.0 ** -8 + 2.0 ** -20])  # just above a tie: nearest is 1 + 2^-7, truncation gives 1
    with interpreter_bf16.uncorrected():
        got = _dot(a, b)
        y, _ = _cast(x)
    bits = (lambda t: t.view(torch.int16).to(torch.int64) & 0xFFFF)
    assert torch.allclose(got.double(), bits(a).double() @ bits(b).double(), rtol=1e-6)
    assert y.item() == 1.0 and x.to(torch.bfloat16).item() == 1 + 2.0 ** -7
    assert interpreter_bf16.installed()
