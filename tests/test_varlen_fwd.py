"""Forward of coreattn.varlen_attn (Triton kernel; the interpreter without a GPU) against the float64 oracle."""

import pytest
import torch

import coreattn
from attn_cases import (BF16_CPU_CASES, CASES, KERNEL_DEVICE, LENS_K, Case, assert_flash_criterion, assert_lse_criterion,
                        case_dtype_params, make_inputs)
from coreattn.kernels import varlen_attn_fwd
from coreattn.kernels.packing import packed
from oracle import attention_ref

def _check_forward(case, dtype, out, lse, q, k, v, cu_q, cu_k):
    opts = dict(causal=case.causal, window=case.window, bottom_right=case.bottom_right)
    ref, ref_lse = attention_ref(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), **opts)
    naive, naive_lse = attention_ref(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), upcast=False, **opts)
    assert out.dtype == dtype and out.shape == (q.shape[0], case.hq, case.dv)
    assert_flash_criterion("out", out.cpu(), naive, ref)
    assert_lse_criterion(lse, naive_lse, ref_lse)


@pytest.mark.parametrize("case, dtype", case_dtype_params(CASES, BF16_CPU_CASES))
def test_forward_matches_oracle(case, dtype):
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, dtype, KERNEL_DEVICE)
    out, lse = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=case.causal,
                                    window_size=case.window, return_lse=True, backend="triton",
                                    causal_alignment="bottom_right" if case.bottom_right else "top_left")
    _check_forward(case, dtype, out, lse, q, k, v, cu_q, cu_k)


def _launch(case, inputs, max_q, **kw):
    q, k, v, cu_q, cu_k = inputs
    right = 0 if case.causal else case.window[1]
    return varlen_attn_fwd(q, k, v, packed(cu_q), packed(cu_k), max_q, q.shape[-1] ** -0.5, case.window[0], right,
                           case.bottom_right, **kw)


def test_every_output_element_is_written():
    """Outputs poisoned with NaN before the call: an element the kernel forgets stays NaN."""
    case = Case(dqk=40, dv=24, hq=4, hkv=2, causal=True, lens_k=LENS_K)
    q, k, v, cu_q, cu_k, max_q, _ = make_inputs(case, torch.float16, KERNEL_DEVICE)
    out = torch.full((q.shape[0], 4, 24), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((4, q.shape[0]), float("nan"), device=q.device)
    _launch(case, (q, k, v, cu_q, cu_k), max_q, out=out, lse=lse)
    assert not out.isnan().any() and not lse.isnan().any()
    _check_forward(case, torch.float16, out, lse, q, k, v, cu_q, cu_k)


def test_max_seqlen_too_small_is_still_correct():
    """max_seqlen only sizes the grid; programs stride over the rest of a longer sequence."""
    case = Case(dqk=32, dv=32, causal=True, lens_q=(70, 3))
    q, k, v, cu_q, cu_k, _, _ = make_inputs(case, torch.float32, KERNEL_DEVICE)
    out, lse = _launch(case, (q, k, v, cu_q, cu_k), max_q=1)
    _check_forward(case, torch.float32, out, lse, q, k, v, cu_q, cu_k)


@pytest.mark.parametrize("cu_vals", [[1, 5, 10], [0, 7, 3, 10], [0, 5, 9], [0, 5, 12]],
                         ids=["not-from-0", "decreasing", "short-of-T", "past-T"])
def test_malformed_cu_seqlens_give_nan_on_device_path(cu_vals):
    """Without the host-side checks (the GPU default), malformed cu_seqlens poison the whole output."""
    case = Case(dqk=16, dv=16, lens_q=(10,))
    q, k, v, _, _, _, _ = make_inputs(case, torch.float32, KERNEL_DEVICE)
    cu = torch.tensor(cu_vals, dtype=torch.int32, device=q.device)
    out, lse = _launch(case, (q, k, v, cu, cu), max_q=10)
    assert out.isnan().all() and lse.isnan().all()


def test_empty_query_batch():
    case = Case(lens_q=(0, 0), lens_k=(4, 0))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, KERNEL_DEVICE)
    out, lse = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, backend="triton")
    assert out.shape == (0, 2, 64) and lse.shape == (2, 0)


def test_flash_attn_varlen_func_matches_varlen_attn():
    case = Case(dqk=64, dv=32, hq=4, hkv=2, causal=True, lens_k=LENS_K)
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float16, KERNEL_DEVICE)
    out, lse, probs = coreattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                                      return_attn_probs=True)
    assert probs is None
    out2 = coreattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    assert torch.equal(out, out2)
    _check_forward(case, torch.float16, out, lse, q, k, v, cu_q, cu_k)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_seqused_matches_dense_packing(backend):
    """seqused (flash-attn 3's name): slots laid out by cu_seqlens, only the first seqused[b]
    tokens used; equals the same sequences packed densely, with zeros in the unused tails."""
    lens, slots = (5, 0, 13, 1), (8, 2, 13, 6)
    gen = torch.Generator().manual_seed(0)
    total = sum(slots)
    q, k, v = (torch.randn(total, h, d, generator=gen).to(KERNEL_DEVICE) for h, d in ((4, 40), (2, 40), (2, 24)))
    cu_slots = torch.tensor([0, 8, 10, 23, 29], dtype=torch.int32, device=KERNEL_DEVICE)
    used = torch.tensor(lens, dtype=torch.int32, device=KERNEL_DEVICE)
    out = coreattn.varlen_attn(q, k, v, cu_slots, cu_slots, 13, 13, causal=True, seqused_q=used, seqused_k=used,
                               backend=backend)
    real = torch.cat([torch.arange(s, s + n) for s, n in zip((0, 8, 10, 23), lens)]).to(KERNEL_DEVICE)
    cu = torch.tensor([0, 5, 5, 18, 19], dtype=torch.int32, device=KERNEL_DEVICE)
    dense = coreattn.varlen_attn(q[real], k[real], v[real], cu, cu, 13, 13, causal=True, backend=backend)
    torch.testing.assert_close(out[real], dense, rtol=0, atol=1e-6)
    unused = torch.ones(total, dtype=torch.bool, device=KERNEL_DEVICE)
    unused[real] = False
    assert not out[unused].any()
