"""The DSA indexer on CPU: coreattn's torch backend against Megatron-Core 0.19's own path, time and
peak-memory growth over the token count T (performance data for the CPU backend).

``python -m bench.indexer [--tokens 1024 2048 4096 8192] [--ops topk loss-dense loss-sparse] [--quick]
[--threads N] [--out DIR]``, under a Python that has megatron-core >= 0.17 for the Megatron rows
(``pip install "megatron-core>=0.17"``, Python >= 3.12; elsewhere those rows are skipped with the
reason). ``--threads``: torch threads per worker (default 1).

Ops, one packed causal sequence of T tokens (Megatron's sbhd with b = 1, its causal varlen bounds):

- ``topk``: scores and top-k. coreattn ``indexer_topk(..., backend="torch")``; Megatron
  ``fused_qk_topk_naive`` (``_compute_index_scores``: a float32 [T, H_I, T] product, then ``topk``).
- ``loss-dense`` / ``loss-sparse``: top-k and the indexer loss, forward and backward.
  coreattn ``indexer_topk_and_loss`` then ``loss.backward()``; Megatron ``FusedDSAIndexerLoss``
  (the naive forward and backward, [T, T] tensors per attention head and more).

Shapes: indexer heads 8 x dim 64, top-k 256, ReLU; attention 8 heads of the absorbed 192 (one
latent key head), float32 indexer side (Megatron's float32 scores) and bf16 attention side. Every row
runs in its own subprocesses: inputs built, one small warm-up call, the peak RSS reset
(``/proc/self/clear_refs``), then the timed calls, under the default allocator; then again, one
call, under the memory allocator settings (``bench.cpu_attention.MEMORY_ENV``), for ``extra_mib``:
the peak resident memory over it minus the resident memory before (the op's working memory). Megatron rows whose estimated
[T, T] buffers pass ``BASELINE_BUDGET`` are skipped with the estimate.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import warnings

import torch

from bench.cpu_attention import _reset_peak, _status_kib, worker_row

OPS = ("topk", "loss-dense", "loss-sparse")
PROVIDERS = ("coreattn", "megatron")
TOKENS = (1024, 2048, 4096, 8192)
INDEX_HEADS, INDEX_DIM, TOPK = 8, 64, 256
HEADS, DIM_QK = 8, 192
BASELINE_BUDGET = 6 << 30
SCALE, COEFF = DIM_QK ** -0.5, 0.01


def megatron_dsa():
    """Megatron's dsa module, or the reason it is not here."""
    try:
        from megatron.core.transformer.experimental_attention_variant import dsa
    except ImportError as exc:
        return None, f"megatron-core's DSA is not importable ({exc})"
    if not hasattr(dsa, "FusedDSAIndexerLoss"):
        return None, "this megatron-core has no FusedDSAIndexerLoss (0.17+)"
    return dsa, ""


def megatron_bytes(op: str, tokens: int) -> int:
    """Estimated peak of Megatron's float32 [T, T] buffers: the [T, H_I, T] score product and its ReLU
    and weighted copies; the loss adds the attention scores, softmax and mask per head and the
    indexer's [T, T] scores, softmax and masks (forward, then again in the backward)."""
    per = 4 * tokens * tokens
    index = (3 * INDEX_HEADS + 3) * per
    return index if op == "topk" else index + (3 * HEADS + 8) * per


def inputs(tokens: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, 1, INDEX_HEADS, INDEX_DIM, generator=g)  # [S, b, H_I, D_I]
    k = torch.randn(tokens, 1, INDEX_DIM, generator=g)
    w = torch.rand(tokens, 1, INDEX_HEADS, generator=g) * INDEX_HEADS ** -0.5 * INDEX_DIM ** -0.5
    query = torch.randn(tokens, 1, HEADS, DIM_QK, generator=g).to(torch.bfloat16)
    key = torch.randn(tokens, 1, 1, DIM_QK, generator=g).to(torch.bfloat16)
    return q, k, w, query, key


def build(op: str, provider: str, tokens: int):
    """The call to time, and the leaves whose grads it sets."""
    import coreattn.layers.dsa.indexer as ix

    q, k, w, query, key = inputs(tokens)
    leaves = [t.requires_grad_() for t in (q, k, w)] if op != "topk" else []
    starts, ends = torch.zeros(tokens, dtype=torch.int64), torch.arange(1, tokens + 1)
    if provider == "coreattn":
        if op == "topk":
            return lambda: ix.indexer_topk(q, k, w, TOPK, layout="sbhd", backend="torch"), leaves

        def loss():
            _, value = ix.indexer_topk_and_loss(q, k, w, query, key, TOPK, SCALE, COEFF, sparse=op == "loss-sparse",
                                                layout="sbhd", backend="torch")
            value.backward()
        return loss, leaves
    dsa, _ = megatron_dsa()
    if op == "topk":
        return lambda: dsa.fused_qk_topk_naive(q, k, w, TOPK, varlen_starts=starts, varlen_ends=ends), leaves
    import types

    pg = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))

    def loss():
        _, value = dsa.FusedDSAIndexerLoss.apply(q, w, k, query, key.expand(-1, -1, HEADS, -1), SCALE, TOPK, COEFF,
                                                 None, op == "loss-sparse", pg, starts, ends, None, None, False, True)
        value.backward()
    return loss, leaves


def run_worker(spec: dict) -> dict:
    import coreattn.layers.dsa.indexer  # noqa: F401 (both providers' processes hold the same modules)

    torch.set_num_threads(spec["threads"])
    megatron_dsa()
    warm, _ = build(spec["op"], spec["provider"], 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.enable_grad():
            warm()
            fn, leaves = build(spec["op"], spec["provider"], spec["tokens"])
            gc.collect()
            base = _status_kib("VmRSS")
            exact = _reset_peak()
            times = []
            for _ in range(spec["reps"]):
                for t in leaves:
                    t.grad = None
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            peak = _status_kib("VmHWM")
    return {"ms": statistics.median(times), "ms_all": times, "extra_mib": (peak - base) / 1024 if peak and base else None,
            "peak_rss_mib": peak / 1024 if peak else None, "peak_reset": exact, "threads": torch.get_num_threads()}


def run(tokens, ops, quick: bool, threads: int = 1) -> list[dict]:
    _, reason = megatron_dsa()
    rows = []
    for op in ops:
        for n in tokens:
            for provider in PROVIDERS:
                row = dict(kind="indexer", op=op, tokens=n, provider=provider, index_heads=INDEX_HEADS,
                           index_dim=INDEX_DIM, topk=TOPK, heads=HEADS, dim_qk=DIM_QK)
                if provider == "megatron" and reason:
                    rows.append(dict(row, status="skipped", reason=reason))
                    continue
                if provider == "megatron" and megatron_bytes(op, n) > BASELINE_BUDGET:
                    rows.append(dict(row, status="skipped", reason=f"estimated {megatron_bytes(op, n) / 2**30:.1f} GiB "
                                                                   f"of [T, T] buffers > {BASELINE_BUDGET >> 30} GiB"))
                    continue
                spec = dict(op=op, provider=provider, tokens=n, reps=1 if quick else 2, threads=threads)
                rows.append(worker_row(["-m", "bench.indexer", "--worker", json.dumps(spec)], row,
                                       memory_args=["-m", "bench.indexer", "--worker", json.dumps(dict(spec, reps=1))]))
                print(format_row(rows[-1]), flush=True)
    return rows


def format_row(r: dict) -> str:
    head = f"{r['op']:<12} T={r['tokens']:<6} {r['provider']:<9}"
    if r["status"] != "ok":
        return f"{head} {r['status']}: {r['reason']}"
    return f"{head} {r['ms']:10.1f} ms   peak growth {r['extra_mib']:9.1f} MiB"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.indexer", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--quick", action="store_true", help="one timed call per row")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per worker (default 1: on a shared machine, OpenMP's per-op barriers "
                        "under other load dominate the many small ops of a chunked path)")
    p.add_argument("--out", help="write results.json (rows and run metadata) and table.txt into this directory")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return 0
    rows = run(args.tokens, args.ops, args.quick, args.threads)
    if args.out:
        from pathlib import Path

        from bench.env import run_metadata

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(run_metadata(torch.device("cpu")), performance_data=True, worker_threads=args.threads)
        with open(out / "results.json", "w") as f:
            json.dump({"meta": meta, "args": vars(args), "rows": rows}, f, indent=1)
        (out / "table.txt").write_text("\n".join(format_row(r) for r in rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
