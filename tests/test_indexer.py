"""The DSA indexer ops (coreattn.layers.dsa.indexer): top-k, loss and Hadamard rotation against the float64
oracle of tests/indexer_oracle.py, on the torch backend and the Triton kernels (under the interpreter
on CPU). Megatron's own functions are compared in tests/megatron/test_dsa_indexer.py.

Ties: integer-valued q and k and power-of-two weights make every score exact in float32 whatever the
summation order, so both backends and the oracle see the same scores and the tie rule (lower key
position first) is checked exactly, zero-score ties of the ReLU included. Float data checks the
selected sets against the float64 scores with a rounding tolerance at the boundary.
"""

from __future__ import annotations

import math

import pytest
import torch

from attn_cases import assert_flash_criterion
import indexer_oracle as oracle
from coreattn.layers.dsa import indexer as ix
from coreattn.layers.torch_backend import indexer_topk as topk_backend

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.interpreter_only(
    "the Triton indexer kernels on CPU tensors"))]
CU = [0, 7, 7, 10, 26, 31]  # an empty sequence, one shorter than the top-k, longer ones
WEIGHTS = (0.5, 1.0, 2.0, 0.25)


def to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A bshd-form [B, S, ...] oracle tensor in ``layout`` (thd: B = 1)."""
    if layout == "thd":
        return x[0]
    return x.transpose(0, 1).contiguous() if layout == "sbhd" else x


def from_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "thd":
        return x[None]
    return x.transpose(0, 1) if layout == "sbhd" else x


def integer_inputs(batch, seqlen, seqlen_k, heads=4, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (batch, seqlen, heads, dim), generator=g).float()
    k = torch.randint(-2, 3, (batch, seqlen_k, dim), generator=g).float()
    w = torch.tensor(WEIGHTS[:heads]).repeat(batch, seqlen, 1)
    w[..., 0] = -w[..., 0]  # a negative weight: negative scores too
    return q, k, w


def float_inputs(batch, seqlen, seqlen_k, heads=4, dim=16, np_heads=4, dim_q=24, kv_heads=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen, heads, dim, generator=g)
    k = torch.randn(batch, seqlen_k, dim, generator=g)
    w = torch.rand(batch, seqlen, heads, generator=g) - 0.3
    query = torch.randn(batch, seqlen, np_heads, dim_q, generator=g)
    key = torch.randn(batch, seqlen_k, kv_heads, dim_q, generator=g)
    return q, k, w, query, key


def bounds_for(layout, batch, seqlen, seqlen_k, causal=True, alignment="bottom_right"):
    """The oracle's [B, S] bounds and the op's arguments for the same keys."""
    if layout == "thd":
        lo, hi = oracle.causal_bounds(1, seqlen, CU, causal)
        return lo, hi, dict(cu_seqlens=torch.tensor(CU, dtype=torch.int32), causal=causal)
    shift = seqlen_k - seqlen if alignment == "bottom_right" else 0
    hi = [[min(max(s + 1 + shift, 0), seqlen_k) if causal else seqlen_k for s in range(seqlen)]] * batch
    return [[0] * seqlen] * batch, hi, dict(causal=causal, causal_alignment=alignment)


# ---- top-k

TOPK_CASES = [  # layout, batch, S, Sk, relu, topk, causal, alignment
    ("thd", 1, 31, 31, True, 6, True, "bottom_right"),
    ("thd", 1, 31, 31, False, 13, False, "bottom_right"),
    ("sbhd", 2, 17, 17, True, 8, True, "bottom_right"),
    ("bshd", 2, 9, 20, False, 5, True, "bottom_right"),
    ("bshd", 1, 9, 20, True, 5, True, "top_left"),
    ("sbhd", 1, 6, 4, True, 16, True, "bottom_right"),  # top-k wider than the keys: K = Sk
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout,batch,seqlen,seqlen_k,relu,topk,causal,alignment", TOPK_CASES,
                         ids=lambda v: str(v))
def test_topk_exact_with_ties(backend, layout, batch, seqlen, seqlen_k, relu, topk, causal, alignment):
    q, k, w = integer_inputs(batch, seqlen, seqlen_k)
    lo, hi, kw = bounds_for(layout, batch, seqlen, seqlen_k, causal, alignment)
    scores = oracle.index_scores(q, k, w, relu)
    expected = oracle.topk_ref(scores, lo, hi, topk)
    got = ix.indexer_topk(to_layout(q, layout), to_layout(k, layout), to_layout(w, layout), topk, layout=layout,
                          relu=relu, return_scores=True, backend=backend, **kw)
    assert got.indices.dtype == torch.int64
    assert torch.equal(from_layout(got.indices, layout), expected)
    want = torch.where(expected >= 0, scores.gather(2, expected.clamp_min(0)), torch.tensor(float("-inf"), dtype=torch.float64))
    assert torch.equal(from_layout(got.scores, layout).double(), want)
    if seqlen > 16:  # the rows do hold equal scores inside and at the top-k boundary for the tie rule to break
        picked = want[..., -1:]
        assert ((scores == picked) & (expected >= 0)[..., -1:]).sum(-1).gt(1).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_given_bounds_and_minus_inf(backend):
    """Megatron-style [S] bounds shared by the batch, a row with lo == hi (no key: all -1), a row whose
    every score is -inf (never selected), bounds past the sample (clamped into it) and hi < lo."""
    batch, seqlen = 2, 12
    q, k, w = integer_inputs(batch, seqlen, seqlen, seed=1)
    k = k.abs() + 1  # every key positive ...
    q[:, 5] = 1.0  # ... so row 5's dot products are all positive
    w[:, 5] = float("-inf")  # and its scores -inf
    lo = torch.tensor([0, 0, 3, 3, 3, 0, 2, 2, 9, 9, -4, 7])
    hi = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 40, 3])  # row 2: empty; 10 and 11 outside the sample
    inside_lo, inside_hi = lo.clamp(0, seqlen), torch.maximum(hi.clamp(0, seqlen), lo.clamp(0, seqlen))
    expected = oracle.topk_ref(oracle.index_scores(q, k, w, True), [inside_lo.tolist()] * batch,
                               [inside_hi.tolist()] * batch, 4)
    got = ix.indexer_topk(q.transpose(0, 1), k.transpose(0, 1), w.transpose(0, 1), 4, layout="sbhd",
                          key_bounds=(lo, hi), backend=backend)
    assert torch.equal(got.indices.transpose(0, 1), expected)
    assert (expected[:, 2] == -1).all() and (expected[:, 5] == -1).all() and (expected[:, 11] == -1).all()
    messy = torch.full((seqlen, batch, 4), seqlen + 3)  # indices past the sample, inside the given hi of row 10
    q_, k_, w_, query, key = float_inputs(batch, seqlen, seqlen, seed=2)
    loss = ix.indexer_loss(*(t.transpose(0, 1) for t in (q_, k_, w_, query, key)), 0.5, 1.0, topk_indices=messy,
                           sparse=True, layout="sbhd", key_bounds=(lo, hi), backend=backend)
    assert loss.item() == 0.0  # no index names a key of the sample: every row's set is empty


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout,relu", [("thd", True), ("sbhd", False)])
def test_topk_float_scores(backend, layout, relu):
    """Random float data: the selected set is a top-k of the float64 scores up to float32 rounding."""
    batch = 1 if layout == "thd" else 2
    q, k, w, _, _ = float_inputs(batch, 31, 31, heads=8, dim=32, seed=3)
    lo, hi, kw = bounds_for(layout, batch, 31, 31)
    got = ix.indexer_topk(to_layout(q, layout), to_layout(k, layout), to_layout(w, layout), 7, layout=layout,
                          relu=relu, backend=backend, **kw)
    idx = from_layout(got.indices, layout)
    scores = oracle.index_scores(q, k, w, relu)
    tol = 1e-5 * scores.abs().max()
    for b in range(batch):
        for s in range(31):
            row = [j for j in idx[b, s].tolist() if j >= 0]
            keys = range(lo[b][s], hi[b][s])
            assert len(row) == len(set(row)) == min(7, len(keys)) and set(row) <= set(keys)
            rest = [scores[b, s, j] for j in keys if j not in row]
            if rest and row:
                assert min(scores[b, s, j] for j in row) >= max(rest) - tol


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("relu", [True, False], ids=["relu", "identity"])
def test_topk_nan_scores_rank_first(backend, relu):
    """NaN in a key (every score of that key NaN) and in a query head (the row's scores NaN, of the
    sign x86 makes for 0 * inf): the same rule on both backends, torch.topk's: NaN ranks above every
    number, the lower position first among NaNs, its score NaN; the ReLU keeps NaN."""
    q, k, w = integer_inputs(1, 12, 12, seed=6)
    k[0, 3] = float("nan")
    k[0, 7, 0] = float("nan")
    q[0, 9, 1] = 0.0 * float("inf")  # row 9: every key NaN
    lo, hi, kw = bounds_for("bshd", 1, 12, 12)
    got = ix.indexer_topk(q, k, w, 4, layout="bshd", relu=relu, return_scores=True, backend=backend, **kw)
    idx, scores = got.indices[0], got.scores[0]
    for s in range(12):
        nan_keys = [j for j in (3, 7) if j <= s] if s != 9 else list(range(10))
        expect = nan_keys[:4]
        assert idx[s, :len(expect)].tolist() == expect, (s, idx[s])
        assert scores[s, :len(expect)].isnan().all() and not scores[s, len(expect):].isnan().any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_indices_are_the_int64_ones(backend):
    """``index_dtype=torch.int32`` (what coreattn's DSAttention keeps: half the memory) gives the same
    selection as the default int64, from indexer_topk and from indexer_topk_and_loss, whose loss it
    leaves unchanged."""
    q, k, w, query, key = float_inputs(2, 19, 19, heads=4, dim=16, seed=5)
    q, k, w, query, key = (to_layout(t, "sbhd") for t in (q, k, w, query, key))
    wide = ix.indexer_topk(q, k, w, 6, layout="sbhd", backend=backend)
    narrow = ix.indexer_topk(q, k, w, 6, layout="sbhd", backend=backend, index_dtype=torch.int32)
    assert narrow.indices.dtype == torch.int32 and torch.equal(narrow.indices.long(), wide.indices)
    idx64, loss64 = ix.indexer_topk_and_loss(q, k, w, query, key, 6, 0.3, 0.5, layout="sbhd", backend=backend)
    idx32, loss32 = ix.indexer_topk_and_loss(q, k, w, query, key, 6, 0.3, 0.5, layout="sbhd", backend=backend,
                                             index_dtype=torch.int32)
    assert idx32.dtype == torch.int32 and torch.equal(idx32.long(), idx64) and torch.equal(loss32, loss64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_and_loss_context_parallel_shape(backend):
    """Megatron's allgather context parallelism: a rank's queries are two zig-zag chunks of the sequence
    (positions 0-5 and 18-23 of 24 with cp = 2), the keys the whole gathered sequence, the bounds given
    ([Sq] causal ends at each query's position): Sq != Sk."""
    positions = list(range(0, 6)) + list(range(18, 24))
    q, k, w, query, key = float_inputs(1, 24, 24, seed=8)
    q, w, query = q[:, positions], w[:, positions], query[:, positions]
    lo, hi = [[0] * 12], [[p + 1 for p in positions]]
    bounds = (torch.zeros(12, dtype=torch.int64), torch.tensor(positions) + 1)
    sb = lambda x: x.transpose(0, 1).contiguous()  # noqa: E731
    expected = oracle.topk_ref(oracle.index_scores(q, k, w, True), lo, hi, 5)
    leaves = [t.clone().requires_grad_() for t in (q, k, w)]
    idx, loss = ix.indexer_topk_and_loss(*(sb(t) for t in (*leaves, query, key)), 5, 0.25, 0.6, sparse=True,
                                         layout="sbhd", key_bounds=bounds, backend=backend)
    assert torch.equal(idx.transpose(0, 1), expected)
    loss.backward()
    refs = []
    for work in (torch.float64, torch.float32):
        base = [t.detach().to(work).requires_grad_() for t in (q, k, w)]
        value = oracle.loss_ref(*base, query, key, lo, hi, 0.25, 0.6, sparse=True, topk_indices=expected, dtype=work)
        value.backward()
        refs.append((value, *(t.grad for t in base)))
    for name, g, r, n in zip(("loss", "dq", "dk", "dw"), (loss, *(t.grad for t in leaves)), *refs):
        assert_flash(name, g, r, n)


# ---- loss

LOSS_LAYOUTS = [("thd", 1), ("sbhd", 2), ("bshd", 2)]


def loss_case(layout, batch, sparse, relu, backend, *, seed=0, kv_heads=1, rows=None, per_token=False,
              rotate=False, topk=6, dtype=torch.float32):
    q, k, w, query, key = float_inputs(batch, 31, 31, kv_heads=kv_heads, seed=seed)
    lo, hi, kw = bounds_for(layout, batch, 31, 31)
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, w)]
    qi, ki = (ix.rotate_activation(t, backend=backend) for t in leaves[:2]) if rotate else leaves[:2]
    valid = None if rows is None else to_layout(rows, layout)
    idx, loss = ix.indexer_topk_and_loss(to_layout(qi, layout), to_layout(ki, layout), to_layout(leaves[2], layout),
                                         to_layout(query, layout), to_layout(key, layout), topk, 0.25, 0.6,
                                         sparse=sparse, layout=layout, relu=relu, query_valid_rows=valid,
                                         calculate_per_token_loss=per_token, backend=backend, **kw)
    loss.backward()
    expected_idx = oracle.topk_ref(oracle.index_scores(qi.detach().double(), ki.detach().double(), w, relu), lo, hi,
                                   topk)
    refs = {}
    for work in (torch.float64, torch.float32):  # the oracle, and the naive same-precision baseline
        base = [t.detach().to(work).requires_grad_() for t in (q, k, w)]
        qr, kr = base[:2]
        if rotate:
            qr, kr = (reference_hadamard(t, t.shape[-1] ** -0.5) for t in base[:2])
        value = oracle.loss_ref(qr, kr, base[2], query, key, lo, hi, 0.25, 0.6, sparse=sparse, topk_indices=expected_idx,
                                relu=relu, query_valid_rows=rows, per_token=per_token, dtype=work)
        value.backward()
        refs[work] = (value, *(t.grad for t in base))
    return from_layout(idx, layout), expected_idx, (loss, *(t.grad for t in leaves)), refs


def assert_flash(name, got, ref, naive, eps=1e-6):
    """The flash criterion against the float64 ``ref`` and the float32 ``naive`` (the loss is a scalar
    of magnitude ~30: the rounding term at its magnitude, not eps, bounds a correct float32 result)."""
    assert_flash_criterion(name, got, naive, ref, eps)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("relu", [True, False], ids=["relu", "identity"])
@pytest.mark.parametrize("layout,batch", LOSS_LAYOUTS, ids=[c[0] for c in LOSS_LAYOUTS])
def test_loss_and_grads(layout, batch, sparse, relu):
    idx, expected_idx, got, refs = loss_case(layout, batch, sparse, relu, "torch")
    assert torch.equal(idx, expected_idx)
    for name, g, r, n in zip(("loss", "dq", "dk", "dw"), got, refs[torch.float64], refs[torch.float32]):
        assert_flash(name, g, r, n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_features(backend):
    """query_valid_rows with the per-token sum, GQA on the attention side, the rotation on q and k
    (gradients through it), sparse: one case on each backend (Triton: the kernels' top-k and Hadamard)."""
    rows = torch.ones(2, 31, dtype=torch.bool)
    rows[0, 3:9] = False
    idx, expected_idx, got, refs = loss_case("sbhd", 2, True, True, backend, seed=4, kv_heads=2, rows=rows,
                                             per_token=True, rotate=True)
    assert torch.equal(idx, expected_idx)
    for name, g, r, n in zip(("loss", "dq", "dk", "dw"), got, refs[torch.float64], refs[torch.float32]):
        assert_flash(name, g, r, n)
    assert (got[1][0, 3:9] == 0).all()  # rows left out get no gradient


def test_loss_float64_and_given_indices():
    """float64 inputs run in float64 (a tight match); indexer_loss with given (unsorted, repeated,
    out-of-bounds) indices counts each valid key once."""
    q, k, w, query, key = float_inputs(1, 31, 31, seed=5)
    lo, hi, kw = bounds_for("thd", 1, 31, 31)
    idx = oracle.topk_ref(oracle.index_scores(q, k, w, True), lo, hi, 6)
    messy = torch.cat([idx.flip(-1), idx[..., :2], torch.full_like(idx[..., :1], 30)], -1)  # repeats; 30: past causality
    leaves = [t.double().requires_grad_() for t in (q, k, w)]
    loss = ix.indexer_loss(*(t[0] for t in leaves), query[0], key[0], 0.25, 0.6, topk_indices=messy[0], sparse=True,
                           layout="thd", **kw)
    loss.backward()
    base = [t.double().requires_grad_() for t in (q, k, w)]
    ref = oracle.loss_ref(*base, query, key, lo, hi, 0.25, 0.6, sparse=True, topk_indices=idx)
    ref.backward()
    assert loss.dtype == torch.float64 and torch.allclose(loss, ref, rtol=1e-12, atol=1e-14)
    for a, b in zip(leaves, base):
        assert torch.allclose(a.grad, b.grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("max_seqlen", [None, 16])
def test_static_key_ranges(max_seqlen, monkeypatch):
    """Where the torch backend reads no bounds (a GPU: no sync; forced here on CPU), each chunk scores the
    keys of a host-known range (causal: up to its last row; with max_seqlen: from max_seqlen - 1 before
    its first): the same top-k and loss as the exact ranges."""
    q, k, w = integer_inputs(1, 31, 31, seed=9)
    _, _, _, query, key = float_inputs(1, 31, 31, seed=9)
    args = [t[0] for t in (q, k, w, query, key)]
    kw = dict(layout="thd", cu_seqlens=torch.tensor(CU, dtype=torch.int32), max_seqlen=max_seqlen, backend="torch")
    monkeypatch.setenv(topk_backend.ENV_CHUNK_BYTES, "20000")  # a few rows per chunk
    exact = ix.indexer_topk_and_loss(*args, 6, 0.25, 0.6, sparse=False, **kw)
    monkeypatch.setenv("COREATTN_VALIDATE", "0")  # read nothing on the host, as on a device
    static = ix.indexer_topk_and_loss(*args, 6, 0.25, 0.6, sparse=False, **kw)
    assert torch.equal(static[0], exact[0])
    assert torch.allclose(static[1], exact[1], rtol=1e-6)


def test_loss_chunks_and_determinism(monkeypatch):
    """A budget of a few rows per chunk gives the one-chunk results (to float32 rounding), and two
    backward runs are bitwise equal."""
    def run():
        _, _, got, _ = loss_case("thd", 1, True, True, "torch", seed=6)
        return got
    whole = run()
    monkeypatch.setenv(topk_backend.ENV_CHUNK_BYTES, "4096")
    sizes = {ch.s1 - ch.s0 for ch in topk_backend.chunks(torch.zeros(31, dtype=torch.int32),
                                                          torch.full((31,), 31, dtype=torch.int32), 1, 31, 31, 2048)}
    assert max(sizes) <= 2
    first, second = run(), run()
    for a, b, c in zip(whole, first, second):
        assert torch.equal(b, c)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


# ---- Hadamard


def reference_hadamard(x: torch.Tensor, scale: float) -> torch.Tensor:
    """fast_hadamard_transform's definition: zero-pad to a power of two, times the Sylvester matrix."""
    dim = x.shape[-1]
    size = 1 << max(dim - 1, 0).bit_length()
    h = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(size)] for i in range(size)], dtype=x.dtype)
    return (torch.nn.functional.pad(x, (0, size - dim)) @ h)[..., :dim] * scale


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dim", [1, 3, 64, 128, 200, 256, 300])
def test_hadamard(backend, dim):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(3, 5, dim, generator=g, dtype=torch.float64)
    scale = dim ** -0.5
    ref = reference_hadamard(x, scale)
    y32 = ix.hadamard_transform(x.float(), scale, backend=backend)
    assert (y32.double() - ref).abs().max() <= 4 * math.log2(max(dim, 2)) * 2**-24 * ref.abs().max() * math.sqrt(dim)
    xb = x.to(torch.bfloat16)
    yb = ix.rotate_activation(xb, backend=backend)
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, ix.rotate_activation(xb, backend="torch"))  # same float32 butterfly, same rounding
    leaf = x.float().requires_grad_()
    grad = torch.randn(3, 5, dim, generator=g)
    ix.hadamard_transform(leaf, scale, backend=backend).backward(grad)
    assert torch.allclose(leaf.grad.double(), reference_hadamard(grad.double(), scale), rtol=0, atol=1e-5)


# ---- argument checks

def _bad_calls():
    q, k, w = torch.zeros(8, 2, 16), torch.zeros(8, 16), torch.zeros(8, 2)
    query, key = torch.zeros(8, 4, 24), torch.zeros(8, 1, 24)
    topk = ix.indexer_topk
    loss = ix.indexer_loss
    return [
        (lambda: topk(q, k, w, 0), ValueError, "topk must be >= 1"),
        (lambda: topk(q, k, w, 2.5), TypeError, "topk must be an int"),
        (lambda: topk(q[None], k, w, 2), ValueError, "q must have 3 dims"),
        (lambda: topk(q, k[:, :8], w, 2), ValueError, "k's head dim"),
        (lambda: topk(q, k, w[:, :1], 2), ValueError, "weights must have shape"),
        (lambda: topk(q.int(), k, w, 2), TypeError, "q must be float16"),
        (lambda: topk(q, k, w, 2, layout="bhsd"), ValueError, "layout must be one of"),
        (lambda: topk(q, k, w, 2, causal_alignment="left"), ValueError, "causal_alignment"),
        (lambda: topk(q, k, w, 2, cu_seqlens=torch.tensor([0, 8])), TypeError, "cu_seqlens must be int32"),
        (lambda: topk(q, k, w, 2, key_bounds=(torch.zeros(8),)), TypeError, "key_bounds must be a pair"),
        (lambda: topk(q, k, w, 2, key_bounds=(torch.zeros(8), torch.zeros(8))), TypeError, "key_bounds[0] must be"),
        (lambda: topk(q, k, w, 2, key_bounds=(torch.zeros(7, dtype=torch.int32),) * 2), ValueError,
         "key_bounds[0] must have shape"),
        (lambda: topk(q, k, w, 2, backend="npu_fused"), RuntimeError, "npu_fused' cannot run indexer top-k on cpu"),
        (lambda: topk(q, k, w, 2, index_dtype=torch.int16), TypeError, "index_dtype must be torch.int32"),
        (lambda: ix.indexer_topk_and_loss(q, k, w, query, key, 2, 1.0, 1.0, index_dtype=torch.float32), TypeError,
         "index_dtype must be torch.int32"),
        (lambda: topk(q[None].expand(2, -1, -1, -1), k[None], w[None].expand(2, -1, -1), 2, layout="bshd"),
         ValueError, "k's batch dim"),
        (lambda: loss(q, k, w, query, key, 1.0, 1.0, sparse=True), ValueError, "needs topk_indices"),
        (lambda: loss(q, k, w, query[:4], key, 1.0, 1.0), ValueError, "query's token dims"),
        (lambda: loss(q, k, w, query, key[:, :, :8], 1.0, 1.0), ValueError, "key's head dim"),
        (lambda: loss(q, k, w, query[:, :3], key.expand(-1, 2, -1), 1.0, 1.0), ValueError, "multiple of key's"),
        (lambda: loss(q, k, w, query, key, 1.0, 1.0, sparse=True, topk_indices=torch.zeros(8, 2)), TypeError,
         "topk_indices must be int32"),
        (lambda: loss(q, k, w, query, key, 1.0, 1.0, sparse=True, topk_indices=torch.zeros(7, 2, dtype=torch.long)),
         ValueError, "topk_indices must have shape"),
        (lambda: loss(q, k, w, query, key, 1.0, 1.0, query_valid_rows=torch.ones(7, dtype=torch.bool)), ValueError,
         "query_valid_rows must have shape"),
        (lambda: ix.hadamard_transform(torch.zeros(4, dtype=torch.int32)), TypeError, "x must be float16"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_arguments(case):
    call, error, message = _bad_calls()[case]
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        call()

