"""coreattn.sparse_varlen_attn / sparse_padded_attn (top-k sparse attention) against the float64 oracle.

The torch backend runs every case (CPU); the Triton backend a handful (the kernels' own tests cover
the kernels, tests/kernels/). Every case's index rows mix visible keys with -1 and other negative
entries, repeats, keys of other sequences or past the sample, keys past causality and rows with no
visible key (tests/sparse_cases.py); lengths include an empty sequence and sequences shorter than
top-k. Then: set semantics of duplicates, rows without keys (zeros, zero gradients, no NaN, NaN keys
elsewhere never leak), a deterministic backward, torch.compile (one opaque node, compiled = eager,
opcheck, fake shapes) and the backend choice.
"""

import pytest
import torch
import torch._dynamo.testing

import coreattn
from attn_cases import KERNEL_DEVICE
from conftest import HAS_CUDA
from sparse_cases import SparseCase, SparseInputs, assert_sparse_matches_oracle, incoming_grad

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64

CASES = [
    (SparseCase(), (F16, BF16, F32, F64)),
    # DeepSeek-V3.2's absorbed MLA: one latent key head of 576, V its first 512 columns
    (SparseCase(dqk=576, dv=512, hq=4, hkv=1, absorbed=True, topk=16, lens_q=(7, 0, 12)), (BF16, F32)),
    (SparseCase(per_head=True, causal=True, bottom_right=False, lens_k=(7, 3, 13, 0, 12), topk_length=True),
     (BF16, F32)),
    (SparseCase(hq=4, hkv=4, causal=False, bounds=True, index_dtype=torch.int32, noncontig=True), (F16,)),
    (SparseCase(dqk=24, dv=40, hq=6, hkv=3, topk=40, lens_q=(9, 30)), (F32,)),  # top-k longer than the sequences
    (SparseCase(layout="bshd", per_head=True, lens_q=(6, 0, 9), lens_k=(4, 2, 11)), (BF16, F32, F64)),
    (SparseCase(layout="bshd", hq=2, hkv=2, lens_q=(8, 8), softmax_scale=0.3, bottom_right=False), (F32,)),
    (SparseCase(layout="sbhd", dqk=48, dv=32, hq=4, hkv=1, absorbed=True, topk_length=True, bounds=True,
                lens_q=(6, 1, 10)), (BF16, F32)),
    (SparseCase(layout="sbhd", per_head=True, causal=False, left_pad=True, noncontig=True, lens_q=(5, 9)), (F16, F64)),
    # full rows (every key of the causal range named: read as ranges) alone, and mixed with sparse rows
    (SparseCase(dqk=576, dv=512, hq=4, hkv=1, absorbed=True, topk=16, lens_q=(5, 0, 8), full_rows=1.0), (BF16,)),
    (SparseCase(per_head=True, topk=12, lens_q=(5, 0, 16, 1), full_rows=0.7, bounds=True), (F32, F64)),
    (SparseCase(layout="bshd", hq=4, hkv=2, topk=10, lens_q=(6, 0, 14), lens_k=(9, 2, 14), full_rows=0.8),
     (F32,)),
    (SparseCase(layout="sbhd", hq=2, hkv=1, absorbed=True, dqk=24, dv=16, topk=8, left_pad=True, lens_q=(3, 11),
                full_rows=1.0, causal=True, bottom_right=False), (F32,)),
    # DeepSeek-V4's form: K = V (absorbed at v_head_dim = Dqk), a window of raw keys next to the indices, sinks
    (SparseCase(dqk=32, dv=32, hq=4, hkv=1, absorbed=True, topk=6, key_window=(3, 0), sinks=True, lens_q=(1, 0, 9, 5)),
     (BF16, F32, F64)),
    (SparseCase(layout="bshd", hq=4, hkv=2, topk=5, key_window=(2, 1), causal=False, topk_length=True, sinks=True,
                lens_q=(6, 0, 9)), (F32,)),
    # sinks alone: rows that see no key (every seventh) output zeros, their lse the sink, d_sink from the others
    (SparseCase(hq=4, hkv=2, topk=6, sinks=True, bounds=True, lens_q=(5, 0, 9)), (F32, F64)),
    # DeepSeek-V4's own width: one 512-wide head that is K and V
    (SparseCase(dqk=512, dv=512, hq=4, hkv=1, absorbed=True, topk=8, key_window=(4, 0), sinks=True, lens_q=(5, 0, 11)),
     (BF16, F32)),
    # runs of rows of one kind (whole causal ranges, windows, subsets, a key or two): blocks and units
    (SparseCase(hq=8, hkv=1, topk=16, lens_q=(9, 0, 14), rows="mixed"), (BF16, F32)),
]


def _params(cases):
    return [pytest.param(c, d, id=f"{c.id}-{str(d)[6:]}") for c, ds in cases for d in ds]


@pytest.mark.parametrize("case, dtype", _params(CASES))
def test_torch_backend_matches_oracle(case, dtype):
    inp = SparseInputs(case, dtype)
    out, lse = inp.call(backend="torch")
    assert_sparse_matches_oracle(inp, out, lse)


TRITON_CASES = [
    (SparseCase(lens_q=(5, 0, 9)), (F16,)),
    (SparseCase(dqk=576, dv=512, hq=16, hkv=1, absorbed=True, topk=16, lens_q=(3, 6)), (BF16,)),
    (SparseCase(layout="sbhd", per_head=True, topk_length=True, bounds=True, lens_q=(4, 7)), (F32,)),
    (SparseCase(dqk=576, dv=512, hq=16, hkv=1, absorbed=True, topk=6, lens_q=(4, 8), full_rows=0.7), (BF16,)),
    (SparseCase(dqk=32, dv=32, hq=4, hkv=1, absorbed=True, topk=4, key_window=(3, 0), sinks=True, lens_q=(6, 0, 3)),
     (F32,)),
    (SparseCase(dqk=512, dv=512, hq=16, hkv=1, absorbed=True, topk=6, key_window=(2, 0), sinks=True, lens_q=(4, 7),
                full_rows=0.5), (BF16,)),
    (SparseCase(hq=4, hkv=1, topk=4, sinks=True, lens_q=(8, 3)), (F32,)),
]


@pytest.mark.parametrize("case, dtype", _params(TRITON_CASES))
def test_triton_backend_matches_oracle(case, dtype):
    inp = SparseInputs(case, dtype)
    run = inp.on(KERNEL_DEVICE)
    out, lse = run.call(backend="triton")
    assert_sparse_matches_oracle(inp, out, lse, run=run)


def _one_sequence(dtype=F32, length=6, topk=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(length, h, d, generator=gen).to(dtype).requires_grad_() for h, d in ((4, 16), (2, 16), (2, 8)))
    return q, k, v, torch.tensor([0, length], dtype=torch.int32)


def test_duplicates_count_once():
    """A key named three times weighs what it weighs named once (Megatron's own path is a set)."""
    q, k, v, cu = _one_sequence()
    once = torch.tensor([[0, -1, -1, -1]] + [[0, 1, -1, -1]] * 5)
    thrice = torch.tensor([[0, 0, 0, -1]] + [[1, 0, 1, 0]] * 5)
    a = coreattn.sparse_varlen_attn(q, k, v, once, cu, cu, backend="torch")
    b = coreattn.sparse_varlen_attn(q, k, v, thrice, cu, cu, backend="torch")
    assert torch.equal(a, b)


def test_rows_without_visible_keys_give_zeros_and_zero_gradients():
    """Every entry unused, past causality, in another sequence or past the tensor: out 0, lse -inf,
    no gradient, no NaN; keys holding NaN that a token cannot see never reach it."""
    gen = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    q, k, v = (torch.randn(9, h, d, generator=gen) for h, d in ((2, 8), (1, 8), (1, 8)))
    k[4:], v[4:] = float("nan"), float("nan")  # the second non-empty sequence's keys
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    topk = torch.tensor([[-1, 5, 1, 2]] * 4 + [[0, 3, -7, 99]] * 5)  # sequence 0 names the future and NaN keys
    out, lse = coreattn.sparse_varlen_attn(q, k, v, topk, cu, cu, return_lse=True, backend="torch")
    assert not out[4:].any() and torch.isneginf(lse[:, 4:]).all()
    assert torch.isfinite(out[:4]).all() and torch.isneginf(lse[:, 0]).all() and torch.isfinite(lse[:, 1:4]).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not g.isnan().any(), name
    assert not dq[4:].any() and not dq[0].any() and not dk[4:].any() and not dv[4:].any()


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter_only(
    "the Triton kernels on CPU tensors"))])
@pytest.mark.parametrize("shape", [(6, 0), (6, 2, 0)], ids=["K0", "heads-K0"])
def test_no_top_k_entries_give_zeros(shape, backend):
    """K = 0 (Megatron's min(topk, sk) with no key): every row has no key, as if all its entries were -1:
    out 0, lse -inf, zero gradients, no NaN."""
    gen = torch.Generator().manual_seed(2)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    q, k, v = (torch.randn(6, h, 8, generator=gen).requires_grad_() for h in (4, 2, 2))
    topk = torch.zeros(shape, dtype=torch.int64)
    out, lse = coreattn.sparse_varlen_attn(q, k, v, topk, cu, cu, return_lse=True, backend=backend)
    assert out.shape == (6, 4, 8) and not out.any() and torch.isneginf(lse).all()
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(not g.isnan().any() and not g.any() for g in grads)


@pytest.mark.parametrize("layout, backend", [("thd", "torch"), ("sbhd", "torch"), ("thd", "triton")])
def test_backward_is_deterministic(layout, backend, monkeypatch):
    """Two backward runs are bitwise equal, with many tokens adding into the same keys and chunks of a
    few tokens (several dK/dV accumulation rounds; the Triton case: its default chunks, smaller inputs)."""
    from coreattn.layers.torch_backend import sparse

    monkeypatch.setenv(sparse.ENV_CHUNK_BYTES, str(1 << 14))
    big = backend == "torch" or KERNEL_DEVICE != "cpu"
    case = SparseCase(layout=layout, dqk=64 if big else 32, dv=64 if big else 16, hq=8 if big else 4, hkv=2,
                      topk=32 if big else 8, lens_q=(40, 23) if big else (7, 5), full_rows=0.6)
    inp = SparseInputs(case, F32).on(KERNEL_DEVICE if backend == "triton" else "cpu")
    runs = []
    for _ in range(2):
        out, _ = inp.call(backend=backend)
        runs.append(torch.autograd.grad(out, inp.leaves(), incoming_grad(out)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_megatron_topk_layout_is_a_view():
    """sbhd: Megatron's ``[b, s, K]`` indices passed as their ``[s, b, K]`` transposed view are read in
    place and give what a contiguous ``[s, b, K]`` tensor gives."""
    from coreattn.layers.checks import flat_tokens

    inp = SparseInputs(SparseCase(layout="sbhd", hq=4, hkv=1, lens_q=(5, 5)), F32)
    contiguous = inp.topk_indices.contiguous()  # [s, b, K]
    view = contiguous.transpose(0, 1).contiguous().transpose(0, 1)  # a [b, s, K] tensor seen as [s, b, K]
    assert flat_tokens(view, "sbhd").data_ptr() == view.data_ptr()
    outs = [coreattn.sparse_padded_attn(inp.q, inp.k, inp.v, t, **inp.kwargs, backend="torch")
            for t in (view, contiguous)]
    assert torch.equal(*outs)


# ---- torch.compile: one opaque node --------------------------------------------------------------

def _compile_case(layout, small=False):
    case = SparseCase(layout=layout, absorbed=layout == "sbhd", hkv=1 if layout == "sbhd" else 2, topk_length=True,
                      lens_q=(3, 0, 2) if small else (5, 0, 7) if layout == "thd" else (5, 7), topk=4 if small else 8)
    return SparseInputs(case, F32)


@pytest.mark.parametrize("layout, backend", [("thd", "torch"), ("bshd", "torch"), ("sbhd", "torch"),
                                             pytest.param("thd", "triton", marks=pytest.mark.interpreter_only(
                                                 "the Triton kernels on CPU tensors"))])
def test_compiles_without_graph_breaks_and_matches_eager(layout, backend):
    torch._dynamo.reset()
    inp = _compile_case(layout, small=backend == "triton" and KERNEL_DEVICE == "cpu")
    topk, kwargs = inp.topk_indices, dict(inp.kwargs, return_lse=True, backend=backend)
    if layout == "thd":
        cu_q, cu_k = inp.cu_q, inp.cu_k

        def fn(q, k, v):
            out, lse = coreattn.sparse_varlen_attn(q, k, v, topk, cu_q, cu_k, **kwargs)
            return out * 2, lse
    else:
        def fn(q, k, v):
            out, lse = coreattn.sparse_padded_attn(q, k, v, topk, **kwargs)
            return out * 2, lse

    args = (inp.q, inp.k, inp.v)
    explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert sum("sparse_attn_fwd" in t for t in ops) == 1, ops
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(*args), fn(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    leaves = [x for x in args if x is not None]
    gg = torch.autograd.grad(got[0], leaves, incoming_grad(got[0]))
    gw = torch.autograd.grad(want[0], leaves, incoming_grad(want[0]))
    for g, w in zip(gg, gw):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _op_args(layout="thd", absorbed=False, extras=False):
    """The forward op's arguments; ``extras``: with a window (2, 1) and a softmax offset."""
    case = SparseCase(layout=layout, absorbed=absorbed, hkv=1 if absorbed else 2, per_head=not absorbed,
                      topk_length=True, bounds=True, lens_q=(4, 0, 6) if layout == "thd" else (4, 6))
    inp = SparseInputs(case, F32)
    from coreattn.layers.checks import flat_tokens

    kw = inp.kwargs
    topk = flat_tokens(inp.topk_indices, layout)
    topk = topk if topk.dim() == 3 else topk.unsqueeze(1)
    length = flat_tokens(kw["topk_length"], layout)
    lo, hi = (flat_tokens(b, layout) for b in kw["key_bounds"])
    if layout == "thd":
        seq = (inp.cu_q, None, inp.cu_k, None)
    else:
        seq = (kw["q_start"], kw["q_len"], kw["k_start"], kw["k_len"])
    window, offset = ((2, 1), torch.randn(case.hq, requires_grad=True)) if extras else ((-1, -1), None)
    return (inp.q, inp.k, inp.v, topk, length, layout, *seq, lo, hi, True, True, 0.25, case.dv, *window, offset,
            "torch", True)


@pytest.mark.parametrize("layout, absorbed, extras", [("thd", False, False), ("sbhd", True, False), ("bshd", False, True)])
def test_opcheck_sparse_ops(layout, absorbed, extras):
    args = _op_args(layout, absorbed, extras)
    torch.library.opcheck(torch.ops.coreattn.sparse_attn_fwd.default, args)
    out, lse, topk, lo, hi = torch.ops.coreattn.sparse_attn_fwd(*args)
    q, k, v = (None if x is None else x.detach() for x in args[:3])
    offset = None if args[18] is None else args[18].detach()
    bwd = (torch.randn_like(out), q, k, v, out.detach(), lse, topk, lo, hi, offset, layout, 0.25, args[15], "torch")
    torch.library.opcheck(torch.ops.coreattn.sparse_attn_bwd.default, bwd)


@pytest.mark.parametrize("layout, absorbed, extras", [("thd", False, False), ("bshd", False, True),
                                                      ("sbhd", True, False)])
def test_fake_shapes_match_the_op(layout, absorbed, extras):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _op_args(layout, absorbed, extras)
    real = torch.ops.coreattn.sparse_attn_fwd(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.coreattn.sparse_attn_fwd(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                    for a in args))
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride()), layout


# ---- backend choice ------------------------------------------------------------------------------

def test_npu_fused_sparse_attention_needs_npu_tensors(monkeypatch):
    q, k, v, cu = _one_sequence()
    topk = torch.zeros(6, 4, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="npu_fused' cannot run sparse attention on cpu"):
        coreattn.sparse_varlen_attn(q, k, v, topk, cu, cu, backend="npu_fused")
    # set for dense attention, COREATTN_BACKEND=npu_fused leaves sparse attention at its default
    monkeypatch.setenv("COREATTN_BACKEND", "npu_fused")
    from coreattn.layers.backends import Backend, select_sparse_backend

    # the kernels' device: CUDA, or CPU under the interpreter (tests/conftest.py)
    assert select_sparse_backend(torch.device(KERNEL_DEVICE)) is Backend.TRITON
    monkeypatch.setenv("COREATTN_BACKEND", "torch")
    assert select_sparse_backend(torch.device(KERNEL_DEVICE)) is Backend.TORCH


def test_backend_resolved_when_the_compiled_graph_runs(monkeypatch):
    """float64 runs only on the torch backend: COREATTN_BACKEND set after compiling still applies."""
    torch._dynamo.reset()
    monkeypatch.setenv("COREATTN_BACKEND", "triton")
    q, k, v, cu = _one_sequence(F64)
    topk = torch.tensor([[0, 1, 2, 3]] * 6)

    def fn(q, k, v):
        return coreattn.sparse_varlen_attn(q, k, v, topk, cu, cu)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    if KERNEL_DEVICE == "cpu" and not HAS_CUDA:  # the interpreter runs CPU tensors: the dtype check raises
        with pytest.raises(TypeError, match="Triton backend supports"):
            compiled(q, k, v)
    monkeypatch.setenv("COREATTN_BACKEND", "torch")
    torch.testing.assert_close(compiled(q, k, v), fn(q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("block_size", [None, 2], ids=["topk", "blocks"])
def test_a_call_the_launch_tables_refuse_runs_on_the_torch_backend(monkeypatch, caplog, block_size):
    """Where the Triton kernels' tables refuse a call (configs/sparse.py ``refusal``: float32 past 256 columns on
    CUDA and CDNA, which spills), the default is the torch backend with the reason logged, forward and backward,
    in the token and the block mode and with the key-centric dK/dV asked for (COREATTN_SPARSE_DKV); an explicit
    backend="triton" (argument or COREATTN_BACKEND) raises naming it."""
    from coreattn.layers import backends
    from coreattn.layers.dsa import sparse_function

    reason = "float32 with head blocks 576/512 on sm90: (stand-in)"
    monkeypatch.setattr(sparse_function, "triton_refusal", lambda *args: reason)
    monkeypatch.setattr(backends, "_logged", set())  # each case sees its choices logged
    monkeypatch.setenv("COREATTN_SPARSE_DKV", "keys")
    q, k, v, cu = _one_sequence()
    q, k, v = (t.detach().to(KERNEL_DEVICE).requires_grad_() for t in (q, k, v))
    cu = cu.to(KERNEL_DEVICE)
    topk = torch.tensor([[0, 1, 2, 3]] * 6, device=KERNEL_DEVICE)
    if block_size:
        topk = topk // block_size
    mode = dict(block_size=block_size) if block_size else {}
    runs = []
    with caplog.at_level("INFO", logger="coreattn"):
        for backend in (None, "torch"):
            out = coreattn.sparse_varlen_attn(q, k, v, topk, cu, cu, backend=backend, **mode)
            runs.append((out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))))
    for got, want in zip(*runs):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    logged = [r.message for r in caplog.records if "torch backend" in r.message and reason in r.message]
    assert any("sparse attention backward" in m for m in logged) and any("backward" not in m for m in logged)
    with pytest.raises(RuntimeError, match=r"backend='triton' cannot run this sparse attention call: float32"):
        coreattn.sparse_varlen_attn(q, k, v, topk, cu, cu, backend="triton", **mode)
    monkeypatch.setenv("COREATTN_BACKEND", "triton")
    with pytest.raises(RuntimeError, match=r"COREATTN_BACKEND='triton' cannot run this sparse attention call"):
        coreattn.sparse_varlen_attn(q, k, v, topk, cu, cu, **mode)
