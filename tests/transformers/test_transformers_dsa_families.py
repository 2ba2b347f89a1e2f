"""transformers' other sparse-attention models under "coreattn" (tests/transformers/hf_models.py
``FAMILIES``): A.X-K2, dots3-note, Hy4, Hy4-VL, Mistral Large 4 and GLM-5.3-Flash.

Per model: a batch of a full row and a right-padded one against each sequence run alone under
"eager" (logits, the model's loss, every parameter gradient; flash criterion), greedy generation with
transformers' caches against eager, and nothing S x S at 1,024 tokens with transformers' own indexer
(and GLM-5.3-Flash's mask construction) made to fail if reached; GLM-5.3-Flash's pooled layer at
8,192 tokens against eager's pool scores, and on the Triton kernels (interpreter) against the torch
backend; the refusals (another transformers' sources, GLM-5.3-Flash without its tail pool).
"""

import pytest
import torch

pytest.importorskip("transformers")

import coreattn.adapters.transformers as coreattn_hf  # noqa: E402
import hf_models as hm  # noqa: E402
from attn_cases import assert_flash_criterion  # noqa: E402

TORCH_IMPL = "coreattn_torch"
LENS = (9, 7)  # a full row and a right-padded one (top-k 4: sparse from the fifth token on)


@pytest.fixture(scope="module", autouse=True)
def registered():
    coreattn_hf.register()
    coreattn_hf.register(TORCH_IMPL, backend="torch")


def _grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _one_by_one(name, dtype, seqs):
    """Each sequence alone under eager; the loss and gradients of the batch's mean token loss."""
    model = hm.build_family(name, dtype, "eager")
    tokens = sum(len(s) - 1 for s in seqs)
    loss, logits = 0.0, []
    for s in seqs:
        out = model(input_ids=s[None], labels=s[None], use_cache=False)
        share = out.loss * (len(s) - 1) / tokens
        share.backward()
        loss, logits = loss + share.detach(), logits + [out.logits.detach()[0]]
    return loss.reshape(1), torch.cat(logits), _grads(model)


@pytest.mark.parametrize("name", hm.FAMILIES)
def test_model_matches_eager(name):
    """A row of 9 tokens and one of 7 right-padded to 9 (top-k 4 of up to 9 keys): logits of the real
    tokens, the model's loss and every parameter gradient of coreattn in float32 against each sequence
    alone under eager in float64, under the flash criterion (naive: eager in float32). (Eager on the
    padded batch itself is no reference: GLM-5.3-Flash's padded rows select no key, which eager's
    float64 softmax turns into NaN.)"""
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, hm.VOCAB, (n,), generator=gen) for n in LENS]
    ref, naive = _one_by_one(name, torch.float64, seqs), _one_by_one(name, torch.float32, seqs)
    ids = torch.zeros(len(seqs), max(LENS), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, :len(s)], mask[b, :len(s)] = s, 1
    model = hm.build_family(name, torch.float32, TORCH_IMPL)
    out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False)
    out.loss.backward()
    got = (out.loss.detach().reshape(1), out.logits.detach()[mask.bool()], _grads(model))
    for what, i in (("loss", 0), ("logits", 1)):
        assert_flash_criterion(what, got[i], naive[i], ref[i])
    assert got[2].keys() == ref[2].keys()
    assert not any(".indexer." in n for n in got[2])  # transformers' indexers run under no_grad: not trained
    for param, g in got[2].items():
        assert_flash_criterion(param, g, naive[2][param], ref[2][param])


def _generate(name, impl, cache_implementation):
    return hm.greedy(hm.build_family(name, torch.float32, impl), cache_implementation)


@pytest.mark.parametrize("name, cache", [(name, None) for name in hm.FAMILIES] + [("glm5_next", "static")])
def test_generate_with_cache_matches_eager(name, cache):
    """Greedy decoding of a left-padded batch past the top-k (6 + 5 tokens) with transformers' dynamic
    cache (GLM-5.3-Flash also its static one: its indexer cache holds the full length): the same tokens
    and scores as eager."""
    want_ids, want_scores = _generate(name, "eager", cache)
    got_ids, got_scores = _generate(name, TORCH_IMPL, cache)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_scores, want_scores, rtol=0, atol=1e-5)


def _fail_if_reached(monkeypatch, model):
    """transformers' own indexers (and GLM-5.3-Flash's visibility, pooling, tail and mask code) raise
    (the source guard, which hashes those originals, checked first)."""
    from coreattn.adapters.transformers import models

    model_type = model.config.get_text_config().model_type
    assert models.family(model_type).check_source(model_type) is None

    def fail(*args, **kwargs):
        pytest.fail("transformers' own indexer code ran")

    for module in model.modules():
        indexer = getattr(module, "indexer", None)
        if indexer is not None:
            monkeypatch.setattr(type(indexer).forward, "coreattn_wrapped", fail)
            for method in ("get_visible_tokens", "get_pooled_states", "append_visible_tail"):
                if hasattr(indexer, method):
                    monkeypatch.setattr(type(indexer), method, fail)
        if hasattr(module, "build_attention_mask_from_topk"):
            monkeypatch.setattr(type(module).build_attention_mask_from_topk, "coreattn_wrapped", fail)


@pytest.mark.parametrize("name", hm.FAMILIES)
def test_nothing_sequence_by_sequence(name, monkeypatch):
    """One sequence of 1,024 tokens, forward and backward, torch-backend chunks of 1 MiB (their byte
    budgets bound them, not S): no op outputs S x S / 2 elements under coreattn, and transformers' own
    indexer code never runs (it raises if reached). Index heads of 24 dims (16 x 32 would make the
    indexer's own q [S, 16, 32] S x S / 2); GLM-5.3-Flash without its linear-attention layer
    (transformers' reference KDA keeps [S / 64, 64, 64, heads x dims] chunks: S x S elements here).
    Eager's witness (its scores and masks are S x S) runs for GLM-5.3-Flash, whose S x S tensors are
    its own; for the DSA indexers see test_transformers_dsa.py."""
    seqlen = 1024
    ids = torch.randint(0, hm.VOCAB, (1, seqlen), generator=torch.Generator().manual_seed(5))
    pooled = dict(layer_types=["indexed_attention"] * 2, indexer_types=["full", "shared"])
    config = lambda: hm.family_config(name, index_head_dim=24, **(pooled if name == "glm5_next" else {}))  # noqa: E731
    if name == "glm5_next":
        model = hm.build_family(name, torch.float32, "eager", config=config())
        with hm.LargestOutput() as eager:
            model(input_ids=ids, use_cache=False).logits.sum().backward()
        assert eager.numel >= seqlen * seqlen
    monkeypatch.setenv("COREATTN_INDEXER_CHUNK_BYTES", str(1 << 20))
    monkeypatch.setenv("COREATTN_SPARSE_TORCH_CHUNK_BYTES", str(1 << 20))
    model = hm.build_family(name, torch.float32, TORCH_IMPL, config=config())
    _fail_if_reached(monkeypatch, model)
    with hm.LargestOutput() as ours:
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    assert ours.numel < seqlen * seqlen // 2, ours.numel


def test_pooled_layer_at_8k_tokens_grows_less_than_a_quarter_of_eager_pool_scores():
    """A one-layer GLM-5.3-Flash (its pooled DSA layer: pools of 4, the best 16 pools plus the tail,
    16 index heads of 32) at 8,192 tokens, forward and backward on the torch backend: the peak resident
    memory grows by less than a quarter of eager's pool scores alone ([1, S, 16, S / 4] float32: 1 GiB;
    eager also builds a [1, 1, S, S] float32 mask, [1, S, S] int32 counts and [1, S, S] visibility,
    576 MiB more). Measured here: about 140 MiB in a fresh process (the layer's activations, the
    indexer's q [S, 16, 32], its chunk budget, the index rows)."""
    seqlen, index_heads, pool = 8192, 16, 4
    config = hm.family_config("glm5_next", layer_types=["indexed_attention"], indexer_types=["full"], index_kpool=pool,
                              index_topk=64, max_position_embeddings=seqlen)
    model = hm.build_family("glm5_next", torch.float32, TORCH_IMPL, config=config)
    ids = torch.randint(0, hm.VOCAB, (1, seqlen), generator=torch.Generator().manual_seed(6))
    grown = hm.peak_growth(lambda: model(input_ids=ids, use_cache=False).logits.sum().backward())
    eager_scores = seqlen * index_heads * (seqlen // pool) * 4
    assert grown < eager_scores // 4, f"grew {grown / 2**20:.0f} MiB"


@pytest.mark.interpreter_only("the models run on CPU, where the default backend is Triton only under the "
                              "interpreter (on a GPU machine it is the torch backend there)")
def test_pooled_model_on_the_triton_kernels_matches_torch_backend():
    """GLM-5.3-Flash on the default backend (on CPU the Triton kernels under the interpreter: the
    indexer's top-k over pooled keys fewer than the queries, within per-query pool bounds, and the
    sparse kernels on the expanded rows) on a left-padded batch equals the torch backend to rounding."""
    batch = hm.padded(hm.sequences(), left=True)
    got = hm.build_family("glm5_next", torch.float32, "coreattn")(**batch.kwargs, use_cache=False).logits
    want = hm.build_family("glm5_next", torch.float32, TORCH_IMPL)(**batch.kwargs, use_cache=False).logits
    for rows, cols in batch.real:
        torch.testing.assert_close(got[rows, cols], want[rows, cols], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, method", [("hy_v4", "HYV4Indexer.forward"),
                                          ("glm5_next", "Glm5NextTextIndexer.get_pooled_states")])
def test_refused_under_another_transformers(name, method, monkeypatch):
    """Each model module restates transformers' methods: under a release whose methods differ it raises
    naming the method (in the mask builder; GLM-5.3-Flash, which has none, in its layer)."""
    from coreattn.adapters.transformers import models

    module = models.family(hm.family_config(name).get_text_config().model_type)
    known = module.KNOWN_SOURCES.get(module.MODEL_TYPES[0], module.KNOWN_SOURCES)
    module.check_source.cache_clear()
    monkeypatch.setitem(known, method, "0" * 64)
    try:
        with pytest.raises(NotImplementedError, match=method.replace(".", r"\.") + " differs"):
            hm.build_family(name, torch.float32, TORCH_IMPL)(input_ids=torch.ones(1, 6, dtype=torch.long),
                                                             use_cache=False)
    finally:
        module.check_source.cache_clear()


def test_pooled_indexer_without_its_tail_raises():
    config = hm.family_config("glm5_next")
    config.text_config.index_kpool_always_select_tail = False
    model = hm.build_family("glm5_next", torch.float32, TORCH_IMPL, config=config)
    with pytest.raises(NotImplementedError, match="index_kpool_always_select_tail=False"):
        model(input_ids=torch.ones(1, 6, dtype=torch.long), use_cache=False)
