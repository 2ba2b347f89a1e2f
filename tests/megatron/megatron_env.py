"""Megatron-Core on CPU for the model tests: a one-rank gloo group, CPU shims, a float64 reference
core attention and small GPT/MLA model builders.

The shims are test-only (never in the package): on megatron-core 0.16.1 RotaryEmbedding asks
``torch.cuda.current_device()`` (at construction in MLA, per forward in GPTModel), and MLA checks
``isinstance(..., TELinear)`` with TELinear a placeholder (not a
class) when Transformer Engine is absent.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from attn_cases import assert_flash_criterion
from coreattn.kernels import dropout
from oracle import attention_ref, max_logit_ref

VOCAB = 96
# the models and layers of these tests run on CPU, where the Triton kernels are the interpreter's
CPU_BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.interpreter_only(
    "Megatron on CPU (gloo, CPU shims): the Triton kernels on CPU tensors"))]


@pytest.fixture(scope="module")
def megatron_cpu():
    """A one-rank gloo process group with Megatron's model-parallel state (all sizes 1)."""
    created = not dist.is_initialized()
    if created:
        fd, path = tempfile.mkstemp(prefix="coreattn-gloo-")
        os.close(fd)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()
        os.unlink(path)


@pytest.fixture
def megatron_cpu_shims(monkeypatch):
    import megatron.core.transformer.multi_latent_attention as mla

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    if not isinstance(getattr(mla, "TELinear", None), type):  # None or a placeholder mock without TE
        monkeypatch.setattr(mla, "TELinear", type("NoTELinear", (), {}), raising=False)


class RefCoreAttention(MegatronModule):
    """Reference core attention: the per-sequence oracle (float64 with ``upcast``, else the naive
    fp32-softmax baseline). Causal is top-left; sbhd padding masks [b,1,1,s] drop keys and queries.
    Megatron's options, from their definitions: config.window_size (per layer), attention dropout in
    training (coreattn's keep mask on its token ids, the RNG state drawn once per call as CoreAttention
    draws it), softmax_type's ``softmax_offset`` and qk-clip's ``current_max_attn_logits``."""

    upcast = True

    def __init__(self, config, layer_number, attn_mask_type, attention_type="self", attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None,
                 **kwargs):
        super().__init__(config=config)
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        self.attention_dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        in_window = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, max(1, layer_number))
        self.window = tuple(config.window_size) if in_window else (-1, -1)
        self.track_max = config.qk_clip or config.log_max_attention_logit
        self.current_max_attn_logits = None
        heads = config.num_attention_heads
        if config.softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
        elif config.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads, dtype=config.params_dtype), persistent=False)
        else:
            self.softmax_offset = None

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        p = self.attention_dropout if self.training else 0.0
        keep_fn = None
        if p > 0:
            state = dropout.rng_state(query.device)
            keep_fn = lambda h, qi, ki: dropout.keep_mask(state, p, h, qi, ki)  # noqa: E731
        opts = dict(causal=causal, bottom_right=False, softmax_scale=self.softmax_scale, upcast=self.upcast,
                    window=self.window, softmax_offset=self.softmax_offset, dropout_p=p, keep_fn=keep_fn)
        limits = dict(causal=causal, window=self.window, bottom_right=False, softmax_scale=self.softmax_scale)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu_q, cu_k = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
            out, _ = attention_ref(query, key, value, cu_q, cu_k, **opts)
            self._track(max_logit_ref(query.detach(), key.detach(), cu_q, cu_k, **limits))
            return out.to(query.dtype).reshape(out.shape[0], -1)
        sq, b = query.shape[:2]
        sk = key.shape[0]
        outs, best = [], None
        for i in range(b):
            keep = torch.ones(sq, dtype=torch.bool)
            if attention_mask is not None and mask_type in (AttnMaskType.padding, AttnMaskType.padding_causal):
                keep = ~attention_mask[i, 0, 0].cpu()
            idx = keep.nonzero().squeeze(1)
            n = idx.numel()
            cu = torch.tensor([0, n], dtype=torch.int32)
            o, _ = attention_ref(query[idx, i], key[idx, i], value[idx, i], cu, cu, q_ids=i * sq + idx,
                                 k_ids=i * sk + idx, **opts)
            m = max_logit_ref(query[idx, i].detach(), key[idx, i].detach(), cu, cu, **limits)
            best = m if best is None else torch.maximum(best, m)
            full = o.new_zeros((sq,) + o.shape[1:])
            full[idx] = o
            outs.append(full)
        self._track(best)
        out = torch.stack(outs, dim=1).to(query.dtype)  # [sq, b, h, dv]
        return out.reshape(sq, b, -1)

    def _track(self, max_logit):
        if not self.track_max:
            return
        if self.current_max_attn_logits is None:
            self.current_max_attn_logits = max_logit
        else:
            self.current_max_attn_logits = torch.maximum(self.current_max_attn_logits, max_logit)


class NaiveCoreAttention(RefCoreAttention):
    upcast = False


def build_gpt(config, spec, seed=0, position_embedding_type="rope"):
    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=128,
                    position_embedding_type=position_embedding_type)


def clone_with(model, config, spec):
    """Same weights as ``model`` under another spec (e.g. the reference core attention)."""
    other = build_gpt(config, spec)
    other.load_state_dict(model.state_dict(), strict=False)
    return other


def gqa_config(**kw):
    """A tiny GQA GPT config (4 q heads, 2 groups, head dim 16) with dropout off unless given."""
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                ffn_hidden_size=96, attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True)
    base.update(kw)
    return TransformerConfig(**base)


def mla_config(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32,
                qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12, ffn_hidden_size=96, normalization="RMSNorm",
                rope_type="rope", attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True)
    base.update(kw)
    return MLATransformerConfig(**base)


def packed_batch(lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, sum(lens)), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                             max_seqlen_kv=max(lens))
    weight = torch.randn(1, sum(lens), VOCAB, generator=gen)
    return ids, pos, params, weight


def assert_model_criterion(tag, got, naive, ref):
    (g_out, g_grads), (n_out, n_grads), (r_out, r_grads) = got, naive, ref
    assert_flash_criterion(f"{tag} logits", g_out, n_out, r_out)
    assert g_grads.keys() == r_grads.keys()
    for name, grad in g_grads.items():
        assert_flash_criterion(f"{tag} grad {name}", grad, n_grads[name], r_grads[name])


def adam_losses(model, ids, pos, params, steps: int, lr: float = 3e-3) -> list[float]:
    """Next-token losses of ``steps`` Adam steps on a packed thd batch."""
    labels = torch.roll(ids, -1, dims=1)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(ids, pos, attention_mask=None, labels=labels, packed_seq_params=params).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
