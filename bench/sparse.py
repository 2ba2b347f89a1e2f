"""Sparse (top-k) attention, DeepSeek Sparse Attention's core: time and peak memory over T at fixed top-k.

One sequence of T tokens in DeepSeek-V3.2's absorbed MLA form: q ``[T, H, 576]``, one latent key head
``[T, 1, 576]`` whose first 512 columns are V, causal, softmax scale 1/sqrt(192); query token i names
min(K, i + 1) distinct keys spread evenly over ``[0, i]`` (``(j * (i + 1)) // K``; the rest of its
row is -1). Providers:

- ``coreattn-torch``: ``coreattn.sparse_varlen_attn(q, k, None, topk, ..., v_head_dim=512,
  backend="torch")``: chunked over query tokens, O(T * K) memory;
- ``coreattn-triton``: the same call on the sparse Triton kernels (CUDA only; the interpreter is
  not timed);
- ``megatron``: Megatron-Core 0.19's own DSA attention (``dsa_kernel_backend="none"``:
  ``megatron.core.transformer.experimental_attention_variant.dsa._unfused_absorbed_dsa_fn``) on
  q ``[T, 1, H, 576]``, k ``[T, 1, 1, 576]``, indices ``[1, T, K]``: dense ``[b, H, T, T]`` scores
  and a ``[b, T, T]`` index mask. Needs megatron-core >= 0.19 in this interpreter (run the bench
  with ``/work/venvs/mcore/bin/python`` here); skipped with the reason otherwise, and where its
  estimated S x S buffers pass ``MEGATRON_BUDGET``;
- ``dense``: ``coreattn.varlen_attn`` (causal; torch backend on CPU, Triton on CUDA) over the same
  tokens at the head dims the same model's attention has without DSA (MLA's 192 / 128, H heads):
  what dense attention costs at that T.

``fwd`` is a training forward (inputs require grad); ``fwdbwd`` adds the backward of a fixed output
gradient. fp32 on CPU, bf16 on CUDA. Every (T, mode, provider) runs in its own subprocess
(``python -m bench.sparse SPEC``): inputs are built and the provider warmed up on a small T first,
then the peak RSS is reset and the timed calls run (``peak_rss``: the process's peak resident
memory over them; ``extra``: that peak minus the resident memory before them, i.e. what the call
itself needs on top of its inputs). On CUDA, peak and extra come from
``torch.cuda.max_memory_allocated``. FLOPs count the useful (query, key) pairs only (docs/benchmarks.md).
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import subprocess
import sys
import time
from typing import Iterable, NamedTuple

import torch

from bench.cpu_attention import _child_env, _reset_peak, _status_kib
from bench.env import REPO_ROOT
from bench.flops import attention_flops

PROVIDERS = ("coreattn-torch", "coreattn-triton", "megatron", "dense")
MODES = ("fwd", "fwdbwd")
DQK, DV, ROPE = 576, 512, 64  # DeepSeek-V3.2: kv_lora_rank 512 + rope 64; qk_head_dim 128 + rope 64 = 192
SCALE = 1.0 / math.sqrt(128 + ROPE)
DENSE_DQK, DENSE_DV = 192, 128
MEGATRON_BUDGET = 10 << 30  # skip Megatron rows whose estimated S x S buffers pass this (the machine must survive)
TIME_BUDGET_S = 60.0
MORE_REPS_S = 10.0
MAX_REPS = 10
SUBPROCESS_TIMEOUT_S = 3600
WARMUP_TOKENS = 64


class SparseBenchCase(NamedTuple):
    tokens: int
    topk: int
    heads: int

    @property
    def id(self) -> str:
        t = f"{self.tokens // 1024}k" if self.tokens % 1024 == 0 else str(self.tokens)
        return f"dsa-absorbed{DQK}x{DV}-h{self.heads}-topk{self.topk}-T{t}"


def sparse_cases(quick: bool, on_gpu: bool = False) -> list[SparseBenchCase]:
    """T 1k..8k at top-k 2,048 (DeepSeek-V3.2's) and 512, 4 heads; GPU: 16 heads, T up to 32k;
    quick: tiny shapes that check the section."""
    if quick:
        return [SparseBenchCase(t, 64, 2) for t in (256, 512)]
    if on_gpu:
        return [SparseBenchCase(t, 2048, 16) for t in (4096, 8192, 16384, 32768)]
    return [SparseBenchCase(t, k, 4) for k in (2048, 512) for t in (1024, 2048, 4096, 8192)]


def visible_pairs(case: SparseBenchCase) -> int:
    """Useful (query, key) pairs: token i sees min(K, i + 1) keys."""
    t, k = case.tokens, case.topk
    full = min(t, k)
    return full * (full + 1) // 2 + (t - full) * k


def megatron_bytes(case: SparseBenchCase, mode: str) -> int:
    """Estimated peak of Megatron's unfused DSA attention: fp32 ``[H, T, T]`` scores, their softmax
    and (backward) gradients, plus ``[T, T]`` masks (calibrated on this machine's 1k-4k rows)."""
    t2 = case.tokens ** 2 * 4
    return (3 if mode == "fwd" else 6) * case.heads * t2 + 3 * t2


def skip_reason(case: SparseBenchCase, provider: str, mode: str, device: torch.device) -> str | None:
    if provider == "coreattn-triton":
        if device.type != "cuda":
            return "the sparse Triton kernels are timed on a GPU only (the interpreter is not timed)"
        try:
            import coreattn.kernels.sparse_fwd  # noqa: F401
        except ImportError as exc:
            return f"the sparse Triton kernels are not in this build ({exc})"
    if provider == "megatron":
        try:
            from megatron.core.transformer.experimental_attention_variant.dsa import _unfused_absorbed_dsa_fn  # noqa
        except ImportError as exc:
            return f"megatron-core >= 0.19 is not importable in this interpreter ({type(exc).__name__}: {exc})"
        need = megatron_bytes(case, mode)
        if need > MEGATRON_BUDGET:
            return f"its S x S buffers need about {need / 2**30:.0f} GiB (budget {MEGATRON_BUDGET >> 30} GiB)"
    if provider == "coreattn-torch" and device.type == "cuda":
        return "the torch backend is timed on CPU"
    return None


# ---- the worker: one (case, mode, provider) in this process


def topk_rows(tokens: int, topk: int, device) -> torch.Tensor:
    """int64 ``[T, K]``: token i names min(K, i + 1) distinct keys spread over ``[0, i]``, the rest -1."""
    i = torch.arange(tokens, device=device)[:, None]
    j = torch.arange(topk, device=device)[None, :]
    spread = (j * (i + 1)) // topk  # distinct when i + 1 >= K
    return torch.where(i + 1 >= topk, spread, torch.where(j <= i, j, -1))


def build(case: SparseBenchCase, provider: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """(forward closure, leaves) of a provider."""
    import coreattn

    gen = torch.Generator(device=device).manual_seed(seed)
    t, h = case.tokens, case.heads

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype).requires_grad_()

    cu = torch.tensor([0, t], dtype=torch.int32, device=device)
    if provider == "dense":
        q, k, v = randn(t, h, DENSE_DQK), randn(t, h, DENSE_DQK), randn(t, h, DENSE_DV)
        backend = "triton" if device.type == "cuda" else "torch"
        return (lambda: coreattn.varlen_attn(q, k, v, cu, cu, t, t, causal=True, backend=backend)), [q, k, v]
    q, k = randn(t, h, DQK), randn(t, 1, DQK)
    topk = topk_rows(t, case.topk, device)
    if provider == "megatron":
        from megatron.core.transformer.experimental_attention_variant.dsa import _unfused_absorbed_dsa_fn

        q4, k4, idx = q.unsqueeze(1), k.unsqueeze(1), topk.unsqueeze(0)  # [s, b, np, D], [s, b, 1, D], [b, s, K]
        return (lambda: _unfused_absorbed_dsa_fn(q4, k4, idx, SCALE, DV)), [q, k]
    backend = "triton" if provider == "coreattn-triton" else "torch"
    return (lambda: coreattn.sparse_varlen_attn(q, k, None, topk, cu, cu, softmax_scale=SCALE, v_head_dim=DV,
                                                backend=backend)), [q, k]


def _call(fn, leaves, mode: str, dout):
    for x in leaves:
        x.grad = None
    out = fn()
    if mode == "fwdbwd":
        out.backward(dout.view(out.shape))


def run_worker(spec: dict) -> dict:
    import coreattn  # noqa: F401 (every worker holds the same modules, so RSS differences are the calls)

    case = SparseBenchCase(**spec["case"])
    provider, mode, device = spec["provider"], spec["mode"], torch.device(spec["device"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cuda = device.type == "cuda"
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    # warm-up on a small T: imports, first-call dispatch, kernel compiles
    small = case._replace(tokens=WARMUP_TOKENS, topk=min(case.topk, WARMUP_TOKENS))
    fn, leaves = build(small, provider, device, dtype)
    dv = DENSE_DV if provider == "dense" else DV
    _call(fn, leaves, mode, torch.randn(small.tokens * small.heads * dv, device=device, dtype=dtype))
    del fn, leaves
    fn, leaves = build(case, provider, device, dtype)
    dout = torch.randn(case.tokens * case.heads * dv, device=device, dtype=dtype)
    gc.collect()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) / 2**10
        exact = True
    else:
        base = _status_kib("VmRSS")
        exact = _reset_peak()
    times = []
    start = time.perf_counter()
    while len(times) < MAX_REPS:
        elapsed = time.perf_counter() - start
        if times and (len(times) >= spec["reps"] and elapsed >= MORE_REPS_S or elapsed >= TIME_BUDGET_S
                      or spec["quick"]):
            break
        t0 = time.perf_counter()
        _call(fn, leaves, mode, dout)
        if cuda:
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2**10 if cuda else _status_kib("VmHWM")
    return {"ms": statistics.median(times), "ms_min": min(times), "ms_all": times,
            "peak_mib": peak / 1024 if peak else None, "base_mib": base / 1024 if base else None,
            "extra_mib": (peak - base) / 1024 if peak and base else None, "peak_reset": exact,
            "memory": "torch.cuda.max_memory_allocated" if cuda else "VmHWM (peak RSS)",
            "threads": torch.get_num_threads()}


# ---- the parent: one subprocess per row


def _run_child(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench.sparse", json.dumps(spec)], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S, cwd=REPO_ROOT, env=_child_env())
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"worker exit {proc.returncode}: {tail[:300]}")
    return json.loads(lines[-1])


def run_sparse(cases: Iterable[SparseBenchCase], providers: list[str], quick: bool, device: torch.device,
               progress=None, modes=MODES, threads: int | None = None) -> list[dict]:
    """One row per (case, mode, provider)."""
    rows = []
    for case in cases:
        pairs = visible_pairs(case)
        for mode in modes:
            for provider in providers:
                dense = provider == "dense"
                dims = (DENSE_DQK, DENSE_DV) if dense else (DQK, DV)
                row_pairs = case.tokens * (case.tokens + 1) // 2 if dense else pairs
                row = {"kind": "sparse", "config": case.id, "tokens": case.tokens, "topk": case.topk,
                       "heads": case.heads, "head_dim_qk": dims[0], "head_dim_v": dims[1], "mode": mode,
                       "provider": provider, "pairs": row_pairs,
                       "flops": attention_flops(row_pairs, case.heads, *dims, mode),
                       "dtype": "bfloat16" if device.type == "cuda" else "float32", "device": device.type}
                reason = skip_reason(case, provider, mode, device)
                if reason:
                    rows.append(dict(row, status="skipped", reason=reason))
                    continue
                spec = {"case": case._asdict(), "provider": provider, "mode": mode, "device": str(device),
                        "reps": 1 if quick else 3, "quick": quick, "threads": threads}
                try:
                    row.update(status="ok", **_run_child(spec))
                    row["gflops"] = row["flops"] / (row["ms"] * 1e-3) / 1e9
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    row.update(status="error", reason=str(exc).splitlines()[0][:300])
                rows.append(row)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix_str(f"sparse {case.id} {mode} {provider}"[:60], refresh=False)
    add_growth(rows)
    return rows


def count(cases: Iterable[SparseBenchCase], providers: list[str], device: torch.device, modes=MODES) -> int:
    return sum(1 for c in cases for m in modes for p in providers if skip_reason(c, p, m, device) is None)


def add_growth(rows: list[dict]) -> None:
    """On each row: its time and extra memory over the same provider's at half the tokens (same
    top-k, heads, mode): about x2 when linear in T, x4 when quadratic."""
    ok = {(r["provider"], r["mode"], r["topk"], r["heads"], r["tokens"]): r for r in rows if r["status"] == "ok"}
    for (provider, mode, topk, heads, tokens), r in ok.items():
        half = ok.get((provider, mode, topk, heads, tokens // 2))
        if half is None:
            continue
        r["time_growth"] = r["ms"] / half["ms"]
        if r.get("extra_mib") and half.get("extra_mib"):
            r["memory_growth"] = r["extra_mib"] / half["extra_mib"]


def main(argv: list[str]) -> int:
    print(json.dumps(run_worker(json.loads(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
