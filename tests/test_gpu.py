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
    from coreattn.kernels.tile_map import _tile_map_kernel, _tile_scan_kernel

    kernels = (_varlen_attn_fwd_kernel, _attn_bwd_preprocess_kernel, _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel,
               _tile_scan_kernel, _tile_map_kernel)
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


def test_max_seqlen_tensors_do_not_sync():
    """0-dim CUDA max_seqlen tensors (Transformer Engine's, Megatron's) are never read on the host."""
    case = Case(dqk=128, dv=128, hq=4, hkv=4, causal=True, lens_q=(300, 0, 129))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.bfloat16, "cuda", requires_grad=True)
    max_q, max_k = (torch.tensor(m, dtype=torch.int32, device="cuda") for m in (max_q, max_k))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
        out.backward(torch.ones_like(out))
        coreattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
        coreattn.cp_attn(q, k, v, cp_group=None, layout="thd", cu_seqlens_q=cu_q, max_seqlen_q=max_q,
                         max_seqlen_kv=max_k, causal=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _padded_cu(lens, capacity: int) -> torch.Tensor:
    """cu_seqlens of ``lens`` followed by zero-length sequences up to ``capacity`` sequences."""
    lens = list(lens) + [0] * (capacity - len(lens))
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def test_cuda_graph_replays_new_packed_batches():
    """Forward + backward captured once with static q/k/v/cu_seqlens buffers (cu_seqlens padded to a
    fixed capacity with zero-length sequences, as Megatron-Core and torchtitan do), then replayed
    after copying in batches with other lengths and another number of real sequences: outputs and
    gradients equal eager runs on the same buffers."""
    total, capacity, hq, hkv, dqk, dv = 1024, 16, 8, 2, 192, 128
    batches = [(300, 0, 129, 595), (17, 500, 1, 6, 250, 250), (1024,), (1,) * 7 + (1017,)]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(h, d):
        return torch.randn(total, h, d, device="cuda", generator=gen, dtype=torch.bfloat16)

    data = [(rand(hq, dqk), rand(hkv, dqk), rand(hkv, dv), rand(hq, dv)) for _ in batches]
    q, k, v = (torch.zeros_like(t).requires_grad_() for t in data[0][:3])
    dout = torch.zeros_like(data[0][3])
    cu = _padded_cu(batches[0], capacity)
    max_len = torch.tensor(total, dtype=torch.int32, device="cuda")

    def step():
        out = coreattn.varlen_attn(q, k, v, cu, cu, max_len, max_len, causal=True, backend="triton")
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    def load(i):
        with torch.no_grad():
            for dst, src in zip((q, k, v, dout), data[i]):
                dst.copy_(src)
            cu.copy_(_padded_cu(batches[i], capacity))

    load(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile every kernel before the capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for i in range(len(batches)):
        load(i)
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for name, got, want in zip(("out", "dq", "dk", "dv"), static, eager):
            assert torch.equal(got, want), f"batch {i}: {name} differs from eager"
