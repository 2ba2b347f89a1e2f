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


# --- the GPU side of the checks tests/test_no_host_sync.py, test_position_ids.py and
# --- kernels/test_device_guard.py make on CPU

from public_paths import PATHS  # noqa: E402


@pytest.mark.parametrize("path", sorted(PATHS))
def test_public_path_does_not_sync(path):
    """Every public path forward and backward under torch.cuda.set_sync_debug_mode("error") (after
    one warm-up call that compiles the kernels)."""
    PATHS[path]("cuda", None)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        PATHS[path]("cuda", None)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_replays_new_position_ids():
    """The position-ids layout (transformers' packed SFT) captured once with a static position-ids
    buffer, replayed after copying in ids with other sequence boundaries: equal to eager each time
    (no cu_seqlens cached from the warm-up, no host read during capture)."""
    from coreattn.kernels.packing import Packing
    from coreattn.layers import function
    from coreattn.layers.checks import VarlenParams

    rows, seqlen, hq, hkv, d = 2, 256, 4, 2, 128
    tokens = rows * seqlen
    ids = [torch.arange(seqlen).repeat(rows, 1),
           torch.cat([torch.arange(100), torch.arange(156)]).repeat(rows, 1),
           torch.tensor([list(range(7)) * 36 + list(range(4))] * rows)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(tokens, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (hq, hkv, hkv))
    dout = torch.randn(tokens, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    pos = ids[0].to("cuda")
    params = VarlenParams(d ** -0.5, -1, 0, True)

    def step():
        pack = Packing(function.POSITION_IDS, pos)
        out, _, _ = function.attention(q, k, v, pack, pack, tokens, tokens, params, "triton")
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for i, new in enumerate(ids):
        pos.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for name, got, want in zip(("out", "dq", "dk", "dv"), static, eager):
            assert torch.equal(got, want), f"ids {i}: {name} differs from eager"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (tensors on one while the other is current)")
def test_launch_on_a_device_other_than_the_current_one():
    """Tensors on cuda:1 while cuda:0 is current (transformers' device_map="auto"): every launch runs
    on cuda:1 (kernels/device.py) and the results equal the same call made with cuda:1 current; the
    current device is left as it was."""
    case = Case(dqk=192, dv=128, hq=8, hkv=2, causal=True, lens_q=(300, 0, 129))

    def run(device):
        q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.bfloat16, device, requires_grad=True, seed=3)
        out = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend="triton")
        return (out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))

    with torch.cuda.device(1):
        want = run("cuda:1")
    torch.cuda.set_device(0)
    got = run("cuda:1")
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.device == torch.device("cuda", 1) and torch.equal(a, b), name


def test_token_stride_past_int32_range():
    """An sbhd view whose token stride times a tile's rows passes 2**31 elements (B * H * D large):
    forward and backward equal a contiguous copy's (64-bit lane offsets). Needs about 6 GiB."""
    stride = 2**31 // 15 + 1  # elements between consecutive tokens: 15 rows of a tile already pass 2**31
    seqlen, heads, dim = 20, 2, 64
    need = (seqlen - 1) * stride * 2 + heads * dim * 2
    free, _ = torch.cuda.mem_get_info()
    if free < need * 1.2 + 2**30:
        pytest.skip(f"needs {need / 2**30:.1f} GiB free on the GPU, has {free / 2**30:.1f}")
    storage = torch.empty(need // 2, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.as_strided(storage, (seqlen, 1, heads, dim), (stride, heads * dim, dim, 1))  # q = k = v
    x.copy_(torch.randn(seqlen, 1, heads, dim, device="cuda", generator=gen).to(torch.bfloat16))
    wide = x.detach().requires_grad_()
    dense = x.detach().clone().requires_grad_()  # the same values, contiguous
    out_w = coreattn.padded_attn(wide, wide, wide, layout="sbhd", causal=True, backend="triton")
    out_d = coreattn.padded_attn(dense, dense, dense, layout="sbhd", causal=True, backend="triton")
    g = torch.randn_like(out_d)
    (grad_w,) = torch.autograd.grad(out_w, wide, g)
    (grad_d,) = torch.autograd.grad(out_d, dense, g)
    assert torch.equal(out_w, out_d)
    torch.testing.assert_close(grad_w, grad_d, rtol=0, atol=0)
