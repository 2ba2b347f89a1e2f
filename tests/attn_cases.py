"""Shared builders for the attention tests: batches, cases and the flash-attention criterion."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from conftest import HAS_CUDA
from oracle import attention_ref

KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"
# every kernel case runs in these; without CUDA, bf16 runs on chosen cases only (BF16_CPU_CASES, and
# the features tests' own picks), on the interpreter as corrected by tests/interpreter_bf16.py
KERNEL_DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_CUDA else [])
EPS = 1e-5


@dataclass(frozen=True)
class Case:
    dqk: int = 64
    dv: int = 64
    hq: int = 2
    hkv: int = 2
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    bottom_right: bool = True
    lens_q: tuple[int, ...] = (0, 1, 17, 33, 5)
    lens_k: tuple[int, ...] | None = None  # None: same as lens_q
    noncontig: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def id(self) -> str:
        parts = [f"hdim{self.dqk}x{self.dv}"]
        if self.hq != self.hkv:
            parts.append("mqa" if self.hkv == 1 else f"gqa{self.hq // self.hkv}")
        if self.causal:
            parts.append("causal" + ("" if self.bottom_right else "-topleft"))
        if self.window != (-1, -1):
            parts.append(f"win{self.window[0]}_{self.window[1]}" + ("" if self.bottom_right else "-topleft"))
        if not self.causal and self.window == (-1, -1):
            parts.append("full")
        if self.lens_k is not None:
            parts.append("qk-lens-differ")
        if self.noncontig:
            parts.append("strided")
        return "-".join(parts)


LENS_Q = (0, 1, 17, 33, 5)
LENS_K = (3, 0, 40, 33, 2)  # an empty key sequence, Lq > Lk and Lq < Lk

CASES = [
    # the head-dim pairs the issue names, each with a mask
    Case(dqk=192, dv=128, hq=4, hkv=2, causal=True),
    Case(dqk=128, dv=128, hq=2, hkv=1),
    Case(dqk=64, dv=64, hq=8, hkv=1, causal=True, lens_k=LENS_K),
    Case(dqk=256, dv=256, hq=2, hkv=2, window=(3, 2)),
    Case(dqk=96, dv=64, hq=4, hkv=1, causal=True, bottom_right=False, lens_k=LENS_K),
    # non-powers of two and tiny dims, independently for q/k and v
    Case(dqk=40, dv=59, hq=2, hkv=2, window=(4, -1), lens_k=LENS_K),
    Case(dqk=111, dv=1, hq=2, hkv=1, window=(-1, 3), bottom_right=False),
    Case(dqk=1, dv=96, hq=2, hkv=2, causal=True, window=(5, 0)),
    # alignment and windows with q and k lengths differing
    Case(dqk=32, dv=16, hq=8, hkv=8, causal=True, lens_k=LENS_K),
    Case(dqk=32, dv=48, hq=4, hkv=2, window=(2, 6), bottom_right=False, lens_k=LENS_K),
    Case(dqk=48, dv=32, hq=4, hkv=4, causal=True, window=(7, 0), lens_k=LENS_K),
    # windows wider than any sequence, up to int32's limit: unlimited, with no index overflow
    Case(dqk=32, dv=32, hq=2, hkv=1, window=(2**31 - 1, 2**31 - 1), lens_k=LENS_K),
    Case(dqk=16, dv=16, hq=2, hkv=2, causal=True, window=(2**31 - 1, 0), bottom_right=False, lens_k=LENS_K),
    # strided views of packed buffers
    Case(dqk=64, dv=32, hq=4, hkv=2, causal=True, noncontig=True),
    Case(dqk=192, dv=128, hq=2, hkv=1, window=(9, 9), noncontig=True, lens_k=LENS_K),
    # longer sequences: several query and key blocks, including fully-visible middle blocks
    Case(dqk=64, dv=64, hq=2, hkv=1, causal=True, lens_q=(130, 67)),
    Case(dqk=64, dv=64, hq=1, hkv=1, window=(40, 20), lens_q=(150,)),
]

# bf16 under the interpreter costs what fp16 does, and all of CASES in bf16 would add about 190 s on
# one core, so without CUDA bf16 runs on these: MQA with 128/128 and 192/128 (strided, a symmetric
# window), odd dims 40/59 (left window), 111/1 (right window, top-left) and 1/96 (causal with a window),
# and 64/64 over several key blocks. The features tests add GQA, causal, dropout, sinks and spans.
BF16_CPU_CASES = [CASES[i] for i in (1, 5, 6, 7, 14, 16)]


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def case_dtype_params(cases, bf16_cases=()):
    """pytest params (case, dtype), ids "<case id>-<dtype>": every case in KERNEL_DTYPES, and where
    those lack bf16 (no CUDA), bf16 on bf16_cases."""
    pairs = [(c, d) for c in cases for d in KERNEL_DTYPES]
    if torch.bfloat16 not in KERNEL_DTYPES:
        pairs += [(c, torch.bfloat16) for c in bf16_cases]
    return [pytest.param(c, d, id=f"{c.id}-{dtype_id(d)}") for c, d in pairs]


def cu_from_lens(lens, device) -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def make_inputs(case: Case, dtype, device, requires_grad=False, seed=0):
    """q, k, v, cu_q, cu_k, max_q, max_k for a case; strided views when case.noncontig."""
    gen = torch.Generator().manual_seed(seed)
    lens_k = case.lens_k if case.lens_k is not None else case.lens_q
    tq, tk = sum(case.lens_q), sum(lens_k)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype).to(device)

    if case.noncontig:
        # slices of one packed buffer per token: [T, H, Dqk | Dqk | Dv | pad], as a fused qkv projection gives
        q = rand(tq, case.hq, case.dqk + 7)[:, :, 3:3 + case.dqk]
        kv = rand(tk, case.hkv, case.dqk + case.dv + 5)
        k, v = kv[:, :, :case.dqk], kv[:, :, case.dqk:case.dqk + case.dv]
    else:
        q, k, v = rand(tq, case.hq, case.dqk), rand(tk, case.hkv, case.dqk), rand(tk, case.hkv, case.dv)
    if requires_grad:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return (q, k, v, cu_from_lens(case.lens_q, device), cu_from_lens(lens_k, device),
            max(case.lens_q), max(lens_k))


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref.double()).abs().max().item() if x.numel() else 0.0


def rounding_term(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Two units of rounding at the reference's magnitude in ``dtype`` (``2 * finfo(dtype).eps *
    max|ref|``: 2 to 4 ulps of the largest value). The criterion's absolute ``eps`` alone is below one
    ulp of a large value (1e-5 against a float32 loss of 29, whose ulp is 1.9e-6, is 5 ulps; 1e-6 is
    half of one), and the naive computation's error is luck there: a scalar or a small tensor that
    it happens to round well would hold a correct kernel to a fraction of an ulp, passing on one CPU
    and failing on another whose SIMD width changes the summation order."""
    finite = ref[torch.isfinite(ref)] if ref.is_floating_point() else ref
    if not finite.numel():
        return 0.0
    return 2 * torch.finfo(dtype).eps * finite.abs().max().item()


def assert_flash_criterion(name: str, got: torch.Tensor, naive: torch.Tensor, ref: torch.Tensor, eps: float = EPS):
    """err(kernel) <= 2 * err(naive same-dtype) + eps + rounding_term(ref, naive's dtype), and no NaN
    anywhere."""
    assert not torch.isnan(got).any(), f"{name}: NaN in output"
    err, base = max_err(got, ref), max_err(naive, ref)
    bound = 2 * base + eps + rounding_term(ref, naive.dtype)
    assert err <= bound, f"{name}: max error {err:.3e} > 2 * {base:.3e} + {eps} + rounding = {bound:.3e}"


def assert_lse_criterion(lse: torch.Tensor, naive: torch.Tensor, ref: torch.Tensor, eps: float = EPS):
    """lse [H, T] float32: -inf exactly where the oracle has -inf, the criterion elsewhere."""
    assert lse.dtype == torch.float32 and lse.shape == ref.shape
    lse, naive, ref = lse.cpu(), naive.cpu(), ref.cpu()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref)), "lse: rows without keys differ"
    fin = torch.isfinite(ref)
    assert_flash_criterion("lse", lse[fin], naive[fin], ref[fin], eps)


def assert_grad_criterion(out: torch.Tensor, ref: torch.Tensor, naive: torch.Tensor, leaves, g: torch.Tensor):
    """Gradients of out, ref (float64 oracle) and naive (same dtype) w.r.t. leaves (q, k, v) under the
    incoming gradient g, compared with the flash criterion."""
    grads = torch.autograd.grad(out, leaves, g.to(out.device))
    refs = torch.autograd.grad(ref, leaves, g.cpu().double())
    naives = torch.autograd.grad(naive, leaves, g.cpu().to(naive.dtype))
    for name, got, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        assert_flash_criterion(name, got.cpu(), n, r)


def assert_matches_oracle(out: torch.Tensor, q, k, v, cu_q, cu_k, case: Case):
    """out = attention(q, k, v) of a varlen case on CPU tensors: out, then dq/dk/dv under a fixed
    incoming gradient, against the float64 oracle with the flash criterion."""
    opts = dict(causal=case.causal, window=case.window, bottom_right=case.bottom_right)
    ref, _ = attention_ref(q, k, v, cu_q, cu_k, **opts)
    naive, _ = attention_ref(q, k, v, cu_q, cu_k, upcast=False, **opts)
    assert_flash_criterion("out", out, naive, ref)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    assert_grad_criterion(out, ref, naive, (q, k, v), g)
