"""Top-k sparse attention on npu_fused (coreattn/layers/npu_fused/sparse.py), on CPU: a stand-in torch_npu
(tests/fake_torch_npu.py + tests/fake_torch_npu_dsa.py) rejects what the DSA operators' pages reject
and computes what their kernels compute, reading the index rows as the kernels read them (the grad:
min(K, S2) slots of every row, whatever they hold), and records what coreattn passes; CPU tensors
stand in for npu ones (the selection is asked for a stand-in npu device, as
tests/npu_fused/test_npu_backend.py does).

Checked: the public ops' forward, lse and backward against the oracle (flash criterion) in every
layout, both causal alignments, key bounds, topk_length, -1 / repeated / out-of-sequence entries and
rows that see no key; what reaches the operators (BSND, sparse_mode 0, attention_mode 2, the
forward's rows valid entries first then -1, the grad's every slot a key: the zero filler row after
each sample's keys, K 2,048); the default per device, each limit's fallback (the grad's B, S and K,
packed thd as one sample, float16) and its logged reason, an explicit ``backend="npu_fused"``
outside a limit raising it; an operator whose kernel the device lacks (its first call fails:
remembered, the fallback runs, a real error still raises) or whose chip it is not built for; no
host read.
"""

import logging

import pytest
import torch

from coreattn.kernels import npu
from coreattn.layers import backends
from coreattn.layers.backends import Backend, select_sparse_backend
from coreattn.layers.npu_fused.sparse import sparse_grad_unfit, sparse_unfit
from fake_torch_npu_dsa import NPU, install
from sparse_cases import SparseCase, SparseInputs, assert_sparse_matches_oracle


@pytest.fixture
def npu_dsa(monkeypatch):
    yield install(monkeypatch)
    npu.cache_clear()


ABSORBED = dict(dqk=576, dv=512, hq=2, hkv=1, absorbed=True, topk=6)
CASES = [
    SparseCase(layout="thd", lens_q=(5, 0, 7, 1), **ABSORBED),
    SparseCase(layout="thd", lens_q=(4, 6), lens_k=(7, 3), topk_length=True, bounds=True, **ABSORBED),
    SparseCase(layout="bshd", lens_q=(5, 7), bottom_right=False, left_pad=True, **ABSORBED),
    SparseCase(layout="sbhd", lens_q=(6, 6), causal=False, softmax_scale=0.05, **ABSORBED),
]
DTYPES = {"thd": torch.bfloat16, "bshd": torch.float16, "sbhd": torch.bfloat16}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_public_ops_match_the_oracle_on_the_operator(npu_dsa, case, caplog):
    inp = SparseInputs(case, DTYPES[case.layout], seed=1)
    with caplog.at_level(logging.INFO, logger="coreattn"):
        out, lse = inp.call()
        assert_sparse_matches_oracle(inp, out, lse)
    (fwd,) = npu_dsa.of("npu_sparse_flash_attention")
    assert (fwd["layout_query"], fwd["layout_kv"], fwd["sparse_mode"], fwd["attention_mode"]) == ("BSND",) * 2 + (0, 2)
    assert fwd["return_softmax_lse"] and fwd["value"] is fwd["key"]
    assert fwd["actual_seq_lengths_query"] is None and fwd["actual_seq_lengths_kv"] is None
    assert fwd["scale_value"] == inp.kwargs.get("softmax_scale", 576 ** -0.5)
    # the forward's rows hold exactly the oracle's key sets (thd: rows of the one packed sample), -1 after them
    rows = fwd["sparse_indices"].reshape(-1, case.topk).tolist()
    sample_rows = fwd["key"].shape[1]
    keys = [{j for j in row if j >= 0} for row in rows]
    want = [{j % sample_rows for j in s[0]} for s in inp.sets]
    assert keys == want
    grads = npu_dsa.of("npu_sparse_flash_attention_grad")
    if DTYPES[case.layout] is torch.float16:  # the zero filler's weight would overflow float16: the fallback
        assert not grads and "sparse attention backward on the torch backend" in caplog.text
        return
    (bwd,) = grads
    assert (bwd["layout"], bwd["sparse_mode"], bwd["attention_mode"]) == ("BSND", 0, 2)
    # every slot of the grad's rows names a key: the forward's entries, then the zero row after the sample's keys
    filler = sample_rows
    assert bwd["key"].shape[1] == filler + 1 and not bwd["key"][:, filler].any()
    grad_rows = bwd["sparse_indices"].reshape(-1, 2048)
    forward_rows = torch.nn.functional.pad(fwd["sparse_indices"].reshape(-1, case.topk), (0, 2048 - case.topk),
                                           value=-1)
    assert torch.equal(grad_rows, torch.where(forward_rows < 0, filler, forward_rows))


def test_rows_without_keys_are_zeros_not_the_operators_result(npu_dsa):
    """The stand-in returns NaN output for a row whose index list is empty (not documented): coreattn
    gives out 0, lse -inf and zero gradients there (the grad's rows all filler)."""
    case = SparseCase(layout="bshd", lens_q=(6,), **ABSORBED)
    inp = SparseInputs(case, torch.bfloat16, seed=2)
    empty = [n for n, s in enumerate(inp.sets) if not s[0]]
    assert empty, "the case has rows without a visible key"
    out, lse = inp.call()
    out.float().sum().backward()
    assert not out.isnan().any() and not inp.q.grad.isnan().any() and not inp.k.grad.isnan().any()
    assert not inp.flat(out)[empty].any() and torch.isneginf(inp.flat_lse(lse)[empty]).all()
    assert not inp.flat(inp.q.grad)[empty].any()
    assert len(npu_dsa.of("npu_sparse_flash_attention_grad")) == 1


def test_no_host_read(npu_dsa, monkeypatch):
    """Forward and backward read no device value on the host (the operators take no host lists here)."""
    import sync_detector

    exempt = ("coreattn.layers.torch_backend", "coreattn.layers.npu_fused.attention")  # the DSA mappings are checked
    monkeypatch.setattr(sync_detector, "EXEMPT", exempt)
    inp = SparseInputs(SparseCase(layout="thd", lens_q=(3, 4), **ABSORBED), torch.bfloat16)
    with sync_detector.no_host_reads(monkeypatch):
        out = inp.call()[0]
        out.float().sum().backward()
    assert len(npu_dsa.calls) == 2


# ---- selection -------------------------------------------------------------------------------

def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


GRAD_FIT = dict(FIT := dict(q=_meta(4, 2, 576), k=_meta(4, 1, 576), v=None, topk=_meta(4, 1, 8, dtype=torch.int32),
                            v_dim=512), fmt="thd")
GRAD_LIMITS = [
    ("float16", dict(q=_meta(4, 2, 576, dtype=torch.float16), k=_meta(4, 1, 576, dtype=torch.float16)),
     "bfloat16 only"),
    ("batch", dict(q=_meta(257, 1, 2, 576), k=_meta(257, 1, 1, 576), fmt="bshd"), "B <= 256"),
    ("seqlen-packed", dict(q=_meta(128 * 1024, 2, 576), k=_meta(128 * 1024, 1, 576)), "S2 <= 131072"),
    ("seqlen-q", dict(q=_meta(1, 128 * 1024 + 1, 2, 576), k=_meta(1, 8, 1, 576), fmt="bshd"), "S1 131073"),
    ("topk", dict(topk=_meta(4, 1, 2049, dtype=torch.int32)), "K = 2048, got 2049"),
]


@pytest.mark.parametrize("name, over, reason", GRAD_LIMITS, ids=[x[0] for x in GRAD_LIMITS])
def test_grad_outside_a_limit_falls_back_with_the_reason(npu_dsa, caplog, name, over, reason):
    args = dict(GRAD_FIT, **over)
    assert sparse_grad_unfit(**GRAD_FIT) is None
    unfit = lambda: sparse_grad_unfit(**args)  # noqa: E731
    with caplog.at_level(logging.INFO, logger="coreattn"):
        assert select_sparse_backend(NPU, unfit=unfit, backward=True) is Backend.TORCH
    assert "sparse attention backward on the torch backend" in caplog.text and reason in caplog.text
    with pytest.raises(RuntimeError, match=f"cannot run this sparse attention backward call: .*{reason}"):
        select_sparse_backend(NPU, "npu_fused", unfit, backward=True)


def test_backward_past_the_grads_batch_runs_on_torch(npu_dsa):
    """257 samples: the forward on the operator, the backward (B <= 256) on torch (the numbers of either
    direction are checked above), never the grad, which rejects B > 256."""
    inp = SparseInputs(SparseCase(layout="bshd", lens_q=(1,) * 257, **dict(ABSORBED, topk=2)), torch.bfloat16)
    out, _ = inp.call()
    out.float().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (inp.q, inp.k))
    assert len(npu_dsa.of("npu_sparse_flash_attention")) == 1 and not npu_dsa.of("npu_sparse_flash_attention_grad")


LIMITS = [
    ("dtype", dict(q=_meta(4, 2, 576, dtype=torch.float32), k=_meta(4, 1, 576, dtype=torch.float32)),
     "float16 or bfloat16"),
    ("separate-v", dict(v=_meta(4, 1, 512)), "absorbed MLA only"),
    ("head-dim", dict(q=_meta(4, 2, 192), k=_meta(4, 1, 192), v_dim=128), "head dim 512 \\+ 64"),
    ("key-heads", dict(q=_meta(4, 4, 576), k=_meta(4, 2, 576), topk=_meta(4, 2, 8, dtype=torch.int32)),
     "one key head"),
    ("query-heads", dict(q=_meta(4, 3, 576)), "query heads, got 3"),
]


def test_npu_tensors_default_to_npu_fused(npu_dsa, monkeypatch):
    assert sparse_unfit(**FIT) is None
    unfit = lambda: sparse_unfit(**FIT)  # noqa: E731
    assert select_sparse_backend(NPU, unfit=unfit) is Backend.NPU_FUSED
    assert select_sparse_backend(NPU, "npu_fused", unfit) is Backend.NPU_FUSED
    assert select_sparse_backend(NPU, "torch", unfit) is Backend.TORCH
    monkeypatch.setenv(backends.ENV_BACKEND, "npu_fused")  # set for dense attention: the same default
    assert select_sparse_backend(NPU, unfit=unfit) is Backend.NPU_FUSED


@pytest.mark.parametrize("name, over, reason", LIMITS, ids=[x[0] for x in LIMITS])
def test_outside_a_limit_falls_back_with_the_reason(npu_dsa, caplog, name, over, reason):
    args = dict(FIT, **over)
    unfit = lambda: sparse_unfit(**args)  # noqa: E731
    with caplog.at_level(logging.INFO, logger="coreattn"):
        assert select_sparse_backend(NPU, unfit=unfit) is Backend.TORCH  # Triton: refused under the interpreter
    assert "sparse attention on the torch backend" in caplog.text and "not npu_fused: npu_sparse" in caplog.text
    with pytest.raises(RuntimeError, match=f"backend='npu_fused' cannot run this sparse attention call: .*{reason}"):
        select_sparse_backend(NPU, "npu_fused", unfit)


def test_a_torch_npu_without_the_operators_falls_back(monkeypatch, caplog):
    install(monkeypatch, ops=("npu_sparse_flash_attention",))
    with caplog.at_level(logging.INFO, logger="coreattn"):
        assert select_sparse_backend(NPU, unfit=lambda: None) is Backend.NPU_FUSED
        assert select_sparse_backend(NPU, unfit=lambda: None, backward=True) is Backend.TORCH
    assert "this torch_npu has no npu_sparse_flash_attention_grad" in caplog.text
    with pytest.raises(RuntimeError, match="cannot run sparse attention backward on npu: this torch_npu has no"):
        select_sparse_backend(NPU, "npu_fused", backward=True)
    npu.cache_clear()


# ---- whether the operators can run on this device ---------------------------------------------

BF16_THD = SparseCase(layout="thd", lens_q=(3, 4), **ABSORBED)


@pytest.mark.parametrize("op", ["npu_sparse_flash_attention", "npu_sparse_flash_attention_grad"])
def test_an_operator_without_a_kernel_falls_back_once_remembered(monkeypatch, caplog, op):
    """torch_npu registers the operator, the installed CANN has no kernel for it: its first call raises
    (op-plugin's missing-symbol error); coreattn remembers that for the device, logs the reason and
    runs the call on the fallback; later calls do not try it again."""
    dsa = install(monkeypatch, unsupported=(op,))
    inp = SparseInputs(BF16_THD, torch.bfloat16, seed=4)
    with caplog.at_level(logging.INFO, logger="coreattn"):
        for _ in range(2):
            out, lse = inp.call()
            assert_sparse_matches_oracle(inp, out, lse)
    assert len(dsa.of(op)) == 1  # tried once
    assert f"torch_npu.{op} has no kernel here" in caplog.text and "not in libopapi.so" in caplog.text
    with pytest.raises(RuntimeError, match=f"npu_fused' cannot run .*torch_npu.{op} has no kernel here"):
        out, _ = inp.call(backend="npu_fused")
        out.float().sum().backward()
    npu.cache_clear()


def test_a_real_error_still_raises(monkeypatch):
    """Only the missing-kernel failure turns into a fallback: any other error of the operator stands."""
    message = "call aclnnSparseFlashAttention failed, detail: EZ1001: the shape of query is invalid"
    dsa = install(monkeypatch, errors={"npu_sparse_flash_attention": message})
    with pytest.raises(RuntimeError, match="the shape of query is invalid"):
        SparseInputs(BF16_THD, torch.bfloat16).call()
    assert len(dsa.of("npu_sparse_flash_attention")) == 1
    with pytest.raises(RuntimeError, match="the shape of query is invalid"):  # not remembered as unavailable
        SparseInputs(BF16_THD, torch.bfloat16).call()
    npu.cache_clear()


def test_a_chip_the_kernels_are_not_built_for_falls_back(monkeypatch, caplog):
    """An Atlas 300I Duo (Ascend310P3): the operators' kernels are built for Atlas A2/A3; nothing is called."""
    dsa = install(monkeypatch, soc="Ascend310P3")
    inp = SparseInputs(BF16_THD, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="coreattn"):
        out, lse = inp.call()
    assert_sparse_matches_oracle(inp, out, lse)
    assert not dsa.calls
    assert "built for ascend910b and ascend910_93 (Atlas A2/A3), not this NPU (other: Ascend310P3)" in caplog.text
    npu.cache_clear()


def test_fallback_runs_the_call_on_torch(npu_dsa):
    """float32 is outside the operator's dtypes: the same public call runs on torch, nothing reaches it."""
    inp = SparseInputs(SparseCase(layout="thd", lens_q=(3, 5), **ABSORBED), torch.float32)
    out, lse = inp.call()
    assert_sparse_matches_oracle(inp, out, lse, grads=False)
    assert not npu_dsa.calls
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        inp.call(backend="npu_fused")
