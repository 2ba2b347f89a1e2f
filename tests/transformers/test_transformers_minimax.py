"""MiniMax-M3 (transformers' ``minimax_m3_vl``: the text model and the VL model) under "coreattn": its
indexer's block-max top-k on ``coreattn.indexer_topk`` and its block-sparse attention on the sparse op's
block mode (coreattn/adapters/transformers/models/minimax_m3.py).

Tiny configs (float32, CPU): blocks of 4 keys, the top 2 blocks of a KV head's selection (below the
5-6 blocks of the sequences), the own block always kept, a dense layer and a sparse one. Against
eager (float64 the reference, float32 the naive baseline of the flash criterion): logits, the loss and
every parameter gradient, unpadded and right-padded, the VL model with an image; greedy generation
with the dynamic and the static cache (the indexer's keys cached); nothing S x S on the path at 1,024
tokens (eager's scores and mask are; transformers' own scorer and block expansion fail if reached);
one layer at 8,192 tokens growing less than a quarter of eager's mask alone; the source guard.
"""

import pytest
import torch

pytest.importorskip("transformers")

import coreattn.adapters.transformers as coreattn_hf  # noqa: E402
from attn_cases import assert_flash_criterion  # noqa: E402
from coreattn.adapters.transformers.models import minimax_m3  # noqa: E402
from test_transformers_dsa import _LargestOutput, _peak_growth  # noqa: E402

TORCH_IMPL = "coreattn_torch"
VOCAB = 61
IMAGE_TOKEN = 60


@pytest.fixture(scope="module", autouse=True)
def registered():
    coreattn_hf.register()
    coreattn_hf.register(TORCH_IMPL, backend="torch")


def text_config(layers=("full_attention", "minimax_m3_sparse"), block=4, topk_blocks=2, local=1, seqlen=64):
    from transformers import MiniMaxM3VLTextConfig

    return MiniMaxM3VLTextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=len(layers), num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rotary_dim=8, intermediate_size=16, dense_intermediate_size=24, shared_intermediate_size=16,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=seqlen, index_n_heads=2,
        index_head_dim=32, index_block_size=block, index_topk_blocks=topk_blocks, index_local_blocks=local,
        layer_types=list(layers), mlp_layer_types=["dense"] + ["sparse"] * (len(layers) - 1),
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def build(dtype, impl, config=None, vl=False):
    from transformers import AutoModelForCausalLM, MiniMaxM3VLConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

    torch.manual_seed(0)
    if vl:
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=2,
                      temporal_patch_size=2, spatial_merge_size=2)
        config = MiniMaxM3VLConfig(text_config=text_config().to_dict(), vision_config=vision,
                                   image_token_index=IMAGE_TOKEN, video_token_index=IMAGE_TOKEN - 1,
                                   projector_hidden_size=24)
        model = MiniMaxM3SparseForConditionalGeneration._from_config(config, attn_implementation=impl,
                                                                    experts_implementation="eager")
    else:
        model = AutoModelForCausalLM.from_config(config or text_config(), attn_implementation=impl,
                                                 experts_implementation="eager")
    return model.to(dtype)


def _run(dtype, impl, inputs, real=None, vl=False):
    """(loss [1], logits of the real tokens, parameter gradients) of the model's own loss."""
    model = build(dtype, impl, vl=vl)
    inputs = {n: x.to(dtype) if x.is_floating_point() else x for n, x in inputs.items()}
    out = model(**inputs, use_cache=False)
    out.loss.backward()
    logits = out.logits.detach() if real is None else out.logits.detach()[real]
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().reshape(1), logits, grads


def _assert_matches_eager(inputs, real=None, vl=False):
    ref = _run(torch.float64, "eager", inputs, real, vl)
    naive = _run(torch.float32, "eager", inputs, real, vl)
    got = _run(torch.float32, TORCH_IMPL, inputs, real, vl)
    for what, i in (("loss", 0), ("logits", 1)):
        assert_flash_criterion(what, got[i], naive[i], ref[i])
    assert got[2].keys() == ref[2].keys()
    assert not any(".indexer." in n for n in got[2])  # the indexer's top-k is not differentiable: not trained
    for param, g in got[2].items():
        assert_flash_criterion(param, g, naive[2][param], ref[2][param])


def _ids(shape, seed):
    return torch.randint(3, IMAGE_TOKEN - 1, shape, generator=torch.Generator().manual_seed(seed))


def test_unpadded_batch_matches_eager():
    """Two rows of 21 tokens (6 blocks of 4, the top 2 per KV head and the own block)."""
    ids = _ids((2, 21), 3)
    _assert_matches_eager(dict(input_ids=ids, labels=ids))


def test_right_padded_batch_matches_eager():
    """Rows of 21, 14 and 9 tokens right-padded: the real tokens' logits, the loss (pads ignored) and every
    gradient (padded query rows output zeros under coreattn and feed nothing real). Position ids count the
    real tokens, pads repeating the last (generate's); with plain slot positions eager's own padded rows can
    keep no key and go NaN, which reaches every gradient through the ignored labels' zero weights."""
    ids, mask = _ids((3, 21), 4), torch.ones(3, 21, dtype=torch.long)
    for row, length in ((1, 14), (2, 9)):
        mask[row, length:] = 0
        ids[row, length:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    _assert_matches_eager(dict(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels),
                          real=mask.bool())


def test_vl_model_with_an_image_matches_eager():
    """``MiniMaxM3SparseForConditionalGeneration``: a 4 x 4-patch image (4 merged tokens) inside 17 text
    tokens; the vision tower's bidirectional attention takes coreattn's dense path."""
    ids = _ids((1, 17), 5)
    ids[0, 3:7] = IMAGE_TOKEN
    pixels = torch.randn(16, 3 * 2 * 2 * 2, generator=torch.Generator().manual_seed(6))
    _assert_matches_eager(dict(input_ids=ids, pixel_values=pixels, image_grid_thw=torch.tensor([[1, 4, 4]]),
                               labels=ids), vl=True)


@pytest.mark.interpreter_only("the models run on CPU, where the default backend is Triton only under the "
                              "interpreter (on a GPU machine it is the torch backend there)")
def test_triton_kernels_match_torch_backend():
    """The default backend (on CPU the Triton kernels under the interpreter: the sparse kernels' block mode
    and the indexer's block-score kernel) equals the torch backend to rounding, forward and backward."""
    ids = _ids((2, 13), 7)
    got, want = (_run(torch.float32, impl, dict(input_ids=ids, labels=ids)) for impl in ("coreattn", TORCH_IMPL))
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for param, g in want[2].items():
        torch.testing.assert_close(got[2][param], g, rtol=1e-4, atol=1e-5)


def _generate(impl, cache_implementation=None):
    model = build(torch.float32, impl).eval()
    ids = _ids((2, 9), 8)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding, as generate wants it
    extra = {} if cache_implementation is None else {"cache_implementation": cache_implementation}
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0, **extra)
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("cache", [None, "static"])
def test_generate_with_cache_matches_eager(cache):
    """Greedy decoding of a left-padded batch across block boundaries (9 + 8 tokens, blocks of 4, the top
    2) with the dynamic or static cache (the indexer's keys cached too): eager's tokens and scores."""
    want_ids, want_scores = _generate("eager", cache)
    got_ids, got_scores = _generate(TORCH_IMPL, cache)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_scores, want_scores, rtol=0, atol=1e-5)


def test_nothing_sequence_by_sequence(monkeypatch):
    """One sequence of 1,024 tokens (blocks of 16, the top 4), forward and backward: no op outputs S x S / 2
    elements under coreattn (eager does: its indexer scores and its mask), with the torch backend's
    chunks made small; transformers' own scorer and its block-mask expansion raise if reached."""
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as mm

    seqlen = 1024
    config = text_config(block=16, topk_blocks=4, seqlen=seqlen)
    ids = torch.randint(0, VOCAB, (1, seqlen), generator=torch.Generator().manual_seed(9))
    model = build(torch.float32, "eager", config)
    with _LargestOutput() as eager:
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    assert eager.numel >= seqlen * seqlen
    monkeypatch.setattr(mm.MiniMaxM3VLIndexer.forward, "coreattn_wrapped",
                        lambda *a, **k: pytest.fail("transformers' indexer scorer ran"))
    monkeypatch.setattr(mm.MiniMaxM3VLIndexer, "build_block_mask",
                        lambda *a, **k: pytest.fail("transformers' block-mask expansion ran"))
    monkeypatch.setenv("COREATTN_INDEXER_CHUNK_BYTES", str(256 << 10))
    monkeypatch.setenv("COREATTN_SPARSE_TORCH_CHUNK_BYTES", str(256 << 10))
    model = build(torch.float32, TORCH_IMPL, config)
    with _LargestOutput() as ours:
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    assert ours.numel < seqlen * seqlen // 2, ours.numel


def test_one_layer_at_8k_tokens_grows_less_than_a_quarter_of_eager_mask():
    """A one-layer MiniMax-M3 (its sparse layer: blocks of 128, the top 4, 4 q heads) at 8,192 tokens,
    forward and backward on the torch backend: the process's peak resident memory grows by less than a
    quarter of eager's block mask alone ([1, 4, S, S] float32: 1 GiB; its indexer scores [1, 2, S, S]
    float32 come on top)."""
    seqlen, heads = 8192, 4
    config = text_config(layers=("minimax_m3_sparse",), block=128, topk_blocks=4, seqlen=seqlen)
    model = build(torch.float32, TORCH_IMPL, config)
    ids = torch.randint(0, VOCAB, (1, seqlen), generator=torch.Generator().manual_seed(10))
    grown = _peak_growth(lambda: model(input_ids=ids, use_cache=False).logits.sum().backward())
    eager_mask = heads * seqlen * seqlen * 4
    assert grown < eager_mask // 4, f"grew {grown / 2**20:.0f} MiB"
    print(f"one MiniMax-M3 layer at {seqlen} tokens grew {grown / 2**20:.0f} MiB (eager's mask alone: "
          f"{eager_mask / 2**20:.0f} MiB)")


def test_block_indices_without_coreattn_mask_raise():
    query = key = value = torch.randn(1, 2, 5, 8)
    module = torch.nn.Module()
    with pytest.raises(NotImplementedError, match="block_indices"):
        coreattn_hf.attention_forward(module, query, key, value, None,
                                      block_indices=torch.zeros(1, 2, 5, 1, dtype=torch.long))


def test_changed_transformers_source_is_refused(monkeypatch):
    """A transformers whose wrapped MiniMax-M3 methods differ from those the module restates: the mask
    builder refuses the model, naming the method."""
    monkeypatch.setitem(minimax_m3.KNOWN_SOURCES, "MiniMaxM3VLIndexer.forward", "0" * 64)
    minimax_m3.check_source.cache_clear()
    try:
        model = build(torch.float32, TORCH_IMPL)
        with pytest.raises(NotImplementedError, match="MiniMaxM3VLIndexer.forward differs"):
            model(input_ids=_ids((1, 6), 11), use_cache=False)
    finally:
        minimax_m3.check_source.cache_clear()


def test_bench_hf_dsa_minimax_worker_runs():
    """``python -m bench.hf_dsa --model minimax_m3`` (docs/transformers.md's memory table): one worker row of
    each implementation, tiny."""
    from bench import hf_dsa

    for impl in ("coreattn", "eager"):
        row = hf_dsa.run_minimax_worker(impl, 32, "float32")
        assert row["impl"] == impl and row["model"] == "minimax_m3" and isinstance(row["grown_mib"], float)
