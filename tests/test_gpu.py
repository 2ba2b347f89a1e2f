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


# --- DeepSeek Sparse Attention compiled: the sparse kernels' range mode (full rows as dense attention over
# --- contiguous keys) and slot mode (each sparse row to its count), and the indexer's kernels

def _dsa_batch(lens, topk: int, heads: int = 16, seed: int = 0):
    """Absorbed MLA 576/512 in bf16 on CUDA, packed ``lens``: token i of a sequence names min(K, i + 1)
    keys spread over its causal range (bench/sparse.py's rule, offsets into the packed k), so each
    sequence's first K tokens are full rows and the rest sparse. Returns (q, k, indices [T, K], cu)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lens)
    q = torch.randn(total, heads, 576, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(total, 1, 576, device="cuda", generator=gen).to(torch.bfloat16)
    starts = torch.tensor([0, *lens[:-1]]).cumsum(0).tolist()
    pos = torch.cat([torch.arange(n) for n in lens])
    start = torch.cat([torch.full((n,), s) for n, s in zip(lens, starts)])
    j = torch.arange(topk)[None, :]
    i = pos[:, None]
    spread = torch.where(i + 1 >= topk, (j * (i + 1)) // topk, torch.where(j <= i, j, -1))
    indices = torch.where(spread >= 0, spread + start[:, None], -1).to("cuda")
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, indices, cu


def _dsa_reference(q, k, indices, scale, dout, upcast: bool):
    """(out, dq, dk) of the dense masked softmax over each token's named keys: float64, or the naive
    computation in the inputs' dtype (fp32 scores from bf16 values, P and the results rounded to
    bf16). Absorbed: V = k[..., :512]."""
    work = torch.float64 if upcast else torch.float32
    qq, kk = (x.detach().to(torch.float64 if upcast else x.dtype).requires_grad_() for x in (q, k))
    total = q.shape[0]
    mask = torch.zeros(total, total + 1, dtype=torch.bool, device=q.device)
    mask.scatter_(1, torch.where(indices >= 0, indices, total), True)
    s = torch.einsum("thd,jd->htj", qq.to(work), kk[:, 0].to(work)) * scale
    p = torch.softmax(s.masked_fill(~mask[:, :total], float("-inf")), -1)
    if not upcast:
        p = p.to(q.dtype).to(work)
    out = torch.einsum("htj,jd->thd", p, kk[:, 0, :512].to(work)).to(qq.dtype)
    return (out, *torch.autograd.grad(out, (qq, kk), dout.to(qq.dtype)))


def test_sparse_full_and_mixed_rows_compiled_match_float64_without_syncs():
    """Sequences shorter and longer than top-k in one packed batch (full rows, then sparse ones, an
    empty sequence): out, dq and dk within the flash criterion of a float64 dense reference; a second
    call under torch.cuda.set_sync_debug_mode("error") is bitwise equal (no host sync, deterministic)."""
    from attn_cases import assert_flash_criterion

    q, k, indices, cu = _dsa_batch((700, 0, 129, 300), topk=256)
    scale = 192 ** -0.5
    dout = torch.randn(q.shape[0], q.shape[1], 512, device="cuda", generator=torch.Generator(device="cuda")
                       .manual_seed(1)).to(torch.bfloat16)

    def run():
        qq, kk = q.detach().requires_grad_(), k.detach().requires_grad_()
        out = coreattn.sparse_varlen_attn(qq, kk, None, indices, cu, cu, softmax_scale=scale, v_head_dim=512,
                                          backend="triton")
        return (out, *torch.autograd.grad(out, (qq, kk), dout))

    first = run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = _dsa_reference(q, k, indices, scale, dout, upcast=True)
    naive = _dsa_reference(q, k, indices, scale, dout, upcast=False)
    for name, got, again, r, n in zip(("out", "dq", "dk"), first, second, ref, naive):
        assert torch.equal(got, again), f"{name}: two runs differ"
        assert_flash_criterion(name, got.float(), n.float(), r)


def test_sparse_new_batches_do_not_recompile():
    """Other lengths, top-k and mixes of full and sparse rows reuse the compiled sparse kernels (both
    modes), their preprocess and reduce kernels."""
    from coreattn.kernels.attn_bwd import _attn_bwd_preprocess_kernel
    from coreattn.kernels.sparse_bwd import _sparse_attn_dkv_kernel, _sparse_attn_dq_kernel, _sparse_attn_reduce_kernel
    from coreattn.kernels.sparse_fwd import _sparse_attn_fwd_kernel

    kernels = (_sparse_attn_fwd_kernel, _sparse_attn_dq_kernel, _sparse_attn_dkv_kernel, _sparse_attn_reduce_kernel,
               _attn_bwd_preprocess_kernel)

    def step(lens, topk, seed):
        q, k, indices, cu = _dsa_batch(lens, topk, heads=16, seed=seed)
        q.requires_grad_()
        out = coreattn.sparse_varlen_attn(q, k, None, indices, cu, cu, v_head_dim=512, backend="triton")
        out.backward(torch.ones_like(out))

    step((100, 37, 300), 64, 0)
    before = [_compiled_count(kernel) for kernel in kernels]
    for i, (lens, topk) in enumerate([((5,), 64), ((1000, 3, 0, 77), 128), ((1,), 1), ((513, 64), 2048)]):
        step(lens, topk, i + 1)
    assert [_compiled_count(kernel) for kernel in kernels] == before


def test_indexer_kernels_compiled_match_the_oracle():
    """The DSA indexer's Triton kernels on CUDA: the fused scores + top-k on integer-valued inputs (every
    score exact, ties broken to the lower key as the oracle does), thd with an empty and a short sequence
    and sbhd, and the Hadamard rotation against its definition."""
    import indexer_oracle as oracle
    from coreattn.layers.dsa import indexer as ix

    gen = torch.Generator().manual_seed(0)
    cu = [0, 7, 7, 10, 260, 300]
    for layout, batch, seqlen in (("thd", 1, cu[-1]), ("sbhd", 2, 150)):
        q = torch.randint(-2, 3, (batch, seqlen, 8, 64), generator=gen).float()
        k = torch.randint(-2, 3, (batch, seqlen, 64), generator=gen).float()
        w = torch.tensor([0.5, -1.0, 2.0, 0.25] * 2).repeat(batch, seqlen, 1)
        lo, hi = oracle.causal_bounds(batch, seqlen, cu if layout == "thd" else None, True)
        expected = oracle.topk_ref(oracle.index_scores(q, k, w, True), lo, hi, 32)
        kw = dict(cu_seqlens=torch.tensor(cu, dtype=torch.int32, device="cuda")) if layout == "thd" else {}
        sides = [x.to("cuda") for x in (q, k, w)]
        sides = [x[0] for x in sides] if layout == "thd" else [x.transpose(0, 1).contiguous() for x in sides]
        got = ix.indexer_topk(*sides, 32, layout=layout, relu=True, causal=True, backend="triton", **kw)
        got = got.indices[None] if layout == "thd" else got.indices.transpose(0, 1)
        assert torch.equal(got.cpu(), expected), layout
    x = torch.randn(300, 128, generator=gen, dtype=torch.float64)
    size = 128
    h = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(size)] for i in range(size)], dtype=torch.float64)
    ref = x @ h * size ** -0.5
    got = ix.hadamard_transform(x.float().to("cuda"), size ** -0.5, backend="triton")
    assert (got.double().cpu() - ref).abs().max() <= 1e-5 * ref.abs().max()
