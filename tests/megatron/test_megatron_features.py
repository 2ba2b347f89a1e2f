"""Megatron's attention options on CoreAttention: attention dropout, softmax_type ("off-by-one",
"learnable" sinks) and qk-clip's max attention logits, layer by layer and inside GPT/MLA models
against the same models with the float64 oracle core attention (tests/megatron/megatron_env.py)."""

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

import coreattn  # noqa: E402
from attn_cases import assert_flash_criterion  # noqa: E402
from coreattn.adapters.megatron import replace_core_attention, use_coreattn  # noqa: E402
from coreattn.layers import CoreAttention  # noqa: E402
from megatron_env import (CPU_BACKENDS, NaiveCoreAttention, RefCoreAttention, adam_losses,  # noqa: E402,F401
                          assert_model_criterion, build_gpt, clone_with, gqa_config, megatron_cpu,
                          megatron_cpu_shims, mla_config, packed_batch)

pytestmark = pytest.mark.usefixtures("megatron_cpu", "megatron_cpu_shims")

LENS = (5, 11, 1, 7)
HQ, HKV, DK, DV = 4, 2, 24, 16


def gpt_config(**kw):
    """gqa_config with Megatron's default attention_dropout (0.1) unless given."""
    return gqa_config(**{"attention_dropout": TransformerConfig.attention_dropout, **kw})


def step(model, ids, pos, params, weight, seed):
    """Logits and parameter gradients of a fixed linear loss, the dropout RNG seeded first."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    logits = model(ids, pos, attention_mask=None, packed_seq_params=params)[0]
    (logits * weight[0].to(logits.dtype)).sum().backward()
    return logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def references(model, config, base_spec):
    ref = clone_with(model, config, replace_core_attention(base_spec, RefCoreAttention)).double()
    naive = clone_with(model, config, replace_core_attention(base_spec, NaiveCoreAttention))
    return naive, ref


def sbhd(sq, sk, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, 2, h, d, generator=gen).requires_grad_() for s, h, d in ((sq, HQ, DK), (sk, HKV, DK),
                                                                                   (sk, HKV, DV))]


def layer(backend="torch", **cfg):
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=HQ, num_query_groups=HKV,
                               kv_channels=DK, hidden_dropout=0.0, **cfg)
    return CoreAttention(config, 1, AttnMaskType.causal, "self", v_channels=DV, backend=backend)


# ---------------------------------------------------------------------------------------------- layer


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_layer_dropout_in_training_only(backend):
    attn = layer(backend)  # Megatron's default attention_dropout = 0.1
    assert attn.attention_dropout == 0.1
    q, k, v = sbhd(7, 7)
    torch.manual_seed(4)
    a = attn(q, k, v, None)
    torch.manual_seed(4)
    b = attn(q, k, v, None)
    torch.manual_seed(4)
    want = coreattn.padded_attn(q, k, v, layout="sbhd", causal=True, causal_alignment="top_left", dropout_p=0.1,
                                backend=backend)
    assert torch.equal(a, b) and torch.equal(a, want.reshape(7, 2, -1))
    attn.eval()
    state = torch.get_rng_state()
    c = attn(q, k, v, None)
    assert torch.equal(torch.get_rng_state(), state), "eval must not draw random numbers"
    plain = coreattn.padded_attn(q, k, v, layout="sbhd", causal=True, causal_alignment="top_left", backend=backend)
    assert torch.equal(c, plain.reshape(7, 2, -1)) and not torch.equal(a, c)


def test_layer_off_by_one_and_learnable_offsets_match_megatron():
    off = layer(softmax_type="off-by-one")
    assert torch.equal(off.softmax_offset, torch.zeros(HQ)) and "softmax_offset" not in off.state_dict()
    q, k, v = sbhd(6, 6)
    want = coreattn.padded_attn(q, k, v, layout="sbhd", causal=True, causal_alignment="top_left",
                                softmax_offset=torch.zeros(HQ), backend="torch")
    off.eval()
    assert torch.equal(off(q, k, v, None), want.reshape(6, 2, -1))

    torch.manual_seed(0)
    ours = layer(softmax_type="learnable", attention_dropout=0.0)
    torch.manual_seed(0)
    theirs = DotProductAttention(ours.config, 1, AttnMaskType.causal, "self")
    assert isinstance(ours.softmax_offset, torch.nn.Parameter) and ours.softmax_offset.shape == (HQ,)
    assert torch.equal(ours.softmax_offset, theirs.softmax_offset)  # same init_method, same draws
    assert ours.state_dict().keys() == theirs.state_dict().keys() == {"softmax_offset"}
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict(theirs.state_dict())
    from megatron.core import parallel_state

    meta = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    mine = ours.sharded_state_dict(prefix="layer.", metadata=meta)
    megatron = theirs.sharded_state_dict(prefix="layer.", metadata=meta)
    assert mine.keys() == megatron.keys() == {"layer.softmax_offset"}
    a, b = mine["layer.softmax_offset"], megatron["layer.softmax_offset"]
    assert (a.key, a.global_shape, a.global_offset, a.axis_fragmentations) == \
        (b.key, b.global_shape, b.global_offset, b.axis_fragmentations)

    out = ours(q, k, v, None)
    out.square().sum().backward()
    assert ours.softmax_offset.grad is not None and torch.isfinite(ours.softmax_offset.grad).all()


def test_layer_unknown_softmax_type_raises():
    with pytest.raises(ValueError, match="softmax_type='bogus'"):
        layer(softmax_type="bogus")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_layer_keeps_a_running_max_logit(backend):
    attn = layer(backend, attention_dropout=0.0, qk_clip=True)
    assert attn.current_max_attn_logits is None
    q, k, v = sbhd(6, 6)
    attn(q, k, v, None)
    first = attn.current_max_attn_logits
    _, want = coreattn.padded_attn(q, k, v, layout="sbhd", causal=True, causal_alignment="top_left",
                                   return_max_logit=True, backend=backend)
    assert first.shape == (HQ,) and first.dtype == torch.float32 and torch.equal(first, want)
    q2, k2, v2 = sbhd(6, 6, seed=1)
    attn(q2 * 0.01, k2, v2, None)  # much smaller logits: the running max keeps the first call's
    assert torch.equal(attn.current_max_attn_logits, first)
    attn(q2 * 10, k2, v2, None)
    assert (attn.current_max_attn_logits >= first).all() and (attn.current_max_attn_logits > first).any()
    attn.current_max_attn_logits = None  # what clip_qk does after using it
    attn(q, k, v, None)
    assert torch.equal(attn.current_max_attn_logits, first)


def test_layer_dense_mask_path_has_the_features():
    """An arbitrary [b, 1, sq, sk] mask runs the O(S²) torch path: dropout, sinks and max logits there too."""
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=HQ, num_query_groups=HKV,
                               kv_channels=DK, hidden_dropout=0.0, softmax_type="learnable", qk_clip=True)
    torch.manual_seed(0)
    attn = CoreAttention(config, 1, AttnMaskType.arbitrary, "self", v_channels=DV, backend="torch")
    q, k, v = sbhd(5, 5)
    full = torch.zeros(2, 1, 5, 5, dtype=torch.bool)  # nothing masked: must equal unmasked attention
    torch.manual_seed(9)
    out = attn(q, k, v, full)
    torch.manual_seed(9)
    want, want_max = coreattn.padded_attn(q, k, v, layout="sbhd", dropout_p=0.1, softmax_offset=attn.softmax_offset,
                                          return_max_logit=True, backend="torch")
    assert_flash_criterion("dense", out.detach(), want.detach().reshape(5, 2, -1), want.detach().reshape(5, 2, -1))
    assert torch.allclose(attn.current_max_attn_logits, want_max, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------- models


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gpt_with_default_attention_dropout_matches_oracle(backend):
    """A GPT config left at Megatron's attention_dropout = 0.1: a training step against the oracle model
    applying the same keep mask (logits and every gradient)."""
    config = gpt_config()
    assert config.attention_dropout == 0.1
    base = get_gpt_layer_local_spec()
    model = build_gpt(config, use_coreattn(base, backend=backend))
    ids, pos, params, weight = packed_batch(LENS)
    naive, ref = references(model, config, base)
    got = step(model, ids, pos, params, weight, seed=3)
    assert_model_criterion("dropout step", got, step(naive, ids, pos, params, weight, seed=3),
                           step(ref, ids, pos, params, weight, seed=3))


def test_gpt_with_default_attention_dropout_trains_reproducibly():
    """Two Adam steps give identical losses from the same seed and different ones from another; in eval
    nothing is dropped (two seeds, one output)."""
    config = gpt_config()
    base = get_gpt_layer_local_spec()
    ids, pos, params, _ = packed_batch(LENS)

    def train(seed):
        m = build_gpt(config, use_coreattn(base, backend="torch"))
        torch.manual_seed(seed)
        return m, adam_losses(m, ids, pos, params, steps=2)

    m1, l1 = train(5)
    _, l2 = train(5)
    _, l3 = train(6)
    assert l1 == l2 and l1 != l3
    m1.eval()
    with torch.no_grad():
        torch.manual_seed(0)
        a = m1(ids, pos, attention_mask=None, packed_seq_params=params)
        torch.manual_seed(1)
        b = m1(ids, pos, attention_mask=None, packed_seq_params=params)
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gpt_oss_like_sinks_and_sliding_windows(backend):
    """Learnable sinks (gpt-oss), sliding-window layers alternating with full ones, GQA: the logits and
    every gradient, softmax_offset's included, against the oracle model."""
    config = gpt_config(attention_dropout=0.0, softmax_type="learnable", window_size=(3, 0), window_attn_skip_freq=2)
    base = get_gpt_layer_local_spec()
    model = build_gpt(config, use_coreattn(base, backend=backend))
    windows = [layer.self_attention.core_attention.window_size for layer in model.decoder.layers]
    assert windows == [(3, 0), (-1, -1)]
    with torch.no_grad():  # sinks strong enough to matter
        for layer_ in model.decoder.layers:
            layer_.self_attention.core_attention.softmax_offset.copy_(torch.tensor([1.5, -0.5, 0.0, 3.0]))
    ids, pos, params, weight = packed_batch(LENS)
    naive, ref = references(model, config, base)
    got = step(model, ids, pos, params, weight, seed=0)
    assert any("softmax_offset" in name for name in got[1])
    assert_model_criterion("sinks", got, step(naive, ids, pos, params, weight, seed=0),
                           step(ref, ids, pos, params, weight, seed=0))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_mla_qk_clip_updates_weights_as_with_oracle_max_logits(backend):
    config = mla_config(qk_clip=True, qk_clip_alpha=0.5)
    base = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm")
    model = build_gpt(config, use_coreattn(base, backend=backend))
    ids, pos, params, weight = packed_batch(LENS)
    naive, ref = references(model, config, base)
    runs = [(m, step(m, ids, pos, params, weight, seed=0)) for m in (model, naive, ref)]
    wanted = []
    for i, attn_layer in enumerate(model.decoder.layers):
        got, low, want = (m.decoder.layers[i].self_attention.core_attention.current_max_attn_logits for m, _ in runs)
        assert got.shape == (4,) and got.dtype == torch.float32
        assert_flash_criterion(f"layer {i} max logits", got, low.float(), want)
        wanted.append(want)
    config.qk_clip_threshold = torch.cat(wanted).median().item()  # clip some heads, leave others
    before = model.decoder.layers[0].self_attention.linear_q_proj.weight.detach().clone()
    for m, _ in runs:
        for attn_layer in m.decoder.layers:
            attn_layer.self_attention.clip_qk()
            assert attn_layer.self_attention.core_attention.current_max_attn_logits is None
    clipped = [dict(m.named_parameters()) for m, _ in runs]
    for name, w in clipped[0].items():
        if "linear_q_proj" in name or "linear_kv_up_proj" in name:
            assert_flash_criterion(f"clipped {name}", w.detach(), clipped[1][name].detach(), clipped[2][name].detach())
    assert not torch.equal(clipped[0]["decoder.layers.0.self_attention.linear_q_proj.weight"].detach(), before)
