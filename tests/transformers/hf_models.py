"""Tiny randomly initialized transformers models built from configs in code (no downloads), and the
batches the tests feed them: the same sequences right-padded, left-padded and packed.

Models: Llama (GQA 4/2), Qwen3 (GQA, q/k norms), gpt-oss (sinks, a sliding window of 4 on every
other layer, MoE), DeepSeek-V3 (MLA scaled down from 192/128: q/k 48 = 32 + 16 rope, v 32; MoE) and the
DeepSeek Sparse Attention models DeepSeek-V3.2 and GLM-5 (the same MLA, an indexer of 8 heads of 32
choosing the top 4 keys: sparse for the 7- and 9-token sequences; GLM-5's second layer reuses the
first one's top-k). ``v4_config`` builds DeepSeek-V4 (shared K = V of 32, sinks, a window of 4;
sliding-only or with its compressed layers). ``family_config`` / ``build_family`` build the other
sparse-attention models (``FAMILIES``: A.X-K2, dots3-note, Hy4, Hy4-VL, Mistral Large 4,
GLM-5.3-Flash) with the same MLA, an indexer of 16 heads of 32 choosing the top 4 keys (GLM-5.3-Flash:
pools of 2, the best 2 pools plus the tail) and dense MLPs, each with the layer sharing it has.
Helpers: ``greedy`` (generation with a cache), ``LargestOutput`` (the largest op output while
active) and ``peak_growth`` (the peak resident memory a call adds).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


FAMILIES = ("axk2", "dots3_note", "hy_v4", "hy_v4_vl", "mistral_large4", "glm5_next")
_NO_TOKENS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)


def family_config(name: str, layers: int | None = None, **overrides):
    """A tiny config of one of ``FAMILIES`` (a composite config for the VL models): MLA q/k 48 =
    32 + 16 rope, v 32, 4 heads; an indexer of 16 heads of 32 with top-k 4; dense MLPs. Layer
    sharing: Hy4 (-VL) reuses layer 0's top-k in layer 1; Mistral Large 4's layer 1 reuses layer 0's
    latent K/V and top-k, layers 2-3 are NoPE and layer 3 reuses layer 2's K/V with its own indexer;
    dots3-note's layer 1 is a sliding-window layer (window 4) and layer 2 a dense one without an
    indexer (a checkpoint's ``use_dsa=False`` layer type); GLM-5.3-Flash runs a linear-attention
    layer, then a DSA layer and one reusing its rows. ``layers``: keep the first ``layers`` only;
    ``overrides``: text config fields."""
    import transformers as tf

    mla = dict(intermediate_size=48, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
               qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
               n_group=1, topk_group=1, n_shared_experts=1, moe_intermediate_size=16)
    text = dict(vocab_size=VOCAB, hidden_size=32, max_position_embeddings=64, tie_word_embeddings=False,
                index_topk=TOPK, index_head_dim=32, index_n_heads=16, **_NO_TOKENS, **mla)
    rope = dict(rope_type="default", rope_theta=10000.0)
    plan = {
        "axk2": dict(layer_types=["indexed_attention"] * 2),
        "dots3_note": dict(layer_types=["indexed_attention", "sliding_attention", "full_attention"], sliding_window=4,
                           per_layer_config={1: dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                                                     kv_lora_rank=16, head_dim=48, qk_nope_head_dim=32,
                                                     qk_rope_head_dim=16, v_head_dim=32)}),
        "hy_v4": dict(indexer_types=["full", "shared"], hc_mult=2),
        "hy_v4_vl": dict(indexer_types=["full", "shared"], hc_mult=2, rope_parameters=dict(rope, mrope_section=[4, 2, 2])),
        "mistral_large4": dict(q_lora_rank=None, indexer_types=["full", "shared", "full", "full"],
                               no_rope_layers=[1, 1, 0, 0], kv_source_layers=[0, 0, 2, 2], rope_parameters=rope),
        "glm5_next": dict(qk_rope_head_dim=0, index_kpool=2, layer_types=["linear_attention", "indexed_attention",
                                                                          "indexed_attention"],
                          indexer_types=["full", "full", "shared"], linear_head_dim=8, linear_num_heads=2, hc_mult=2),
    }[name]
    text.update(plan)
    text.update(overrides)
    if text["q_lora_rank"] is None:
        del text["q_lora_rank"]
    n = len(text.get("layer_types") or text.get("indexer_types"))
    text.update(num_hidden_layers=n, mlp_layer_types=["dense"] * n)
    if layers is not None:
        text["num_hidden_layers"] = layers
        for key in ("layer_types", "indexer_types", "no_rope_layers", "kv_source_layers", "mlp_layer_types"):
            if key in text:
                text[key] = text[key][:layers]
        if "per_layer_config" in text:
            text["per_layer_config"] = {i: c for i, c in text["per_layer_config"].items() if i < layers}
    if name == "hy_v4_vl":
        return tf.HYV4VLConfig(text_config=text, vision_config=dict(hidden_size=16, intermediate_size=32,
                                                                    num_attention_heads=2, num_hidden_layers=1,
                                                                    out_hidden_size=32))
    if name == "mistral_large4":
        return tf.MistralLarge4Config(text_config=text, vision_config=dict(hidden_size=16, intermediate_size=32,
                                                                           num_attention_heads=2, num_hidden_layers=1,
                                                                           head_dim=8))
    if name == "glm5_next":
        return tf.Glm5NextConfig(text_config=text, vision_config=dict(depth=1, hidden_size=16, num_heads=2,
                                                                      intermediate_size=32, out_hidden_size=32))
    return {"axk2": tf.AXK2Config, "dots3_note": tf.Dots3NoteTextConfig, "hy_v4": tf.HYV4Config}[name](**text)


def build_family(name: str, dtype: torch.dtype, attn_implementation: str, seed: int = 0, config=None):
    """A tiny model of one of ``FAMILIES`` with random weights, the parameters initialized to no-ops made
    to matter: Hy4's sinks, Mistral Large 4's per-head position scales, GLM-5.3-Flash's pooling gate."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = family_config(name) if config is None else config
    auto = AutoModelForImageTextToText if name in ("hy_v4_vl", "mistral_large4", "glm5_next") else AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation=attn_implementation, experts_implementation="eager")
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(("self_attn.sinks", "softmax_scaling.scale", "softmax_scaling.bias",
                                    "index_kpool_compress_ape", "index_kpool_compress_gate")):
                param.normal_(0.0, 0.5)
    return model.to(dtype)


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


def greedy(model, cache_implementation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, scores) of greedy decoding of a left-padded batch of 2 x 6 tokens, 5 new ones, with
    transformers' default (dynamic) cache or ``cache_implementation``."""
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # left padding, as generate wants it
    extra = {} if cache_implementation is None else {"cache_implementation": cache_implementation}
    out = model.eval().generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, output_scores=True,
                                return_dict_in_generate=True, pad_token_id=0, **extra)
    return out.sequences, torch.stack(out.scores)


class LargestOutput(TorchDispatchMode):
    """The largest number of elements of any op's output while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_growth(run) -> int:
    """Bytes the process's peak resident memory grows by while ``run()`` runs (skips where the peak
    cannot be reset)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak (VmHWM) to the current resident size
    except OSError as exc:
        pytest.skip(f"no resettable peak RSS here ({exc})")
    before = _rss_kib("VmRSS")
    run()
    return (_rss_kib("VmHWM") - before) * 1024
