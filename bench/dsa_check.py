"""``python -m bench.dsa_check``: the DeepSeek Sparse Attention row of ``python -m bench.acceptance``.

The sparse Triton kernels against dense varlen attention over the same tokens, forward + backward,
in the two regimes DSA runs in:

- ``full``: T = 2,048 at top-k 2,048: every token names its whole causal range, which the kernels
  run as dense attention over contiguous keys (their range mode);
- ``sparse``: T = 8,192 at top-k 512: the first 512 tokens full, every later one naming 512 keys
  spread over its range (the slot mode, each row's loop to its count).

Inputs from bench/sparse.py's builder: one sequence, DeepSeek-V3.2's absorbed MLA (q ``[T, 16,
576]``, one latent key head whose first 512 columns are V, token i naming min(K, i + 1) keys spread
over ``[0, i]``), bf16; ``dense`` is ``coreattn.varlen_attn`` at the 192/128 head dims the model's
attention has without DSA (16 heads, causal). Per row: the median time of forward + backward
(``triton.testing.do_bench``), TFLOP/s over the visible (query, key) pairs (bench/flops.py), and the
sparse provider's time over the dense one's (``ratio_to_dense``). Rows run one after the other
until ``--time-limit``; a row that does not fit is reported as skipped.

Without a GPU the same rows run at tiny shapes under Triton's interpreter: a check of the code
path, not performance data. Writes ``{"meta": ..., "results": [...]}`` (bench's result rows) to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

PROVIDERS = ("coreattn-triton", "dense")
HEADS = 16


class Regime(NamedTuple):
    name: str
    tokens: int
    topk: int


GPU_REGIMES = (Regime("full", 2048, 2048), Regime("sparse", 8192, 512))
CPU_REGIMES = (Regime("full", 8, 8), Regime("sparse", 12, 4))  # the interpreter: the path, not the speed
CPU_HEADS = 2


def rows_for(device: torch.device, time_limit: float, say=print) -> list[dict]:
    """One row per (regime, provider): status, ms (median), tflops, ratio_to_dense on the sparse rows."""
    from bench.flops import attention_flops
    from bench.sparse import DENSE_DQK, DENSE_DV, DQK, DV, SparseBenchCase, visible_pairs

    on_gpu = device.type == "cuda"
    start = time.monotonic()
    rows = []
    for regime in GPU_REGIMES if on_gpu else CPU_REGIMES:
        case = SparseBenchCase(regime.tokens, regime.topk, HEADS if on_gpu else CPU_HEADS)
        timed = {}
        for provider in PROVIDERS:
            dense = provider == "dense"
            pairs = case.tokens * (case.tokens + 1) // 2 if dense else visible_pairs(case)
            dims = (DENSE_DQK, DENSE_DV) if dense else (DQK, DV)
            row = dict(config=f"dsa-{regime.name}-T{case.tokens}-topk{case.topk}-h{case.heads}", regime=regime.name,
                       tokens=case.tokens, topk=case.topk, heads=case.heads, provider=provider, mode="fwdbwd",
                       dtype="bfloat16" if on_gpu else "float32", head_dim_qk=dims[0], head_dim_v=dims[1],
                       pairs=pairs, flops=attention_flops(pairs, case.heads, *dims, "fwdbwd"))
            if time.monotonic() - start > time_limit:
                rows.append(dict(row, status="skipped", reason=f"past the {time_limit:.0f} s time limit"))
                continue
            try:
                row.update(status="ok", ms=_time(case, provider, device, on_gpu))
            except Exception as exc:  # reported in the row (and by the acceptance summary), the next row runs
                row.update(status="error", reason=f"{type(exc).__name__}: {str(exc).strip()[:300]}")
                rows.append(row)
                continue
            row["tflops"] = row["flops"] / (row["ms"] * 1e-3) / 1e12
            timed[provider] = row
            rows.append(row)
            say(f"[dsa] {row['config']} {provider}: {row['ms']:.2f} ms, {row['tflops']:.3f} TFLOP/s")
        if len(timed) == len(PROVIDERS):
            timed["coreattn-triton"]["ratio_to_dense"] = timed["coreattn-triton"]["ms"] / timed["dense"]["ms"]
    return rows


def _time(case, provider: str, device: torch.device, on_gpu: bool) -> float:
    """Median ms of forward + backward of ``provider`` on ``case`` (one untimed call first: compiles);
    on CPU the time of one call."""
    from bench.sparse import build

    dtype = torch.bfloat16 if on_gpu else torch.float32
    fn, leaves = build(case, provider, device, dtype)
    gen = torch.Generator(device=device).manual_seed(1)

    def step():
        for x in leaves:
            x.grad = None
        out = fn()
        out.backward(dout)

    out = fn()
    dout = torch.randn(out.shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    if not on_gpu:  # the interpreter: one call, the path checked, nothing worth timing again
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    step()
    return do_bench(step, warmup=5, rep=50, grad_to_none=leaves)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dsa_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the results file (JSON)")
    p.add_argument("--time-limit", type=float, default=120.0, metavar="SECONDS",
                   help="start no row after this many seconds")
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before coreattn's kernels are imported
    from bench.env import run_metadata

    device = torch.device("cuda" if on_gpu else "cpu")
    rows = rows_for(device, args.time_limit, say=lambda line: print(line, flush=True))
    meta = dict(run_metadata(device), performance_data=on_gpu, kind="dsa_check")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=1, default=str) + "\n")
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
