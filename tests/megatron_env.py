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
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from oracle import attention_ref

VOCAB = 96


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
    fp32-softmax baseline). Causal is top-left; sbhd padding masks [b,1,1,s] drop keys and queries."""

    upcast = True

    def __init__(self, config, layer_number, attn_mask_type, attention_type="self", attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None,
                 **kwargs):
        super().__init__(config=config)
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        opts = dict(causal=causal, bottom_right=False, softmax_scale=self.softmax_scale, upcast=self.upcast)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu_q, cu_k = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
            out, _ = attention_ref(query, key, value, cu_q, cu_k, **opts)
            return out.to(query.dtype).reshape(out.shape[0], -1)
        sq, b = query.shape[:2]
        outs = []
        for i in range(b):
            keep = torch.ones(sq, dtype=torch.bool)
            if attention_mask is not None and mask_type in (AttnMaskType.padding, AttnMaskType.padding_causal):
                keep = ~attention_mask[i, 0, 0].cpu()
            idx = keep.nonzero().squeeze(1)
            n = idx.numel()
            cu = torch.tensor([0, n], dtype=torch.int32)
            o, _ = attention_ref(query[idx, i], key[idx, i], value[idx, i], cu, cu, **opts)
            full = o.new_zeros((sq,) + o.shape[1:])
            full[idx] = o
            outs.append(full)
        out = torch.stack(outs, dim=1).to(query.dtype)  # [sq, b, h, dv]
        return out.reshape(sq, b, -1)


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
