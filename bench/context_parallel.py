"""Context parallelism (coreattn.cp_attn): per exchange and cp degree, the bytes each rank sends and
receives per layer and the K/V bytes it holds, COMPUTED from the shapes (not measured), and one
rank's attention compute timed on a GPU.

Per layer and rank, for T tokens (one sequence), n = T / cp local tokens and e-byte elements,
with kv = Hkv * (Dqk + Dv) * e, q = Hq * Dqk * e and o = Hq * Dv * e bytes per token; every
exchange here is symmetric, so each rank sends what it receives:
- all_gather: forward a ring all-gather of K/V, (cp-1) * n * kv; backward a ring reduce-scatter of
  dK/dV, the same (twice that through the all_reduce fallback of backends without
  reduce_scatter_tensor). Saves the gathered K/V, T * kv, for the backward; 2 * T * kv at the
  forward's peak (the rank-major receive buffer and its global-order copy).
- p2p: forward (cp-1) hops of the local K/V, (cp-1) * n * kv; backward (cp-1) hops of K/V and cp hops
  of the dK/dV accumulator (in K/V's dtype), (2cp-1) * n * kv. Saves no K/V beyond the rank's own
  (the backward passes them round again); 2 * n * kv at the peak (the buffer being attended and
  the one arriving; the backward adds two dK/dV buffers and an fp32 accumulator of the same rows).
- a2a: forward one all-to-all of q, k and v and one of the output, (cp-1)/cp * n * (q + kv' + o),
  kv' = kv * max(1, cp / Hkv) (K/V heads replicated when there are fewer than ranks); backward the
  same. Saves its heads' K/V over the whole sequence, n * kv' (and q and out, n * (q + o)); 3 * n * kv'
  at the peak (send, receive and global-order buffers). Needs Hq % cp == 0 and Hkv % cp == 0 or
  cp % Hkv == 0; other shapes are skipped with the reason.
- a2a+p2p-AxB (hierarchical, cp = a * b, a and b > 1: every such split of cp): the a2a stage on the
  inner links (inside a node), a2a's formula with a for cp: (a-1)/a * n * (q + kv_a + o),
  kv_a = kv * max(1, a / Hkv), forward and backward alike; then the p2p ring over b ranks on the
  outer links (across nodes), each holding a * n tokens of Hq/a heads (K/V kv_a / a per token, so
  n * kv_a per hop): forward (b-1) * n * kv_a, backward (2b-1) * n * kv_a. Saves its heads' K/V
  over its group's tokens, n * kv_a (and q and out, n * (q + o)); 3 * n * kv_a at the peak (the
  all-to-all's buffers, or the K/V, the ring buffer and the one arriving). Needs a2a's head rules
  with a for cp. fwd_bytes/bwd_bytes are the sums; the inner and outer parts and one ring hop
  (outer_hop_bytes) are in their own fields.
Timing the collectives needs cp processes with a GPU each (torchrun); this single-process suite
does not launch them, so only one rank's compute between the exchanges (forward + backward, rank
0's share: the all-gather's two span calls, the ring's steps on a local buffer, a2a's whole
sequences of Hq/cp heads) is timed, on one GPU.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from bench.flops import attention_flops, visible_pairs
from bench.timing import kernel_configs, time_fn, untimed

CP_SIZES = (1, 2, 4, 8)
COMMS = ("p2p", "all_gather", "a2a")
HIERARCHICAL = "a2a+p2p"
PROVIDER = "coreattn-cp"
COMPUTED = "computed from shapes (ring and all-to-all collectives), not measured"


class CPConfig(NamedTuple):
    name: str = "gqa"
    total_tokens: int = 131072  # one sequence
    heads_q: int = 64
    heads_kv: int = 8
    head_dim_qk: int = 128
    head_dim_v: int = 128
    causal: bool = True

    @property
    def id(self) -> str:
        tokens = f"{self.total_tokens // 1024}k" if self.total_tokens % 1024 == 0 else str(self.total_tokens)
        return (f"cp-{self.name}-hdim{self.head_dim_qk}x{self.head_dim_v}-h{self.heads_q}kv{self.heads_kv}-"
                f"{'causal' if self.causal else 'full'}-1x{tokens}")


def cp_configs() -> list[CPConfig]:
    """An MLA layer (128 heads, q/k 192, v 128; K/V expanded to every head) at 32k and 128k tokens
    and a GQA layer (64 q heads, 8 K/V heads, 128) at 128k. The same on CPU and GPU: the volumes
    are computed, and CPU runs time nothing."""
    mla = dict(name="mla", heads_q=128, heads_kv=128, head_dim_qk=192, head_dim_v=128)
    return [CPConfig(total_tokens=32768, **mla), CPConfig(total_tokens=131072, **mla), CPConfig()]


def hierarchical_comms(cp: int) -> list[str]:
    """"a2a+p2p-AxB" for every split cp = a * b with a, b > 1 (a: the a2a group inside a node)."""
    return [f"{HIERARCHICAL}-{a}x{cp // a}" for a in range(2, cp) if cp % a == 0]


def split(comm: str) -> tuple[int, int]:
    """(a, b) of "a2a+p2p-AxB"."""
    a, b = comm.removeprefix(HIERARCHICAL + "-").split("x")
    return int(a), int(b)


def a2a_skip_reason(cfg: CPConfig, cp: int, what: str = "a2a") -> str | None:
    """Why an all-to-all over ``cp`` ranks cannot split the heads (None: it can)."""
    if cfg.heads_q % cp:
        return f"{what} needs Hq divisible by {cp} ({cfg.heads_q} % {cp} != 0)"
    if cfg.heads_kv % cp and cp % cfg.heads_kv:
        return f"{what} needs Hkv divisible by {cp} or {cp} by Hkv (Hkv {cfg.heads_kv})"
    return None


def skip_reason(cfg: CPConfig, cp: int, comm: str) -> str | None:
    if comm == "a2a":
        return a2a_skip_reason(cfg, cp)
    if comm.startswith(HIERARCHICAL):
        return a2a_skip_reason(cfg, split(comm)[0], comm)
    return None


def comm_volume(cfg: CPConfig, cp: int, comm: str, element_bytes: int) -> dict:
    """Bytes per layer per rank (see the module docstring); ``cp`` must divide the token count by 2*cp.
    cp 1 moves and holds nothing (``comm`` is ignored)."""
    kv = cfg.heads_kv * (cfg.head_dim_qk + cfg.head_dim_v) * element_bytes
    q = cfg.heads_q * cfg.head_dim_qk * element_bytes
    o = cfg.heads_q * cfg.head_dim_v * element_bytes
    n = cfg.total_tokens // cp
    base = {"kv_bytes_per_token": kv, "kv_local_bytes": n * kv}
    if cp == 1:
        return dict(base, fwd_bytes=0, bwd_bytes=0, kv_saved_bytes=0, kv_peak_bytes=0)
    if comm == "all_gather":
        ring = (cp - 1) * n * kv
        return dict(base, fwd_bytes=ring, bwd_bytes=ring, bwd_fallback_bytes=2 * ring,
                    kv_saved_bytes=cfg.total_tokens * kv, kv_peak_bytes=2 * cfg.total_tokens * kv)
    if comm == "p2p":
        return dict(base, fwd_bytes=(cp - 1) * n * kv, bwd_bytes=(2 * cp - 1) * n * kv, kv_saved_bytes=0,
                    kv_peak_bytes=2 * n * kv)
    if comm == "a2a":
        kv_rep = kv * max(1, cp // cfg.heads_kv)
        moved = (cp - 1) * n * (q + kv_rep + o) // cp
        return dict(base, fwd_bytes=moved, bwd_bytes=moved, kv_saved_bytes=n * kv_rep, qo_saved_bytes=n * (q + o),
                    kv_peak_bytes=3 * n * kv_rep)
    if comm in hierarchical_comms(cp):
        a, b = split(comm)
        kv_rep = kv * max(1, a // cfg.heads_kv)
        inner = (a - 1) * n * (q + kv_rep + o) // a
        fwd_outer, bwd_outer = (b - 1) * n * kv_rep, (2 * b - 1) * n * kv_rep
        return dict(base, fwd_bytes=inner + fwd_outer, bwd_bytes=inner + bwd_outer, fwd_inner_bytes=inner,
                    bwd_inner_bytes=inner, fwd_outer_bytes=fwd_outer, bwd_outer_bytes=bwd_outer,
                    outer_hop_bytes=n * kv_rep, kv_saved_bytes=n * kv_rep, qo_saved_bytes=n * (q + o),
                    kv_peak_bytes=3 * n * kv_rep)
    raise ValueError(f"unknown comm {comm!r}; choose one of {COMMS + tuple(hierarchical_comms(cp))}")


def rank_pairs(cfg: CPConfig, cp: int, rank: int = 0) -> int:
    """Visible (q, k) pairs of one rank under the chunk exchanges (all_gather, p2p): its chunks j
    against the key prefix [0, (j+1)*c)."""
    if cp == 1:
        return visible_pairs(cfg.total_tokens, cfg.total_tokens, cfg.causal)
    chunk = cfg.total_tokens // (2 * cp)
    keys = (lambda j: (j + 1) * chunk) if cfg.causal else (lambda j: cfg.total_tokens)
    return sum(visible_pairs(chunk, keys(j), cfg.causal) for j in (rank, 2 * cp - 1 - rank))


def rank_flops(cfg: CPConfig, cp: int, comm: str) -> tuple[int, int]:
    """(visible pairs per head, forward + backward FLOPs) of rank 0's attention."""
    if comm == "a2a" and cp > 1:  # every pair of the sequence, for Hq / cp heads
        pairs = visible_pairs(cfg.total_tokens, cfg.total_tokens, cfg.causal)
        return pairs, attention_flops(pairs, cfg.heads_q // cp, cfg.head_dim_qk, cfg.head_dim_v, "fwdbwd")
    a, ring = split(comm) if comm.startswith(HIERARCHICAL) else (1, cp)  # a2a+p2p: a ring of b, Hq / a heads
    pairs = rank_pairs(cfg, ring)
    return pairs, attention_flops(pairs, cfg.heads_q // a, cfg.head_dim_qk, cfg.head_dim_v, "fwdbwd")


def rank_compute(cfg: CPConfig, cp: int, dtype: torch.dtype, device: torch.device, backend: str | None = None,
                 seed: int = 0, comm: str = "all_gather"):
    """(fn, leaves): rank 0's attention between the exchanges; ``fn()`` returns its output.
    all_gather: local q [T/cp, Hq, Dqk] against the global K/V, the two span calls; p2p: the ring's
    steps, each on the rank's own K/V buffer (the shapes it would receive), merged through the lse;
    a2a: whole sequences of Hq/cp heads (and the K/V heads they read); a2a+p2p-AxB: p2p's ring at
    cp b on a * n tokens of Hq/a heads."""
    from coreattn.kernels.packing import Packing
    from coreattn.layers.checks import VarlenParams
    from coreattn.layers.context_parallel.attention import attend_local, build_cp_plan
    from coreattn.layers.context_parallel.layout import make_layout
    from coreattn.layers.context_parallel.ring import LocalRing, RingAttnFunction, ring_impl
    from coreattn.layers.dispatch import run_attention

    total = cfg.total_tokens
    cu = torch.zeros(2, dtype=torch.int32, device=device)
    cu[1] = total
    gen = torch.Generator(device=device).manual_seed(seed)
    params = VarlenParams(1.0 / math.sqrt(cfg.head_dim_qk), -1, 0 if cfg.causal else -1, True)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype).requires_grad_()

    if comm == "a2a" and cp > 1:
        heads_kv = max(1, cfg.heads_kv // cp)
        q = leaf(total, cfg.heads_q // cp, cfg.head_dim_qk)
        k, v = leaf(total, heads_kv, cfg.head_dim_qk), leaf(total, heads_kv, cfg.head_dim_v)
        pack = Packing("thd", cu[:1].clone(), cu[1:].clone())
        return (lambda: run_attention(q, k, v, pack, pack, total, total, params, True, backend)[0]), [q, k, v]
    a, ring_size = split(comm) if comm.startswith(HIERARCHICAL) else (1, cp)
    if (comm == "p2p" or a > 1) and cp > 1:
        n, heads_kv = total // ring_size, max(1, cfg.heads_kv // a)
        q = leaf(n, cfg.heads_q // a, cfg.head_dim_qk)
        k, v = leaf(n, heads_kv, cfg.head_dim_qk), leaf(n, heads_kv, cfg.head_dim_v)
        layout = make_layout("thd", ring_size, 0, n, real=cu[1:] - cu[:1], cu_seqlens_padded=cu, max_seqlen=total)
        ring, impl = LocalRing(layout, params, cfg.causal), ring_impl(q, backend)
        return (lambda: RingAttnFunction.apply(q, k, v, None, ring, impl, None, False)[0]), [q, k, v]
    q = leaf(total // cp, cfg.heads_q, cfg.head_dim_qk)
    plan = build_cp_plan("thd", cp, 0, total // cp, cfg.causal, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                         cu_seqlens_padded=cu, max_seqlen_q=total, max_seqlen_kv=total, device=device)
    k, v = leaf(total, cfg.heads_kv, cfg.head_dim_qk), leaf(total, cfg.heads_kv, cfg.head_dim_v)
    return (lambda: attend_local(q, k, v, plan, params, backend=backend)[0]), [q, k, v]


def _time_rank(row: dict, cfg: CPConfig, cp: int, comm: str, dtype: torch.dtype, device: torch.device,
               quick: bool) -> None:
    try:
        with kernel_configs(row):
            with untimed():
                fn, leaves = rank_compute(cfg, cp, dtype, device, backend="triton", comm=comm)
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
            for comm in (COMMS + tuple(hierarchical_comms(cp)) if cp > 1 else ("none",)):
                base = {"kind": "cp", "config": cfg.id, **cfg._asdict(), "cp_size": cp, "comm": comm,
                        "dtype": dtype_name, "provider": PROVIDER}
                skip = skip_reason(cfg, cp, comm)
                if skip:
                    rows.append(dict(base, op="comm", status="skipped", reason=skip))
                    continue
                rows.append(dict(base, op="comm", status="ok", method=COMPUTED,
                                 **comm_volume(cfg, cp, comm, element_bytes)))
                pairs, flops = rank_flops(cfg, cp, comm)
                row = dict(base, op="rank_fwdbwd", pairs=pairs, flops=flops)
                rows.append(row)
                if device.type != "cuda":
                    row.update(status="skipped", reason="per-rank compute is timed on a CUDA device only "
                                                        "(communication volumes are computed, not measured)")
                else:
                    _time_rank(row, cfg, cp, comm if cp > 1 else "all_gather", dtype, device, quick)
            if progress is not None:
                progress.update(1)
        rows.append({"kind": "cp", "config": cfg.id, "op": "collectives", "provider": PROVIDER, "dtype": dtype_name,
                     "status": "skipped", "reason": "timing the exchanges needs cp processes with a GPU each "
                                                    "(torchrun); not launched by this suite"})
    return rows
