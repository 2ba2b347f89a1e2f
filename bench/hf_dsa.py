"""transformers' DeepSeek-V3.2 attention layer (MLA + its lightning indexer + top-k sparse attention)
under ``attn_implementation="coreattn"`` and "eager": peak memory growth of one layer's forward +
backward over the token count, each (implementation, T) in its own process.

``python -m bench.hf_dsa [--tokens 2048 4096 8192] [--eager-tokens 1024 2048 4096] [--dtype bf16]``

The layer is DeepSeek-V3.2's with its real indexer (64 heads of 128, top-k 2,048) and attention head
dims (q/k 192 = 128 + 64 rope, v 128, kv_lora_rank 512), scaled down in width (hidden 1,024, 16
heads, q_lora_rank 768) so that it runs on a CPU; one sequence, no padding, the torch backend.
``grown``: the process's peak resident memory during the call minus its resident memory before it
(glibc's allocator told to return large blocks, as the other memory benches do). Eager's indexer
scores alone are ``[1, T, 64, T]`` float32: 1 GiB at 2,048 tokens, 16 GiB at 8,192 (not run: the
row gives that estimate). Prints one JSON line per row; no timing (bench/sparse.py times the op).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.cpu_attention import _reset_peak, _status_kib, worker_row

INDEX_HEADS, INDEX_DIM, TOPK = 64, 128, 2048


def _config(tokens: int):
    from transformers import DeepseekV32Config

    return DeepseekV32Config(vocab_size=256, hidden_size=1024, num_hidden_layers=1, intermediate_size=1024,
                             num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768, kv_lora_rank=512,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_topk=TOPK,
                             index_head_dim=INDEX_DIM, index_n_heads=INDEX_HEADS, first_k_dense_replace=1,
                             max_position_embeddings=max(tokens, 64))


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
    p.add_argument("--tokens", nargs="+", type=int, default=[2048, 4096, 8192])
    p.add_argument("--eager-tokens", nargs="+", type=int, default=[1024, 2048, 4096])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--worker", nargs=2, metavar=("IMPL", "TOKENS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        torch.set_num_threads(1)
        print(json.dumps(run_worker(args.worker[0], int(args.worker[1]), args.dtype)))
        return 0
    for impl, counts in (("coreattn", args.tokens), ("eager", args.eager_tokens)):
        for tokens in counts:
            row = dict(impl=impl, tokens=tokens)
            print(json.dumps(worker_row(["-m", "bench.hf_dsa", "--dtype", args.dtype, "--worker", impl, str(tokens)],
                                        row)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
