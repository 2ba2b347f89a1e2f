"""Per-token sinks: ``softmax_offset`` with one logit per query token and head (thd ``[T, Hq]``,
padded ``[B, Hq, S]``, Inkling 2's), on the dense and the sparse ops, the Triton kernels (the
interpreter without a GPU) and the torch backend, against the float64 oracles (tests/oracle.py,
tests/sparse_oracle.py) under the flash criterion; the gradient is per row and deterministic."""

from __future__ import annotations

import pytest
import torch

import coreattn
from attn_cases import (KERNEL_DEVICE, LENS_K, Case, assert_flash_criterion, assert_lse_criterion, make_inputs)
from oracle import attention_ref, padded_attention_ref
from sparse_cases import SparseCase, SparseInputs, assert_sparse_matches_oracle

F32 = torch.float32


def _token_offset(shape, device, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 1.5).to(device).requires_grad_()


DENSE = [
    pytest.param("triton", F32, Case(dqk=32, dv=16, hq=4, hkv=2, causal=True, lens_q=(0, 9, 20), lens_k=(3, 14, 0)),
                 id="triton-fp32-gqa-causal-qk-lens-differ"),
    pytest.param("torch", F32, Case(dqk=32, dv=16, hq=4, hkv=2, causal=True, lens_k=LENS_K), id="torch-fp32-fused"),
    pytest.param("torch", torch.float16, Case(dqk=48, dv=32, hq=2, hkv=1, window=(3, 2)), id="torch-fp16-blocked"),
]


@pytest.mark.parametrize("backend, dtype, case", DENSE)
def test_varlen_token_sinks_match_oracle(backend, dtype, case):
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, dtype, KERNEL_DEVICE, requires_grad=True)
    offset = _token_offset((q.shape[0], case.hq), q.device)  # [T, Hq]
    out, lse = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=case.causal, window_size=case.window,
                                    softmax_offset=offset, return_lse=True, backend=backend)
    leaves = [[t.detach().cpu().requires_grad_() for t in (q, k, v, offset)] for _ in range(2)]
    ref, ref_lse = attention_ref(*leaves[0][:3], cu_q.cpu(), cu_k.cpu(), causal=case.causal, window=case.window,
                                 softmax_offset=leaves[0][3])
    naive, naive_lse = attention_ref(*leaves[1][:3], cu_q.cpu(), cu_k.cpu(), causal=case.causal, window=case.window,
                                     softmax_offset=leaves[1][3], upcast=False)
    assert_flash_criterion("out", out.cpu(), naive, ref)
    assert_lse_criterion(lse, naive_lse, ref_lse)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v, offset), g.to(out.device))
    refs = torch.autograd.grad(ref, leaves[0], g.double())
    naives = torch.autograd.grad(naive, leaves[1], g.float())
    assert grads[3].shape == offset.shape and grads[3].dtype == offset.dtype
    for name, got, r, n in zip(("dq", "dk", "dv", "d_offset"), grads, refs, naives):
        assert_flash_criterion(name, got.cpu(), n, r)
    again = torch.autograd.grad(coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=case.causal,
                                                     window_size=case.window, softmax_offset=offset,
                                                     backend=backend), (q, k, v, offset), g.to(out.device))
    assert all(torch.equal(a, b) for a, b in zip(grads, again)), "the backward is not deterministic"


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_padded_token_sinks_match_oracle(backend):
    """[B, Hq, S] sinks (Inkling 2's [B, H, S, 1] squeezed) on a right-padded bshd batch with keep masks."""
    gen = torch.Generator().manual_seed(1)
    b, s, hq, hkv, d = 2, 13, 4, 2, 16
    q, k, v = (torch.randn(b, s, h, d, generator=gen).to(KERNEL_DEVICE).requires_grad_() for h in (hq, hkv, hkv))
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[1, 9:] = False
    offset = _token_offset((b, hq, s), q.device)
    out = coreattn.padded_attn(q, k, v, q_keep_mask=keep.to(q.device), k_keep_mask=keep.to(q.device), causal=True,
                               softmax_offset=offset, backend=backend)
    leaves = [[t.detach().cpu().requires_grad_() for t in (q, k, v, offset)] for _ in range(2)]
    ref, naive = (padded_attention_ref(*lv[:3], keep, keep, causal=True, upcast=up, softmax_offset=lv[3])
                  for lv, up in zip(leaves, (True, False)))
    assert_flash_criterion("out", out.cpu(), naive, ref)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(out, (q, k, v, offset), g.to(out.device))
    refs = torch.autograd.grad(ref, leaves[0], g.double())
    naives = torch.autograd.grad(naive, leaves[1], g)
    for name, got, r, n in zip(("dq", "dk", "dv", "d_offset"), grads, refs, naives):
        assert_flash_criterion(name, got.cpu(), n, r)


SPARSE = [
    pytest.param(SparseCase(hq=4, hkv=2, topk=6, sinks=True, token_sinks=True, lens_q=(5, 0, 9)), "torch",
                 id="thd-torch"),
    pytest.param(SparseCase(layout="bshd", hq=4, hkv=2, topk=5, causal=False, sinks=True, token_sinks=True,
                            lens_q=(4, 7)), "triton", id="bshd-triton"),
]


@pytest.mark.parametrize("case, backend", SPARSE)
def test_sparse_token_sinks_match_oracle(case, backend):
    inp = SparseInputs(case, F32)
    run = inp.on(KERNEL_DEVICE)
    out, lse = run.call(backend=backend)
    assert_sparse_matches_oracle(inp, out, lse, run=run)


def test_token_sink_shapes_are_checked():
    q = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="softmax_offset has shape"):
        coreattn.varlen_attn(q, q, q, cu, cu, 6, 6, softmax_offset=torch.zeros(2, 6))
    with pytest.raises(ValueError, match=r"\[B, Hq, S\]"):
        coreattn.padded_attn(q[None], q[None], q[None], softmax_offset=torch.zeros(1, 6, 2))
    with pytest.raises(TypeError, match="softmax_offset must be a floating tensor"):
        coreattn.varlen_attn(q, q, q, cu, cu, 6, 6, softmax_offset=torch.zeros(6, 2, dtype=torch.int64))
