"""The DSA indexer's top-k and sparse loss on npu_fused (coreattn/layers/npu_fused/indexer.py), on CPU:
the stand-in torch_npu of tests/fake_torch_npu_dsa.py (the documented contract, computed by the float64
oracles of tests/indexer_oracle.py and tests/sparse_oracle.py), CPU tensors standing in for npu ones.

Checked: the top-k equals the oracle's selection and order (score descending, then position; -1
last) though the operator sorts masked keys in and orders ties its own way; the loss and its
q/k/weights gradients meet the flash criterion against the oracle, fed the attention's statistics
by a sparse flash attention over the same list; what reaches the operators; each documented limit's
fallback with its logged reason, and an explicit ``backend="npu_fused"`` outside one raising it.
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


def _loss_inputs(layout, batch, seqlen, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed + 1)
    q, k, w = _side(layout, batch, seqlen, seqlen, dtype, seed)
    shape = (seqlen, NP, 576) if layout == "thd" else (batch, seqlen, NP, 576)
    query = torch.randn(*shape, generator=gen).to(dtype)
    key = torch.randn(*shape[:-2], 1, 576, generator=gen).to(dtype)
    if layout == "sbhd":
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    return q, k, w, query, key


LOSS_CASES = [("thd", 1, 9, dict(cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32)), False),
              ("sbhd", 2, 6, {}, True)]


@pytest.mark.parametrize("layout, batch, seqlen, extra, per_token", LOSS_CASES, ids=[c[0] for c in LOSS_CASES])
def test_sparse_loss_and_gradients_match_the_oracle(npu_dsa, layout, batch, seqlen, extra, per_token):
    q, k, w, query, key = _loss_inputs(layout, batch, seqlen)
    gen = torch.Generator().manual_seed(5)
    idx = torch.randint(-1, seqlen, (batch, seqlen, 5), generator=gen)  # -1, repeats, keys past causality
    idx[:, :, 1] = idx[:, :, 0]
    topk_indices = idx[0] if layout == "thd" else (idx.transpose(0, 1) if layout == "sbhd" else idx)
    scale, coeff = 0.07, 0.5
    leaves = [t.detach().requires_grad_() for t in (q, k, w)]
    loss = ix.indexer_loss(*leaves, query, key, scale, coeff, topk_indices=topk_indices, sparse=True, layout=layout,
                           calculate_per_token_loss=per_token, **extra)
    got = [loss] + list(torch.autograd.grad(loss, leaves))
    lo, hi = causal_bounds(batch, seqlen, extra.get("cu_seqlens"))
    results = []
    for dtype in (torch.float64, torch.float32):
        ref_leaves = [_bshd(t, layout).detach().double().requires_grad_() for t in (q, k, w)]
        ref_loss = loss_ref(*ref_leaves, _bshd(query, layout), _bshd(key, layout), lo, hi, scale, coeff, sparse=True,
                            topk_indices=idx, per_token=per_token, dtype=dtype)
        results.append([ref_loss] + [_bshd(g, layout) if layout != "thd" else g[0]
                                     for g in torch.autograd.grad(ref_loss, ref_leaves)])
    for name, x, r, n in zip(("loss", "dq", "dk", "dw"), got, *results):  # naive: rounded as its dtype returns it
        assert_flash_criterion(name, x.float(), n.to(x.dtype).float(), r, eps=1e-5 * r.abs().max().item())
    fwd = npu_dsa.of("npu_sparse_flash_attention")
    (kl,) = npu_dsa.of("npu_sparse_lightning_indexer_grad_kl_loss")
    assert len(fwd) == 1 and torch.equal(fwd[0]["sparse_indices"], kl["sparse_indices"])
    assert (kl["layout"], kl["sparse_mode"], kl["actual_seq_qlen"]) == ("BSND", 3, None)
    assert kl["sparse_indices"].shape[-1] == 1024  # 5 entries padded with -1 to the operator's smallest K


def test_topk_and_loss_select_then_score_on_the_operators(npu_dsa):
    q, k, w, query, key = _loss_inputs("bshd", 2, 6, seed=3)
    indices, loss = ix.indexer_topk_and_loss(q, k, w, query, key, 3, 0.1, 1.0, sparse=True, layout="bshd",
                                             index_dtype=torch.int32)
    assert indices.dtype == torch.int32
    assert torch.equal(indices, ix.indexer_topk(q, k, w, 3, layout="bshd", index_dtype=torch.int32).indices)
    again = ix.indexer_loss(q, k, w, query, key, 0.1, 1.0, topk_indices=indices, sparse=True, layout="bshd")
    assert torch.equal(loss, again)
    assert [c["op"] for c in npu_dsa.calls] == ["npu_lightning_indexer", "npu_sparse_flash_attention",
                                                 "npu_sparse_lightning_indexer_grad_kl_loss", "npu_lightning_indexer",
                                                 "npu_sparse_flash_attention",
                                                 "npu_sparse_lightning_indexer_grad_kl_loss"]


# ---- limits ----------------------------------------------------------------------------------

def _topk_choice(q, k, w, topk=4, relu=True, return_scores=False, override=None, layout="bshd", **keys):
    tokens, q, k, w = ix.checks.check_index_side(q, k, w, layout)
    mode = ops._mask_mode(tokens, keys.get("cu_seqlens"), keys.get("causal", True),
                          keys.get("causal_alignment", "bottom_right"), keys.get("key_bounds"))
    return function.indexer_backend(NPU, override, what="indexer top-k", ops=NPU_TOPK_OPS,
                                    unfit=lambda: ix.ops.topk_unfit(q, k, w, topk, relu, return_scores, mode))


TOPK_LIMITS = [
    ("identity", dict(relu=False), "ReLU"),
    ("heads", dict(heads=32), "64 index heads"),
    ("float32", dict(dtype=torch.float32), "float16 or bfloat16"),
    ("topk", dict(topk=4096), "up to 2048"),
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
    idx = torch.randint(0, 6, (2, 6, over.pop("width", 3)), generator=torch.Generator().manual_seed(0))
    kw = dict(dict(topk_indices=idx, sparse=True, layout="bshd"), **over)
    with caplog.at_level(logging.INFO, logger="coreattn"):
        loss = ix.indexer_loss(q, k, w, query, key, 0.1, 1.0, **kw)
    assert "indexer loss on the torch backend" in caplog.text and reason in caplog.text
    assert not npu_dsa.of("npu_sparse_lightning_indexer_grad_kl_loss") and torch.isfinite(loss)
    with pytest.raises(RuntimeError, match="npu_fused' cannot run this indexer loss call: .*" + reason):
        ix.indexer_loss(q, k, w, query, key, 0.1, 1.0, backend="npu_fused", **kw)


def test_loss_rows_past_the_operators_largest_k_fall_back(npu_dsa):
    q, k, w, query, key = _loss_inputs("bshd", 2, 6)
    fit = dict(sparse=True, relu=True, query_valid_rows=None, tp_group=None, fmt="bshd", causal=True,
               bottom_right=True, key_bounds=False)
    assert ix.ops.loss_unfit(q, k, w, query, key, width=8192, **fit) is None
    assert "up to 8192 entries (K), got 8193" in ix.ops.loss_unfit(q, k, w, query, key, width=8193, **fit)


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
        _, loss = ix.indexer_topk_and_loss(*leaves, query, key, 3, 0.1, 1.0, sparse=True, layout="sbhd")
        loss.backward()
    assert [c["op"] for c in npu_dsa.calls][0] == "npu_lightning_indexer" and len(npu_dsa.calls) == 3
