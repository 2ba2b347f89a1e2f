"""Inkling 2 (relative position bias as factors, per-token sinks, block-attention residuals) and the
T5 family (bucketed relative bias as factors, the zero cross-attention bias dropped) under
attn_implementation="coreattn", on tiny random models built in code.

Reference: each sample run alone (no padding) by attn_implementation="eager" in float64 (Inkling 2's
router stays float32, as the model keeps it; every expert is routed to, so no top-k choice can
flip); the naive baseline is the same in float32. coreattn runs in float32 on the samples alone and
on a right-padded batch of them, and the loss (the model's cross entropy plus fixed random weights
on the logits), the logits of the real tokens and every parameter gradient must meet the flash
criterion of tests/attn_cases.py (err <= 2 * err(naive) + eps + two float32 units of rounding at the
reference's largest entry). Greedy generation with the models' caches (Inkling 2's
sliding-window cache included) gives eager's tokens.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

import coreattn.adapters.transformers as coreattn_hf  # noqa: E402
from attn_cases import assert_flash_criterion  # noqa: E402

TORCH_IMPL = "coreattn_torch"
VOCAB = 61
LENS = ((11, 6), (4, 3))  # (input length, target length) per sample; causal LMs take the input only
CAUSAL = ("inkling2", "inkling2_loop")
SEQ2SEQ = ("t5", "mt5", "umt5", "longt5", "switch_transformers")


@pytest.fixture(scope="module", autouse=True)
def registered():
    coreattn_hf.register()
    coreattn_hf.register(TORCH_IMPL, backend="torch")


def _inkling(loop: bool):
    import transformers as T

    common = dict(vocab_size=64, unpadded_vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
                  sliding_window_size=5, d_rel=4, rel_extent=7, moe_intermediate_size=16, n_routed_experts=2,
                  num_experts_per_tok=2, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    # eager experts: the grouped-mm MoE kernels take no float64
    if loop:
        return T.Inkling2LoopForCausalLM._from_config(T.Inkling2LoopTextConfig(
            **common, num_hidden_layers=4, n_layers_per_attn_res_block=1, loop_layer_index_start=1,
            loop_layer_index_end=3, loop_num_passes=2, loop_gate_rank=8,
            layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"]), experts_implementation="eager")
    return T.Inkling2ForCausalLM._from_config(T.Inkling2TextConfig(
        **common, num_hidden_layers=3, n_layers_per_attn_res_block=2,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"]), experts_implementation="eager")


def _t5(name: str):
    import transformers as T

    common = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
                  relative_attention_num_buckets=8, relative_attention_max_distance=6, dropout_rate=0.0,
                  decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    build = {"t5": (T.T5ForConditionalGeneration, T.T5Config, {}),
             "mt5": (T.MT5ForConditionalGeneration, T.MT5Config, {}),
             "umt5": (T.UMT5ForConditionalGeneration, T.UMT5Config, {}),
             "longt5": (T.LongT5ForConditionalGeneration, T.LongT5Config, dict(local_radius=3)),
             "switch_transformers": (T.SwitchTransformersForConditionalGeneration, T.SwitchTransformersConfig,
                                     dict(num_experts=1, expert_capacity=64))}
    model_cls, config_cls, extra = build[name]
    return model_cls(config_cls(**common, **extra))


def build(name: str, dtype: torch.dtype, impl: str):
    """A tiny model with random weights perturbed off their initial values (zero block-residual
    queries, unit scales), the same for every dtype; eval mode (no dropout, no router jitter)."""
    torch.manual_seed(0)
    model = _inkling(name == "inkling2_loop") if name in CAUSAL else _t5(name)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model = model.to(dtype).eval()
    if name in CAUSAL:  # parts the model runs in float32 whatever its dtype (.float() on their inputs)
        for layer in model.model.layers:
            layer.mlp.gate.float()
        for module in model.modules():
            if type(module).__name__ == "Inkling2LoopMessageGate":
                module.forget_gate_proj.float()
                module.message_gate_proj.float()
    model.set_attn_implementation(impl)
    return model


def _samples():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(3, VOCAB, (n,), generator=gen), torch.randint(3, VOCAB, (m,), generator=gen))
            for n, m in LENS]


def _weights(name):
    gen = torch.Generator().manual_seed(2)
    return [torch.randn(n if name in CAUSAL else m, 64 if name in CAUSAL else VOCAB, generator=gen,
                        dtype=torch.float64) for n, m in LENS]


def _targets(name) -> int:
    """Target tokens of the cross entropy over every sample (causal LMs predict each next token)."""
    return sum(n - 1 if name in CAUSAL else m for n, m in LENS)


def _batch(name, samples):
    """Right-padded inputs (and labels) of the samples, and each sample's real logit positions."""
    width = max(len(x) for x, _ in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (x, _) in enumerate(samples):
        ids[b, :len(x)], mask[b, :len(x)] = x, 1
    if name in CAUSAL:
        labels = ids.masked_fill(mask == 0, -100)
        return dict(input_ids=ids, attention_mask=mask, labels=labels), [len(x) for x, _ in samples]
    labels = torch.full((len(samples), max(len(y) for _, y in samples)), -100, dtype=torch.long)
    for b, (_, y) in enumerate(samples):
        labels[b, :len(y)] = y
    return dict(input_ids=ids, attention_mask=mask, labels=labels), [len(y) for _, y in samples]


def _run(model, name, batches, w):
    """(loss, per-sample logits, gradients) of sum over ``batches`` (kwargs, real lengths, share of the
    targets) of the model's cross entropy times its share plus the logits weighted by ``w``."""
    model.zero_grad(set_to_none=True)
    total, logits, i = 0.0, [], 0
    for kwargs, real, share in batches:
        out = model(**kwargs, use_cache=False)
        objective = out.loss.to(torch.float64) * share
        for b, n in enumerate(real):
            x = out.logits[b, :n]
            objective = objective + (x.to(torch.float64) * w[i]).sum()
            logits.append(x.detach())
            i += 1
        objective.backward()
        total = total + out.loss.detach().to(torch.float64) * share
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, logits, grads


def _one_by_one(name, samples):
    out = []
    for sample in samples:
        kwargs, real = _batch(name, [sample])
        targets = real[0] - 1 if name in CAUSAL else real[0]
        out.append((kwargs, real, targets / _targets(name)))
    return out


@functools.lru_cache(maxsize=None)
def _reference(name: str, dtype: torch.dtype):
    return _run(build(name, dtype, "eager"), name, _one_by_one(name, _samples()), _weights(name))


def _assert_criterion(name, got):
    ref, naive = _reference(name, torch.float64), _reference(name, torch.float32)
    assert_flash_criterion("loss", got[0].reshape(1), naive[0].reshape(1), ref[0].reshape(1))
    assert_flash_criterion("logits", torch.cat(got[1]), torch.cat(naive[1]), torch.cat(ref[1]))
    assert got[2].keys() == ref[2].keys()
    for param, g in got[2].items():
        assert_flash_criterion(param, g, naive[2][param], ref[2][param])


@pytest.mark.parametrize("padding", ["none", "right"])
@pytest.mark.parametrize("name", CAUSAL + SEQ2SEQ)
def test_model_matches_eager(name, padding):
    model = build(name, torch.float32, TORCH_IMPL)
    samples = _samples()
    if padding == "none":
        batches = _one_by_one(name, samples)
    else:
        kwargs, real = _batch(name, samples)
        batches = [(kwargs, real, 1.0)]
    _assert_criterion(name, _run(model, name, batches, _weights(name)))


@pytest.mark.parametrize("name", CAUSAL + SEQ2SEQ)
def test_generation_with_cache_matches_eager(name):
    """Greedy decoding with the models' caches: one token per step against the cached keys (T5's
    self-attention bias with past tokens, Inkling 2's windows of 5 past the sliding cache's length)."""
    samples = _samples()
    kwargs, _ = _batch(name, samples)
    kwargs.pop("labels")
    if name in CAUSAL:  # greedy continuation of the longest prompt (no padding in a decoder-only prompt)
        kwargs = dict(input_ids=samples[0][0][None])
    tokens = [build(name, torch.float32, impl).generate(**kwargs, max_new_tokens=4, do_sample=False)
              for impl in ("eager", TORCH_IMPL)]
    assert torch.equal(*tokens)


@pytest.mark.interpreter_only("the models run on CPU, where the default backend is Triton only under the interpreter")
def test_inkling2_on_the_triton_kernels():
    """The Triton kernels (the interpreter on CPU): the low-rank bias, per-token sinks, windows, padding."""
    kwargs, real = _batch("inkling2", _samples())
    _assert_criterion("inkling2", _run(build("inkling2", torch.float32, "coreattn"), "inkling2",
                                       [(kwargs, real, 1.0)], _weights("inkling2")))


def test_materialized_bias_and_changed_sources_are_refused(monkeypatch):
    """A position_bias tensor from an unserved model raises naming it; a wrapped method whose source
    differs from the release coreattn was written against makes the mask builder refuse the model."""
    from coreattn.adapters.transformers import attention
    from coreattn.adapters.transformers.models import t5

    class Other(torch.nn.Module):
        is_causal = True

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="position_bias as a materialized tensor"):
        attention.attention_forward(Other(), q, q, q, None, position_bias=torch.zeros(1, 2, 4, 4))
    monkeypatch.setitem(t5.KNOWN_SOURCES["t5"], "T5Attention.compute_bias", "0" * 64)
    t5.check_source.cache_clear()
    try:
        with pytest.raises(NotImplementedError, match="T5Attention.compute_bias differs"):
            build("t5", torch.float32, TORCH_IMPL)(**{k: v for k, v in _batch("t5", _samples())[0].items()})
    finally:
        t5.check_source.cache_clear()


def test_bench_hf_bias_worker_runs():
    """``python -m bench.hf_bias`` (docs/transformers.md's memory table): one worker row of each
    implementation, on a small sliding-window layer."""
    from bench import hf_bias

    for impl in ("coreattn", "eager"):
        row = hf_bias.run_worker(impl, "sliding", 128, "float32")
        assert row["impl"] == impl and row["grown_mib"] >= 0 and row["eager_bias_mib"] == 8 * 128 * 128 * 4 / 2**20


def test_inkling2_layer_memory_at_8k_tokens():
    """One Inkling 2 full-attention layer (the relative bias over 1,024 distances, per-token sinks, every
    earlier token) at 8,192 tokens under coreattn's torch backend grows less than a quarter of eager's
    ``position_bias`` tensor alone (2 GiB), measured as ``python -m bench.hf_bias`` measures it (its own
    process, the bench's allocator settings)."""
    from bench.cpu_attention import worker_json

    row = worker_json(["-m", "bench.hf_bias", "--layer", "full", "--worker", "coreattn", "8192"], 600, memory=True)
    assert "error" not in row, row
    assert row["eager_bias_mib"] == 2048 and row["grown_mib"] < row["eager_bias_mib"] / 4, row
