"""Backward of coreattn.varlen_attn (Triton kernels; the interpreter without a GPU) against the float64 oracle."""

import pytest
import torch

import coreattn
from attn_cases import (BF16_CPU_CASES, CASES, KERNEL_DEVICE, LENS_K, Case, assert_flash_criterion, case_dtype_params,
                        make_inputs)
from coreattn.kernels import runs_in_interpreter, varlen_attn_bwd, varlen_attn_fwd
from coreattn.kernels.packing import packed
from oracle import attention_ref


def _alignment(case):
    return "bottom_right" if case.bottom_right else "top_left"


def _grad_out(case, tq, dtype, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(tq, case.hq, case.dv + 3, generator=gen).to(dtype).to(device)
    return g[:, :, 2:2 + case.dv] if case.noncontig else g[:, :, :case.dv].contiguous()


def _reference_grads(case, q, k, v, cu_q, cu_k, g, upcast):
    leaves = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref(*leaves, cu_q.cpu(), cu_k.cpu(), causal=case.causal, window=case.window,
                           bottom_right=case.bottom_right, upcast=upcast)
    return torch.autograd.grad(out, leaves, g.cpu().to(out.dtype))


@pytest.mark.parametrize("case, dtype", case_dtype_params(CASES, BF16_CPU_CASES))
def test_backward_matches_oracle(case, dtype):
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, dtype, KERNEL_DEVICE, requires_grad=True)
    out = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=case.causal, window_size=case.window,
                               causal_alignment=_alignment(case), backend="triton")
    g = _grad_out(case, q.shape[0], dtype, q.device)
    grads = torch.autograd.grad(out, (q, k, v), g)
    refs = _reference_grads(case, q, k, v, cu_q, cu_k, g, upcast=True)
    naives = _reference_grads(case, q, k, v, cu_q, cu_k, g, upcast=False)
    for name, got, ref, naive, leaf in zip(("dq", "dk", "dv"), grads, refs, naives, (q, k, v)):
        assert got.dtype == dtype and got.shape == leaf.shape
        assert_flash_criterion(name, got.cpu(), naive, ref)


def test_every_gradient_element_is_written():
    """Gradient buffers poisoned with NaN before the call: an element the kernels forget stays NaN."""
    case = Case(dqk=40, dv=24, hq=4, hkv=2, causal=True, lens_k=LENS_K)
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, KERNEL_DEVICE)
    pq, pk = packed(cu_q), packed(cu_k)
    scale = case.dqk ** -0.5
    out, lse = varlen_attn_fwd(q, k, v, pq, pk, max_q, scale, -1, 0, True)
    g = _grad_out(case, q.shape[0], torch.float32, q.device)
    bufs = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    dq, dk, dv = varlen_attn_bwd(g, q, k, v, out, lse, pq, pk, max_q, max_k, scale, -1, 0, True, *bufs)
    assert all(a is b for a, b in zip((dq, dk, dv), bufs))
    refs = _reference_grads(case, q, k, v, cu_q, cu_k, g, upcast=True)
    naives = _reference_grads(case, q, k, v, cu_q, cu_k, g, upcast=False)
    for name, got, ref, naive in zip(("dq", "dk", "dv"), (dq, dk, dv), refs, naives):
        assert_flash_criterion(name, got.cpu(), naive, ref)


def test_backward_is_bitwise_deterministic():
    case = Case(dqk=48, dv=32, hq=4, hkv=2, causal=True, lens_q=(0, 45, 19))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float16, KERNEL_DEVICE, requires_grad=True)
    g = _grad_out(case, q.shape[0], torch.float16, q.device)
    runs = []
    for _ in range(2):
        out = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend="triton",
                                   deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), g))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_packed_matches_one_sequence_at_a_time():
    """THD vs per-sequence: the same sequences packed or alone give identical outputs and gradients."""
    case = Case(dqk=96, dv=64, hq=4, hkv=2, causal=True, lens_q=(23, 0, 41, 7), lens_k=(30, 5, 41, 2))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, KERNEL_DEVICE, requires_grad=True)
    g = _grad_out(case, q.shape[0], torch.float32, q.device)
    out = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend="triton")
    grads = torch.autograd.grad(out, (q, k, v), g)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        qb, kb, vb = (t[s].detach().requires_grad_() for t, s in ((q, sq), (k, sk), (v, sk)))
        one_q = torch.tensor([0, cq[b + 1] - cq[b]], dtype=torch.int32, device=q.device)
        one_k = torch.tensor([0, ck[b + 1] - ck[b]], dtype=torch.int32, device=q.device)
        ob = coreattn.varlen_attn(qb, kb, vb, one_q, one_k, int(one_q[1]), int(one_k[1]), causal=True,
                                  backend="triton")
        assert torch.equal(ob, out[sq])
        if ob.numel():
            gb = torch.autograd.grad(ob, (qb, kb, vb), g[sq])
            for full, part, s in zip(grads, gb, (sq, sk, sk)):
                assert torch.equal(full[s], part)
        elif kb.shape[0]:
            assert not grads[1][sk].any() and not grads[2][sk].any()


def test_backprop_through_out_only_with_lse_returned():
    case = Case(dqk=32, dv=16, causal=True)
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, KERNEL_DEVICE, requires_grad=True)
    out, lse = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True,
                                    backend="triton")
    assert not lse.requires_grad
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("cu_vals", [[0, 7, 3, 10], [0, 5, 9]], ids=["decreasing", "short-of-T"])
def test_malformed_cu_seqlens_give_nan_gradients_on_device_path(cu_vals):
    case = Case(dqk=16, dv=16, lens_q=(10,))
    q, k, v, _, _, _, _ = make_inputs(case, torch.float32, KERNEL_DEVICE)
    pack = packed(torch.tensor(cu_vals, dtype=torch.int32, device=q.device))
    out, lse = torch.zeros(10, 2, 16, device=q.device), torch.zeros(2, 10, device=q.device)
    dq, dk, dv = varlen_attn_bwd(torch.ones_like(out), q, k, v, out, lse, pack, pack, 10, 10, 0.25)
    assert dq.isnan().all() and dk.isnan().all() and dv.isnan().all()


@pytest.mark.parametrize("lens_q, lens_k", [((0, 0), (3, 5)), ((4, 2), (0, 0))], ids=["no-queries", "no-keys"])
def test_a_side_without_tokens(monkeypatch, lens_q, lens_k):
    """T = 0 on one side: zero outputs and gradients, and no kernel is handed a tensor without rows: a
    loop over an empty sequence addresses row 0 of its sample, and a pipelined load is issued even by a
    loop that runs zero times (which the interpreter never runs), so that row must exist
    (kernels/packing.stand_in)."""
    case = Case(dqk=24, dv=16, hq=4, hkv=2, causal=True, lens_q=lens_q, lens_k=lens_k)
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, KERNEL_DEVICE, requires_grad=True)
    launched, empty_args = [], []

    def spy(real, kernel_name):
        def launch(self, *args, **kwargs):
            name = kernel_name(self)
            launched.append(name)
            empty_args.extend(f"{name}:{key}" for key, a in [*enumerate(args), *kwargs.items()]
                              if isinstance(a, torch.Tensor) and a.numel() == 0)
            return real(self, *args, **kwargs)
        return launch

    if runs_in_interpreter():  # upstream's and triton-ascend's interpreters both launch through a GridExecutor
        from triton.runtime.interpreter import GridExecutor

        monkeypatch.setattr(GridExecutor, "__call__", spy(GridExecutor.__call__, lambda ex: ex.fn.__name__))
    else:
        from triton.runtime.jit import JITFunction

        monkeypatch.setattr(JITFunction, "run", spy(JITFunction.run, lambda fn: fn.__name__))
    out = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max(max_q, 1), max(max_k, 1), causal=True, backend="triton")
    out.sum().backward()
    # the spy saw the launches (without queries the forward has nothing to launch, dK/dV zeroes the keys)
    assert {"_varlen_attn_fwd_kernel", "_attn_bwd_dkdv_kernel"} & set(launched), launched
    assert not empty_args, empty_args
    assert out.shape == (q.shape[0], case.hq, case.dv) and not out.any()
    for leaf in (q, k, v):
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape and not leaf.grad.any()
