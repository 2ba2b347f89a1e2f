"""One DeepSeek Sparse Attention layer on CPU: Megatron-Core 0.19's ``DSAttention`` against coreattn's
``CoreDSAttention`` (what ``use_coreattn`` swaps in) and dense attention, forward + backward, time and
peak-memory growth over the token count T.

``python -m bench.dsa_layer [--tokens 1024 2048 4096 8192] [--topk 2048 256] [--providers coreattn
megatron dense] [--dtype bf16|fp32] [--quick] [--threads N] [--out DIR]``, under a Python that has
megatron-core >= 0.19 (``pip install "megatron-core>=0.19"``, Python >= 3.12; elsewhere the run
stops with the reason). Without ``--tokens`` / ``--topk`` the cases are ``CASES``: top-k 2,048 at T
1k..8k (T <= K: every token's top-k is its whole causal range, the *full* regime; past K the first K
tokens are full and the rest sparse, *mixed*) and top-k 256 at T 2k and 8k (almost every token sparse).

Providers:

- ``coreattn`` / ``megatron``: the ``core_attention`` module of Megatron's own DSA spec
  (``get_transformer_layer_with_experimental_attention_variant_spec``: absorbed MLA), built with the
  CPU stand-ins of the test suite (tests/megatron/dsa_env.py: Transformer Engine's duplicated linear
  and norms), through ``use_coreattn(spec, backend="torch")`` for coreattn: its indexer (projections
  of x and qr, optional rotation, scoring, top-k), the indexer loss (training, dense), the sparse
  attention and the V up-projection. Its inputs (absorbed query ``[T, 1, H, 576]``, latent key
  ``[T, 1, 1, 576]``, x, qr, up_v_weight) are built before the measurement;
- ``dense``: what the same model's attention costs without DSA: ``coreattn.varlen_attn`` (torch
  backend, causal) over the T tokens at MLA's 192 / 128 head dims, H heads (no indexer, no loss).

Shapes (``--dtype``, bf16 by default: parameters and inputs; the indexer scores in float32 on both
DSA paths): 4 attention heads, kv_lora_rank 512 + rope 64, v_head_dim 128, hidden 256, q_lora_rank
128, indexer 8 heads x 64, ReLU scoring, loss coefficient 0.01, one causal sequence (sbhd, b = 1).

Two kinds of subprocess (``--worker SPEC``): per (T, top-k), one that times every provider under the
default allocator, their calls interleaved round by round after a warm-up at 64 tokens (``s``, and
``x_megatron`` / ``x_dense``: this time over Megatron's / dense attention's from that process), and
per (T, top-k, provider) one that measures memory under the memory allocator settings
(``bench.cpu_attention.MEMORY_ENV``): the peak RSS reset (``/proc/self/clear_refs``), one call,
``extra_mib`` the peak resident memory over it minus the resident memory before. Megatron rows whose
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

from bench.cpu_attention import _reset_peak, _status_kib, worker_json
from bench.env import REPO_ROOT

PROVIDERS = ("coreattn", "megatron", "dense")
TOKENS = (1024, 2048, 4096, 8192)
TOPK = 2048  # DeepSeek-V3.2's
CASES = tuple((t, TOPK) for t in TOKENS) + ((2048, 256), (8192, 256))  # (T, top-k)
HEADS, KV_LORA, ROPE, V_DIM, HIDDEN, Q_LORA = 4, 512, 64, 128, 256, 128
DENSE_DQK, DENSE_DV = 192, 128
INDEX_HEADS, INDEX_DIM, COEFF = 8, 64, 0.01
BASELINE_BUDGET = 16 << 30
WARMUP_TOKENS = 64
SUBPROCESS_TIMEOUT_S = 3600


def megatron_bytes(tokens: int) -> int:
    """Estimated peak of Megatron's [T, T] buffers in one layer: about 32 float32 [T, T] tensors (its
    sparse attention's and its indexer loss's; measured here: 2.0 GiB at 4,096 tokens)."""
    return 32 * 4 * tokens * tokens


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def regime(tokens: int, topk: int) -> str:
    """"full" when every token's top-k is its whole causal range, else "mixed"."""
    return "full" if tokens <= topk else "mixed"


def layer_config(dtype: torch.dtype, topk: int = TOPK):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        params_dtype=dtype, bf16=dtype == torch.bfloat16,
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA,
        qk_head_dim=128, qk_pos_emb_head_dim=ROPE, v_head_dim=V_DIM, ffn_hidden_size=2 * HIDDEN,
        normalization="RMSNorm", rope_type="rope", attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=True, add_bias_linear=False, multi_latent_attention=True,
        experimental_attention_variant="dsa", dsa_indexer_n_heads=INDEX_HEADS, dsa_indexer_head_dim=INDEX_DIM,
        dsa_indexer_topk=topk, dsa_indexer_loss_coeff=COEFF, dsa_indexer_rotate_activation=False,
        dsa_indexer_scoring_relu=True, dsa_kernel_backend="none")


def build_layer(provider: str, dtype: torch.dtype, topk: int = TOPK):
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

    config = layer_config(dtype, topk)
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


def _dense_step(tokens: int, dtype: torch.dtype):
    """Dense causal attention over the same tokens at MLA's 192 / 128: (step, leaves)."""
    import coreattn

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(tokens, HEADS, d, generator=g).to(dtype).requires_grad_()
               for d in (DENSE_DQK, DENSE_DQK, DENSE_DV))
    grad = torch.randn(tokens, HEADS, DENSE_DV, generator=g).to(dtype)
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    return (lambda: coreattn.varlen_attn(q, k, v, cu, cu, tokens, tokens, causal=True, backend="torch")
            .backward(grad)), [q, k, v]


def _prepare(provider: str, tokens: int, topk: int, dtype: torch.dtype):
    """(step, leaves) of a provider at T, warmed up at a small T first."""
    if provider == "dense":
        warm, _ = _dense_step(WARMUP_TOKENS, dtype)
        warm()
        return _dense_step(tokens, dtype)
    layer = build_layer(provider, dtype, topk)
    step(layer, inputs(WARMUP_TOKENS, dtype))
    tensors = inputs(tokens, dtype)
    return (lambda: step(layer, tensors)), [*tensors[:2], tensors[4], *layer.parameters()]


def _call(fn, leaves) -> float:
    for t in leaves:
        t.grad = None
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_worker(spec: dict) -> dict:
    """kind "time": {provider: [s, ...]} with the providers' calls interleaved; kind "memory": one
    provider's peak growth over one call."""
    torch.set_num_threads(spec["threads"])
    dtype = DTYPES[spec["dtype"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if spec["kind"] == "time":
            prepared = {p: _prepare(p, spec["tokens"], spec["topk"], dtype) for p in spec["providers"]}
            times = {p: [] for p in prepared}
            for _ in range(spec["reps"]):
                for p, (fn, leaves) in prepared.items():
                    times[p].append(_call(fn, leaves))
            return {"times": times, "threads": torch.get_num_threads()}
        fn, leaves = _prepare(spec["provider"], spec["tokens"], spec["topk"], dtype)
        gc.collect()
        base = _status_kib("VmRSS")
        exact = _reset_peak()
        _call(fn, leaves)
        peak = _status_kib("VmHWM")
    return {"extra_mib": (peak - base) / 1024 if peak and base else None, "peak_rss_mib": peak / 1024 if peak else None,
            "peak_reset": exact}


def _worker(spec: dict, memory: bool) -> dict:
    return worker_json(["-m", "bench.dsa_layer", "--worker", json.dumps(spec)], SUBPROCESS_TIMEOUT_S, memory)


def run(tokens, providers, quick: bool, threads: int = 1, dtype: str = "bf16", topks=(TOPK,), cases=None) -> list[dict]:
    """One row per (T, top-k, provider): ``cases`` (T, top-k) pairs, or every T with every top-k."""
    rows = []
    for n, topk in cases or [(t, k) for k in topks for t in tokens]:
        group = []
        for provider in providers:
            dims = (DENSE_DQK, DENSE_DV) if provider == "dense" else (KV_LORA + ROPE, KV_LORA)
            row = dict(kind="dsa-layer", tokens=n, topk=topk, regime=regime(n, topk), provider=provider, dtype=dtype,
                       heads=HEADS, dim_qk=dims[0], dim_v=dims[1], index_heads=INDEX_HEADS, index_dim=INDEX_DIM)
            if provider == "megatron" and megatron_bytes(n) > BASELINE_BUDGET:
                row.update(status="skipped", reason=f"estimated {megatron_bytes(n) / 2**30:.1f} GiB of [T, T] buffers "
                                                    f"> {BASELINE_BUDGET >> 30} GiB")
            group.append(row)
        live = [r for r in group if "status" not in r]
        spec = dict(kind="time", tokens=n, topk=topk, reps=1 if quick else 2, threads=threads, dtype=dtype,
                    providers=[r["provider"] for r in live])
        timed = _worker(spec, memory=False) if live else {}
        for r in live:
            if "error" in timed:
                r.update(status="error", reason=timed["error"])
                continue
            r.update(status="ok", s=statistics.median(timed["times"][r["provider"]]),
                     s_all=timed["times"][r["provider"]], threads=timed["threads"])
            measured = _worker(dict(spec, kind="memory", provider=r["provider"]), memory=True)
            r.update(measured if "error" not in measured else {"memory_error": measured["error"], "extra_mib": None})
        ok = {r["provider"]: r for r in live if r["status"] == "ok"}
        for r in ok.values():
            for name, other in (("x_megatron", "megatron"), ("x_dense", "dense")):
                if other in ok and other != r["provider"]:
                    r[name] = r["s"] / ok[other]["s"]
        for r in group:
            print(format_row(r), flush=True)
        rows += group
    return rows


def format_row(r: dict) -> str:
    head = f"T={r['tokens']:<6} top-k {r['topk']:<5} {r['regime']:<5} {r['dtype']:<5} {r['provider']:<9}"
    if r["status"] != "ok":
        return f"{head} {r['status']}: {r['reason']}"
    ratios = "".join(f"   x {other} {r[name]:5.2f}" for name, other in (("x_megatron", "megatron"), ("x_dense", "dense"))
                     if name in r)
    memory = f"{r['extra_mib']:9.1f} MiB" if r.get("extra_mib") is not None else f"? ({r.get('memory_error')})"
    return f"{head} {r['s']:8.2f} s   peak growth {memory}{ratios}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dsa_layer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, nargs="+", help=f"token counts (default: the cases {CASES})")
    parser.add_argument("--topk", type=int, nargs="+", help=f"top-k values (default {TOPK} with --tokens)")
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
    cases = None if args.tokens or args.topk else CASES
    rows = run(args.tokens or TOKENS, args.providers, args.quick, args.threads, args.dtype, args.topk or (TOPK,), cases)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["status"] != "error" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
