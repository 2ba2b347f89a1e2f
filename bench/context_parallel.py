"""Context parallelism (coreattn.cp_attn): communication volume per layer per rank, COMPUTED from the
shapes (not measured), and one rank's attention compute timed on a GPU.

cp_attn all-gathers K and V in the forward and reduce-scatters dK/dV in the backward. Per layer
and rank, with n = T / cp local tokens and b = Hkv * (Dqk + Dv) * element bytes per token:
- all-gather (ring): each rank sends and receives (cp - 1) * n * b bytes;
- reduce-scatter (ring): the same, in the backward;
- fallback where a backend lacks reduce_scatter_tensor: all_reduce, 2 * (cp - 1) * n * b;
- K/V held per rank for the backward: T * b (the whole sequence; it does not shrink with cp).
Timing the collectives needs cp processes with a GPU each (torchrun); this single-process suite
does not launch them, so only the per-rank compute (the two span calls after the all-gather,
forward + backward) is timed, on one GPU.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from bench.flops import attention_flops, visible_pairs
from bench.timing import time_fn

CP_SIZES = (1, 2, 4)
PROVIDER = "coreattn-cp"
COMPUTED = "computed from shapes (ring collectives), not measured"


class CPConfig(NamedTuple):
    total_tokens: int = 65536  # one sequence
    heads_q: int = 32
    heads_kv: int = 8
    head_dim_qk: int = 192
    head_dim_v: int = 128
    causal: bool = True

    @property
    def id(self) -> str:
        heads = "mha" if self.heads_q == self.heads_kv else f"gqa{self.heads_q // self.heads_kv}"
        tokens = f"{self.total_tokens // 1024}k" if self.total_tokens % 1024 == 0 else str(self.total_tokens)
        return (f"cp-hdim{self.head_dim_qk}x{self.head_dim_v}-{heads}-hkv{self.heads_kv}-"
                f"{'causal' if self.causal else 'full'}-1x{tokens}")


def cp_configs() -> list[CPConfig]:
    """The same shape on CPU and GPU: the volumes are computed, and CPU runs time nothing."""
    return [CPConfig()]


def comm_volume(cfg: CPConfig, cp: int, element_bytes: int) -> dict:
    """Bytes per layer per rank (see the module docstring); ``cp`` must divide the token count by 2*cp."""
    per_token = cfg.heads_kv * (cfg.head_dim_qk + cfg.head_dim_v) * element_bytes
    local = cfg.total_tokens // cp
    ring = (cp - 1) * local * per_token
    return {
        "kv_bytes_per_token": per_token,
        "allgather_kv_bytes": ring,  # sent and received by each rank, forward
        "reducescatter_dkv_bytes": ring,  # sent and received by each rank, backward
        "allreduce_fallback_dkv_bytes": 2 * ring,
        "kv_held_bytes": cfg.total_tokens * per_token,
        "kv_local_bytes": local * per_token,
    }


def rank_pairs(cfg: CPConfig, cp: int, rank: int = 0) -> int:
    """Visible (q, k) pairs of one rank: its chunks j against the key prefix [0, (j+1)*c)."""
    if cp == 1:
        return visible_pairs(cfg.total_tokens, cfg.total_tokens, cfg.causal)
    chunk = cfg.total_tokens // (2 * cp)
    keys = (lambda j: (j + 1) * chunk) if cfg.causal else (lambda j: cfg.total_tokens)
    return sum(visible_pairs(chunk, keys(j), cfg.causal) for j in (rank, 2 * cp - 1 - rank))


def rank_compute(cfg: CPConfig, cp: int, dtype: torch.dtype, device: torch.device, backend: str | None = None,
                 seed: int = 0):
    """(fn, leaves): rank 0's attention after the all-gather (what cp_attn runs between collectives):
    local q [T/cp, Hq, Dqk] against the global K/V, the two span calls; ``fn()`` returns the output."""
    from coreattn.layers.checks import VarlenParams
    from coreattn.layers.context_parallel import attend_local, build_cp_plan

    total = cfg.total_tokens
    cu = torch.zeros(2, dtype=torch.int32, device=device)
    cu[1] = total
    plan = build_cp_plan("thd", cp, 0, total // cp, cfg.causal, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                         cu_seqlens_padded=cu, max_seqlen_q=total, max_seqlen_kv=total, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype).requires_grad_()

    q = leaf(total // cp, cfg.heads_q, cfg.head_dim_qk)
    k, v = leaf(total, cfg.heads_kv, cfg.head_dim_qk), leaf(total, cfg.heads_kv, cfg.head_dim_v)
    params = VarlenParams(1.0 / math.sqrt(cfg.head_dim_qk), -1, 0 if cfg.causal else -1, True)
    return (lambda: attend_local(q, k, v, plan, params, backend=backend)[0]), [q, k, v]


def _time_rank(row: dict, cfg: CPConfig, cp: int, dtype: torch.dtype, device: torch.device, quick: bool) -> None:
    try:
        fn, leaves = rank_compute(cfg, cp, dtype, device, backend="triton")
        dout = torch.randn_like(fn())
        timing = time_fn(lambda: fn().backward(dout), device, leaves, quick)
    except Exception as exc:  # one failing size must not end the run; the row says why
        first = (str(exc).strip().splitlines() or [""])[0]
        row.update(status="error", reason=f"{type(exc).__name__}: {first[:200]}")
    else:
        row.update(status="ok", ms=timing.ms, ms_p20=timing.ms_p20, ms_p80=timing.ms_p80, timing=timing.method,
                   tflops=row["flops"] / (timing.ms * 1e-3) / 1e12)
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_cp(configs, dtype: torch.dtype, device: torch.device, quick: bool, progress=None) -> list[dict]:
    rows = []
    dtype_name = str(dtype).removeprefix("torch.")
    element_bytes = torch.empty((), dtype=dtype).element_size()
    for cfg in configs:
        for cp in CP_SIZES:
            base = {"kind": "cp", "config": cfg.id, **cfg._asdict(), "cp_size": cp, "dtype": dtype_name,
                    "provider": PROVIDER}
            rows.append(dict(base, op="comm", status="ok", method=COMPUTED, **comm_volume(cfg, cp, element_bytes)))
            pairs = rank_pairs(cfg, cp)
            row = dict(base, op="rank_fwdbwd", pairs=pairs,
                       flops=attention_flops(pairs, cfg.heads_q, cfg.head_dim_qk, cfg.head_dim_v, "fwdbwd"))
            rows.append(row)
            if device.type != "cuda":
                row.update(status="skipped", reason="per-rank compute is timed on a CUDA device only "
                                                    "(communication volumes are computed, not measured)")
            else:
                _time_rank(row, cfg, cp, dtype, device, quick)
            if progress is not None:
                progress.update(1)
        rows.append({"kind": "cp", "config": cfg.id, "op": "collectives", "provider": PROVIDER, "dtype": dtype_name,
                     "status": "skipped", "reason": "timing all-gather/reduce-scatter needs cp processes with a GPU "
                                                    "each (torchrun); not launched by this suite"})
    return rows
