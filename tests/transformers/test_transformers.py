"""coreattn as a transformers attention implementation, on tiny random models (tests/transformers/hf_models.py).

Reference: each sequence run alone (no padding) by attn_implementation="eager" in float64; the
naive baseline is the same in float32. coreattn runs in float32 on a right-padded, a left-padded
and a packed batch (restarting position_ids) of the same sequences, and logits and every parameter
gradient must meet the flash criterion (err <= 2 * err(naive) + eps). (The per-sequence runs are
the reference because eager itself is not one: in float64 it takes its softmax in float32 for
Llama, Qwen3 and DeepSeek-V3 and gives NaN on left padding there, and gpt-oss's eager path does
not separate packed sequences.) In float64, the packed batch (both packing inputs) must equal the
sequences run one by one to rounding.
"""

import functools
import logging

import pytest
import torch

pytest.importorskip("transformers")

import coreattn.adapters.transformers as coreattn_hf  # noqa: E402
import hf_models as hm  # noqa: E402
from attn_cases import assert_flash_criterion, max_err  # noqa: E402

TORCH_IMPL = "coreattn_torch"  # the torch backend, for speed; "coreattn" follows the device default


@pytest.fixture(scope="module", autouse=True)
def registered():
    coreattn_hf.register()
    coreattn_hf.register(TORCH_IMPL, backend="torch")


@functools.lru_cache(maxsize=None)
def _one_by_one(name: str, dtype: torch.dtype, impl: str):
    seqs = hm.sequences()
    return hm.run_one_by_one(hm.build(name, dtype, impl), seqs, hm.weights(seqs))


def _batch(layout):
    seqs = hm.sequences()
    if layout == "packed":
        return hm.packed(seqs)
    return hm.padded(seqs, left=layout == "left")


def _assert_criterion(got, name):
    ref = _one_by_one(name, torch.float64, "eager")
    naive = _one_by_one(name, torch.float32, "eager")
    logits, grads = got
    assert_flash_criterion("logits", torch.cat(logits), torch.cat(naive[0]), torch.cat(ref[0]))
    assert grads.keys() == ref[1].keys()
    for param, g in grads.items():
        assert_flash_criterion(param, g, naive[1][param], ref[1][param])


def test_register_sets_the_implementation():
    model = hm.build("llama", torch.float32, "coreattn")
    assert model.config._attn_implementation == "coreattn"
    model = hm.build("llama", torch.float32, "eager")
    model.set_attn_implementation(TORCH_IMPL)
    assert model.config._attn_implementation == TORCH_IMPL
    seqs = hm.sequences()
    _assert_criterion(hm.run(model, _batch("right"), hm.weights(seqs)), "llama")


@pytest.mark.parametrize("layout", ["right", "left", "packed"])
@pytest.mark.parametrize("name", hm.MODELS)
def test_model_matches_eager(name, layout):
    model = hm.build(name, torch.float32, TORCH_IMPL)
    _assert_criterion(hm.run(model, _batch(layout), hm.weights(hm.sequences())), name)


@pytest.mark.interpreter_only("the models run on CPU, where the default backend is Triton only under the "
                              "interpreter (on a GPU machine it is the torch backend there)")
@pytest.mark.parametrize("name, layout", [("deepseek_v3", "packed"), ("gpt_oss", "left")])
def test_model_on_the_triton_kernels(name, layout):
    """The Triton kernels (interpreter on CPU): MLA 48/32 packed, sinks + sliding window padded."""
    model = hm.build(name, torch.float32, "coreattn")
    _assert_criterion(hm.run(model, _batch(layout), hm.weights(hm.sequences())), name)


class _Float32AsFloat64:
    """A stand-in for a model module's ``torch`` whose ``float32`` is float64."""

    float32 = torch.float64

    def __getattr__(self, attr):
        return getattr(torch, attr)


@pytest.mark.parametrize("name", hm.MODELS)
def test_packed_equals_one_by_one_float64(name, monkeypatch):
    if name in ("deepseek_v3",) + hm.DSA_MODELS:
        # DeepSeek-V3 (and V3.2, GLM-5) runs its router in float32 by design (F.linear of float32
        # casts): a matmul whose rounding follows the number of rows, so packed and one-by-one differ
        # at float32 rounding there, and through the router's input gradient in every parameter
        # upstream of it (seen: 3.5e-10 relative in the embedding's gradient). Its float32 casts run
        # in float64 here, so everything must agree to float64 rounding.
        import importlib

        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        monkeypatch.setattr(module, "torch", _Float32AsFloat64())
    seqs = hm.sequences()
    w = hm.weights(seqs)
    alone = hm.run_one_by_one(hm.build(name, torch.float64, TORCH_IMPL), seqs, w)
    model = hm.build(name, torch.float64, TORCH_IMPL)
    for flash_kwargs in (False, True):  # restarting position_ids; cu_seq_lens_q/k + max_length_q/k
        logits, grads = hm.run(model, hm.packed(seqs, flash_kwargs=flash_kwargs), w)
        for got, want in zip(logits, alone[0]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        for param, g in grads.items():
            torch.testing.assert_close(g, alone[1][param], rtol=1e-12, atol=1e-12 * alone[1][param].abs().max())


def test_dropout_runs_and_follows_the_seed():
    model = hm.build("llama", torch.float32, TORCH_IMPL)
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    batch = _batch("right")
    model.train()

    def logits(seed):
        torch.manual_seed(seed)
        return model(**batch.kwargs, use_cache=False).logits

    train = logits(0)
    assert torch.equal(train, logits(0))
    assert not torch.equal(train, logits(1))
    model.eval()
    assert not torch.equal(train, logits(0))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_sliding_window_follows_transformers_masks(causal):
    """sliding_window as transformers' mask functions define it, evaluated densely as reference."""
    from transformers import masking_utils as mu

    window, seqlen = 3, 9
    q, k, v = (x.double() for x in _qkv(batch=1, seqlen=seqlen))
    fn = (mu.sliding_window_causal_mask_function if causal else mu.sliding_window_bidirectional_mask_function)(window)
    idx = torch.arange(seqlen)
    visible = fn(0, 0, idx[:, None], idx[None, :])  # [Sq, Sk]
    scores = torch.einsum("bhsd,bhtd->bhst", q, k.repeat_interleave(2, dim=1)) / 8 ** 0.5
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    want = torch.einsum("bhst,bhtd->bshd", probs, v.repeat_interleave(2, dim=1))
    got, _ = coreattn_hf.attention_forward(_module(), q, k, v, None, sliding_window=window, is_causal=causal,
                                           backend="torch")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_npu_fused_backend_reads_position_ids(monkeypatch):
    """npu_fused (a fake torch_npu, pinned for CPU tensors) runs the position-ids packing outside the
    ops: the same result as the torch backend."""
    import sys

    from coreattn.kernels import npu
    from coreattn.layers.backends import Backend
    from coreattn.layers import dispatch
    from fake_torch_npu import FakeTorchNpu

    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake.module)
    npu.cache_clear()
    q, k, v = (x.requires_grad_() for x in _qkv(batch=1, seqlen=9))
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2]])
    want, _ = coreattn_hf.attention_forward(_module(), q, k, v, None, backend="torch", position_ids=position_ids)
    monkeypatch.setattr(dispatch, "select_backend", lambda device, override=None: Backend.NPU_FUSED)
    got, _ = coreattn_hf.attention_forward(_module(), q, k, v, None, position_ids=position_ids)
    npu.cache_clear()
    assert fake.calls and fake.calls[0]["input_layout"] == "TND" and fake.calls[0]["actual_seq_qlen"] == [4, 6, 9]
    torch.testing.assert_close(got, want)


# --- what coreattn cannot run raises ---------------------------------------------------------------

def _module():
    return torch.nn.Module()


def _qkv(batch=2, seqlen=5):
    return torch.randn(batch, 4, seqlen, 8), torch.randn(batch, 2, seqlen, 8), torch.randn(batch, 2, seqlen, 8)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(softcap=30.0), NotImplementedError, "softcap"),
    (dict(position_bias=torch.zeros(1)), NotImplementedError, "position_bias"),
    (dict(block_table=torch.zeros(1, dtype=torch.int32)), NotImplementedError, "paged"),
    (dict(attention_mask=torch.zeros(2, 1, 5, 5)), ValueError, "custom 4D masks are not supported"),
    (dict(attention_mask=torch.ones(2, 5, dtype=torch.bool), cu_seq_lens_q=torch.tensor([0, 10]),
          cu_seq_lens_k=torch.tensor([0, 10])), NotImplementedError, "padding mask with packed"),
    (dict(cu_seq_lens_q=torch.tensor([0, 10])), ValueError, "both cu_seq_lens_q and cu_seq_lens_k"),
])
def test_unsupported_arguments_raise(kwargs, exc, match):
    mask = kwargs.pop("attention_mask", None)
    with pytest.raises(exc, match=match):
        coreattn_hf.attention_forward(_module(), *_qkv(), mask, backend="torch", **kwargs)


def test_output_attentions_warns_once(caplog):
    coreattn_hf.attention._warned.discard("output_attentions")
    with caplog.at_level(logging.WARNING, logger="coreattn"):
        for _ in range(2):
            out, weights = coreattn_hf.attention_forward(_module(), *_qkv(), None, backend="torch",
                                                         output_attentions=True)
            assert weights is None and out.shape == (2, 5, 4, 8)
    assert sum("output_attentions" in r.message for r in caplog.records) == 1


def _mask_functions():
    from transformers import masking_utils as mu

    return {
        "chunked": (mu.chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long)), "chunked attention"),
        "blockwise": (mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(torch.zeros(2, 5))), "or_mask"),
        "blockwise-and": (mu.and_masks(mu.causal_mask_function, mu.blockwise_overlay(torch.zeros(2, 5))),
                          "blockwise overlays"),
        "custom": (lambda b, h, q, kv: kv <= q, "a custom mask function"),
    }


@pytest.mark.parametrize("case", ["chunked", "blockwise", "blockwise-and", "custom"])
def test_unsupported_mask_patterns_raise(case):
    fn, match = _mask_functions()[case]
    with pytest.raises(NotImplementedError, match=match):
        coreattn_hf.padding_mask(2, 5, 5, mask_function=fn, attention_mask=torch.ones(2, 5, dtype=torch.bool))


def test_mask_overlays_raise_through_the_model():
    from transformers.masking_utils import create_causal_mask

    model = hm.build("llama", torch.float32, TORCH_IMPL)
    embeds = torch.zeros(2, 5, 32)
    with pytest.raises(NotImplementedError, match="mask overlays"):
        create_causal_mask(model.config, embeds, torch.ones(2, 5), None, and_mask_function=lambda b, h, q, kv: q >= 0)


def test_supported_mask_patterns_give_the_padding_mask():
    from transformers import masking_utils as mu

    keep = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    packed = mu.and_masks(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, torch.zeros(2, 4)),
                          mu.packed_sequence_mask_function(torch.zeros(2, 4)))
    for fn in (mu.causal_mask_function, mu.bidirectional_mask_function, mu.sliding_window_causal_mask_function(3),
               mu.sliding_window_bidirectional_mask_function(3), packed):
        assert torch.equal(coreattn_hf.padding_mask(2, 4, 4, mask_function=fn, attention_mask=keep), keep)
        assert coreattn_hf.padding_mask(2, 4, 4, mask_function=fn, attention_mask=None) is None


def test_no_keep_mask_when_nothing_is_padded(monkeypatch):
    """An all-ones attention mask builds no keep mask (the kernels' masked path for every key block
    of every layer otherwise), a padded one does; under torch.compile the mask is kept (no read)."""
    ones = torch.ones(2, 4, dtype=torch.long)
    assert coreattn_hf.padding_mask(2, 4, 4, attention_mask=ones) is None
    padded = ones.clone()
    padded[1, 0] = 0
    assert torch.equal(coreattn_hf.padding_mask(2, 4, 4, attention_mask=padded), padded.bool())
    # a longer mask (a cache) sliced to kv_length is kept as it is
    assert coreattn_hf.padding_mask(2, 4, 3, attention_mask=ones).shape == (2, 3)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert torch.equal(coreattn_hf.padding_mask(2, 4, 4, attention_mask=ones), ones.bool())


def test_unpadded_batch_with_a_mask_runs_without_keep_masks(monkeypatch):
    """What the layers see for a right-padded model call whose mask keeps everything: no keep mask."""
    from coreattn.layers import function

    seen = []
    real = function._packings

    def spy(*args):
        packs = real(*args)
        seen.extend(pack.keep for pack in packs)
        return packs

    monkeypatch.setattr(function, "_packings", spy)
    model = hm.build("llama", torch.float32, TORCH_IMPL)
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    model(input_ids=ids, attention_mask=torch.ones(2, 6, dtype=torch.long), use_cache=False)
    assert seen and all(keep is None for keep in seen)
    seen.clear()
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, 4:] = 0
    model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert seen and all(keep is not None for keep in seen)


# --- torch.compile ---------------------------------------------------------------------------------

def test_position_ids_are_read_when_the_op_runs(monkeypatch):
    """The op derives cu_seqlens from the position ids each time it runs (q and k share one
    derivation); nothing is cached on the tensor, so new ids copied into the same tensor (a CUDA
    graph's static input) are read afresh."""
    from coreattn.layers import function

    results = []
    real = function.cu_seqlens_from_position_ids
    monkeypatch.setattr(function, "cu_seqlens_from_position_ids",
                        lambda pos, tokens, compact=None: results.append(real(pos, tokens, compact)) or results[-1])
    model = hm.build("llama", torch.float32, TORCH_IMPL)
    hm.run(model, _batch("packed"), hm.weights(hm.sequences()))
    assert len(results) == 4  # 2 layers, forward and backward
    assert all(cu.tolist() == [0, 7, 10, 19] for cu in results)


@pytest.mark.parametrize("layout", ["right", "packed", "packed-flash-kwargs"])
def test_compiled_model_has_no_graph_breaks_and_matches_eager(layout):
    torch._dynamo.reset()
    model = hm.build("llama", torch.float32, TORCH_IMPL)
    batch = hm.packed(hm.sequences(), flash_kwargs=True) if layout == "packed-flash-kwargs" else _batch(layout)
    explained = torch._dynamo.explain(model)(**batch.kwargs, use_cache=False)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    if layout == "packed-flash-kwargs":
        return  # traced only: it runs the same varlen_attn op as the compiled tests of tests/test_compile.py
    w = hm.weights(hm.sequences())
    want = hm.run(model, batch, w)
    model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    got = hm.run(model, batch, w)
    for a, b in zip(got[0], want[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for param, g in got[1].items():
        torch.testing.assert_close(g, want[1][param], rtol=0, atol=0)
    assert max_err(torch.cat(got[0]), torch.cat(want[0])) == 0
