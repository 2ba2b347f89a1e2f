"""CoreAttention inside real megatron-core models on CPU (one-rank gloo group).

Each comparison uses the flash criterion at model level: the model under test (fp32) against the
same weights in float64 with the oracle core attention, relative to the fp32 model with the naive
core attention (fp32 softmax, P rounded to the input dtype).
"""

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_decoder_block_spec, get_gpt_layer_local_spec, get_gpt_mtp_block_spec)
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402

from coreattn.adapters.megatron import patch_mla_native_value_dim, replace_core_attention, use_coreattn  # noqa: E402
from coreattn.layers import CoreAttention  # noqa: E402
from megatron_env import (CPU_BACKENDS, VOCAB, NaiveCoreAttention, RefCoreAttention, adam_losses,  # noqa: E402,F401
                          assert_model_criterion, build_gpt, clone_with, gqa_config, megatron_cpu,
                          megatron_cpu_shims, mla_config, packed_batch)

pytestmark = pytest.mark.usefixtures("megatron_cpu", "megatron_cpu_shims")

LENS = (5, 11, 1, 7)
BACKENDS = CPU_BACKENDS


def run_thd(model, ids, pos, params, weight):
    """Logits [T, V] and the parameter gradients of a fixed linear loss."""
    model.zero_grad(set_to_none=True)
    logits = model(ids, pos, attention_mask=None, packed_seq_params=params)[0]
    (logits * weight[0].to(logits.dtype)).sum().backward()
    return logits, {n: p.grad for n, p in model.named_parameters()}


def run_per_sequence(model, ids, lens, weight):
    """Each sequence alone in sbhd (b = 1); logits concatenated, gradients summed."""
    model.zero_grad(set_to_none=True)
    outs, start = [], 0
    for n in lens:
        logits = model(ids[:, start:start + n], torch.arange(n)[None], attention_mask=None)[0]
        (logits * weight[0, start:start + n].to(logits.dtype)).sum().backward()
        outs.append(logits)
        start += n
    return torch.cat(outs), {n: p.grad for n, p in model.named_parameters()}


def references(model, config, base_spec, run):
    ref = clone_with(model, config, replace_core_attention(base_spec, RefCoreAttention)).double()
    naive = clone_with(model, config, replace_core_attention(base_spec, NaiveCoreAttention))
    return run(naive), run(ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_thd_matches_each_sequence_alone(backend):
    config = gqa_config()
    base = get_gpt_layer_local_spec()
    model = build_gpt(config, use_coreattn(base, backend=backend))
    ids, pos, params, weight = packed_batch(LENS)
    packed = run_thd(model, ids, pos, params, weight)
    alone = run_per_sequence(model, ids, LENS, weight)
    naive, ref = references(model, config, base, lambda m: run_per_sequence(m, ids, LENS, weight))
    assert_model_criterion("thd", packed, naive, ref)
    assert_model_criterion("sbhd per sequence", alone, naive, ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["thd", "sbhd"])
def test_mla_with_unequal_head_dims(layout, backend):
    config = mla_config()
    base = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm")
    model = build_gpt(config, use_coreattn(base, backend=backend))
    attn = model.decoder.layers[0].self_attention.core_attention
    assert isinstance(attn, CoreAttention)
    assert (attn.hidden_size_per_attention_head_k, attn.hidden_size_per_attention_head_v) == (24, 12)
    ids, pos, params, weight = packed_batch(LENS)
    if layout == "thd":
        run = lambda m: run_thd(m, ids, pos, params, weight)  # noqa: E731
    else:  # two equal-length samples in one sbhd batch
        ids2, w2 = ids[:, :12].reshape(2, 6), weight[:, :12].reshape(2, 6, VOCAB)

        def run(m):
            m.zero_grad(set_to_none=True)
            logits = m(ids2, torch.arange(6).expand(2, 6), attention_mask=None)
            (logits * w2.to(logits.dtype)).sum().backward()
            return logits, {n: p.grad for n, p in m.named_parameters()}
    got = run(model)
    naive, ref = references(model, config, base, run)
    assert_model_criterion(f"mla {layout}", got, naive, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sbhd_padding_mask_matches_thd(backend):
    """Right- and left-padded samples with a [b,1,1,s] mask give, on the real tokens, what the
    packed thd batch of the same tokens gives (both within the criterion of the float64 model)."""
    config = gqa_config()
    base = get_gpt_layer_local_spec()
    base.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.padding_causal
    model = build_gpt(config, use_coreattn(base, backend=backend))
    lens, s = (9, 6, 4), 9
    ids, _, params, weight = packed_batch(lens)
    keep = torch.zeros(3, s, dtype=torch.bool)
    keep[0, :9], keep[1, :6], keep[2, 5:] = True, True, True  # full, right padding, left padding
    ids_pad = torch.zeros(3, s, dtype=torch.long)
    ids_pad[keep] = ids[0]
    pos_pad = (keep.cumsum(1) - 1).clamp(min=0)
    w_pad = torch.zeros(3, s, VOCAB)
    w_pad[keep] = weight[0]
    mask = ~keep[:, None, None, :]  # Megatron convention: True = masked out

    def run_padded(m):
        m.zero_grad(set_to_none=True)
        logits = m(ids_pad, pos_pad, attention_mask=mask)
        (logits * w_pad.to(logits.dtype)).sum().backward()
        return logits[keep], {n: p.grad for n, p in m.named_parameters()}

    got_padded = run_padded(model)
    got_thd = run_thd(model, ids, torch.cat([torch.arange(n) for n in lens])[None], params, weight)
    naive, ref = references(model, config, base, run_padded)
    assert_model_criterion("sbhd padding", got_padded, naive, ref)
    assert_model_criterion("thd", got_thd, naive, ref)


def test_optimizer_steps_lower_the_loss():
    model = build_gpt(gqa_config(), use_coreattn(get_gpt_layer_local_spec(), backend="torch"))
    ids, pos, params, _ = packed_batch(LENS)
    losses = adam_losses(model, ids, pos, params, steps=6)
    assert losses[-1] < 0.9 * losses[0], losses


def _core_attention_fields(node, found, seen=None):
    seen = set() if seen is None else seen
    if id(node) in seen:
        return found
    seen.add(id(node))
    if isinstance(node, ModuleSpec):
        _core_attention_fields(node.submodules, found, seen)
        for v in node.params.values():
            _core_attention_fields(v, found, seen)
    elif isinstance(node, (list, tuple)):
        for v in node:
            _core_attention_fields(v, found, seen)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            v = getattr(node, f.name)
            if f.name == "core_attention":
                found.append(v)
            else:
                _core_attention_fields(v, found, seen)
    return found


@pytest.mark.parametrize("kind", ["dense", "mla", "moe-block", "mtp"])
def test_use_coreattn_replaces_every_core_attention(kind):
    if kind == "dense":
        spec = get_gpt_layer_local_spec()
    elif kind == "mla":
        spec = get_gpt_layer_local_spec(multi_latent_attention=True)
    elif kind == "moe-block":
        config = gqa_config(num_layers=4, num_moe_experts=2, moe_layer_freq=[0, 1, 0, 1], moe_router_topk=1,
                            moe_router_pre_softmax=True)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    else:
        config = gqa_config(mtp_num_layers=1)
        spec = get_gpt_mtp_block_spec(config, get_gpt_layer_local_spec(), use_transformer_engine=False)
    before = _core_attention_fields(spec, [])
    assert before and all(v is not CoreAttention for v in before)
    swapped = use_coreattn(spec)
    after = _core_attention_fields(swapped, [])
    assert len(after) == len(before) and all(v is CoreAttention for v in after)
    assert _core_attention_fields(spec, []) == before, "the input spec must not change"
    pinned = _core_attention_fields(use_coreattn(spec, backend="torch"), [])
    assert all(isinstance(v, ModuleSpec) and v.module is CoreAttention and v.params == {"backend": "torch"}
               for v in pinned)


def test_use_coreattn_keeps_core_attentions_that_are_not_dense(caplog):
    """A sparse attention with parameters of its own (DSA's kind) is not swapped for dense attention."""
    sparse = type("SparseIndexedAttention", (torch.nn.Module,), {})
    spec = get_gpt_layer_local_spec(multi_latent_attention=True)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(module=sparse)
    dense = get_gpt_layer_local_spec()
    with caplog.at_level("WARNING", logger="coreattn"):
        swapped = use_coreattn([spec, dense])
    assert swapped[0].submodules.self_attention.submodules.core_attention.module is sparse
    assert swapped[1].submodules.self_attention.submodules.core_attention is CoreAttention
    assert "SparseIndexedAttention" in caplog.text


def test_use_coreattn_backend_reaches_the_module():
    model = build_gpt(gqa_config(), use_coreattn(get_gpt_layer_local_spec(), backend="torch"))
    assert model.decoder.layers[1].self_attention.core_attention.backend.value == "torch"


def test_patch_mla_native_value_dim(monkeypatch):
    import megatron.core.transformer.multi_latent_attention as mla

    if not hasattr(mla, "_prepare_mla_core_attention_value"):
        assert patch_mla_native_value_dim() is False  # this megatron-core passes V unpadded already

    def prepare(parallel_attention, query, value, packed_seq_params):  # megatron-core >= 0.18's behaviour
        pad = query.shape[-1] - value.shape[-1]
        return torch.nn.functional.pad(value, [0, pad]), pad > 0, value.shape[-1], query.shape[-1]

    monkeypatch.setattr(mla, "_prepare_mla_core_attention_value", prepare, raising=False)
    assert patch_mla_native_value_dim() is True
    patched = mla._prepare_mla_core_attention_value
    assert patch_mla_native_value_dim() is True and mla._prepare_mla_core_attention_value is patched  # idempotent
    q, v = torch.zeros(4, 2, 24), torch.ones(4, 2, 12)
    ours = type("Layer", (), {"core_attention": CoreAttention(gqa_config(), 1, AttnMaskType.causal, "self")})()
    theirs = type("Layer", (), {"core_attention": RefCoreAttention(gqa_config(), 1, AttnMaskType.causal)})()
    value, need_pad, orig, padded = patched(ours, q, v, None)
    assert value is v and not need_pad and orig == padded == 12
    value, need_pad, orig, padded = patched(theirs, q, v, None)
    assert value.shape[-1] == 24 and need_pad and (orig, padded) == (12, 24)
    ours.cache_mla_latents = True  # inference's latent cache pads V for its own flash decode
    assert patched(ours, q, v, None)[0].shape[-1] == 24
