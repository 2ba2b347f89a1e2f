"""Additive biases computed in registers (``bias=``): Inkling 2's low-rank relative bias and T5's
bucketed relative bias, through the public functions, on the Triton kernels (the interpreter
without a GPU) and the torch backend, against the float64 oracle (tests/oracle.py with the bias
built here from its definition: the distances by Python loops, T5's buckets by transformers' own
``T5Attention._relative_position_bucket``), under the flash criterion for out, lse and every
gradient (q, k, v, the bias's tensors); the backward bitwise-deterministic."""

from __future__ import annotations

import pytest
import torch

import coreattn
from attn_cases import (KERNEL_DEVICE, Case, assert_flash_criterion, assert_lse_criterion, cu_from_lens,
                        make_inputs)
from coreattn import BucketedRelativeBias, LowRankRelativeBias
from coreattn.kernels import dropout
from oracle import attention_ref, padded_attention_ref

F32, F16 = torch.float32, torch.float16


def _distances(len_q: int, len_k: int, bottom_right: bool) -> torch.Tensor:
    """[Lq, Lk] int64: i + shift - j, written out pair by pair."""
    shift = len_k - len_q if bottom_right else 0
    return torch.tensor([[i + shift - j for j in range(len_k)] for i in range(len_q)], dtype=torch.long).view(len_q,
                                                                                                             len_k)


def low_rank_fn(states: torch.Tensor, proj: torch.Tensor, bottom_right: bool = True):
    """bias_fn of LowRankRelativeBias(states [T, H, R], proj [R, E]) on packed rows."""
    def fn(b, q0, len_q, len_k):
        d = _distances(len_q, len_k, bottom_right)
        inside = (d >= 0) & (d < proj.shape[1])
        cols = proj[:, d.clamp(0, proj.shape[1] - 1)]  # [R, Lq, Lk]
        return torch.where(inside, torch.einsum("ihr,rij->hij", states[q0:q0 + len_q], cols), 0.0)
    return fn


def bucket_fn(embedding: torch.Tensor, bidirectional: bool, max_distance: int, bottom_right: bool = True):
    """bias_fn of BucketedRelativeBias(embedding [num_buckets, H], ...): transformers' buckets of j - i - shift."""
    T5Attention = pytest.importorskip("transformers.models.t5.modeling_t5").T5Attention

    def fn(b, q0, len_q, len_k):
        rel = -_distances(len_q, len_k, bottom_right)
        buckets = T5Attention._relative_position_bucket(rel, bidirectional, embedding.shape[0], max_distance)
        return embedding[buckets].permute(2, 0, 1)  # [H, Lq, Lk]
    return fn


def _leaves(*tensors):
    return [t.detach().cpu().double().requires_grad_() if t.dtype != torch.float64 else t.detach().cpu()
            .requires_grad_() for t in tensors]


def _check(out, lse, grads, names, ref_fn, inputs, g):
    """out, lse and grads against the float64 oracle and the naive same-dtype computation."""
    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in inputs]
    naive_leaves = [t.detach().cpu().requires_grad_() for t in inputs]
    naive_leaves = [t if t.dtype != torch.float16 else t for t in naive_leaves]
    ref, ref_lse = ref_fn(ref_leaves, True)
    naive, naive_lse = ref_fn(naive_leaves, False)
    assert_flash_criterion("out", out.detach().cpu(), naive, ref)
    if lse is not None:
        assert_lse_criterion(lse, naive_lse, ref_lse)
    refs = torch.autograd.grad(ref, ref_leaves, g.double())
    naives = torch.autograd.grad(naive, naive_leaves, g.to(naive.dtype))
    for name, got, r, n in zip(names, grads, refs, naives):
        assert got.shape == r.shape, name
        assert_flash_criterion(name, got.detach().cpu(), n, r)


CASES = [
    # (backend, dtype, case, kind): kind "rank3" = LowRankRelativeBias with R = 3 over 9 distances;
    # "t5-bi" / "t5-causal" = BucketedRelativeBias with 8 buckets, max_distance 6
    pytest.param("triton", F32, Case(dqk=32, dv=16, hq=4, hkv=2, causal=True, lens_q=(0, 17, 6), lens_k=(3, 22, 0)),
                 "rank3", id="triton-fp32-low-rank-gqa-causal-qk-lens-differ"),
    pytest.param("triton", F16, Case(dqk=48, dv=32, hq=2, hkv=1, window=(5, 3), lens_q=(7, 40)), "t5-bi",
                 id="triton-fp16-t5-bidirectional-window"),
    pytest.param("torch", F32, Case(dqk=32, dv=16, hq=4, hkv=2, causal=True, lens_q=(0, 17, 6), lens_k=(3, 22, 0)),
                 "rank3", id="torch-fp32-low-rank-gqa-causal-qk-lens-differ"),
    pytest.param("torch", F16, Case(dqk=48, dv=32, hq=2, hkv=1, causal=True, bottom_right=False,
                                    lens_q=(7, 40), lens_k=(9, 30)), "t5-causal",
                 id="torch-fp16-t5-causal-topleft"),
]


def _bias(kind, case, tq, device, seed=2):
    gen = torch.Generator().manual_seed(seed)
    if kind == "rank3":
        states = torch.randn(tq, case.hq, 3, generator=gen) * 0.7
        proj = torch.randn(3, 9, generator=gen)
        return (states.to(device), proj.to(device))
    return (torch.randn(8, case.hq, generator=gen).to(device),)


def _make(kind, tensors):
    if kind == "rank3":
        return LowRankRelativeBias(*tensors)
    return BucketedRelativeBias(tensors[0], kind == "t5-bi", 6)


def _ref_fn(kind, tensors, bottom_right):
    if kind == "rank3":
        return low_rank_fn(*tensors, bottom_right)
    return bucket_fn(tensors[0], kind == "t5-bi", 6, bottom_right)


@pytest.mark.parametrize("backend, dtype, case, kind", CASES)
def test_bias_matches_oracle(backend, dtype, case, kind):
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, dtype, KERNEL_DEVICE, requires_grad=True)
    tensors = [t.requires_grad_() for t in _bias(kind, case, q.shape[0], q.device)]
    opts = dict(causal=case.causal, window_size=case.window,
                causal_alignment="bottom_right" if case.bottom_right else "top_left")

    def run():
        return coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, backend=backend,
                                    bias=_make(kind, tensors), **opts)

    out, lse = run()
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    grads = torch.autograd.grad(out, [q, k, v] + tensors, g.to(out.device))

    def ref_fn(leaves, upcast):
        return attention_ref(*leaves[:3], cu_q.cpu(), cu_k.cpu(), causal=case.causal, window=case.window,
                             bottom_right=case.bottom_right, upcast=upcast,
                             bias_fn=_ref_fn(kind, leaves[3:], case.bottom_right))

    names = ["dq", "dk", "dv"] + (["d_states", "d_proj"] if kind == "rank3" else ["d_embedding"])
    _check(out, lse, grads, names, ref_fn, [q, k, v] + tensors, g)
    if dtype == F16:  # one rerun per backend
        again = torch.autograd.grad(run()[0], [q, k, v] + tensors, g.to(out.device))
        assert all(torch.equal(a, b) for a, b in zip(grads, again)), "the backward is not bitwise deterministic"


@pytest.mark.parametrize("backend, layout", [("triton", "bshd"), ("torch", "sbhd")])
def test_padded_low_rank_bias_with_token_sinks_and_window(backend, layout):
    """Inkling 2's attention call: right padding as keep masks, a sliding window, the low-rank bias
    and per-token sinks [B, Hq, S] together, GQA, on a padded batch used in place."""
    gen = torch.Generator().manual_seed(4)
    b, s, hq, hkv, d, rank, extent = 2, 13, 4, 2, 16, 2, 6
    q, k, v = (torch.randn(b, s, h, d, generator=gen).to(KERNEL_DEVICE) for h in (hq, hkv, hkv))
    states = torch.randn(b, s, hq, rank, generator=gen).to(KERNEL_DEVICE)
    proj = torch.randn(rank, extent, generator=gen).to(KERNEL_DEVICE)
    sinks = torch.randn(b, hq, s, generator=gen).to(KERNEL_DEVICE)
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[1, 9:] = False
    leaves = [t.requires_grad_() for t in (q, k, v, states, proj, sinks)]

    def view(x):  # bshd -> the layout
        return x.transpose(0, 1) if layout == "sbhd" else x

    out = coreattn.padded_attn(view(q), view(k), view(v), layout=layout, q_keep_mask=keep.to(q.device),
                               k_keep_mask=keep.to(q.device), causal=True, window_size=(4, 0),
                               softmax_offset=sinks, bias=LowRankRelativeBias(view(states), proj), backend=backend)
    out = view(out)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(out, leaves, g.to(out.device))

    def ref_fn(lv, upcast):
        def bias_fn(bi, q0, len_q, len_k):
            return low_rank_fn(lv[3][bi], lv[4])(0, 0, len_q, len_k)
        out = padded_attention_ref(*lv[:3], keep, keep, causal=True, window=(4, 0), upcast=upcast,
                                   softmax_offset=lv[5], bias_fn=bias_fn)
        return out, None

    _check(out, None, grads, ["dq", "dk", "dv", "d_states", "d_proj", "d_sinks"], ref_fn, leaves, g)


def test_t5_bias_with_dropout_on_the_kernels():
    """T5 trains with attention dropout: the bias's gradient with the forward's keep mask regenerated."""
    case = Case(dqk=16, dv=16, hq=2, hkv=2, lens_q=(5, 19))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, F32, KERNEL_DEVICE, requires_grad=True)
    emb = torch.randn(8, 2, generator=torch.Generator().manual_seed(1)).to(q.device).requires_grad_()
    torch.manual_seed(5)
    state = dropout.rng_state(q.device)
    torch.manual_seed(5)
    p = 0.25
    out = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=p, backend="triton",
                               bias=BucketedRelativeBias(emb, True, 6))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(out, [q, k, v, emb], g.to(out.device))
    keep_fn = lambda heads, qi, ki: dropout.keep_mask(state.cpu(), p, heads, qi, ki)  # noqa: E731

    def ref_fn(lv, upcast):
        return attention_ref(*lv[:3], cu_q.cpu(), cu_k.cpu(), upcast=upcast, dropout_p=p, keep_fn=keep_fn,
                             bias_fn=bucket_fn(lv[3], True, 6))

    _check(out, None, grads, ["dq", "dk", "dv", "d_embedding"], ref_fn, [q, k, v, emb], g)


def test_bucket_table_is_t5s():
    """coreattn.layers.bias.t5_buckets equals transformers' bucket function, boundaries included."""
    T5Attention = pytest.importorskip("transformers.models.t5.modeling_t5").T5Attention

    from coreattn.layers.bias import t5_buckets

    for bidirectional in (True, False):
        for buckets, max_distance in ((32, 128), (8, 20)):
            rel = torch.arange(-max_distance, max_distance + 1)
            want = T5Attention._relative_position_bucket(rel, bidirectional, buckets, max_distance)
            assert torch.equal(t5_buckets(bidirectional, buckets, max_distance), want)


def test_bad_bias_arguments_name_the_argument():
    q = torch.randn(6, 2, 8)
    cu = cu_from_lens((6,), "cpu")
    call = lambda bias, **kw: coreattn.varlen_attn(q, q, q, cu, cu, 6, 6, bias=bias, backend="torch", **kw)  # noqa
    with pytest.raises(TypeError, match="bias must be a coreattn.LowRankRelativeBias"):
        call(torch.zeros(2, 6, 6))
    with pytest.raises(ValueError, match="bias.states has shape"):
        call(LowRankRelativeBias(torch.zeros(6, 2, 4), torch.zeros(3, 5)))
    with pytest.raises(ValueError, match="bias.proj must have 2 dims"):
        call(LowRankRelativeBias(torch.zeros(6, 2, 3), torch.zeros(3)))
    with pytest.raises(TypeError, match="bias.proj must be a floating tensor"):
        call(LowRankRelativeBias(torch.zeros(6, 2, 3), torch.zeros(3, 5, dtype=torch.int64)))
    with pytest.raises(ValueError, match="bias.embedding has shape"):
        call(BucketedRelativeBias(torch.zeros(8, 3), True, 6))
    with pytest.raises(ValueError, match="bias.max_distance must be an int >= 1"):
        call(BucketedRelativeBias(torch.zeros(8, 2), True, 0))
    with pytest.raises(TypeError, match="bias.bidirectional must be a bool"):
        call(BucketedRelativeBias(torch.zeros(8, 2), 1, 6))
    with pytest.raises(ValueError, match="bias.buckets has shape"):
        call(BucketedRelativeBias(torch.zeros(8, 2), True, 6, torch.zeros(5, dtype=torch.long)))
    with pytest.raises(NotImplementedError, match="bias with return_max_logit"):
        call(BucketedRelativeBias(torch.zeros(8, 2), True, 6), return_max_logit=True)


def test_opcheck_with_a_bias():
    """The attention ops with a bias's four arguments: schema, fake shapes and autograd (torch backend)."""
    from coreattn.layers.bias import check_bias
    from coreattn.layers import function as ops

    q, k, v = (torch.randn(9, 2, 8, requires_grad=True) for _ in range(3))
    cu = cu_from_lens((4, 5), "cpu")
    for bias in (LowRankRelativeBias(torch.randn(9, 2, 3), torch.randn(3, 5)),
                 BucketedRelativeBias(torch.randn(8, 2), False, 6)):
        table, coef, lo, clamp = check_bias(bias, q)
        table.requires_grad_()
        coef = None if coef is None else coef.requires_grad_()
        args = (q, k, v, "thd", cu, None, None, None, cu, None, None, None, 5, 5, 0.3, -1, 0, True, 0.0, None, None,
                False, "torch", True, table, coef, lo, clamp)
        torch.library.opcheck(torch.ops.coreattn.attn_fwd.default, args)
        out, lse, _ = ops.attn_fwd(*args)
        bwd = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse) + args[3:20] + (
            None, "torch", table.detach(), None if coef is None else coef.detach(), lo, clamp)
        torch.library.opcheck(torch.ops.coreattn.attn_bwd.default, bwd)


@pytest.mark.interpreter_only("runs the kernels' looped mode under the interpreter")
def test_bias_kernels_looped_launch_is_bitwise_the_unlooped(monkeypatch):
    """A biased forward + backward through the launch seam (kernels/launch.py) with the interpreter's
    grid shrunk to 3 programs: the launches past it, the table-gradient kernel's included, loop over
    their tasks (PERSISTENT) and give bitwise what one program per task gives."""
    from coreattn.kernels import launch as seam

    case = Case(dqk=16, dv=16, hq=2, hkv=1, lens_q=(5, 12))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, F32, KERNEL_DEVICE, requires_grad=True)
    gen = torch.Generator().manual_seed(4)
    states = torch.randn(q.shape[0], 2, 3, generator=gen).to(q.device).requires_grad_()
    proj = torch.randn(3, 6, generator=gen).to(q.device).requires_grad_()
    emb = torch.randn(8, 2, generator=gen).to(q.device).requires_grad_()
    g = torch.randn(q.shape[0], 2, 16, generator=gen).to(q.device)

    def run():
        results = []
        for bias, table in ((LowRankRelativeBias(states, proj), [states, proj]),
                            (BucketedRelativeBias(emb, True, 6), [emb])):
            out = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, backend="triton", bias=bias)
            results += [out, *torch.autograd.grad(out, [q, k, v, *table], g)]
        return results

    plain = run()
    looped = []
    real_fit, real_max = seam.fit_grid, seam.max_programs

    def spy(*args, **kwargs):
        grid, was_looped = real_fit(*args, **kwargs)
        looped.append((args[1], was_looped))
        return grid, was_looped

    monkeypatch.setattr(seam, "max_programs", lambda target, num_warps=4: 3 if target == "interpreter"
                        else real_max(target, num_warps))
    monkeypatch.setattr(seam, "fit_grid", spy)
    again = run()
    # per bias the forward, the delta preprocess, dQ and the table gradient (2 heads x 2 query tiles) loop
    assert sum(was for _, was in looped) >= 8, looped
    for a, b in zip(plain, again):
        assert torch.equal(a, b)


def test_a_table_past_int32_entries_is_refused():
    """The kernels address a table's rows with int32 lane offsets: a table of 2**31 entries per head or
    more is refused, naming the bias (an expanded view: nothing allocated)."""
    from coreattn.kernels.attn_common import TableBias, bias_args
    from coreattn.kernels.packing import packed

    q = torch.empty(4, 2, 8)
    table = torch.empty(1, 1, 1).expand(1, 2, 2**30)
    with pytest.raises(ValueError, match="bias"):
        bias_args(TableBias(table, None, 0, True), packed(cu_from_lens((4,), "cpu")), q)
