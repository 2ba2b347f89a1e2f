"""The DSA indexer's top-k and sparse loss on npu_fused (coreattn/layers/npu_fused/indexer.py), on CPU:
the stand-in torch_npu of tests/fake_torch_npu_dsa.py (what the operators' pages reject, what their
kernels compute, reading the index rows as the kernels read them: the loss min(K, S2 - S1 + s + 1)
slots of row s whatever they hold), against the float64 oracles of tests/indexer_oracle.py, CPU
tensors standing in for npu ones.

Checked: the top-k equals the oracle's selection and order (score descending, then position; -1
last) though the operator sorts masked keys in, orders ties its own way and returns its scores in
the query's dtype; the loss and its q/k/weights gradients meet the flash criterion against the
oracle on the operator where each row holds exactly the slots it reads (coreattn's own top-k of
every key, or of the operator's K), and on the fallback where it would not (packed sequences, a
top-k narrower than the operator's K, given indices: the stand-in would return garbage there);
what reaches the operators; each limit's fallback with its logged reason, and an explicit
``backend="npu_fused"`` outside one raising it; an operator whose kernel the device lacks or whose
chip it is not built for; no host read.
"""

import logging

import pytest
import torch

import coreattn.layers.dsa.indexer as ix
from attn_cases import assert_flash_criterion
from coreattn.kernels import npu
from coreattn.layers.backends import NPU_LOSS_OPS, NPU_TOPK_OPS, Backend
from coreattn.layers.dsa.indexer import function, ops
from fake_torch_npu_dsa import NPU, install
from indexer_oracle import causal_bounds, index_scores, loss_ref, topk_ref


H, D, NP = 64, 128, 32  # index heads and dim (the operators' only ones), attention heads (the loss: 32, 64 or 128)


@pytest.fixture
def npu_dsa(monkeypatch):
    yield install(monkeypatch)
    npu.cache_clear()


def _side(layout, batch, seqlen, seqlen_k, dtype=torch.bfloat16, seed=0, heads=H):
    """q, k, weights in ``layout`` (thd: batch 1) and their bshd views."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen, heads, D, generator=gen).to(dtype)
    k = torch.randn(batch, seqlen_k, D, generator=gen).to(dtype)
    if seqlen_k > 3:
        k[:, 1] *= 3  # keys 1 and 3: the top two of every query seeing both, scored alike (a tie the operator
        k[:, 3] = k[:, 1]  # orders its own way; one at the K-th place would be the operator's pick: not converted)
    w = (torch.rand(batch, seqlen, heads, generator=gen) * 0.2).to(dtype)
    if layout == "thd":
        return q[0], k[0], w[0]
    if layout == "sbhd":
        return q.transpose(0, 1), k.transpose(0, 1), w.transpose(0, 1)
    return q, k, w


def _bshd(x, layout):
    return x[None] if layout == "thd" else (x.transpose(0, 1) if layout == "sbhd" else x)


TOPK_CASES = [("bshd", 2, 5, 9, True, "bottom_right", 4, 3), ("sbhd", 2, 6, 6, False, "bottom_right", 8, 0),
              ("thd", 1, 7, 7, True, "bottom_right", 4, 3)]


@pytest.mark.parametrize("layout, batch, seqlen, seqlen_k, causal, alignment, topk, mode", TOPK_CASES,
                         ids=[f"{c[0]}-{'causal' if c[4] else 'full'}" for c in TOPK_CASES])
def test_topk_is_the_oracles_selection_in_coreattns_order(npu_dsa, layout, batch, seqlen, seqlen_k, causal,
                                                           alignment, topk, mode):
    q, k, w = _side(layout, batch, seqlen, seqlen_k)
    got = ix.indexer_topk(q, k, w, topk, layout=layout, causal=causal, causal_alignment=alignment).indices
    scores = index_scores(_bshd(q, layout), _bshd(k, layout), _bshd(w, layout), relu=True)
    shift = seqlen_k - seqlen
    lo = [[0] * seqlen for _ in range(batch)]
    hi = [[min(seqlen_k, s + 1 + shift) if causal else seqlen_k for s in range(seqlen)] for _ in range(batch)]
    assert torch.equal(_bshd(got, layout).long(), topk_ref(scores, lo, hi, topk))
    (call,) = npu_dsa.of("npu_lightning_indexer")
    assert (call["layout_query"], call["layout_key"], call["sparse_mode"]) == ("BSND", "BSND", mode)
    assert call["sparse_count"] == min(topk, seqlen_k) and call["return_value"]
    assert call["query"].shape == (batch, seqlen, H, D) and call["key"].shape == (batch, seqlen_k, 1, D)


def _loss_inputs(layout, batch, seqlen, seed=0, dtype=torch.bfloat16, w_scale=(H * D) ** -0.5):
    """q, k, weights and the attention side's query [.., NP, 576] and key [.., 1, 576]. The weights are
    scaled as Megatron pre-scales them (H_I^-1/2 D_I^-1/2): no key of a row gets an index
    probability below the operator's 1e-8 clamp (see test_logged_loss_differs_where_the_indexer_...)."""
    gen = torch.Generator().manual_seed(seed + 1)
    q, k, w = _side(layout, batch, seqlen, seqlen, dtype, seed)
    w = (w.float() * w_scale).to(dtype)
    shape = (seqlen, NP, 576) if layout == "thd" else (batch, seqlen, NP, 576)
    query = torch.randn(*shape, generator=gen).to(dtype)
    key = torch.randn(*shape[:-2], 1, 576, generator=gen).to(dtype)
    if layout == "sbhd":
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    return q, k, w, query, key


def _loss_oracle(q, k, w, query, key, layout, batch, seqlen, idx, scale, coeff, per_token=False, cu_seqlens=None):
    """[loss, dq, dk, dw] of the float64 oracle and of its float32 evaluation (the naive), over the
    bshd-shaped top-k ``idx`` [B, S, K] (causal self-attention bounds)."""
    lo, hi = causal_bounds(batch, seqlen, cu_seqlens)
    results = []
    for dtype in (torch.float64, torch.float32):
        leaves = [_bshd(t, layout).detach().double().requires_grad_() for t in (q, k, w)]
        value = loss_ref(*leaves, _bshd(query, layout), _bshd(key, layout), lo, hi, scale, coeff, sparse=True,
                         topk_indices=idx, per_token=per_token, dtype=dtype)
        results.append([value] + [_bshd(g, layout) if layout != "thd" else g[0]
                                  for g in torch.autograd.grad(value, leaves)])
    return results


def _assert_loss(got, results):
    for name, x, r, n in zip(("loss", "dq", "dk", "dw"), got, *results):  # naive: rounded as its dtype returns it
        assert_flash_criterion(name, x.float(), n.to(x.dtype).float(), r, eps=1e-5 * r.abs().max().item())


# rows coreattn's top-k fills whole: every key (top-k >= Sk), in each layout (thd: one sequence)
WHOLE_ROWS = [("sbhd", 2, 6, 8, True), ("bshd", 2, 5, 5, False), ("thd", 1, 9, 16, False)]


@pytest.mark.parametrize("layout, batch, seqlen, topk, per_token", WHOLE_ROWS, ids=[c[0] for c in WHOLE_ROWS])
def test_loss_on_the_operator_where_its_rows_are_whole(npu_dsa, layout, batch, seqlen, topk, per_token):
    """indexer_topk_and_loss with a top-k of every key: row s names its s + 1 keys, the min(K, s + 1)
    slots the operator reads (K = 1,024), so it runs there; loss and gradients as the oracle's."""
    q, k, w, query, key = _loss_inputs(layout, batch, seqlen)
    scale, coeff = 0.07, 0.5
    leaves = [t.detach().requires_grad_() for t in (q, k, w)]
    indices, loss = ix.indexer_topk_and_loss(*leaves, query, key, topk, scale, coeff, sparse=True, layout=layout,
                                             calculate_per_token_loss=per_token)
    got = [loss] + list(torch.autograd.grad(loss, leaves))
    _assert_loss(got, _loss_oracle(q, k, w, query, key, layout, batch, seqlen, _bshd(indices, layout).long(), scale,
                                   coeff, per_token))
    fwd = npu_dsa.of("npu_sparse_flash_attention")
    (kl,) = npu_dsa.of("npu_sparse_lightning_indexer_grad_kl_loss")
    assert len(fwd) == 1 and torch.equal(fwd[0]["sparse_indices"], kl["sparse_indices"])
    assert (kl["layout"], kl["sparse_mode"], kl["actual_seq_qlen"]) == ("BSND", 3, None)
    rows = kl["sparse_indices"].reshape(-1, 1024)
    assert rows.shape[0] == batch * seqlen
    counts = (rows >= 0).sum(-1).view(batch, seqlen)  # each row's valid keys: exactly the min(K, s + 1) it reads
    assert torch.equal(counts, torch.arange(1, seqlen + 1).expand(batch, -1))


def _packed(seed=0):
    """Two sequences of 17 and 23 tokens in one thd stream, top-k 8 (the held-out packed case)."""
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    return _loss_inputs("thd", 1, 40, seed=seed), dict(cu_seqlens=cu), 8


HELD_OUT = {
    # a later sequence's row s holds fewer keys than the s + 1 slots the one BSND sample reads
    "packed": lambda: (*_packed(), "packed sequences (cu_seqlens)"),
    # top-k 8 padded to K 1,024: rows past 8 keys hold -1 inside the min(1024, s + 1) slots it reads
    "narrow": lambda: (_loss_inputs("bshd", 2, 12), {}, 8, "top-k 8 below the operator's K 1024"),
}


@pytest.mark.parametrize("case", sorted(HELD_OUT))
def test_loss_falls_back_where_the_operator_would_read_minus_one(npu_dsa, caplog, case):
    """Rows with fewer valid keys than the slots the kernel reads would give a wrong loss and wrong
    gradients there (the stand-in returns what the kernel returns: stale slots): the fallback runs,
    the reason logged; loss and gradients as the oracle's."""
    (q, k, w, query, key), extra, topk, reason = HELD_OUT[case]()
    layout = "thd" if "cu_seqlens" in extra else "bshd"
    batch, seqlen = (1, q.shape[0]) if layout == "thd" else q.shape[:2]
    leaves = [t.detach().requires_grad_() for t in (q, k, w)]
    with caplog.at_level(logging.INFO, logger="coreattn"):
        indices, loss = ix.indexer_topk_and_loss(*leaves, query, key, topk, 0.07, 1.0, sparse=True, layout=layout,
                                                 **extra)
    assert "indexer loss on the torch backend" in caplog.text and reason in caplog.text
    assert not npu_dsa.of("npu_sparse_lightning_indexer_grad_kl_loss")
    got = [loss] + list(torch.autograd.grad(loss, leaves))
    _assert_loss(got, _loss_oracle(q, k, w, query, key, layout, batch, seqlen, _bshd(indices, layout).long(), 0.07,
                                   1.0, cu_seqlens=extra.get("cu_seqlens")))


def test_loss_over_given_indices_falls_back(npu_dsa, caplog):
    """topk_indices handed in (-1, repeats, keys past causality): nothing says they fill the slots the
    operator reads, and nothing is read on the host to find out: the fallback, the reason logged."""
    q, k, w, query, key = _loss_inputs("sbhd", 2, 6)
    idx = torch.randint(-1, 6, (2, 6, 5), generator=torch.Generator().manual_seed(5))
    idx[:, :, 1] = idx[:, :, 0]
    leaves = [t.detach().requires_grad_() for t in (q, k, w)]
    with caplog.at_level(logging.INFO, logger="coreattn"):
        loss = ix.indexer_loss(*leaves, query, key, 0.07, 0.5, topk_indices=idx.transpose(0, 1), sparse=True,
                               layout="sbhd")
    assert "given topk_indices" in caplog.text and not npu_dsa.calls
    got = [loss] + list(torch.autograd.grad(loss, leaves))
    _assert_loss(got, _loss_oracle(q, k, w, query, key, "sbhd", 2, 6, idx, 0.07, 0.5))
    with pytest.raises(RuntimeError, match="npu_fused' cannot run this indexer loss call: given topk_indices"):
        ix.indexer_loss(q, k, w, query, key, 0.07, 0.5, topk_indices=idx.transpose(0, 1), sparse=True, layout="sbhd",
                        backend="npu_fused")


def test_topk_and_loss_select_then_score_on_the_operators(npu_dsa):
    q, k, w, query, key = _loss_inputs("bshd", 2, 6, seed=3)
    indices, loss = ix.indexer_topk_and_loss(q, k, w, query, key, 6, 0.1, 1.0, sparse=True, layout="bshd",
                                             index_dtype=torch.int32)
    assert indices.dtype == torch.int32
    assert torch.equal(indices, ix.indexer_topk(q, k, w, 6, layout="bshd", index_dtype=torch.int32).indices)
    assert [c["op"] for c in npu_dsa.calls] == ["npu_lightning_indexer", "npu_sparse_flash_attention",
                                                 "npu_sparse_lightning_indexer_grad_kl_loss", "npu_lightning_indexer"]
    again = ix.indexer_loss(q, k, w, query, key, 0.1, 1.0, topk_indices=indices, sparse=True, layout="bshd")
    torch.testing.assert_close(loss, again, rtol=1e-5, atol=0)  # the same loss over the same rows, on torch
    assert len(npu_dsa.calls) == 4


def test_logged_loss_differs_where_the_indexer_gives_below_1e_8(npu_dsa):
    """Index scores so peaked that keys carrying attention get index probabilities below 1e-8: the
    operator's loss clamps both distributions at 1e-8 (its kernel's VectorLoss), Megatron's only the
    target inside its log (1e-10), so the logged values differ there, as docs/ascend.md states; the
    gradients (softmax of the index scores minus the target, unclamped in both) agree."""
    q, k, w, query, key = _loss_inputs("bshd", 2, 6, w_scale=1.0)
    leaves = [t.detach().requires_grad_() for t in (q, k, w)]
    indices, loss = ix.indexer_topk_and_loss(*leaves, query, key, 6, 0.07, 1.0, sparse=True, layout="bshd")
    assert npu_dsa.of("npu_sparse_lightning_indexer_grad_kl_loss")
    idx = indices.long()
    megatron, naive = _loss_oracle(q, k, w, query, key, "bshd", 2, 6, idx, 0.07, 1.0)
    lo, hi = causal_bounds(2, 6)
    clamped = loss_ref(q.double(), k.double(), w.double(), query, key, lo, hi, 0.07, 1.0, sparse=True,
                       topk_indices=idx, clamp=1e-8)
    assert megatron[0] > 2 * clamped  # the clamp bites: the values differ by far more than rounding
    assert_flash_criterion("loss (the kernel's definition)", loss.float(), naive[0].float(), clamped,
                           eps=1e-5 * clamped.abs().item())
    grads = torch.autograd.grad(loss, leaves)
    _assert_loss([megatron[0].float()] + list(grads), (megatron, naive))  # the loss slot: the oracle itself


# ---- limits ----------------------------------------------------------------------------------

def _topk_choice(q, k, w, topk=4, relu=True, return_scores=False, override=None, layout="bshd", **keys):
    tokens, q, k, w = ix.checks.check_index_side(q, k, w, layout)
    mode = ops._mask_mode(tokens, keys.get("cu_seqlens"), keys.get("causal", True),
                          keys.get("causal_alignment", "bottom_right"), keys.get("key_bounds"))
    return function.indexer_backend(NPU, override, what="indexer top-k", ops=NPU_TOPK_OPS,
                                    unfit=lambda: ix.ops.topk_unfit(q, k, w, topk, relu, return_scores, mode))


TOPK_LIMITS = [
    ("identity", dict(relu=False), "ReLU"),
    ("heads", dict(heads=65), "1 to 64 index heads"),
    ("float32", dict(dtype=torch.float32), "float16 or bfloat16"),
    ("topk", dict(topk=3000), "or a multiple of 1024 up to 8192"),
    ("scores", dict(return_scores=True), "sparse_values"),
    ("packed", dict(layout="thd", cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32)), "packed sequences"),
    ("bounds", dict(key_bounds=(torch.zeros(2, 5, dtype=torch.int32), torch.ones(2, 5, dtype=torch.int32))),
     "key_bounds"),
    ("top-left", dict(causal_alignment="top_left", seqlen_k=9), "aligned bottom-right"),
]


@pytest.mark.parametrize("name, over, reason", TOPK_LIMITS, ids=[x[0] for x in TOPK_LIMITS])
def test_topk_outside_a_limit_falls_back_with_the_reason(npu_dsa, caplog, name, over, reason):
    over = dict(over)
    side = {n: over.pop(n) for n in ("heads", "dtype", "seqlen_k") if n in over}
    layout = over.get("layout", "bshd")
    q, k, w = _side(layout, 2 if layout != "thd" else 1, 5, side.pop("seqlen_k", 5), **side)
    with caplog.at_level(logging.INFO, logger="coreattn"):
        assert _topk_choice(q, k, w, **over) is Backend.TORCH
    assert "indexer top-k on the torch backend" in caplog.text and reason in caplog.text
    with pytest.raises(RuntimeError, match="npu_fused' cannot run this indexer top-k call: .*" + reason):
        _topk_choice(q, k, w, override="npu_fused", **over)


def test_topk_fallback_runs_on_torch(npu_dsa):
    q, k, w = _side("thd", 1, 5, 5)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    got = ix.indexer_topk(q, k, w, 3, cu_seqlens=cu).indices
    assert torch.equal(got, ix.indexer_topk(q, k, w, 3, cu_seqlens=cu, backend="torch").indices)
    assert not npu_dsa.calls


LOSS_LIMITS = [
    ("dense", dict(sparse=False), "the dense loss"),
    ("row-mask", dict(query_valid_rows=torch.ones(2, 6, dtype=torch.bool)), "query_valid_rows"),
    ("not-causal", dict(causal=False), "causal sparse_mode 3 only"),
    ("identity", dict(relu=False), "ReLU"),
    ("attention-heads", dict(heads=2), "32, 64, 128 attention heads, got 2"),
]


@pytest.mark.parametrize("name, over, reason", LOSS_LIMITS, ids=[x[0] for x in LOSS_LIMITS])
def test_loss_outside_a_limit_falls_back_with_the_reason(npu_dsa, caplog, name, over, reason):
    over = dict(over)
    q, k, w, query, key = _loss_inputs("bshd", 2, 6)
    query = query[:, :, :over.pop("heads", NP)]
    kw = dict(dict(sparse=True, layout="bshd"), **over)
    with caplog.at_level(logging.INFO, logger="coreattn"):
        _, loss = ix.indexer_topk_and_loss(q, k, w, query, key, 6, 0.1, 1.0, **kw)
    assert "indexer loss on the torch backend" in caplog.text and reason in caplog.text
    assert not npu_dsa.of("npu_sparse_lightning_indexer_grad_kl_loss") and torch.isfinite(loss)
    with pytest.raises(RuntimeError, match="npu_fused' cannot run this indexer loss call: .*" + reason):
        ix.indexer_topk_and_loss(q, k, w, query, key, 6, 0.1, 1.0, backend="npu_fused", **kw)


def test_loss_rows_wider_or_narrower_than_the_operators_k(npu_dsa):
    q, k, w, query, key = _loss_inputs("bshd", 2, 6)
    fit = dict(sparse=True, relu=True, query_valid_rows=None, tp_group=None, fmt="bshd", causal=True,
               bottom_right=True, key_bounds=False, selected=True)
    assert ix.ops.loss_unfit(q, k, w, query, key, width=8192, **fit) is None  # K itself
    assert ix.ops.loss_unfit(q, k, w, query, key, width=6, **fit) is None  # every key: rows whole
    assert "top-k 5 below the operator's K 1024" in ix.ops.loss_unfit(q, k, w, query, key, width=5, **fit)
    assert "up to 8192 entries (K), got 8193" in ix.ops.loss_unfit(q, k, w, query, key, width=8193, **fit)
    assert "given topk_indices" in ix.ops.loss_unfit(q, k, w, query, key, width=6, **dict(fit, selected=False))
    assert "aligned bottom-right" in ix.ops.loss_unfit(q, k[:, :5], w, query, key, width=5,
                                                       **dict(fit, bottom_right=False))


def test_missing_loss_operator_falls_back(monkeypatch, caplog):
    install(monkeypatch, ops=("npu_sparse_flash_attention",))
    with caplog.at_level(logging.INFO, logger="coreattn"):
        assert function.indexer_backend(NPU, what="indexer loss", ops=NPU_LOSS_OPS) is Backend.TORCH
    assert "this torch_npu has no npu_sparse_lightning_indexer_grad_kl_loss" in caplog.text
    npu.cache_clear()


def test_empty_inputs_need_no_operator_call(npu_dsa):
    q, k, w, query, key = _loss_inputs("bshd", 2, 0)
    loss = ix.indexer_loss(q.requires_grad_(), k, w, query, key, 0.1, 1.0, topk_indices=torch.zeros(2, 0, 4).long(),
                           sparse=True, layout="bshd")
    loss.backward()
    assert loss == 0 and q.grad.shape == q.shape and not npu_dsa.calls
    assert ix.indexer_topk(q.detach(), k, w, 4, layout="bshd").indices.shape == (2, 0, 0)


def test_no_host_read(npu_dsa, monkeypatch):
    """The top-k and the loss on the operators read no device value on the host (BSND: no host lists)."""
    import sync_detector

    exempt = ("coreattn.layers.torch_backend", "coreattn.layers.npu_fused.attention")  # the DSA mappings are checked
    monkeypatch.setattr(sync_detector, "EXEMPT", exempt)
    q, k, w, query, key = _loss_inputs("sbhd", 2, 6)
    leaves = [t.detach().requires_grad_() for t in (q, k, w)]
    with sync_detector.no_host_reads(monkeypatch):
        _, loss = ix.indexer_topk_and_loss(*leaves, query, key, 6, 0.1, 1.0, sparse=True, layout="sbhd")
        loss.backward()
    assert [c["op"] for c in npu_dsa.calls] == ["npu_lightning_indexer", "npu_sparse_flash_attention",
                                                 "npu_sparse_lightning_indexer_grad_kl_loss"]


# ---- whether the operators can run on this device ---------------------------------------------

@pytest.mark.parametrize("op", ["npu_lightning_indexer", "npu_sparse_lightning_indexer_grad_kl_loss"])
def test_an_operator_without_a_kernel_falls_back_once_remembered(monkeypatch, caplog, op):
    """The installed CANN has no kernel for the operator torch_npu registers: its first call fails,
    coreattn remembers it for the device, logs why and runs that step on the fallback."""
    dsa = install(monkeypatch, unsupported=(op,))
    q, k, w, query, key = _loss_inputs("bshd", 2, 6)
    with caplog.at_level(logging.INFO, logger="coreattn"):
        results = [ix.indexer_topk_and_loss(q, k, w, query, key, 6, 0.1, 1.0, sparse=True, layout="bshd")
                   for _ in range(2)]
    reference = ix.indexer_topk_and_loss(q, k, w, query, key, 6, 0.1, 1.0, sparse=True, layout="bshd",
                                         backend="torch")
    for indices, loss in results:
        assert _sets(indices) == _sets(reference[0])
        torch.testing.assert_close(loss, reference[1], rtol=1e-5, atol=0)
    assert len(dsa.of(op)) == 1 and f"torch_npu.{op} has no kernel here" in caplog.text
    npu.cache_clear()


def test_a_chip_the_kernels_are_not_built_for_falls_back(monkeypatch, caplog):
    dsa = install(monkeypatch, soc="Ascend910ProB")  # an Atlas 800 training server (Ascend 910, not A2/A3)
    q, k, w, query, key = _loss_inputs("bshd", 2, 6)
    with caplog.at_level(logging.INFO, logger="coreattn"):
        ix.indexer_topk_and_loss(q, k, w, query, key, 6, 0.1, 1.0, sparse=True, layout="bshd")
    assert not dsa.calls and "not this NPU (other: Ascend910ProB)" in caplog.text
    npu.cache_clear()


def _sets(indices):
    return [sorted(j for j in row if j >= 0) for row in indices.reshape(-1, indices.shape[-1]).tolist()]
