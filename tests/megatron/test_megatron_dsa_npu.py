"""CoreDSAttention on an Ascend NPU, on CPU: megatron-core 0.19's DSA GPTModel with its DSAttention swapped
by use_coreattn, CPU tensors standing in for npu ones (the DSA ops' backend choice is asked for an npu
device) and the stand-in torch_npu of tests/fake_torch_npu_dsa.py (the DSA operators' documented
contract, computed by the float64 oracles).

A model of DeepSeek-V3.2's attention shapes (absorbed MLA, kv_lora_rank 512 + rope 64, an indexer of
64 heads x 128, ReLU scoring, the sparse indexer loss) in bf16, the operators' dtype, against
Megatron's own model from the same weights (bf16) and a float64 copy whose sparse-attention step is
the float64 oracle (tests/megatron/test_megatron_dsa.py): logits, each layer's logged indexer loss
and every parameter gradient meet the flash criterion err(coreattn) <= 2 * err(Megatron) + 1e-5.
The top-k covers every key (16 tokens), so the three models attend the same key sets though bf16
and float64 rank scores differently; the selection itself is checked against the oracle in
tests/npu_fused/test_npu_indexer.py. Then, per layer, the steps on the inputs Megatron handed them (no
propagation through the model): the sparse attention (output and the gradients of query, key and the
V up-projection) against the float64 oracle, relative to Megatron's own step in bf16; and (sbhd) the
indexer loss and its q/k/weights gradients against the float64 oracle, relative to it in float32,
Megatron's plain causal bounds having reached the indexer as causal. sbhd runs the sparse attention
(forward and grad), the indexer top-k and the loss on the operators (the top-k of every key fills each
row's slots the loss operator reads); packed thd runs the sparse attention there, and the indexer
(per-row bounds, which the indexer operators do not take) on torch, the fallback logged. The stand-in
computes what the kernels compute (tests/fake_torch_npu_dsa.py): the loss clamps both distributions
at 1e-8 where Megatron's clamps its target at 1e-10, which these inputs do not reach.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

pytest.importorskip("megatron.core")
dsa = pytest.importorskip("megatron.core.transformer.experimental_attention_variant.dsa")

from attn_cases import assert_flash_criterion  # noqa: E402
from coreattn.adapters.megatron import use_coreattn  # noqa: E402
from coreattn.kernels import npu  # noqa: E402
import coreattn.layers.dsa.indexer as ix  # noqa: E402
from dsa_env import build, dsa_block_spec, dsa_config, install_shims  # noqa: E402
from fake_torch_npu_dsa import install  # noqa: E402
from megatron_env import megatron_cpu, megatron_cpu_shims  # noqa: E402,F401
from indexer_oracle import loss_ref  # noqa: E402
from test_megatron_dsa import ORACLE_STEP, SEAM, V019, make_batch, run_model  # noqa: E402

pytestmark = pytest.mark.skipif(not V019, reason="megatron-core 0.19's DSAttention (absorbed MLA, the indexer loss)")


@pytest.fixture
def npu_model(megatron_cpu, megatron_cpu_shims, monkeypatch):
    install_shims(monkeypatch)
    monkeypatch.setattr(dsa.DSAIndexerLossAutoScaler, "main_loss_backward_scale", torch.tensor(1.0))
    yield install(monkeypatch)
    npu.cache_clear()


def npu_config():
    """DeepSeek-V3.2's attention shapes at a tiny width: 32 heads (the loss operator's fewest), latent 512 + rope 64,
    indexer 64 x 128."""
    return dsa_config(init_method_std=0.05, num_attention_heads=32, kv_lora_rank=512, qk_pos_emb_head_dim=64,
                      dsa_indexer_n_heads=64, dsa_indexer_head_dim=128, dsa_indexer_topk=16,
                      dsa_indexer_scoring_relu=True, dsa_indexer_use_sparse_loss=True, bf16=True,
                      params_dtype=torch.bfloat16)


def _sets(indices):
    """Each row's valid keys, as a sorted list (the order within a row is each backend's own)."""
    return [sorted(j for j in row if j >= 0) for row in indices.reshape(-1, indices.shape[-1]).tolist()]


EXPECTED = {"sbhd": ("npu_lightning_indexer", "npu_sparse_flash_attention", "npu_sparse_lightning_indexer_grad_kl_loss",
                     "npu_sparse_flash_attention", "npu_sparse_flash_attention_grad"),
            "thd": ("npu_sparse_flash_attention", "npu_sparse_flash_attention_grad")}


def assert_attention_steps(calls, gen):
    """Each layer's sparse-attention step on the bf16 inputs Megatron handed it: coreattn's (the
    operators) against the float64 oracle, relative to Megatron's own step in bf16."""
    for layer, (module, kwargs) in enumerate(calls, 1):
        names = [n for n in ("query", "key", "value", "up_v_weight") if kwargs.get(n) is not None]
        results = []
        for dtype, fn in ((torch.bfloat16, functools.partial(SEAM.replacement, module)),
                          (torch.float64, ORACLE_STEP), (torch.bfloat16, getattr(dsa, SEAM.name))):
            kw = dict(kwargs, **{n: kwargs[n].to(dtype).requires_grad_(True) for n in names})
            results.append((fn(**kw), kw))
        (got, kg), (ref, kr), (naive, kn) = results
        grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
        assert_flash_criterion(f"layer {layer} sparse attention", got.float(), naive.float(), ref)
        for (name, g), r, n in zip(zip(names, torch.autograd.grad(got, [kg[n] for n in names], grad.bfloat16())),
                                   torch.autograd.grad(ref, [kr[n] for n in names], grad),
                                   torch.autograd.grad(naive, [kn[n] for n in names], grad.bfloat16())):
            assert_flash_criterion(f"layer {layer} sparse attention d{name}", g.float(), n.float(), r)


def assert_loss_steps(loss_calls):
    """Each layer's indexer loss on the inputs Megatron handed it (Megatron's plain causal bounds as
    top-left causal): the operators' loss and gradients against the float64 oracle, relative to it
    in float32 on the same bf16 inputs (gradients rounded to bf16, as returned), with eps relative to
    the values (a loss of about 2e-4 here)."""
    for layer, (args, kwargs, (indices, logged)) in enumerate(loss_calls, 1):
        assert kwargs["causal"] is True and kwargs["causal_alignment"] == "top_left" and "key_bounds" not in kwargs
        q, k, w, query, key, topk, scale, coeff = args
        leaves = [t.detach().requires_grad_() for t in (q, k, w)]
        again, loss = ix.indexer_topk_and_loss(*leaves, query, key, topk, scale, coeff, **kwargs)
        assert torch.equal(again, indices) and torch.equal(loss, logged.detach())
        got = [loss] + list(torch.autograd.grad(loss, leaves))
        sq = q.shape[0]
        lo, hi = [[0] * sq] * q.shape[1], [list(range(1, sq + 1))] * q.shape[1]
        refs = []
        for dtype in (torch.float64, torch.float32):
            base = [t.detach().transpose(0, 1).double().requires_grad_() for t in (q, k, w)]
            value = loss_ref(*base, query.transpose(0, 1), key.transpose(0, 1), lo, hi, scale, coeff, sparse=True,
                             topk_indices=indices.transpose(0, 1).long(), dtype=dtype)
            refs.append([value] + [g.transpose(0, 1) for g in torch.autograd.grad(value, base)])
        for name, x, r, n in zip(("loss", "dq", "dk", "dw"), got, *refs):  # eps relative: the values are small
            assert_flash_criterion(f"layer {layer} indexer {name}", x.float(), n.to(x.dtype).float(), r,
                                   eps=1e-5 * r.abs().max().item())


@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_model_on_the_npu_operators_matches_megatron(npu_model, layout, monkeypatch, caplog):
    config = npu_config()
    spec = dsa_block_spec(config)
    megatron_model = build(config, spec)
    model = build(config, use_coreattn(spec))
    model.load_state_dict(megatron_model.state_dict())
    reference = build(config, spec)
    reference.load_state_dict(megatron_model.state_dict())
    reference.double()
    batch = make_batch(layout)
    calls, loss_calls = [], []
    topk_and_loss = ix.indexer_topk_and_loss

    def record(*args, **kwargs):
        result = topk_and_loss(*args, **kwargs)
        loss_calls.append((args, kwargs, result))
        return result

    with caplog.at_level(logging.INFO, logger="coreattn"), monkeypatch.context() as patch:
        patch.setattr(ix, "indexer_topk_and_loss", record)
        got = run_model(model, batch, monkeypatch, calls=calls)
    naive = run_model(megatron_model, batch, monkeypatch)
    ref = run_model(reference, batch, monkeypatch, step=ORACLE_STEP)

    ran = sorted({c["op"] for c in npu_model.calls})
    assert ran == sorted(set(EXPECTED[layout])), ran
    per_layer = {name: len(npu_model.of(name)) for name in set(EXPECTED[layout])}
    assert per_layer == {name: EXPECTED[layout].count(name) * config.num_layers for name in per_layer}
    if layout == "thd":  # packed bounds: the indexer falls back, the reason logged once
        assert "indexer top-k on the torch backend" in caplog.text and "key_bounds" in caplog.text
    for i, (a, r, n) in enumerate(zip(got[3], ref[3], naive[3])):
        assert _sets(a) == _sets(r) == _sets(n), f"layer {i + 1}: other key sets"
    assert_flash_criterion("logits", got[0].float(), naive[0].float(), ref[0])
    assert (got[1] > 0).all(), got[1]
    assert_flash_criterion("logged indexer loss", got[1].float(), naive[1].float(), ref[1])
    assert got[2].keys() == ref[2].keys() == naive[2].keys()
    for name, grad in got[2].items():
        assert_flash_criterion(f"grad {name}", grad.float(), naive[2][name].float(), ref[2][name])
    npu_model.calls.clear()
    assert_attention_steps(calls, torch.Generator().manual_seed(1))
    assert len(npu_model.of("npu_sparse_flash_attention_grad")) == config.num_layers  # the steps ran on it too
    assert len(loss_calls) == config.num_layers
    if layout == "sbhd":
        assert_loss_steps(loss_calls)
