"""transformers' DeepSeek-V3.2 attention layer (MLA + its lightning indexer + top-k sparse attention)
or a one-layer DeepSeek-V4 (``--model v4``: a CSA layer) under ``attn_implementation="coreattn"`` and
"eager": peak memory growth of one forward + backward over the token count, each (implementation, T)
in its own process.

``python -m bench.hf_dsa [--model v32|v4|minimax_m3|axk2|dots3_note|hy_v4|mistral_large4|glm5_next]
[--tokens 2048 4096 8192] [--eager-tokens 1024 2048 4096] [--dtype bfloat16]``

The layer is DeepSeek-V3.2's with its real indexer (64 heads of 128, top-k 2,048) and attention head
dims (q/k 192 = 128 + 64 rope, v 128, kv_lora_rank 512), scaled down in width (hidden 1,024, 16
heads, q_lora_rank 768) so that it runs on a CPU; one sequence, no padding, the torch backend.
``grown``: the process's peak resident memory during the call minus its resident memory before it
(glibc's allocator told to return large blocks, as the other memory benches do). Eager's indexer
scores alone are ``[1, T, 64, T]`` float32: 1 GiB at 2,048 tokens, 16 GiB at 8,192 (not run: the
row gives that estimate). Prints one JSON line per row; no timing (bench/sparse.py times the op).

``--model v4``: ``DeepseekV4ForCausalLM`` with one compressed sparse attention layer at DeepSeek-V4's
attention widths (one 512-wide head that is K and V, a window of 128 raw keys, compression rate 4, an
indexer of 64 heads of 128 choosing 512 entries, partial RoPE on 64 dims), scaled down elsewhere
(hidden 1,024, 4 query heads, a small MoE, vocabulary 256), the model's loss-free ``logits.sum()``
backward; ``eager_mask_mib`` is eager's ``[1, 1, T, T + T/4]`` float32 mask alone, and eager's
scores are ``[1, 4, T, T + T/4]`` float32 per copy.

The other sparse-attention families (``--model axk2``, ``dots3_note``, ``hy_v4``, ``mistral_large4``,
``glm5_next``): the family's text model with one DSA layer at its config's attention and indexer
defaults (A.X-K2: q/k 96, v 64, 16 index heads of 128; dots3-note: 192/128, 64 index heads; Hy4:
256/256, 16 index heads, sinks, 4 hyper-connection streams; Mistral Large 4: 128/128, 32 index
heads; GLM-5.3-Flash: NoPE 256/256, 32 index heads over pools of 16, 4 streams; top-k 2,048 each),
narrower elsewhere (hidden 1,024, 16 query heads, a dense MLP of 1,024, vocabulary 256), forward +
backward of the last hidden state's sum; ``eager_index_scores_mib`` is eager's ``[1, T, index heads,
T]`` float32 scores alone (GLM-5.3-Flash: ``[1, T, 32, T / 16]`` over pools, and ``eager_mask_mib``
its ``[1, 1, T, T]`` float32 mask).

``--model minimax_m3``: ``MiniMaxM3VLForCausalLM`` (MiniMax-M3's text model) with one block-sparse
layer at its attention widths (heads of 128, an indexer of 4 heads of 128 on 4 kv heads, blocks of
128 keys, the top 16 blocks and the own block), scaled down elsewhere (hidden 1,024, 16 query heads on
4 kv heads: group 4 where the model's is 16, a small MoE, vocabulary 256), ``logits.sum()``'s
backward; ``eager_mask_mib`` is eager's ``[1, 16, T, T]`` block mask alone, in the model's dtype (its
indexer's ``[1, 4, T, T]`` float32 scores and the attention's ``[1, 16, T, T]`` come on top).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.cpu_attention import _reset_peak, _status_kib, worker_json

INDEX_HEADS, INDEX_DIM, TOPK = 64, 128, 2048


def _config(tokens: int):
    from transformers import DeepseekV32Config

    return DeepseekV32Config(vocab_size=256, hidden_size=1024, num_hidden_layers=1, intermediate_size=1024,
                             num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768, kv_lora_rank=512,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_topk=TOPK,
                             index_head_dim=INDEX_DIM, index_n_heads=INDEX_HEADS, first_k_dense_replace=1,
                             max_position_embeddings=max(tokens, 64))


def _v4_config(tokens: int):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(vocab_size=256, hidden_size=1024, num_hidden_layers=1, num_attention_heads=4,
                            head_dim=512, q_lora_rank=256, o_groups=2, o_lora_rank=256, moe_intermediate_size=256,
                            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, hc_mult=2,
                            layer_types=["compressed_sparse_attention"], mlp_layer_types=["moe"],
                            max_position_embeddings=max(tokens, 64))


def _causal_lm_growth(make_config, impl: str, tokens: int, dtype: str) -> float:
    """MiB the peak resident memory grows by over one forward + backward of ``logits.sum()`` of a
    causal LM of ``make_config(tokens)`` under coreattn's torch backend or eager (random ids, one sequence)."""
    import coreattn.adapters.transformers as coreattn_hf
    from transformers import AutoModelForCausalLM

    coreattn_hf.register("coreattn_torch", backend="torch")
    torch.manual_seed(0)
    config = make_config(tokens)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="coreattn_torch" if impl == "coreattn"
                                             else "eager", experts_implementation="eager").to(getattr(torch, dtype))
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    _reset_peak()
    before = _status_kib("VmRSS")
    model(input_ids=ids, use_cache=False).logits.float().sum().backward()
    return round((_status_kib("VmHWM") - before) / 1024, 1)


def run_v4_worker(impl: str, tokens: int, dtype: str) -> dict:
    keys = tokens + tokens // 4
    return dict(model="v4", impl=impl, tokens=tokens, dtype=dtype,
                grown_mib=_causal_lm_growth(_v4_config, impl, tokens, dtype),
                eager_mask_mib=tokens * keys * 4 / 2**20)


FAMILIES = ("axk2", "dots3_note", "hy_v4", "mistral_large4", "glm5_next")


def _family(model: str, tokens: int):
    """(text model class, config) of one of ``FAMILIES`` with one DSA layer (see the module docstring)."""
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=1024, num_attention_heads=16, num_key_value_heads=16,
                  intermediate_size=1024, num_hidden_layers=1, mlp_layer_types=["dense"],
                  max_position_embeddings=max(tokens, 64), pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if model == "axk2":
        return tf.AXK2Model, tf.AXK2Config(**common, layer_types=["indexed_attention"])
    if model == "dots3_note":
        return tf.Dots3NoteTextModel, tf.Dots3NoteTextConfig(**common, layer_types=["indexed_attention"])
    if model == "hy_v4":
        return tf.HYV4Model, tf.HYV4Config(**common, indexer_types=["full"])
    if model == "mistral_large4":
        return tf.MistralLarge4TextModel, tf.MistralLarge4TextConfig(
            **common, indexer_types=["full"], no_rope_layers=[1], kv_source_layers=[0],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    return tf.Glm5NextTextModel, tf.Glm5NextTextConfig(**common, layer_types=["indexed_attention"],
                                                         indexer_types=["full"])


def run_family_worker(model: str, impl: str, tokens: int, dtype: str) -> dict:
    import coreattn.adapters.transformers as coreattn_hf

    coreattn_hf.register("coreattn_torch", backend="torch")
    torch.manual_seed(0)
    cls, config = _family(model, tokens)
    net = cls._from_config(config, attn_implementation="coreattn_torch" if impl == "coreattn" else "eager",
                           dtype=getattr(torch, dtype))
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    _reset_peak()
    before = _status_kib("VmRSS")
    net(input_ids=ids, use_cache=False).last_hidden_state.float().sum().backward()
    peak = _status_kib("VmHWM")
    keys = -(-tokens // config.index_kpool) if model == "glm5_next" else tokens
    row = dict(model=model, impl=impl, tokens=tokens, dtype=dtype, grown_mib=round((peak - before) / 1024, 1),
               eager_index_scores_mib=tokens * config.index_n_heads * keys * 4 / 2**20)
    if model == "glm5_next":
        row["eager_mask_mib"] = tokens * tokens * 4 / 2**20
    return row


MINIMAX_HEADS = 16


def _minimax_config(tokens: int):
    from transformers import MiniMaxM3VLTextConfig

    return MiniMaxM3VLTextConfig(vocab_size=256, hidden_size=1024, num_hidden_layers=1,
                                 num_attention_heads=MINIMAX_HEADS, num_key_value_heads=4, head_dim=128,
                                 intermediate_size=256, dense_intermediate_size=1024, shared_intermediate_size=256,
                                 num_local_experts=4, num_experts_per_tok=2, index_n_heads=4, index_head_dim=128,
                                 index_block_size=128, index_topk_blocks=16, index_local_blocks=1,
                                 layer_types=["minimax_m3_sparse"], mlp_layer_types=["sparse"],
                                 max_position_embeddings=max(tokens, 64), bos_token_id=1, eos_token_id=2)


def run_minimax_worker(impl: str, tokens: int, dtype: str) -> dict:
    return dict(model="minimax_m3", impl=impl, tokens=tokens, dtype=dtype,
                grown_mib=_causal_lm_growth(_minimax_config, impl, tokens, dtype),
                eager_mask_mib=MINIMAX_HEADS * tokens * tokens * torch.finfo(getattr(torch, dtype)).bits / 8 / 2**20)


def run_worker(impl: str, tokens: int, dtype: str) -> dict:
    import coreattn.adapters.transformers as coreattn_hf
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as mod

    coreattn_hf.register("coreattn_torch", backend="torch")
    torch.manual_seed(0)
    config = _config(tokens)
    config._attn_implementation = "coreattn_torch" if impl == "coreattn" else "eager"
    dt = getattr(torch, dtype)
    layer = mod.DeepseekV32Attention(config, 0).to(dt)
    rotary = mod.DeepseekV32RotaryEmbedding(config)
    hidden = torch.randn(1, tokens, config.hidden_size, dtype=dt, requires_grad=True)
    position_ids = torch.arange(tokens)[None]
    position_embeddings = rotary(hidden, position_ids)
    from transformers.masking_utils import create_causal_mask

    mask = create_causal_mask(config, hidden, None, None, position_ids, allow_is_causal_skip=False)
    _reset_peak()
    before = _status_kib("VmRSS")
    out, _ = layer(hidden, position_embeddings, mask, position_ids=position_ids)
    out.float().sum().backward()
    peak = _status_kib("VmHWM")
    return dict(impl=impl, tokens=tokens, dtype=dtype, grown_mib=round((peak - before) / 1024, 1),
                eager_index_scores_mib=tokens * INDEX_HEADS * tokens * 4 / 2**20)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hf_dsa", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="v32", choices=["v32", "v4", "minimax_m3", *FAMILIES])
    p.add_argument("--tokens", nargs="*", type=int, default=[2048, 4096, 8192])
    p.add_argument("--eager-tokens", nargs="*", type=int, default=[1024, 2048, 4096])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--worker", nargs=2, metavar=("IMPL", "TOKENS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        torch.set_num_threads(1)
        if args.model in FAMILIES:
            row = run_family_worker(args.model, args.worker[0], int(args.worker[1]), args.dtype)
        else:
            worker = {"v4": run_v4_worker, "minimax_m3": run_minimax_worker}.get(args.model, run_worker)
            row = worker(args.worker[0], int(args.worker[1]), args.dtype)
        print(json.dumps(row))
        return 0
    for impl, counts in (("coreattn", args.tokens), ("eager", args.eager_tokens)):
        for tokens in counts:
            row = dict(model=args.model, impl=impl, tokens=tokens)
            # one run, under the memory benches' allocator settings (bench/cpu_attention.py MEMORY_ENV)
            result = worker_json(["-m", "bench.hf_dsa", "--model", args.model, "--dtype", args.dtype, "--worker",
                                  impl, str(tokens)], 3600, memory=True)
            row.update(dict(status="error", reason=result["error"]) if "error" in result else dict(result, status="ok"))
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
