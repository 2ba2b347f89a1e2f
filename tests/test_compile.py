"""torch.compile: the public functions and CoreAttention trace without graph breaks through the
coreattn custom ops, compiled runs match eager (forward, backward, dropout for a seed), new packed
lengths do not recompile, torch.library.opcheck passes for each op, and the backend choice and its
overrides still apply when the compiled graph runs.

Most cases use the torch backend and the "aot_eager" compile backend (dynamo + AOTAutograd + the
ops' fake implementations, without Inductor's slow CPU codegen); one case each runs Inductor and
the Triton kernels under the interpreter.
"""

import pytest
import torch
import torch._dynamo.testing
from torch._dynamo.utils import counters

import coreattn
from coreattn.layers import function as ops

H, HKV, DQK, DV = 4, 2, 24, 16
LENS = (5, 0, 9, 3)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _thd(lens=LENS, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype).requires_grad_()
               for h, d in ((H, DQK), (HKV, DQK), (HKV, DV)))
    return q, k, v, _cu(lens), max(lens)


def _bshd(batch=3, seqlen=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, seqlen, h, d, generator=gen).requires_grad_()
                 for h, d in ((H, DQK), (HKV, DQK), (HKV, DV)))


def _keep(batch=3, seqlen=7):
    keep = torch.ones(batch, seqlen, dtype=torch.int64)
    keep[0, seqlen - 2:] = 0  # right padding
    keep[1, :2] = 0  # left padding
    keep[-1, 3] = 0  # a hole
    return keep


def varlen_fn(q, k, v, cu, max_len, offset):
    out, lse, max_logit = coreattn.varlen_attn(q, k, v, cu, cu, max_len, max_len, causal=True, window_size=(3, -1),
                                               softmax_offset=offset, return_lse=True, return_max_logit=True,
                                               backend="torch")
    return out * 2, lse, max_logit


def padded_fn(q, k, v, keep):
    return coreattn.padded_attn(q, k, v, q_keep_mask=keep, k_keep_mask=keep, causal=True, backend="torch")


def flash_fn(q, k, v, cu, max_len):
    return coreattn.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True, return_attn_probs=True)[:2]


def _graph_breaks(fn, *args):
    explained = torch._dynamo.explain(fn)(*args)
    return explained.graph_break_count, [r.reason for r in explained.break_reasons]


def _grads(outs, inputs, seed=3):
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in outs if o.requires_grad)
    return torch.autograd.grad(loss, [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad])


def _assert_same(compiled, eager):
    compiled = compiled if isinstance(compiled, tuple) else (compiled,)
    eager = eager if isinstance(eager, tuple) else (eager,)
    for c, e in zip(compiled, eager, strict=True):
        assert c.shape == e.shape and c.dtype == e.dtype
        torch.testing.assert_close(c, e, rtol=0, atol=0)


CALLS = {
    "varlen_attn": lambda: (varlen_fn, (*_thd(), torch.randn(H, requires_grad=True))),
    "padded_attn": lambda: (padded_fn, (*_bshd(), _keep())),
    "flash_attn_varlen_func": lambda: (flash_fn, _thd()),
}


@pytest.fixture
def torch_backend(monkeypatch):
    """flash_attn_varlen_func has no backend argument: the torch backend through the environment."""
    monkeypatch.setenv("COREATTN_BACKEND", "torch")


@pytest.mark.parametrize("name", list(CALLS))
def test_public_functions_trace_without_graph_breaks(name, torch_backend):
    torch._dynamo.reset()
    fn, args = CALLS[name]()
    assert _graph_breaks(fn, *args) == (0, [])


@pytest.mark.parametrize("name", list(CALLS))
def test_compiled_matches_eager_forward_and_backward(name, torch_backend):
    torch._dynamo.reset()
    fn, args = CALLS[name]()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(*args), fn(*args)
    _assert_same(got, want)
    _assert_same(_grads(got, args), _grads(want, args))


def test_inductor_matches_eager_with_dropout_and_sinks():
    """Inductor around the ops; dropout draws its RNG state in the coreattn::rng_state op when the
    graph runs, so compiled and eager drop the same probabilities for a seed."""
    torch._dynamo.reset()

    def fn(q, k, v, cu, max_len, offset):
        return coreattn.varlen_attn(q, k, v, cu, cu, max_len, max_len, dropout_p=0.3, causal=True,
                                    softmax_offset=offset, backend="torch")

    q, k, v, cu, max_len = _thd()
    offset = torch.randn(H, requires_grad=True)
    compiled = torch.compile(fn, fullgraph=True)
    torch.manual_seed(7)
    got = compiled(q, k, v, cu, max_len, offset)
    torch.manual_seed(7)
    want = fn(q, k, v, cu, max_len, offset)
    _assert_same(got, want)
    assert (got == 0).any()  # dropout dropped something
    args = (q, k, v, offset)
    for c, e in zip(_grads(got, args), _grads(want, args)):
        torch.testing.assert_close(c, e)  # Inductor may fuse the offset's gradient reduction differently


@pytest.mark.interpreter_only("the Triton kernels on CPU tensors (tests/test_gpu.py and the GPU run of the suite "
                              "compile the kernels for real)")
def test_triton_interpreter_compiled_matches_eager():
    torch._dynamo.reset()

    def fn(q, k, v, cu, max_len):
        return coreattn.varlen_attn(q, k, v, cu, cu, max_len, max_len, causal=True, backend="triton")

    q, k, v, cu, max_len = _thd(lens=(3, 6))
    assert _graph_breaks(fn, q, k, v, cu, max_len)[0] == 0
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v, cu, max_len), fn(q, k, v, cu, max_len)
    _assert_same(got, want)
    _assert_same(_grads(got, (q, k, v)), _grads(want, (q, k, v)))


@pytest.mark.parametrize("dynamic, graphs", [(True, 1), (None, 2)], ids=["dynamic", "automatic-dynamic"])
def test_new_packed_lengths_recompile_at_most_once(dynamic, graphs, monkeypatch):
    """20 packed batches of new lengths (and numbers of sequences): one graph with dynamic=True; with
    the default automatic dynamic shapes, the second batch recompiles once and nothing after. The
    backend choice is not logged yet, as in a fresh process (its logging must not add a guard)."""
    from coreattn.layers import backends

    monkeypatch.setattr(backends, "_logged", set())
    torch._dynamo.reset()
    counters.clear()

    def fn(q, k, v, cu, max_len):
        return coreattn.varlen_attn(q, k, v, cu, cu, max_len, max_len, causal=True, backend="torch")

    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    gen = torch.Generator().manual_seed(0)
    for step in range(20):
        lens = torch.randint(2, 12, (int(torch.randint(2, 5, (1,), generator=gen)),), generator=gen).tolist()
        q, k, v, cu, max_len = _thd(lens, seed=step)
        out = compiled(q, k, v, cu, max_len)
        if step % 7 == 0:
            _assert_same(out, fn(q, k, v, cu, max_len))
        out.sum().backward()
    assert counters["stats"]["unique_graphs"] == graphs


def test_value_checks_run_in_the_op_when_compiled():
    """Malformed cu_seqlens raise the eager error from inside the compiled graph."""
    torch._dynamo.reset()

    def fn(q, k, v, cu, max_len):
        return coreattn.varlen_attn(q, k, v, cu, cu, max_len, max_len, backend="torch")

    q, k, v, cu, max_len = _thd()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    compiled(q, k, v, cu, max_len)
    with pytest.raises(ValueError, match="max_seqlen_q = 4 is smaller than the longest sequence"):
        compiled(q, k, v, cu, 4)
    bad = torch.tensor([0, 14, 5, 14, 17], dtype=torch.int32)  # LENS' cu_seqlens is [0, 5, 5, 14, 17]
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        compiled(q, k, v, bad, max_len)


@pytest.mark.interpreter_only("the CPU default backend is Triton only under the interpreter (else torch, which "
                              "takes float64)")
def test_backend_choice_and_override_apply_when_the_compiled_graph_runs(monkeypatch):
    """The op resolves the backend when it runs: COREATTN_BACKEND set after compiling still applies
    (float64 runs only on the torch backend), and an impossible override raises."""
    torch._dynamo.reset()
    monkeypatch.delenv("COREATTN_BACKEND", raising=False)

    def fn(q, k, v, cu, max_len):
        return coreattn.varlen_attn(q, k, v, cu, cu, max_len, max_len)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    q, k, v, cu, max_len = _thd(dtype=torch.float64)
    with pytest.raises(TypeError, match="Triton backend supports"):  # CPU default under TRITON_INTERPRET=1
        compiled(q, k, v, cu, max_len)
    monkeypatch.setenv("COREATTN_BACKEND", "torch")
    _assert_same(compiled(q, k, v, cu, max_len), fn(q, k, v, cu, max_len))
    monkeypatch.setenv("COREATTN_BACKEND", "npu_fused")
    with pytest.raises(RuntimeError, match="npu_fused"):
        compiled(q, k, v, cu, max_len)


# --- opcheck ---------------------------------------------------------------------------------------

def _fwd_args(fmt, backend, dropout_p=0.0, offset=True):
    opts = (0.25, 3, 0, True, dropout_p, torch.tensor([11, 5, 0]) if dropout_p else None,
            torch.randn(H, requires_grad=True) if offset else None, True, backend, True)
    if fmt == "thd":
        q, k, v, cu, max_len = _thd(lens=(3, 0, 6) if backend == "torch" else (2, 3))
        return (q, k, v, "thd", cu, None, None, None, cu, None, None, None, max_len, max_len) + opts
    if fmt == "bshd":
        q, k, v = _bshd(batch=2, seqlen=5)
        keep = _keep(2, 5)
        start, length = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([5, 3], dtype=torch.int32)
        return (q, k, v, "bshd", start, length, keep, None, start, length, keep, None, 5, 5) + opts
    q, k, v, _, _ = _thd(lens=(9,))
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])  # sequences of 3, 2 and 4 tokens
    return (q, k, v, ops.POSITION_IDS, pos, None, None, None, pos, None, None, None, 9, 9) + opts


@pytest.mark.parametrize("fmt, backend, dropout_p", [("thd", "torch", 0.2), ("bshd", "torch", 0.0),
                                                     (ops.POSITION_IDS, "torch", 0.0)])
def test_opcheck_attention_ops(fmt, backend, dropout_p):
    args = _fwd_args(fmt, backend, dropout_p)
    torch.library.opcheck(torch.ops.coreattn.attn_fwd.default, args)
    out, lse, _ = torch.ops.coreattn.attn_fwd(*args)
    q, k, v = (x.detach() for x in args[:3])
    bwd_args = (torch.randn_like(out), q, k, v, out.detach(), lse) + args[3:20] + (args[20].detach(), backend)
    torch.library.opcheck(torch.ops.coreattn.attn_bwd.default, bwd_args)


def test_opcheck_rng_state():
    torch.library.opcheck(torch.ops.coreattn.rng_state.default, (torch.zeros(3),))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter_only(
    "the Triton kernels on CPU tensors"))])
def test_fake_shapes_match_the_op(backend):
    """The fake implementations give the real outputs' shapes, dtypes and strides on each backend
    (also max_logit's empty placeholder); opcheck above runs the torch backend (the interpreter
    would take a minute)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for fmt in ("thd", "bshd", ops.POSITION_IDS):
        args = list(_fwd_args(fmt, backend, offset=False))
        for return_max_logit in (True, False):
            args[21] = return_max_logit
            real = torch.ops.coreattn.attn_fwd(*args)
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fake = torch.ops.coreattn.attn_fwd(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                     for a in args))
            for r, f in zip(real, fake):
                assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride()), fmt


# --- CoreAttention (Megatron) ----------------------------------------------------------------------

def _core_attention_case(kind):
    pytest.importorskip("megatron.core")
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from coreattn.layers import CoreAttention

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=H, num_query_groups=HKV,
                               kv_channels=DQK, attention_dropout=0.0, hidden_dropout=0.0)
    mask_type = AttnMaskType.padding_causal if kind == "sbhd-padding" else AttnMaskType.causal
    layer = CoreAttention(config, 1, mask_type, "self", v_channels=DV, backend="torch")
    if kind.startswith("sbhd"):
        q, k, v = (x.transpose(0, 1).detach().requires_grad_() for x in _bshd(batch=2, seqlen=6))
        mask = ~_keep(2, 6).bool()[:, None, None, :] if kind == "sbhd-padding" else None
        return layer, (q, k, v, mask), {}
    q, k, v, cu, max_len = _thd()
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max_len if kind == "thd" else None,
                             max_seqlen_kv=max_len if kind == "thd" else None)
    return layer, (q, k, v, None), dict(packed_seq_params=params)


@pytest.mark.parametrize("kind", ["sbhd", "sbhd-padding", "thd", "thd-no-max-seqlen"])
def test_core_attention_compiles_without_graph_breaks(kind):
    torch._dynamo.reset()
    layer, args, kwargs = _core_attention_case(kind)
    explained = torch._dynamo.explain(layer)(*args, **kwargs)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got, want = compiled(*args, **kwargs), layer(*args, **kwargs)
    _assert_same(got, want)
    _assert_same(_grads(got, args[:3]), _grads(want, args[:3]))


@pytest.mark.interpreter_only("the CPU default backend is Triton only under the interpreter (else torch, which "
                              "takes float64)")
def test_core_attention_follows_the_backend_environment_when_compiled(monkeypatch):
    """CoreAttention passes its override (None here) to the ops, which resolve it when they run."""
    monkeypatch.delenv("COREATTN_BACKEND", raising=False)
    torch._dynamo.reset()
    layer, (q, k, v, _), _ = _core_attention_case("sbhd")
    layer.backend = None  # the per-device default (Triton under the interpreter on CPU)
    q, k, v = (x.detach().double() for x in (q, k, v))
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with pytest.raises(TypeError, match="Triton backend supports"):
        compiled(q, k, v, None)
    monkeypatch.setenv("COREATTN_BACKEND", "torch")
    _assert_same(compiled(q, k, v, None), layer(q, k, v, None))
