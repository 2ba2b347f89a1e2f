"""The sparse op's block mode (``block_size``: entries name blocks of contiguous keys, MiniMax-M3's
block-sparse attention) against the float64 oracle (tests/sparse_block_cases.py), on both backends.

The torch backend runs every case (CPU); the Triton kernels (the interpreter without a GPU) a few,
each with what the kernels must mask: the own block (causal inside), blocks at sequence starts and
ends, partial last blocks, -1, repeats, blocks past causality and past the sequence, entries past
int32. Then: a block named twice counts once, the backward is bitwise deterministic on both backends,
a block of one key equals the token op, the arguments' checks, and torch.compile's fake shapes.
"""

import pytest
import torch

import coreattn
from attn_cases import KERNEL_DEVICE
from sparse_block_cases import BlockCase, BlockInputs
from sparse_cases import assert_sparse_matches_oracle, incoming_grad

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64

TORCH_CASES = [
    (BlockCase(), (BF16, F32, F64)),
    (BlockCase(per_head=True, block_size=3, n_blocks=4, lens_q=(7, 0, 11, 1, 5), topk_length=True), (F32, F64)),
    (BlockCase(per_head=True, hq=8, hkv=2, block_size=5, bounds=True, bottom_right=False,
               lens_k=(7, 3, 13, 0, 12)), (F32,)),
    (BlockCase(layout="bshd", per_head=True, block_size=4, n_blocks=2, lens_q=(6, 0, 9), lens_k=(4, 2, 11)),
     (F32, F64)),
    (BlockCase(layout="sbhd", per_head=True, left_pad=True, causal=False, block_size=2, n_blocks=3,
               lens_q=(5, 9), index_dtype=torch.int32, own_block=False), (F32,)),
    (BlockCase(layout="bshd", dqk=48, dv=32, hq=4, hkv=1, absorbed=True, sinks=True, block_size=8, n_blocks=2,
               lens_q=(13, 13)), (F32, F64)),
    (BlockCase(hq=4, hkv=4, block_size=1, n_blocks=5, noncontig=True), (F16,)),
]
TRITON_CASES = [
    (BlockCase(per_head=True, hq=4, hkv=2, block_size=5, n_blocks=3, lens_q=(7, 0, 12, 3)), (F32,)),
    (BlockCase(layout="bshd", per_head=True, hq=8, hkv=2, block_size=16, n_blocks=2, bounds=True, topk_length=True,
               lens_q=(5, 0, 19), lens_k=(9, 3, 21)), (F16,)),
    (BlockCase(layout="sbhd", dqk=40, dv=24, hq=2, hkv=1, absorbed=True, sinks=True, block_size=3, n_blocks=4,
               left_pad=True, lens_q=(4, 10)), (F32,)),
]


def _params(cases):
    return [pytest.param(c, d, id=f"{c.id}-{str(d)[6:]}") for c, ds in cases for d in ds]


@pytest.mark.parametrize("case, dtype", _params(TORCH_CASES))
def test_torch_backend_matches_oracle(case, dtype):
    inp = BlockInputs(case, dtype)
    out, lse = inp.call(backend="torch")
    assert_sparse_matches_oracle(inp, out, lse)


@pytest.mark.interpreter_only("the Triton kernels on CPU tensors")
@pytest.mark.parametrize("case, dtype", _params(TRITON_CASES))
def test_triton_backend_matches_oracle(case, dtype):
    inp = BlockInputs(case, dtype)
    run = inp.on(KERNEL_DEVICE)
    out, lse = run.call(backend="triton")
    assert_sparse_matches_oracle(inp, out, lse, run=run)


def _one_sequence(heads=(4, 2, 2), length=11, dim=8):
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(length, h, dim, generator=gen, dtype=torch.float64).requires_grad_() for h in heads)
    return q, k, v, torch.tensor([0, length], dtype=torch.int32)


def test_block_named_twice_counts_once_and_blocks_of_one_are_tokens():
    q, k, v, cu = _one_sequence()
    rows = torch.tensor([[min(n // 3, 2), -1, 0] for n in range(11)])
    twice = torch.tensor([[min(n // 3, 2), min(n // 3, 2), 0] for n in range(11)])
    a = coreattn.sparse_varlen_attn(q, k, v, rows, cu, cu, block_size=3, backend="torch")
    b = coreattn.sparse_varlen_attn(q, k, v, twice, cu, cu, block_size=3, backend="torch")
    assert torch.equal(a, b)
    tokens = torch.tensor([[n, n - 1, 0] for n in range(11)])
    c = coreattn.sparse_varlen_attn(q, k, v, tokens, cu, cu, block_size=1, backend="torch")
    d = coreattn.sparse_varlen_attn(q, k, v, tokens, cu, cu, backend="torch")
    torch.testing.assert_close(c, d, rtol=0, atol=1e-14)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter_only(
    "the Triton kernels on CPU tensors"))])
def test_backward_is_deterministic(backend, monkeypatch):
    """Two backward runs are bitwise equal: many tokens naming the same blocks (the kernels' dK/dV sums
    each block's tokens in one fixed order; the torch backend adds in its plan's order, small chunks)."""
    from coreattn.layers.torch_backend import sparse

    monkeypatch.setenv(sparse.ENV_CHUNK_BYTES, str(1 << 14))
    big = backend == "torch" or KERNEL_DEVICE != "cpu"
    case = BlockCase(layout="thd", per_head=True, dqk=32, dv=16, hq=8 if big else 4, hkv=2, block_size=4,
                     n_blocks=4 if big else 2, lens_q=(40, 23) if big else (9, 6))
    inp = BlockInputs(case, F32).on(KERNEL_DEVICE if backend == "triton" else "cpu")
    runs = []
    for _ in range(2):
        out, _ = inp.call(backend=backend)
        runs.append(torch.autograd.grad(out, inp.leaves(), incoming_grad(out)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(block_size=0), ValueError, "block_size must be >= 1"),
    (dict(block_size=2.0), TypeError, "block_size must be None or an int"),
    (dict(block_size=True), TypeError, "block_size must be None or an int >= 1, got bool"),
    (dict(block_size=2, key_window=(1, 0)), ValueError, "cannot be combined with block_size"),
    (dict(block_size=2, backend="npu_fused"), (RuntimeError, ValueError, NotImplementedError), "npu"),
])
def test_bad_block_arguments_raise_naming_them(kwargs, error, match):
    q, k, v, cu = _one_sequence()
    with pytest.raises(error, match=match):
        coreattn.sparse_varlen_attn(q, k, v, torch.zeros(11, 2, dtype=torch.int64), cu, cu, **kwargs)


def test_compiles_without_graph_breaks_and_the_ops_pass_opcheck():
    """torch.compile traces a block-mode call as one opaque node (compiled = eager, gradients too), and
    the custom ops pass opcheck with block rows (the backward's thd cu_seqlens_k and block size)."""
    torch._dynamo.reset()
    inp = BlockInputs(BlockCase(per_head=True, lens_q=(5, 0, 9)), F32)
    kwargs = dict(inp.kwargs, return_lse=True, backend="torch")

    def fn(q, k, v):
        out, lse = coreattn.sparse_varlen_attn(q, k, v, inp.topk_indices, inp.cu_q, inp.cu_k, **kwargs)
        return out * 2, lse

    args = (inp.q, inp.k, inp.v)
    explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(*args), fn(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    gg, gw = (torch.autograd.grad(x[0], args, incoming_grad(x[0])) for x in (got, want))
    for g, w in zip(gg, gw):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    rows = inp.topk_indices
    fwd = (inp.q, inp.k, inp.v, rows, None, "thd", inp.cu_q, None, inp.cu_k, None, None, None, True, True, 0.25, 16,
           -1, -1, None, "torch", True, 4)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")  # compile is checked above
    torch.library.opcheck(torch.ops.coreattn.sparse_attn_fwd.default, fwd, test_utils=checks)
    out, lse, topk, lo, hi = torch.ops.coreattn.sparse_attn_fwd(*fwd)
    assert topk.shape == rows.shape  # prepared block rows: never one entry per key
    bwd = (torch.randn_like(out), *(x.detach() for x in args), out.detach(), lse, topk, lo, hi, None, "thd", 0.25,
           16, "torch", 4, inp.cu_k)
    torch.library.opcheck(torch.ops.coreattn.sparse_attn_bwd.default, bwd, test_utils=checks)
