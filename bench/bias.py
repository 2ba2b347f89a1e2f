"""Attention with a relative-position bias: coreattn (computed in registers) against eager attention
with the materialized bias and FlexAttention's ``score_mod``.

One sequence of T tokens, H heads of 64, causal, and one of two biases:

- ``rel``: Inkling 2's low-rank relative bias, per-token states ``[T, H, 16]`` and a projection
  ``[16, EXTENT]``: ``bias(i, j) = states[i] . proj[:, i - j]`` for ``0 <= i - j < EXTENT``;
- ``t5``: T5's bucketed bias, 32 buckets, max_distance 128, bidirectional (the causal mask still
  applies: the encoder's buckets on a causal call).

Providers:

- ``coreattn``: ``coreattn.varlen_attn(..., bias=...)`` (the Triton kernels on CUDA, the torch
  backend on CPU);
- ``coreattn-nobias``: the same call without the bias: what the bias costs on top;
- ``eager``: the models' eager attention: ``scores = q k^T * scale + bias``, the bias materialized
  ``[H, T, T]`` from its factors as the models build it, masked, softmax in float32, ``@ v``;
- ``flex``: ``torch.nn.attention.flex_attention`` (compiled) with a ``score_mod`` over the captured
  factors and a causal block mask. Its backward does not run on CPU (torch raises
  "FlexAttention does not support backward on CPU"): on CPU it runs ``fwd`` only; its compile time
  is left out (warmed up at T first).

``fwd`` is a training forward (inputs require grad), ``fwdbwd`` adds the backward of a fixed output
gradient (into the bias's tensors too). Time: every provider of a (case, mode) in one subprocess,
calls interleaved round by round, ``ms`` each one's median, ``x_eager`` / ``x_flex`` / ``x_nobias``
this row's time over theirs from the same process. Memory apart: one subprocess per (case, mode,
provider) under ``bench.cpu_attention.MEMORY_ENV`` on CPU (``extra_mib``: the call's peak resident
memory on top of its inputs), ``torch.cuda.max_memory_allocated`` on CUDA. fp32 on CPU, bf16 on CUDA.
``python -m bench --what bias``.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Iterable, NamedTuple

import torch

from bench.flops import attention_flops
from bench.sparse import _call as sparse_call
from bench.sparse import call_memory, run_groups, time_rounds

PROVIDERS = ("coreattn", "coreattn-nobias", "eager", "flex")
MODES = ("fwd", "fwdbwd")
KINDS = ("rel", "t5")
HEAD_DIM, RANK, EXTENT = 64, 16, 1024
BUCKETS, MAX_DISTANCE = 32, 128
EAGER_BUDGET = 8 << 30  # skip eager rows whose estimated [H, T, T] buffers pass this


class BiasBenchCase(NamedTuple):
    kind: str
    tokens: int
    heads: int

    @property
    def id(self) -> str:
        t = f"{self.tokens // 1024}k" if self.tokens % 1024 == 0 else str(self.tokens)
        bias = f"rel{RANK}x{EXTENT}" if self.kind == "rel" else f"t5-{BUCKETS}b{MAX_DISTANCE}"
        return f"bias-{bias}-h{self.heads}-d{HEAD_DIM}-causal-T{t}"


def bias_cases(quick: bool, on_gpu: bool = False) -> list[BiasBenchCase]:
    if quick:
        return [BiasBenchCase(kind, 256, 2) for kind in KINDS]
    tokens = (4096, 8192, 16384) if on_gpu else (1024, 2048, 4096)
    return [BiasBenchCase(kind, t, 8) for kind in KINDS for t in tokens]


def eager_bytes(case: BiasBenchCase, mode: str) -> int:
    """Estimated float32 [H, T, T] buffers of eager attention: the bias, the scores, their softmax and, with
    the backward, the gradients autograd holds (about 5 and 8 copies)."""
    return (5 if mode == "fwd" else 8) * case.heads * case.tokens ** 2 * 4


def skip_reason(case: BiasBenchCase, provider: str, mode: str, device: torch.device) -> str | None:
    if provider == "eager" and eager_bytes(case, mode) > EAGER_BUDGET:
        return f"its [H, T, T] buffers need about {eager_bytes(case, mode) / 2**30:.0f} GiB (budget " \
               f"{EAGER_BUDGET >> 30} GiB)"
    if provider == "flex":
        try:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        except ImportError as exc:
            return f"torch has no FlexAttention ({exc})"
        if device.type == "cpu" and mode == "fwdbwd":
            return "FlexAttention does not support backward on CPU (torch raises)"
    return None


def _factors(case: BiasBenchCase, device, randn):
    if case.kind == "rel":
        return randn(case.tokens, case.heads, RANK, scale=0.3), randn(RANK, EXTENT)
    return (randn(BUCKETS, case.heads),)


def _dense_bias(case: BiasBenchCase, factors) -> torch.Tensor:
    """[H, T, T] as the models build it (Inkling 2's gather of states @ proj, T5's embedding of buckets)."""
    t = case.tokens
    i = torch.arange(t, device=factors[0].device)
    dist = i[:, None] - i[None, :]
    if case.kind == "rel":
        states, proj = factors
        logits = (states @ proj).transpose(0, 1)  # [H, T, EXTENT]
        gathered = logits.gather(-1, dist.clamp(0, EXTENT - 1).expand(case.heads, -1, -1))
        return gathered.masked_fill((dist < 0) | (dist >= EXTENT), 0.0)
    from coreattn.layers.bias import t5_buckets

    buckets = t5_buckets(True, BUCKETS, MAX_DISTANCE, dist.device)
    return factors[0][buckets[(-dist).clamp(-MAX_DISTANCE, MAX_DISTANCE) + MAX_DISTANCE]].permute(2, 0, 1)


def build(case: BiasBenchCase, provider: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """(forward closure, leaves) of a provider."""
    import coreattn

    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        x = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * scale
        return x.to(dtype if len(shape) == 3 and shape[-1] == HEAD_DIM else torch.float32).requires_grad_()

    t, h = case.tokens, case.heads
    q, k, v = (randn(t, h, HEAD_DIM) for _ in range(3))
    factors = _factors(case, device, randn)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    if provider.startswith("coreattn"):
        cu = torch.tensor([0, t], dtype=torch.int32, device=device)
        bias = None
        if provider == "coreattn":
            bias = (coreattn.LowRankRelativeBias(*factors) if case.kind == "rel"
                    else coreattn.BucketedRelativeBias(factors[0], True, MAX_DISTANCE))
        backend = "triton" if device.type == "cuda" else "torch"
        leaves = [q, k, v] + (list(factors) if bias is not None else [])
        return (lambda: coreattn.varlen_attn(q, k, v, cu, cu, t, t, causal=True, bias=bias, backend=backend)), leaves
    if provider == "eager":
        causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()

        def eager():
            s = torch.einsum("ihd,jhd->hij", q, k) * scale + _dense_bias(case, factors)
            p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1, dtype=torch.float32).to(q.dtype)
            return torch.einsum("hij,jhd->ihd", p, v)

        return eager, [q, k, v, *factors]
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = create_block_mask(lambda b, hh, qi, kv: qi >= kv, None, None, t, t, device=str(device))
    if case.kind == "rel":
        states, proj = factors

        def score_mod(score, b, hh, qi, kv):
            d = qi - kv
            entry = (states[qi, hh] * proj[:, d.clamp(0, EXTENT - 1)]).sum()
            return score + torch.where((d >= 0) & (d < EXTENT), entry, 0.0)
    else:
        from coreattn.layers.bias import t5_buckets

        buckets = t5_buckets(True, BUCKETS, MAX_DISTANCE, device)
        (emb,) = factors

        def score_mod(score, b, hh, qi, kv):
            return score + emb[buckets[(kv - qi).clamp(-MAX_DISTANCE, MAX_DISTANCE) + MAX_DISTANCE], hh]
    compiled = torch.compile(flex_attention, dynamic=False)

    def flex():
        q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))
        return compiled(q4, k4, v4, score_mod=score_mod, block_mask=block_mask, scale=scale)[0].transpose(0, 1)

    return flex, [q, k, v, *factors]


def _prepare(case: BiasBenchCase, provider: str, mode: str, device: torch.device, dtype):
    fn, leaves = build(case, provider, device, dtype)
    if provider == "flex" and mode == "fwd":
        for x in leaves:
            x.requires_grad_(False)
    dout = torch.randn(case.tokens * case.heads * HEAD_DIM, device=device, dtype=dtype)
    sparse_call(fn, leaves, mode, dout)  # warm-up: imports, dispatch, compiles
    return fn, leaves, dout


def _setup(spec: dict):
    import coreattn  # noqa: F401 (every worker holds the same modules, so RSS differences are the calls)

    device = torch.device(spec["device"])
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    return BiasBenchCase(**spec["case"]), device, torch.bfloat16 if device.type == "cuda" else torch.float32


def time_worker(spec: dict) -> dict:
    """{provider: [ms, ...]} of every provider of the spec, their calls interleaved round by round."""
    case, device, dtype = _setup(spec)
    mode = spec["mode"]
    return time_rounds({p: _prepare(case, p, mode, device, dtype) for p in spec["providers"]}, mode, device, spec)


def memory_worker(spec: dict) -> dict:
    """The peak memory of one call of one provider on top of its inputs."""
    case, device, dtype = _setup(spec)
    fn, leaves, dout = _prepare(case, spec["provider"], spec["mode"], device, dtype)
    return call_memory(fn, leaves, dout, spec["mode"], device)


def _base_row(case: BiasBenchCase, mode: str, provider: str, device: torch.device) -> dict:
    pairs = case.tokens * (case.tokens + 1) // 2
    return {"kind": "bias", "config": case.id, "bias": case.kind, "tokens": case.tokens, "heads": case.heads,
            "mode": mode, "provider": provider, "pairs": pairs,
            "flops": attention_flops(pairs, case.heads, HEAD_DIM, HEAD_DIM, mode),
            "dtype": "bfloat16" if device.type == "cuda" else "float32", "device": device.type}


def run_bias(cases: Iterable[BiasBenchCase], providers: list[str], quick: bool, device: torch.device,
             progress=None, modes=MODES, threads: int | None = None) -> list[dict]:
    """One row per (case, mode, provider): time from the (case, mode)'s time worker, memory from the
    row's own memory worker (bench/sparse.py ``run_groups``)."""
    return run_groups(cases, providers, quick, device, progress, modes, threads, "bench.bias", _base_row, skip_reason,
                      add_ratios)


def count(cases: Iterable[BiasBenchCase], providers: list[str], device: torch.device, modes=MODES) -> int:
    return sum(1 for c in cases for m in modes for p in providers if skip_reason(c, p, m, device) is None)


def add_ratios(group: list[dict]) -> None:
    """On each row of one (case, mode), timed in one process: its time over eager's, FlexAttention's and
    coreattn's without the bias (``x_eager``, ``x_flex``, ``x_nobias``)."""
    ok = {r["provider"]: r for r in group if r["status"] == "ok"}
    for r in ok.values():
        for name, other in (("x_eager", "eager"), ("x_flex", "flex"), ("x_nobias", "coreattn-nobias")):
            if other in ok and other != r["provider"]:
                r[name] = r["ms"] / ok[other]["ms"]


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    print(json.dumps(time_worker(spec) if spec["kind"] == "time" else memory_worker(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
