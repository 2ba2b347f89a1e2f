"""GPU-only checks (skipped without CUDA): no recompiles across packed batches, no host syncs."""

import pytest
import torch

import coreattn
from attn_cases import Case, make_inputs

pytestmark = pytest.mark.gpu


def _compiled_count(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:  # Triton >= 3.2: device -> (kernel_cache, ...)
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in kernel.cache.values())


def _train_step(lens, seed):
    case = Case(dqk=192, dv=128, hq=8, hkv=2, causal=True, lens_q=lens)
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.bfloat16, "cuda", requires_grad=True, seed=seed)
    out = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    out.backward(torch.ones_like(out))


def test_new_packed_batches_do_not_recompile():
    from coreattn.kernels.attn_bwd import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_bwd_preprocess_kernel
    from coreattn.kernels.attn_fwd import _varlen_attn_fwd_kernel

    kernels = (_varlen_attn_fwd_kernel, _attn_bwd_preprocess_kernel, _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel)
    _train_step((100, 37, 512), seed=0)
    before = [_compiled_count(k) for k in kernels]
    for i, lens in enumerate([(5,), (1000, 3, 0, 77), (4096, 2048, 17, 1, 1, 9), (512,), (1,)]):  # totals: odd, %16, 1
        _train_step(lens, seed=i + 1)
    assert [_compiled_count(k) for k in kernels] == before


def test_forward_and_backward_do_not_sync():
    case = Case(dqk=128, dv=128, hq=4, hkv=4, causal=True, lens_q=(300, 0, 129))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.bfloat16, "cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
