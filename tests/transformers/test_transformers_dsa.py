"""transformers' DeepSeek Sparse Attention models (DeepSeek-V3.2, GLM-5) and DeepSeek-V4 under "coreattn".

The padded and packed batches against each sequence run alone are in test_transformers.py (the DSA
models are among its MODELS); here: an unpadded batch against the same batch under "eager" (logits,
the model's own loss, every gradient), generation with transformers' caches, the indexer running on
coreattn, nothing S x S on the path (every op's output counted, and one layer's memory at 8,192
tokens), DeepSeek-V4 (sliding-only equals eager; its compressed layers raise), and the rule that a
keyword argument coreattn does not implement raises in every path of the attention function.
"""

import pytest
import torch

pytest.importorskip("transformers")

import coreattn.adapters.transformers as coreattn_hf  # noqa: E402
import hf_models as hm  # noqa: E402
from attn_cases import assert_flash_criterion  # noqa: E402

TORCH_IMPL = "coreattn_torch"


@pytest.fixture(scope="module", autouse=True)
def registered():
    coreattn_hf.register()
    coreattn_hf.register(TORCH_IMPL, backend="torch")


def _loss_logits_grads(name, dtype, impl, ids):
    model = hm.build(name, dtype, impl)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().reshape(1), out.logits.detach(), grads


@pytest.mark.parametrize("name", hm.DSA_MODELS)
def test_unpadded_batch_matches_eager(name):
    """Two rows of 9 tokens (top-k 4: most rows sparse): logits, the model's loss and every parameter
    gradient of coreattn in float32 against eager in float64, under the flash criterion (naive: eager
    in float32)."""
    ids = torch.randint(0, hm.VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    ref = _loss_logits_grads(name, torch.float64, "eager", ids)
    naive = _loss_logits_grads(name, torch.float32, "eager", ids)
    got = _loss_logits_grads(name, torch.float32, TORCH_IMPL, ids)
    for what, i in (("loss", 0), ("logits", 1)):
        assert_flash_criterion(what, got[i], naive[i], ref[i])
    assert got[2].keys() == ref[2].keys()
    assert not any(".indexer." in n for n in got[2])  # transformers' indexer runs under no_grad: not trained
    for param, g in got[2].items():
        assert_flash_criterion(param, g, naive[2][param], ref[2][param])


def _generate(name, impl, cache_implementation=None):
    return hm.greedy(hm.build(name, torch.float32, impl), cache_implementation)


@pytest.mark.parametrize("name, cache", [("deepseek_v32", None), ("glm_moe_dsa", None), ("deepseek_v32", "static")])
def test_generate_with_cache_matches_eager(name, cache):
    """Greedy decoding of a left-padded batch past the top-k (6 + 5 tokens, top-k 4) with transformers'
    dynamic or static cache (the indexer's keys cached too): the same tokens and scores as eager."""
    want_ids, want_scores = _generate(name, "eager", cache)
    got_ids, got_scores = _generate(name, TORCH_IMPL, cache)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_scores, want_scores, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", hm.DSA_MODELS)
def test_nothing_sequence_by_sequence(name, monkeypatch):
    """One sequence of 1,024 tokens, forward and backward: no op outputs S x S / 2 elements under
    coreattn (eager does: its indexer scores and its mask), with the torch backend's chunks made
    small (their byte budgets bound them, not S); the indexer runs coreattn's top-k (transformers'
    own indexer forward raises if reached)."""
    seqlen = 1024
    ids = torch.randint(0, hm.VOCAB, (1, seqlen), generator=torch.Generator().manual_seed(5))
    model = hm.build(name, torch.float32, "eager")
    with hm.LargestOutput() as eager:
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    assert eager.numel >= seqlen * seqlen
    indexer = type(model.model.layers[0].self_attn.indexer)
    monkeypatch.setattr(indexer.forward, "coreattn_wrapped", lambda *a, **k: pytest.fail("transformers' indexer ran"))
    monkeypatch.setenv("COREATTN_INDEXER_CHUNK_BYTES", str(256 << 10))
    monkeypatch.setenv("COREATTN_SPARSE_TORCH_CHUNK_BYTES", str(256 << 10))
    model = hm.build(name, torch.float32, TORCH_IMPL)
    with hm.LargestOutput() as ours:
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    assert ours.numel < seqlen * seqlen // 2, ours.numel


def test_one_layer_at_8k_tokens_grows_far_less_than_eager_indexer_scores():
    """A one-layer DeepSeek-V3.2 (8 index heads, top-k 256) at 8,192 tokens, forward and backward on
    the torch backend: the process's peak resident memory grows by less than an eighth of eager's
    indexer scores alone ([1, S, 8, S] float32: 2 GiB; an S x S float32 tensor alone would be 256 MiB,
    mmapped and touched, so it would show)."""
    seqlen, index_heads = 8192, 8
    config = hm._configs()["deepseek_v32"]()
    config.num_hidden_layers, config.index_topk, config.max_position_embeddings = 1, 256, seqlen
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=TORCH_IMPL, experts_implementation="eager")
    ids = torch.randint(0, hm.VOCAB, (1, seqlen), generator=torch.Generator().manual_seed(6))
    grown = hm.peak_growth(lambda: model(input_ids=ids, use_cache=False).logits.sum().backward())
    eager_scores = seqlen * index_heads * seqlen * 4
    assert grown < eager_scores // 8, f"grew {grown / 2**20:.0f} MiB"


def test_deepseek_v4_layer_at_16k_tokens_grows_less_than_a_quarter_of_eager_mask():
    """A one-layer DeepSeek-V4 (a CSA layer: rate 4, top-64 of its 4,096 compressed entries, a window
    of 4) at 16,384 tokens, forward and backward on the torch backend: the peak resident memory grows
    by less than a quarter of eager's attention mask alone ([1, 1, S, S + S / 4] float32: 1.25 GiB)."""
    seqlen = 16384
    config = hm.v4_config(["compressed_sparse_attention"], rates=(4, 128))
    config.index_topk, config.max_position_embeddings = 64, seqlen
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=TORCH_IMPL, experts_implementation="eager")
    ids = torch.randint(0, hm.VOCAB, (1, seqlen), generator=torch.Generator().manual_seed(11))
    grown = hm.peak_growth(lambda: model(input_ids=ids, use_cache=False).logits.sum().backward())
    eager_mask = seqlen * (seqlen + seqlen // 4) * 4
    assert grown < eager_mask // 4, f"grew {grown / 2**20:.0f} MiB"


def test_bench_hf_dsa_worker_runs():
    """``python -m bench.hf_dsa`` (docs/transformers.md's memory tables): one worker row of each kind and
    model, tiny (the other families on coreattn, GLM-5.3-Flash also on eager)."""
    from bench import hf_dsa

    for impl in ("coreattn", "eager"):
        for worker in (hf_dsa.run_worker, hf_dsa.run_v4_worker):
            row = worker(impl, 32, "float32")
            assert row["impl"] == impl and isinstance(row["grown_mib"], float)  # tiny: RSS counters lag by pages
    for model, impl in [(model, "coreattn") for model in hf_dsa.FAMILIES] + [("glm5_next", "eager")]:
        row = hf_dsa.run_family_worker(model, impl, 32, "float32")
        assert (row["model"], row["impl"]) == (model, impl) and isinstance(row["grown_mib"], float)


def test_padding_with_holes_raises_for_dsa_models():
    model = hm.build("deepseek_v32", torch.float32, TORCH_IMPL)
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]])
    with pytest.raises(NotImplementedError, match="holes"):
        model(input_ids=torch.ones(2, 5, dtype=torch.long), attention_mask=mask, use_cache=False)


@pytest.mark.interpreter_only("the models run on CPU, where the default backend is Triton only under the "
                              "interpreter (on a GPU machine it is the torch backend there)")
@pytest.mark.parametrize("name", hm.DSA_MODELS)
def test_dsa_model_on_the_triton_kernels_matches_torch_backend(name):
    """The default backend (on CPU the Triton kernels under the interpreter: the sparse kernels and
    the indexer's top-k kernel) on a left-padded batch equals the torch backend to rounding."""
    batch = hm.padded(hm.sequences(), left=True)
    got = hm.build(name, torch.float32, "coreattn")(**batch.kwargs, use_cache=False).logits
    want = hm.build(name, torch.float32, TORCH_IMPL)(**batch.kwargs, use_cache=False).logits
    for rows, cols in batch.real:
        torch.testing.assert_close(got[rows, cols], want[rows, cols], rtol=1e-5, atol=1e-5)


# --- DeepSeek-V4 ---------------------------------------------------------------------------------

V4_LAYERS = {"sliding": ["sliding_attention"] * 2, "csa": ["sliding_attention", "compressed_sparse_attention"],
             "hca": ["heavily_compressed_attention"], "all": ["sliding_attention", "compressed_sparse_attention",
                                                              "heavily_compressed_attention"]}


def _v4(layers, impl, dtype=torch.float32, rates=(2, 4)):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hm.v4_config(V4_LAYERS[layers], rates), attn_implementation=impl,
                                             experts_implementation="eager")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)  # zeros at init: make them matter
    return model.to(dtype)


@pytest.mark.parametrize("layers, padded", [("sliding", False), ("csa", True), ("hca", True), ("all", False)])
def test_deepseek_v4_matches_eager(layers, padded):
    """DeepSeek-V4 (K = V shared, sinks, a window of 4, compressed entries every 2 (CSA: top-2 of them)
    and 4 (HCA) tokens) on two rows of 9 tokens, one left-padded by 2: logits of the real tokens and
    every gradient of coreattn in float32 against eager in float64 under the flash criterion (naive:
    eager in float32)."""
    ids = torch.randint(0, hm.VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(2, 9, dtype=torch.long)
    if padded:
        mask[1, :2] = 0
    w = torch.randn(2, 9, hm.VOCAB, generator=torch.Generator().manual_seed(8), dtype=torch.float64) * mask[..., None]
    results = []
    for impl, dtype in (("eager", torch.float64), ("eager", torch.float32), (TORCH_IMPL, torch.float32)):
        model = _v4(layers, impl, dtype)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        (logits.double() * w).sum().backward()
        results.append((logits.detach()[mask.bool()], {n: p.grad for n, p in model.named_parameters()
                                                       if p.grad is not None}))
    (ref, ref_grads), (naive, naive_grads), (got, got_grads) = results
    assert_flash_criterion("logits", got, naive, ref)
    assert got_grads.keys() == ref_grads.keys()
    for param, g in got_grads.items():
        assert_flash_criterion(param, g, naive_grads[param], ref_grads[param])


def test_deepseek_v4_generate_with_cache_matches_eager():
    """Greedy decoding of a left-padded batch with V4's sliding, CSA and HCA caches: the same tokens and
    scores as eager."""
    results = []
    for impl in ("eager", TORCH_IMPL):
        model = _v4("all", impl).eval()
        ids = torch.randint(2, hm.VOCAB, (2, 7), generator=torch.Generator().manual_seed(9))
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[1, :2] = 0
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
        results.append((out.sequences, torch.stack(out.scores)))
    assert torch.equal(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=1e-5)


def test_deepseek_v4_nothing_sequence_by_sequence(monkeypatch):
    """1,024 tokens through every V4 layer kind (compress rates 4 and 64), forward and backward, small
    torch-backend chunks: no op outputs S x S / 4 elements under coreattn (eager's mask, CSA's
    block_bias and indexer scores do); what grows with S x S / rate is HCA's index rows (S / 64 + W
    entries per token here, S / 128 + W in the released model)."""
    seqlen = 1024
    ids = torch.randint(0, hm.VOCAB, (1, seqlen), generator=torch.Generator().manual_seed(10))
    model = _v4("all", "eager", rates=(4, 64))
    with hm.LargestOutput() as eager:
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    assert eager.numel >= seqlen * seqlen
    monkeypatch.setenv("COREATTN_INDEXER_CHUNK_BYTES", str(32 << 10))
    monkeypatch.setenv("COREATTN_SPARSE_TORCH_CHUNK_BYTES", str(32 << 10))
    model = _v4("all", TORCH_IMPL, rates=(4, 64))
    with hm.LargestOutput() as ours:
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    assert ours.numel < seqlen * seqlen // 4, ours.numel


def test_deepseek_v4_refused_under_another_transformers(monkeypatch):
    """coreattn's V4 path restates transformers' compressors: under a release whose V4 methods differ it
    raises naming the method instead of computing something else."""
    from coreattn.adapters.transformers.models import deepseek_v4 as v4

    v4.check_source.cache_clear()
    monkeypatch.setitem(v4.KNOWN_SOURCES, "DeepseekV4CSACompressor.forward", "0" * 64)
    try:
        with pytest.raises(NotImplementedError, match="DeepseekV4CSACompressor.forward differs"):
            _v4("csa", TORCH_IMPL)(input_ids=torch.ones(1, 6, dtype=torch.long), use_cache=False)
    finally:
        v4.check_source.cache_clear()


def test_unserved_dsa_indexer_models_raise():
    """A model with a DSA indexer coreattn does not serve (its config has index_topk) raises in the
    mask builder, naming it."""
    from types import SimpleNamespace

    config = SimpleNamespace(model_type="kolibri1_1", index_topk=2048)
    with pytest.raises(NotImplementedError, match="'kolibri1_1'.*not one coreattn restates"):
        coreattn_hf.padding_mask(1, 4, 4, attention_mask=None, config=config)


# --- keyword arguments -----------------------------------------------------------------------------

def _qkv(batch=2, seqlen=5):
    gen = torch.Generator().manual_seed(8)
    return (torch.randn(batch, 4, seqlen, 8, generator=gen), torch.randn(batch, 2, seqlen, 8, generator=gen),
            torch.randn(batch, 2, seqlen, 8, generator=gen))


def _paths():
    """One call per path of the attention function: (mask, kwargs)."""
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    sparse = coreattn_hf.SparseMask(torch.zeros(2, 5, dtype=torch.int32), torch.full((2, 5), 5, dtype=torch.int32),
                                    "torch")
    return {
        "whole-rows": (None, {}),
        "padding": (torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool), {}),
        "position-ids": (None, dict(position_ids=torch.tensor([[0, 1, 2, 0, 1]] * 2))),
        "cu-seq-lens": (None, dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=3, max_length_k=3)),
        "dsa": (sparse, dict(indices=torch.zeros(2, 5, 2, dtype=torch.int32))),
        "index-rows": (coreattn_hf.IndexRows(torch.zeros(2, 5, 2, dtype=torch.int32), "torch"), {}),
    }


@pytest.mark.parametrize("path", ["whole-rows", "padding", "position-ids", "cu-seq-lens", "dsa", "index-rows"])
def test_arguments_coreattn_does_not_implement_raise_in_every_path(path):
    """Every path of the attention function: the ignored arguments are ignored, the rejected and unknown
    ones raise, ``indices`` raises without a DSA mask and ``input_ids`` (GLM-5.3-Flash's layers pass it)
    is accepted only with index rows."""
    mask, kwargs = _paths()[path]
    q, k, v = _qkv()
    if path == "cu-seq-lens":
        q, k, v = (x[:1] for x in (q, k, v))
    run = lambda **extra: coreattn_hf.attention_forward(torch.nn.Module(), q, k, v, mask, backend="torch",  # noqa
                                                        **kwargs, **extra)
    out, weights = run(use_cache=True, output_router_logits=False, num_items_in_batch=torch.tensor(3),
                       some_future_flag=None)
    assert weights is None and not torch.isnan(out).any()
    for key in coreattn_hf.REJECTED:
        with pytest.raises(NotImplementedError, match="not supported by coreattn"):
            run(**{key: torch.zeros(1)})
    with pytest.raises(NotImplementedError, match="'some_future_flag'.*it takes .*indices"):
        run(some_future_flag=1.0)
    if path != "dsa":
        with pytest.raises(NotImplementedError, match="indices .*without coreattn's DSA mask"):
            run(indices=torch.zeros(2, 5, 2, dtype=torch.int32))
    input_ids = torch.zeros(2, 5, dtype=torch.long)
    if path == "index-rows":  # accepted where the rows stand for the mask: it cannot change the result
        torch.testing.assert_close(run(input_ids=input_ids)[0], out, rtol=0, atol=0)
    else:
        with pytest.raises(NotImplementedError, match="'input_ids'"):
            run(input_ids=input_ids)
