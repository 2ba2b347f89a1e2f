"""Megatron-Core DeepSeek Sparse Attention (DSA) models on CPU for the CoreDSAttention tests.

The shims are test-only. Megatron's DSA spec builds the indexer's projections (and, for absorbed
MLA, the q/kv down-projections) with ``backend.linear()``, which takes Transformer Engine's
``parallel_mode="duplicated"``; without Transformer Engine, ``DuplicatedLinear`` stands in for
TE's ``TELinear`` there (a full, replicated weight), and ``absorbed_mla.TELinear`` names it so
absorbed MLA passes it that argument as it passes TELinear. Megatron's torch norms refuse sequence
parallelism (its SP norms are Transformer Engine's or Apex's): ``CPUNorm`` is the same torch norm
without that refusal (replicated weights applied to this rank's rows, as TE's are). Under context
parallelism, rotary embeddings on sbhd cut this rank's positions with a pinned-memory CUDA index
(needs a GPU): ``cp_share_of_positions`` cuts the same zig-zag share on CPU. megatron-core 0.16's
indexer always applies a CUDA-only Hadamard rotation: the identity stands in for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig

VOCAB = 96


class DuplicatedLinear(MegatronModule):
    """CPU stand-in for Transformer Engine's ``TELinear(parallel_mode="duplicated")``: every rank
    holds the whole weight and applies it to the rows it has."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool = False,
                 skip_bias_add: bool = False, skip_weight_param_allocation: bool = False, parallel_mode=None,
                 **unused):
        super().__init__(config=config)
        assert parallel_mode in (None, "duplicated") and not bias and not skip_weight_param_allocation
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            init_method(self.weight)
        # what TE marks on a duplicated weight under sequence parallelism: its gradient is summed over TP
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x):
        return F.linear(x, self.weight), None


class CPUNorm:
    """torch's LayerNorm or RMSNorm (``config.normalization``), as Megatron's torch norm builds it,
    also under sequence parallelism: a replicated weight applied to this rank's rows, marked
    ``sequence_parallel`` as TE marks its norms' weights (their gradients are summed over TP)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm


class CPUSpecProvider(LocalSpecProvider):
    """Megatron's local spec provider with the duplicated linear DSA's spec asks ``linear()`` for
    and norms that also run under sequence parallelism."""

    def linear(self):
        return DuplicatedLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        return CPUNorm


def cp_share_of_positions(pos_emb, seq_dim: int, cp_group):
    """This context-parallel rank's rows of a rotary table: chunks r and 2 * cp - 1 - r of 2 * cp
    along ``seq_dim`` (the zig-zag layout of Megatron's get_batch_on_this_cp_rank)."""
    cp, r = cp_group.size(), cp_group.rank()
    chunks = pos_emb.chunk(2 * cp, dim=seq_dim)
    return torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=seq_dim)


def install_shims(monkeypatch=None) -> None:
    """absorbed MLA passes ``parallel_mode="duplicated"`` to its down-projections when they are
    TELinear; rotary tables are cut per CP rank on CPU."""
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary
    import megatron.core.transformer.experimental_attention_variant.dsa as dsa

    patch = monkeypatch.setattr if monkeypatch is not None else setattr
    try:
        import megatron.core.transformer.experimental_attention_variant.absorbed_mla as absorbed
    except ImportError:  # megatron-core 0.16: DSA runs in MLA, whose down-projections are built alike
        import megatron.core.transformer.multi_latent_attention as absorbed
    patch(absorbed, "TELinear", DuplicatedLinear)
    patch(rotary, "get_pos_emb_on_this_cp_rank", cp_share_of_positions)
    if not hasattr(MLATransformerConfig, "dsa_indexer_rotate_activation"):
        # megatron-core 0.16 always rotates the indexer's q and k with a Hadamard transform from a
        # CUDA-only library, in bf16: identity here (an orthogonal rotation of both q and k, which
        # leaves their products, the index scores, unchanged)
        patch(dsa, "rotate_activation", lambda x: x)


def dsa_config(**kw) -> MLATransformerConfig:
    """A tiny absorbed-MLA DSA config: 4 heads, kv_lora_rank 32 + rope 8 (the latent key is 40
    wide, V its first 32 columns), v_head_dim 12, an indexer of 2 heads x 16 picking top-8."""
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=32,
                qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12, ffn_hidden_size=96,
                normalization="RMSNorm", rope_type="rope", attention_dropout=0.0, hidden_dropout=0.0,
                use_cpu_initialization=True, add_bias_linear=False, multi_latent_attention=True,
                experimental_attention_variant="dsa", dsa_indexer_n_heads=2, dsa_indexer_head_dim=16,
                dsa_indexer_topk=8, dsa_indexer_loss_coeff=0.5, dsa_indexer_rotate_activation=False,
                dsa_indexer_scoring_relu=False, dsa_kernel_backend="none")
    base.update(kw)
    fields = MLATransformerConfig.__dataclass_fields__  # megatron-core 0.16 has fewer DSA options
    return MLATransformerConfig(**{k: v for k, v in base.items() if k in fields or k in kw})


def dsa_block_spec(config):
    """Megatron's own DSA layer specs as a decoder block: absorbed MLA + DSAttention on 0.19
    (``get_transformer_layer_with_experimental_attention_variant_spec``); on 0.16 Megatron's MLA +
    DSAttention attention spec (``get_dsa_module_spec_for_backend``) in its local GPT layer spec."""
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs

    provider = CPUSpecProvider()
    if hasattr(specs, "get_transformer_layer_with_experimental_attention_variant_spec"):
        layers = specs.get_transformer_layer_with_experimental_attention_variant_spec(config, backend=provider)
        return TransformerBlockSubmodules(layer_specs=layers, layer_norm=provider.layer_norm(rms_norm=True))
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    layer = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm")
    layer.submodules.self_attention = specs.get_dsa_module_spec_for_backend(config, backend=provider)
    return layer


def build(config, spec, seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=64,
                    position_embedding_type="none")


def packed_params(lens, padded=None) -> PackedSeqParams:
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    extra = {}
    if padded is not None:
        cu_pad = torch.tensor([0] + torch.tensor(padded).cumsum(0).tolist(), dtype=torch.int32)
        extra = dict(cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(padded or lens),
                           max_seqlen_kv=max(padded or lens), **extra)
