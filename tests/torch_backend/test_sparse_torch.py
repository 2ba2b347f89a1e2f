"""The torch backend of sparse attention, called as the launchers are (prepared indices and key bounds):
every output element written, chunking that changes nothing but memory, float64 gradcheck, and
NaN in keys a token cannot see never reaching it."""

import pytest
import torch

import coreattn
from coreattn.layers.dsa.sparse_function import key_bounds
from coreattn.layers.torch_backend import sparse
from coreattn.kernels.sparse_index import prepare_topk
from sparse_cases import SparseCase, SparseInputs, incoming_grad


def _prepared(inp: SparseInputs):
    """The pair's inputs for a case: q, k, v in the layout, prepared indices and the key bounds."""
    from coreattn.layers.checks import flat_tokens

    case, kw = inp.case, inp.kwargs
    topk = flat_tokens(inp.topk_indices, case.layout)
    topk = prepare_topk(inp.topk_indices, case.layout, kw.get("topk_length"))
    if case.layout == "thd":
        layout = (inp.cu_q, None, inp.cu_k, None)
        seqlen_q = inp.q.shape[0]
    else:
        layout = (kw["q_start"], kw["q_len"], kw["k_start"], kw["k_len"])
        seqlen_q = inp.q.shape[1 if case.layout == "bshd" else 0]
    bounds = [flat_tokens(b, case.layout) for b in kw["key_bounds"]] if "key_bounds" in kw else (None, None)
    lo, hi = key_bounds(case.layout, *layout, topk.shape[0], seqlen_q, case.causal, case.bottom_right, *bounds)
    return topk, lo, hi


CASES = [SparseCase(lens_q=(5, 0, 9)), SparseCase(layout="bshd", per_head=True, lens_q=(4, 6)),
         SparseCase(layout="sbhd", hkv=1, absorbed=True, topk_length=True, bounds=True, lens_q=(3, 7))]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_output_element_is_written(case):
    """out and lse poisoned with NaN before the call: an element the backend forgets stays NaN."""
    inp = SparseInputs(case, torch.float16)
    topk, lo, hi = _prepared(inp)
    q, k, v = (None if x is None else x.detach() for x in (inp.q, inp.k, inp.v))
    want_out, want_lse = sparse.sparse_attn_torch_fwd(q, k, v, topk, lo, hi, case.layout, 0.3, v_dim=case.dv)
    out = torch.full_like(want_out, float("nan"))
    lse = torch.full_like(want_lse, float("nan"))
    got = sparse.sparse_attn_torch_fwd(q, k, v, topk, lo, hi, case.layout, 0.3, v_dim=case.dv, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_chunks_change_nothing_but_memory(case, monkeypatch):
    """One query token per chunk gives what one chunk for every token gives."""
    inp = SparseInputs(case, torch.float32)
    topk, lo, hi = _prepared(inp)
    q, k, v = (None if x is None else x.detach() for x in (inp.q, inp.k, inp.v))
    results = []
    for budget in (1, 1 << 30):
        monkeypatch.setenv(sparse.ENV_CHUNK_BYTES, str(budget))
        out, lse = sparse.sparse_attn_torch_fwd(q, k, v, topk, lo, hi, case.layout, 0.3, v_dim=case.dv)
        grads = sparse.sparse_attn_torch_bwd(incoming_grad(out), q, k, v, out, lse, topk, lo, hi, case.layout, 0.3,
                                             v_dim=case.dv)
        results.append((out, lse, *(g for g in grads if g is not None)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_chunk_size_follows_the_budget(monkeypatch):
    """576/512 absorbed, 16 heads, top-k 2,048: the estimate covers at least the gathered keys and the
    scores, the CPU's 8 MiB chunk holds one token or a few, the environment variable sets the
    budget, and a budget below one token still makes progress (one token per chunk)."""
    q, k = torch.empty(0, 16, 576), torch.empty(0, 1, 576)
    per_token = sparse.bytes_per_token(q, k, None, 1, 2048, backward=True)
    assert per_token >= 4 * 2048 * (576 + 16 * 4)
    assert sparse._chunk_tokens(q, k, None, 1, 2048, backward=True) == max(1, (8 << 20) // per_token) <= 4
    monkeypatch.setenv(sparse.ENV_CHUNK_BYTES, str(per_token * 3 + 5))
    assert sparse._chunk_tokens(q, k, None, 1, 2048, backward=True) == 3
    monkeypatch.setenv(sparse.ENV_CHUNK_BYTES, "1")
    assert sparse._chunk_tokens(q, k, None, 1, 2048, backward=True) == 1


def test_gradcheck_float64():
    case = SparseCase(dqk=6, dv=4, hq=2, hkv=1, topk=4, lens_q=(3, 0, 4))
    inp = SparseInputs(case, torch.float64)

    def fn(q, k, v):
        return coreattn.sparse_varlen_attn(q, k, v, inp.topk_indices, inp.cu_q, inp.cu_k, backend="torch")

    assert torch.autograd.gradcheck(fn, (inp.q, inp.k, inp.v))


def test_gradcheck_float64_absorbed_padded():
    case = SparseCase(layout="sbhd", dqk=6, dv=4, hq=2, hkv=1, absorbed=True, topk=4, lens_q=(3, 4))
    inp = SparseInputs(case, torch.float64)

    def fn(q, k):
        return coreattn.sparse_padded_attn(q, k, None, inp.topk_indices, **inp.kwargs, backend="torch")

    assert torch.autograd.gradcheck(fn, (inp.q, inp.k))


def test_nan_in_padding_never_reaches_a_token():
    """Padded keys (and padded query rows) full of NaN: outputs and gradients of real tokens stay
    finite, padded rows output zeros."""
    case = SparseCase(layout="bshd", hkv=1, topk=6, lens_q=(3, 6))
    inp = SparseInputs(case, torch.float32)
    k = inp.k.detach().clone()
    v = inp.v.detach().clone()
    q = inp.q.detach().clone()
    k[0, 3:], v[0, 3:], q[0, 3:] = float("nan"), float("nan"), float("nan")  # sample 0 has 3 real tokens
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    topk = torch.randint(0, k.shape[1], inp.topk_indices.shape, generator=torch.Generator().manual_seed(0))
    out = coreattn.sparse_padded_attn(q, k, v, topk, **inp.kwargs, backend="torch")
    assert not out[0, 3:].any() and torch.isfinite(out).all()
    for g in torch.autograd.grad(out, (q, k, v), torch.randn_like(out)):
        assert torch.isfinite(g).all()
