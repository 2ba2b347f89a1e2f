"""The torch backend of sparse attention, called as the launchers are (prepared indices and key bounds):
every output element written, chunking that changes nothing but memory, float64 gradcheck, and
NaN in keys a token cannot see never reaching it. Its plan (coreattn/layers/torch_backend/sparse_plan.py):
every way a span of tokens can run (one block over its key range, one block over the union of its
keys, a gather per unit, the static plan of a device) against the float64 oracle on rows of every
kind; tokens that name their whole causal range run as dense blocks without a gather; unused slots
are cut; the device plan reads nothing on the host; the backward over blocks is bitwise deterministic."""

import pytest
import torch

import coreattn
from coreattn.layers.dsa.sparse_function import key_bounds
from coreattn.layers.torch_backend import sparse, sparse_plan
from coreattn.layers.torch_backend.sparse_blocks import block_cost
from coreattn.layers.torch_backend.sparse_inputs import SparseProblem
from coreattn.layers.torch_backend.sparse_units import unit_bytes
from coreattn.kernels.sparse_index import prepare_topk
from sparse_cases import SparseCase, SparseInputs, assert_sparse_matches_oracle, incoming_grad


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
    """One query token per chunk gives what one chunk for every token gives (in float64: the budget
    also decides which spans run as blocks, which sums in another order)."""
    inp = SparseInputs(case, torch.float64)
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
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _problem(tokens: int, heads: int, topk: torch.Tensor, hkv: int = 1, dqk: int = 576, v_dim: int = 512):
    """An absorbed MLA problem over one causal sequence of ``tokens`` tokens (indices prepared)."""
    q, k = torch.zeros(tokens, heads, dqk), torch.zeros(tokens, hkv, dqk)
    lo = torch.zeros(tokens, dtype=torch.int32)
    hi = torch.arange(1, tokens + 1, dtype=torch.int32)
    return SparseProblem(q, k, None, prepare_topk(topk, "thd"), lo, hi, "thd", 0.1, v_dim)


def _host_plan(p: SparseProblem, budget: int = 8 << 20):
    stats = sparse_plan.unit_stats(p.topk, p.key_lo, p.key_hi, p.seqlen_q, p.seqlen_k)
    return sparse_plan.plan_host(p.topk, p.key_lo, p.key_hi, stats, seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k,
                                 group=p.group, block_bytes=sparse.BLOCK_SCALE * budget,
                                 block_cost=block_cost(p), chunk_bytes=budget,
                                 unit_bytes=lambda w: unit_bytes(p, w, True, 4))


def test_chunk_size_follows_the_budget(monkeypatch):
    """576/512 absorbed, 16 heads, 2,048 slots: the estimate covers at least the gathered keys and the
    scores, the CPU's 8 MiB chunk holds one unit or a few, the environment variable sets the budget,
    and a budget below one unit still makes progress (one unit per chunk)."""
    p = _problem(4, 16, torch.full((4, 2048), -1))
    per_unit = unit_bytes(p, 2048, True, 4)
    assert per_unit >= 4 * 2048 * (576 + 16 * 4)
    assert sparse.chunk_bytes(torch.device("cpu")) == 8 << 20 and (8 << 20) // per_unit <= 4
    monkeypatch.setenv(sparse.ENV_CHUNK_BYTES, str(per_unit * 3 + 5))
    plan = sparse_plan.plan_device(10, 2048, per_unit, sparse.chunk_bytes(torch.device("cpu")), "cpu")
    assert [len(units) for units, _ in plan.rows] == [3, 3, 3, 1]
    monkeypatch.setenv(sparse.ENV_CHUNK_BYTES, "1")
    plan = sparse_plan.plan_device(3, 2048, per_unit, sparse.chunk_bytes(torch.device("cpu")), "cpu")
    assert [units.tolist() for units, _ in plan.rows] == [[0], [1], [2]]


def test_full_rows_run_as_dense_blocks():
    """Token i names all of [0, i] (in any order, with repeats and -1; top-k longer than the
    sequence, DSA's regime below K tokens): every token runs in a block over its contiguous key
    range (a slice of k, no gather, no membership mask), one product per block of tokens."""
    tokens, topk = 300, 512
    i, j = torch.arange(tokens)[:, None], torch.arange(topk)[None, :]
    rows = torch.where(j <= i, (i - j) % (i + 1), torch.where(j % 5 == 0, 0, -1))  # [0, i] reversed, repeats of 0
    plan = _host_plan(_problem(tokens, 4, rows))
    assert plan.rows == []
    assert all(b.union is None and b.contiguous for b in plan.blocks)
    assert sum(b.n1 - b.n0 for b in plan.blocks) == tokens
    assert len(plan.blocks) <= tokens // 64  # blocks of many tokens (512 query rows at 4 heads per kv head)


def test_unused_slots_are_cut():
    """Rows naming one to three keys among 2,048 slots spread over a long sequence run in the
    per-unit path at the width of their counts, not K; the device plan is as wide as the keys a
    token can see at all (min(K, Sk))."""
    tokens, topk = 256, 2048
    i = torch.arange(tokens)[:, None]
    rows = torch.full((tokens, topk), -1)
    rows[:, :3] = torch.cat([i, i // 2, i // 3], 1)
    rows[::2, 2] = -1
    plan = _host_plan(_problem(tokens, 16, rows))
    assert plan.blocks == [] or all(b.n1 - b.n0 <= 32 for b in plan.blocks)
    widths = [w for _, w in plan.rows]
    assert widths and max(widths) <= 3
    assert sparse_plan.static_width(topk, tokens) == tokens


def test_overlapping_rows_share_one_gather():
    """Tokens late in a long sequence naming a shared set of far keys plus their own neighbours: the
    range is much wider than what they name, so a span gathers the union of their keys once."""
    tokens, topk, far = 2048, 256, 240
    i, j = torch.arange(tokens)[:, None], torch.arange(topk)[None, :]
    shared = torch.arange(far)[None, :] * 8  # [0, 1912]: the same far keys for every token
    rows = torch.cat([shared.expand(tokens, far), (i - j[:, :topk - far]).clamp(min=-1)], 1)
    rows = torch.where(rows <= i, rows, -1)
    plan = _host_plan(_problem(tokens, 4, rows, dqk=64, v_dim=32))
    unions = [b for b in plan.blocks if b.union is not None]
    assert unions and sum(b.n1 - b.n0 for b in unions) > tokens // 2
    assert all(b.union.numel() <= topk + (b.n1 - b.n0) for b in unions)


MODES = ("plan", "range", "union", "rows", "device")
MIXED = [SparseCase(hq=4, hkv=2, topk=16, lens_q=(9, 0, 14, 1), rows="mixed"),
         SparseCase(layout="sbhd", dqk=48, dv=32, hq=4, hkv=1, absorbed=True, topk=16, bottom_right=False,
                    left_pad=True, bounds=True, topk_length=True, lens_q=(6, 1, 12), rows="mixed"),
         SparseCase(layout="bshd", per_head=True, topk=16, lens_q=(7, 0, 10), lens_k=(9, 2, 10), rows="mixed")]


def _force(mode: str, monkeypatch, seen: list) -> None:
    """Every span of the host plan runs as ``mode`` ("plan": the cost model's choice; "device": the
    static plan, no host read); the plans made are appended to ``seen``."""
    if mode == "device":
        monkeypatch.setenv("COREATTN_VALIDATE", "0")
    elif mode != "plan":
        monkeypatch.setattr(sparse_plan, "choose_mode",
                            lambda tokens, group, keys, width, union: (mode, union() if mode == "union" else None))
    for name in ("plan_host", "plan_device"):
        real = getattr(sparse, name)
        monkeypatch.setattr(sparse, name, lambda *a, _real=real, **kw: seen.append(_real(*a, **kw)) or seen[-1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", MIXED, ids=lambda c: c.id)
def test_every_path_matches_oracle(case, mode, monkeypatch):
    """Rows of every kind (whole causal ranges, windows, subsets, one or two keys, none; empty
    sequences, padded spans, key bounds, per-kv-head indices, absorbed and separate V) through each
    way the backend can run them, forward and backward, against the float64 oracle."""
    seen = []
    _force(mode, monkeypatch, seen)
    inp = SparseInputs(case, torch.float64)
    out, lse = inp.call(backend="torch")
    assert_sparse_matches_oracle(inp, out, lse)
    blocks = [b for plan in seen for b in plan.blocks]
    rows = [units for plan in seen for units, _ in plan.rows]
    if mode in ("range", "union"):
        assert blocks and not rows and all((b.union is not None) == (mode == "union") for b in blocks)
    elif mode in ("rows", "device"):
        assert rows and not blocks
    else:
        assert blocks and any(b.contiguous for b in blocks)


@pytest.mark.parametrize("mode", ("plan", "union"))
def test_backward_over_blocks_is_deterministic(mode, monkeypatch):
    """Blocks and chunks of units adding into the same keys (a small budget: many of each), two
    backward runs bitwise equal."""
    _force(mode, monkeypatch, [])
    monkeypatch.setenv(sparse.ENV_CHUNK_BYTES, str(1 << 13))
    inp = SparseInputs(SparseCase(dqk=64, dv=64, hq=8, hkv=2, topk=48, lens_q=(40, 23), rows="mixed"),
                       torch.float32)
    runs = []
    for _ in range(2):
        out, _ = inp.call(backend="torch")
        runs.append(torch.autograd.grad(out, inp.leaves(), incoming_grad(out)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_device_plan_reads_nothing(monkeypatch):
    """With COREATTN_VALIDATE=0 (a device's view on CPU) the sparse torch backend reads no tensor on
    the host, forward and backward (tests/sync_detector.py, the torch backend not exempt here)."""
    import sync_detector

    monkeypatch.setattr(sync_detector, "EXEMPT", tuple(e for e in sync_detector.EXEMPT
                                                       if e != "coreattn.layers.torch_backend"))
    inp = SparseInputs(MIXED[1], torch.float32)
    with sync_detector.no_host_reads(monkeypatch):
        out, lse = inp.call(backend="torch")
        grads = torch.autograd.grad(out, inp.leaves(), incoming_grad(out))
    assert torch.isfinite(lse[~torch.isneginf(lse)]).all() and all(torch.isfinite(g).all() for g in grads)


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
