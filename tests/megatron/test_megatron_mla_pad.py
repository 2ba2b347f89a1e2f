"""MLA's V pad on thd (megatron-core >= 0.18) in a real MLA GPTModel, and patch_mla_native_value_dim().

megatron-core >= 0.18 zero-pads V from v_head_dim to the q head dim before an MLA layer's core
attention on thd batches (``_prepare_mla_core_attention_value``), sets the core attention's
``hidden_size_per_attention_head_v`` to the padded dim for the call, and trims the output back
(``_trim_mla_core_attention_output``). The patch skips the pad for CoreAttention only. Forward hooks
record what each core attention is called with; results use the flash criterion at model level, as
tests/test_megatron_models.py does: the model under test (fp32) against the same weights in float64
with the oracle core attention, relative to the fp32 model with the naive core attention.
"""

import contextlib

import pytest
import torch

pytest.importorskip("megatron.core")

import megatron.core  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer import multi_latent_attention as mla  # noqa: E402

from attn_cases import assert_flash_criterion  # noqa: E402
from coreattn.adapters.megatron import patch_mla_native_value_dim, replace_core_attention, use_coreattn  # noqa: E402
from megatron_env import (NaiveCoreAttention, RefCoreAttention, assert_model_criterion, build_gpt,  # noqa: E402,F401
                          clone_with, megatron_cpu, megatron_cpu_shims, mla_config, packed_batch)
from oracle import attention_ref  # noqa: E402
from test_megatron_models import BACKENDS, LENS, run_thd  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not hasattr(mla, "_prepare_mla_core_attention_value"),
                       reason=f"megatron-core {megatron.core.__version__} does not pad MLA's V on thd "
                              "(the pad came in 0.18): nothing for patch_mla_native_value_dim to undo"),
    pytest.mark.usefixtures("megatron_cpu", "megatron_cpu_shims"),
]

HEADS, QK_DIM, V_DIM = 4, 24, 12  # mla_config: qk_head_dim 16 + qk_pos_emb_head_dim 8; v_head_dim 12
TOKENS = sum(LENS)
# (V shape, core attention's hidden_size_per_attention_head_v during the call, output shape)
PADDED = ((TOKENS, HEADS, QK_DIM), QK_DIM, (TOKENS, HEADS * QK_DIM))
NATIVE = ((TOKENS, HEADS, V_DIM), V_DIM, (TOKENS, HEADS * V_DIM))


def mla_spec():
    return get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm")


@contextlib.contextmanager
def native_value_dim():
    """patch_mla_native_value_dim() inside the block; Megatron's own function is put back after it."""
    original = mla._prepare_mla_core_attention_value
    try:
        assert patch_mla_native_value_dim() is True
        assert mla._prepare_mla_core_attention_value is not original
        yield
    finally:
        mla._prepare_mla_core_attention_value = original


@contextlib.contextmanager
def recording(model):
    """Per core attention call in ``model``: (class name, V shape, its hidden_size_per_attention_head_v
    during the call, output shape)."""
    calls = []

    def hook(module, args, kwargs, out):
        value = args[2] if len(args) > 2 else kwargs["value"]
        calls.append((type(module).__name__, tuple(value.shape),
                      getattr(module, "hidden_size_per_attention_head_v", None), tuple(out.shape)))

    handles = [layer.self_attention.core_attention.register_forward_hook(hook, with_kwargs=True)
               for layer in model.decoder.layers]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("backend", BACKENDS)
def test_core_attention_gets_v_unpadded_and_results_match(backend):
    config, base = mla_config(), mla_spec()
    layers = config.num_layers
    model = build_gpt(config, use_coreattn(base, backend=backend))
    ids, pos, params, weight = packed_batch(LENS)
    run = lambda m: run_thd(m, ids, pos, params, weight)  # noqa: E731
    original = mla._prepare_mla_core_attention_value

    with recording(model) as calls:
        padded = run(model)
    assert calls == [("CoreAttention", *PADDED)] * layers, "megatron-core no longer pads V as expected"

    with native_value_dim():
        with recording(model) as calls:
            native = run(model)
        assert calls == [("CoreAttention", *NATIVE)] * layers
        # core attentions that are not CoreAttention keep Megatron's pad in the same process
        ref_model = clone_with(model, config, replace_core_attention(base, RefCoreAttention)).double()
        naive_model = clone_with(model, config, replace_core_attention(base, NaiveCoreAttention))
        with recording(ref_model) as ref_calls, recording(naive_model) as naive_calls:
            ref, naive = run(ref_model), run(naive_model)
        assert ref_calls == [("RefCoreAttention", PADDED[0], None, PADDED[2])] * layers
        assert naive_calls == [("NaiveCoreAttention", PADDED[0], None, PADDED[2])] * layers

    assert mla._prepare_mla_core_attention_value is original, "the patch leaked out of the test"
    assert all(layer.self_attention.core_attention.hidden_size_per_attention_head_v == V_DIM
               for layer in model.decoder.layers)
    assert_model_criterion("mla thd, V unpadded (patched)", native, naive, ref)
    assert_model_criterion("mla thd, V padded (Megatron)", padded, naive, ref)
    # the same up to fp32 rounding (torch.testing's fp32 defaults): the zero columns change the matmul
    # shapes and so the summation order in P @ V and dO @ V^T
    (n_out, n_grads), (p_out, p_grads) = native, padded
    assert n_grads.keys() == p_grads.keys()
    for name, got, other in [("logits", n_out, p_out)] + [(n, n_grads[n], p_grads[n]) for n in n_grads]:
        torch.testing.assert_close(got, other, msg=lambda m, name=name: f"{name}, patched vs padded: {m}")


def test_latent_cache_layers_keep_the_pad():
    """cache_mla_latents layers (inference; dynamic batching runs Flash MLA) keep Megatron's pad under
    the patch; others in the same process get V unpadded. Such a layer's forward needs Transformer
    Engine (prepare_for_absorption), so its core-attention step, ``_run_core_attention`` (pad, call,
    trim, as the static-batching forward runs it), is called directly."""
    cached = build_gpt(mla_config(cache_mla_latents=True), use_coreattn(mla_spec(), backend="torch")).eval()
    plain = build_gpt(mla_config(), use_coreattn(mla_spec(), backend="torch")).eval()
    _, _, params, _ = packed_batch(LENS)
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(TOKENS, HEADS, QK_DIM, generator=gen) for _ in range(2))
    v = torch.randn(TOKENS, HEADS, V_DIM, generator=gen)
    cu = params.cu_seqlens_q
    scale = cached.decoder.layers[0].self_attention.softmax_scale
    ref, _ = attention_ref(q, k, v, cu, cu, causal=True, bottom_right=False, softmax_scale=scale)
    naive, _ = attention_ref(q, k, v, cu, cu, causal=True, bottom_right=False, softmax_scale=scale, upcast=False)
    with native_value_dim(), torch.no_grad():
        for model, expect in ((cached, PADDED), (plain, NATIVE)):
            layer = model.decoder.layers[0].self_attention
            with recording(model) as calls:
                out = layer._run_core_attention(q, k, v, None, packed_seq_params=params)
            assert calls == [("CoreAttention", *expect)], layer.cache_mla_latents
            assert_flash_criterion(f"cache_mla_latents={layer.cache_mla_latents}", out.reshape(TOKENS, HEADS, V_DIM),
                                   naive, ref)
