"""Tiny randomly initialized transformers models built from configs in code (no downloads), and the
batches the tests feed them: the same sequences right-padded, left-padded and packed.

Models: Llama (GQA 4/2), Qwen3 (GQA, q/k norms), gpt-oss (sinks, a sliding window of 4 on every
other layer, MoE), DeepSeek-V3 (MLA scaled down from 192/128: q/k 48 = 32 + 16 rope, v 32; MoE) and the
DeepSeek Sparse Attention models DeepSeek-V3.2 and GLM-5 (the same MLA, an indexer of 8 heads of 32
choosing the top 4 keys: sparse for the 7- and 9-token sequences; GLM-5's second layer reuses the
first one's top-k). ``v4_config`` builds DeepSeek-V4 (shared K = V of 32, sinks, a window of 4;
sliding-only or with its compressed layers).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

VOCAB = 61
LENS = (7, 3, 9)  # sequence lengths: longer and shorter than gpt-oss's window


DSA_MODELS = ("deepseek_v32", "glm_moe_dsa")
TOPK = 4  # the DSA models' index_topk: below the longer sequences' lengths


def _configs():
    from transformers import (DeepseekV3Config, DeepseekV32Config, GlmMoeDsaConfig, GptOssConfig, LlamaConfig,
                              Qwen3Config)

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, max_position_embeddings=64,
                  tie_word_embeddings=False)
    mla = dict(intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4, num_key_value_heads=4,
               n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
               first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=32, qk_rope_head_dim=16,
               v_head_dim=32)
    dsa = dict(index_topk=TOPK, index_head_dim=32, index_n_heads=8)
    return {
        "deepseek_v32": lambda: DeepseekV32Config(**common, **mla, **dsa),
        "glm_moe_dsa": lambda: GlmMoeDsaConfig(**common, **mla, **dsa, indexer_types=["full", "shared"]),
        "llama": lambda: LlamaConfig(**common, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2),
        "qwen3": lambda: Qwen3Config(**common, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=16),
        "gpt_oss": lambda: GptOssConfig(**common, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                                        layer_types=["sliding_attention", "full_attention"],
                                        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
        "deepseek_v3": lambda: DeepseekV3Config(**common, intermediate_size=48, moe_intermediate_size=16,
                                                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                                                num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                                                first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                                                qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
    }


MODELS = ("llama", "qwen3", "gpt_oss", "deepseek_v3") + DSA_MODELS


def v4_config(layer_types, rates=(2, 4)):
    """A tiny DeepSeek-V4 (``layer_types``: "sliding_attention", "compressed_sparse_attention",
    "heavily_compressed_attention"; ``rates``: the CSA and HCA compress rates)."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config(vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, num_attention_heads=4,
                            num_hidden_layers=len(layer_types), head_dim=32, q_lora_rank=16, n_routed_experts=4,
                            num_experts_per_tok=2, n_shared_experts=1, hc_mult=2, hc_sinkhorn_iters=2, sliding_window=4,
                            o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=16, index_topk=2,
                            layer_types=list(layer_types), mlp_layer_types=["moe"] * len(layer_types),
                            compress_rates={"compressed_sparse_attention": rates[0],
                                            "heavily_compressed_attention": rates[1]},
                            max_position_embeddings=64, partial_rotary_factor=0.25)


def build(name: str, dtype: torch.dtype, attn_implementation: str, seed: int = 0):
    """A tiny causal LM with random weights (the same weights for a given seed, whatever dtype)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _configs()[name]()  # a fresh config per model: set_attn_implementation mutates it
    # eager experts: the grouped-mm MoE kernels take no float64
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                             experts_implementation="eager")
    if name == "gpt_oss":  # sinks are initialized to zeros: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    return model.to(dtype)


class Batch(NamedTuple):
    kwargs: dict  # model inputs
    real: list  # per sequence: the (row, position) indices of its tokens in the logits


def sequences(seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in LENS]


def padded(seqs, left: bool) -> Batch:
    """Right- or left-padded batch with a [B, S] attention mask; position ids count real tokens
    from 0 (as generate computes them for left padding)."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    real = []
    for b, s in enumerate(seqs):
        start = width - len(s) if left else 0
        ids[b, start:start + len(s)] = s
        mask[b, start:start + len(s)] = 1
        real.append((torch.full((len(s),), b), torch.arange(start, start + len(s))))
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return Batch(dict(input_ids=ids, attention_mask=mask, position_ids=position_ids), real)


def packed(seqs, flash_kwargs: bool = False) -> Batch:
    """One row of concatenated sequences with restarting position ids (DataCollatorWithFlattening),
    optionally with its flash-attention kwargs (cu_seq_lens_q/k, max_length_q/k)."""
    ids = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    starts = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    real = [(torch.zeros(len(s), dtype=torch.long), torch.arange(starts[i], starts[i + 1]))
            for i, s in enumerate(seqs)]
    kwargs = dict(input_ids=ids, position_ids=position_ids)
    if flash_kwargs:
        cu = starts.to(torch.int32)
        longest = max(len(s) for s in seqs)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return Batch(kwargs, real)


def weights(seqs, seed: int = 2) -> list[torch.Tensor]:
    """Fixed random loss weights per sequence [L, VOCAB] (float64)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(len(s), VOCAB, generator=gen, dtype=torch.float64) for s in seqs]


def run(model, batch: Batch, w) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Per-sequence logits of the real tokens and the parameter gradients of
    sum(logits * w) over the real tokens."""
    model.zero_grad(set_to_none=True)
    logits = model(**batch.kwargs, use_cache=False).logits
    per_seq = [logits[rows, cols] for rows, cols in batch.real]
    loss = sum((x.to(torch.float64) * wi).sum() for x, wi in zip(per_seq, w))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return [x.detach() for x in per_seq], grads


def run_one_by_one(model, seqs, w) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Each sequence alone (batch of one, no padding); gradients summed over the sequences."""
    model.zero_grad(set_to_none=True)
    logits = []
    for s, wi in zip(seqs, w):
        out = model(input_ids=s[None], use_cache=False).logits[0]
        (out.to(torch.float64) * wi).sum().backward()
        logits.append(out.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits, grads
