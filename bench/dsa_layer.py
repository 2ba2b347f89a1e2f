"""One DeepSeek Sparse Attention layer on CPU: Megatron-Core 0.19's ``DSAttention`` against coreattn's
``CoreDSAttention`` (what ``use_coreattn`` swaps in), forward + backward, time and peak-memory growth
over the token count T.

``python -m bench.dsa_layer [--tokens 1024 2048 4096 8192] [--providers coreattn megatron]
[--dtype bf16|fp32] [--quick] [--threads N] [--out DIR]``, with a Python that has megatron-core >= 0.19 (/work/venvs/mcore/bin/python
here; elsewhere the run stops with the reason).

The layer is the ``core_attention`` module of Megatron's own DSA spec
(``get_transformer_layer_with_experimental_attention_variant_spec``: absorbed MLA), built with the
CPU stand-ins of the test suite (tests/megatron/dsa_env.py: Transformer Engine's duplicated linear
and norms): its indexer (projections of x and qr, optional rotation, scoring, top-k), the indexer
loss (training, dense), the sparse attention and the V up-projection. Its inputs (absorbed query
``[T, 1, H, 576]``, latent key ``[T, 1, 1, 576]``, x, qr, up_v_weight) are built before the
measurement; the growth is what one forward + backward of the layer needs on top of them.

Shapes (``--dtype``, bf16 by default: parameters and inputs; the indexer scores in float32 on both
paths): 4 attention heads, kv_lora_rank 512 + rope 64, v_head_dim 128, hidden 256,
q_lora_rank 128, indexer 8 heads x 64, top-k 2,048 (DeepSeek-V3.2's), ReLU scoring, loss coefficient
0.01, one causal sequence (sbhd, b = 1). Each (T, provider) runs in its own subprocess: a warm-up
at 64 tokens, the peak RSS reset (``/proc/self/clear_refs``), then the timed calls; ``extra_mib``
is the peak resident memory over them minus the resident memory before. Megatron rows whose
estimated [T, T] buffers pass ``BASELINE_BUDGET`` are skipped with the estimate.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from bench.cpu_attention import _reset_peak, _status_kib, worker_row
from bench.env import REPO_ROOT

PROVIDERS = ("coreattn", "megatron")
TOKENS = (1024, 2048, 4096, 8192)
HEADS, KV_LORA, ROPE, V_DIM, HIDDEN, Q_LORA = 4, 512, 64, 128, 256, 128
INDEX_HEADS, INDEX_DIM, TOPK, COEFF = 8, 64, 2048, 0.01
BASELINE_BUDGET = 16 << 30


def megatron_bytes(tokens: int) -> int:
    """Estimated peak of Megatron's [T, T] buffers in one layer: about 32 float32 [T, T] tensors (its
    sparse attention's and its indexer loss's; measured here: 2.0 GiB at 4,096 tokens)."""
    return 32 * 4 * tokens * tokens


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def layer_config(dtype: torch.dtype):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        params_dtype=dtype, bf16=dtype == torch.bfloat16,
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA,
        qk_head_dim=128, qk_pos_emb_head_dim=ROPE, v_head_dim=V_DIM, ffn_hidden_size=2 * HIDDEN,
        normalization="RMSNorm", rope_type="rope", attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=True, add_bias_linear=False, multi_latent_attention=True,
        experimental_attention_variant="dsa", dsa_indexer_n_heads=INDEX_HEADS, dsa_indexer_head_dim=INDEX_DIM,
        dsa_indexer_topk=TOPK, dsa_indexer_loss_coeff=COEFF, dsa_indexer_rotate_activation=False,
        dsa_indexer_scoring_relu=True, dsa_kernel_backend="none")


def build_layer(provider: str, dtype: torch.dtype):
    """The core_attention of Megatron's DSA layer spec (through use_coreattn for coreattn)."""
    import os
    import tempfile

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.experimental_attention_variant import dsa

    sys.path.insert(0, str(REPO_ROOT / "tests" / "megatron"))  # the test suite's CPU stand-ins for TE
    from dsa_env import dsa_block_spec, install_shims

    if not dist.is_initialized():
        fd, path = tempfile.mkstemp(prefix="coreattn-gloo-")
        os.close(fd)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
    torch.cuda.current_device = lambda: "cpu"
    install_shims()
    dsa.DSAIndexerLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)
    from megatron.core.transformer.transformer_block import TransformerBlock

    config = layer_config(dtype)
    spec = dsa_block_spec(config)
    if provider == "coreattn":
        from coreattn.adapters.megatron import use_coreattn

        spec = use_coreattn(spec, backend="torch")
    torch.manual_seed(0)
    block = TransformerBlock(config, spec)
    return block.layers[0].self_attention.core_attention.train()


def inputs(tokens: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    query = torch.randn(tokens, 1, HEADS, KV_LORA + ROPE, generator=g).to(dtype).requires_grad_()
    key = torch.randn(tokens, 1, 1, KV_LORA + ROPE, generator=g).to(dtype).requires_grad_()
    x = torch.randn(tokens, 1, HIDDEN, generator=g).to(dtype)
    qr = torch.randn(tokens, 1, Q_LORA, generator=g).to(dtype)
    up_v = (torch.randn(HEADS, V_DIM, KV_LORA, generator=g) * KV_LORA ** -0.5).to(dtype).requires_grad_()
    grad = torch.randn(tokens, 1, HEADS * V_DIM, generator=g).to(dtype)
    return query, key, x, qr, up_v, grad


def step(layer, tensors):
    from megatron.core.transformer.enums import AttnMaskType

    query, key, x, qr, up_v, grad = tensors
    out = layer(query, key, None, None, x, qr, attn_mask_type=AttnMaskType.causal, up_v_weight=up_v)
    out.reshape(grad.shape).backward(grad)


def run_worker(spec: dict) -> dict:
    torch.set_num_threads(spec["threads"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dtype = DTYPES[spec["dtype"]]
        layer = build_layer(spec["provider"], dtype)
        step(layer, inputs(64, dtype))
        tensors = inputs(spec["tokens"], dtype)
        gc.collect()
        base = _status_kib("VmRSS")
        exact = _reset_peak()
        times = []
        for _ in range(spec["reps"]):
            for t in (*tensors[:2], tensors[4], *layer.parameters()):
                t.grad = None
            t0 = time.perf_counter()
            step(layer, tensors)
            times.append(time.perf_counter() - t0)
        peak = _status_kib("VmHWM")
    return {"s": statistics.median(times), "s_all": times, "extra_mib": (peak - base) / 1024 if peak and base else None,
            "peak_rss_mib": peak / 1024 if peak else None, "peak_reset": exact, "threads": torch.get_num_threads()}


def run(tokens, providers, quick: bool, threads: int = 1, dtype: str = "bf16") -> list[dict]:
    rows = []
    for n in tokens:
        for provider in providers:
            row = dict(kind="dsa-layer", tokens=n, provider=provider, dtype=dtype, heads=HEADS, dim_qk=KV_LORA + ROPE,
                       dim_v=KV_LORA, topk=TOPK, index_heads=INDEX_HEADS, index_dim=INDEX_DIM)
            if provider == "megatron" and megatron_bytes(n) > BASELINE_BUDGET:
                rows.append(dict(row, status="skipped", reason=f"estimated {megatron_bytes(n) / 2**30:.1f} GiB of "
                                                               f"[T, T] buffers > {BASELINE_BUDGET >> 30} GiB"))
                print(format_row(rows[-1]), flush=True)
                continue
            spec = dict(provider=provider, tokens=n, reps=1 if quick else 2, threads=threads, dtype=dtype)
            rows.append(worker_row(["-m", "bench.dsa_layer", "--worker", json.dumps(spec)], row))
            print(format_row(rows[-1]), flush=True)
    return rows


def format_row(r: dict) -> str:
    head = f"T={r['tokens']:<6} {r['dtype']:<5} {r['provider']:<9}"
    if r["status"] != "ok":
        return f"{head} {r['status']}: {r['reason']}"
    return f"{head} {r['s']:8.1f} s   peak growth {r['extra_mib']:9.1f} MiB"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dsa_layer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--quick", action="store_true", help="one timed call per row")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--out", type=Path, help="write rows.json there")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return 0
    try:
        from megatron.core.transformer.experimental_attention_variant import dsa  # noqa: F401
        from coreattn.layers.dsa.core_dsa_attention import INDEXER_ON_COREATTN, INDEXER_REASON
    except ImportError as exc:
        print(f"needs megatron-core >= 0.19 in this Python: {exc}", file=sys.stderr)
        return 2
    if not INDEXER_ON_COREATTN:
        print(f"coreattn's indexer does not run in this megatron-core's DSAttention: {INDEXER_REASON}", file=sys.stderr)
        return 2
    rows = run(args.tokens, args.providers, args.quick, args.threads, args.dtype)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["status"] != "error" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
