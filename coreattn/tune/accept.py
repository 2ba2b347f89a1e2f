"""The acceptance check a tuned config passes before the tuner writes it.

The candidate runs forward and backward through the real launchers (the other kernels at the
shipped config) on a small packed batch with odd and empty sequences, and so does the shipped
config; both are compared with a float64 naive attention of the same class (mask, GQA, sinks,
dropout's keep mask, max logits). The candidate passes when every output and gradient is finite
and within flash-attention's criterion of that reference (``err <= 2 * err_same_dtype + eps``, as
the self-check applies it) and agrees with the shipped config's error (``err <= 2 * err_shipped +
eps``), and when a second run gives bitwise the same results (the backward is deterministic).
Changing configs may change results only by floating-point rounding; this is where that is held.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from coreattn.kernels import varlen_attn_bwd, varlen_attn_fwd
from coreattn.kernels.configs.pick import forced_configs
from coreattn.kernels.dropout import keep_mask, rng_state
from coreattn.kernels.packing import packed
from coreattn.kernels.softmax_offset import softmax_offset_grad
from coreattn.kernels.tuned_cache import KernelClass
from coreattn.selfcheck import EPS, Check, band_mask, compare, naive_attention

GPU_LENS = (0, 1, 37, 128, 300, 513)
CPU_LENS = (0, 1, 17, 40)  # the interpreter runs each program in Python
HEADS_Q = 4
DROPOUT_P = 0.1
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OUTPUTS = ("out", "dq", "dk", "dv", "d_offset", "max_logit")


class Inputs(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    cu: torch.Tensor
    lens: tuple[int, ...]
    offset: torch.Tensor | None
    rng: torch.Tensor | None


class Acceptance(NamedTuple):
    passed: bool
    checks: list[Check]

    @property
    def note(self) -> str:
        failed = [f"{c.name}: {c.note}" for c in self.checks if not c.passed]
        return "; ".join(failed) if failed else "ok"


def make_inputs(cls: KernelClass, device: torch.device, lens=None, seed: int = 0) -> Inputs:
    lens = tuple(lens or (CPU_LENS if device.type == "cpu" else GPU_LENS))
    gen = torch.Generator().manual_seed(seed)
    dtype, total = DTYPES[cls.dtype], sum(lens)
    heads_kv = HEADS_Q // 2 if cls.gqa else HEADS_Q

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device=device)
    offset = torch.randn(HEADS_Q, generator=gen).to(device) if "sink" in cls.features else None
    rng = rng_state(device, torch.Generator(device=device).manual_seed(seed)) if "dropout" in cls.features else None
    return Inputs(rand(total, HEADS_Q, cls.dim_qk), rand(total, heads_kv, cls.dim_qk), rand(total, heads_kv, cls.dim_v),
                  rand(total, HEADS_Q, cls.dim_v), cu, lens, offset, rng)


def run(cls: KernelClass, inp: Inputs, configs: dict) -> dict:
    """Forward and backward through the launchers with ``configs`` forced (kernel -> AttnConfig)."""
    pack, longest = packed(inp.cu), max(inp.lens)
    scale, right = cls.dim_qk ** -0.5, 0 if cls.causal else -1
    dropout = dict(dropout_p=DROPOUT_P, rng_state=inp.rng) if inp.rng is not None else {}
    max_logit = "max_logit" in cls.features
    with forced_configs(**configs):
        out, lse, *mx = varlen_attn_fwd(inp.q, inp.k, inp.v, pack, pack, longest, scale, -1, right, True, **dropout,
                                        softmax_offset=inp.offset, return_max_logit=max_logit)
        rowsum = torch.zeros_like(lse) if inp.offset is not None else None
        dq, dk, dv = varlen_attn_bwd(inp.dout, inp.q, inp.k, inp.v, out, lse, pack, pack, longest, longest, scale, -1,
                                     right, True, **dropout, sink_rowsum=rowsum)
    res = dict(out=out, dq=dq, dk=dk, dv=dv)
    if inp.offset is not None:
        res["d_offset"] = softmax_offset_grad(inp.offset, lse, rowsum, pack)
    if max_logit:
        res["max_logit"] = mx[0]
    return res


def reference(cls: KernelClass, inp: Inputs, exact: bool) -> dict:
    """The same outputs from naive attention on the CPU: float64 (exact) or the same-dtype baseline."""
    leaves = [t.detach().cpu().requires_grad_() for t in (inp.q, inp.k, inp.v)]
    offset = inp.offset.detach().cpu().requires_grad_() if inp.offset is not None else None
    cu, outs, maxima = inp.cu.tolist(), [], []
    scale = cls.dim_qk ** -0.5
    group = inp.q.shape[1] // inp.k.shape[1]
    for b, n in enumerate(inp.lens):
        rows = slice(cu[b], cu[b + 1])
        q, k, v = (t[rows] for t in leaves)
        mask = band_mask(n, n, cls.causal, (-1, -1))
        keep = None
        if inp.rng is not None:
            ids = torch.arange(cu[b], cu[b + 1])
            keep = keep_mask(inp.rng.cpu(), DROPOUT_P, torch.arange(HEADS_Q)[:, None, None], ids[None, :, None],
                             ids[None, None, :])
        outs.append(naive_attention(q, k, v, mask, offset, exact, keep, DROPOUT_P))
        work = torch.float64 if exact else torch.float32
        s = torch.einsum("ihd,jhd->hij", q.detach().to(work), k.detach().to(work).repeat_interleave(group, 1)) * scale
        maxima.append(s.masked_fill(~mask, -math.inf).amax(dim=(1, 2)) if n else torch.full((HEADS_Q,), -math.inf))
    out = torch.cat(outs)
    wrt = leaves + ([offset] if offset is not None else [])
    grads = torch.autograd.grad(out, wrt, inp.dout.cpu().to(out.dtype))
    res = dict(out=out, dq=grads[0], dk=grads[1], dv=grads[2])
    if offset is not None:
        res["d_offset"] = grads[3]
    if "max_logit" in cls.features:
        res["max_logit"] = torch.stack(maxima).amax(0)
    return res


def _finite_max_logit(got: torch.Tensor, naive: torch.Tensor, ref: torch.Tensor) -> tuple:
    """max_logit is -inf for a head without a visible pair: compare the finite heads, and the -infs exactly."""
    same = torch.equal(torch.isneginf(got.cpu()), torch.isneginf(ref))
    keep = torch.isfinite(ref)
    return same, got.cpu()[keep], naive[keep], ref[keep]


def accept(kernel: str, cls: KernelClass, candidate, shipped: dict, device: torch.device, lens=None,
           runner=run) -> Acceptance:
    """Whether ``candidate`` (``kernel``'s config) may replace the shipped one for ``cls``; ``shipped``:
    every kernel's shipped config. ``runner`` is ``run`` (tests inject a broken one)."""
    inp = make_inputs(cls, device, lens)
    ref, naive = reference(cls, inp, True), reference(cls, inp, False)
    base = runner(cls, inp, shipped)
    configs = dict(shipped, **{kernel: candidate})
    got, again = runner(cls, inp, configs), runner(cls, inp, configs)
    checks = []
    for name in (n for n in OUTPUTS if n in ref):
        g, s, r, nv = got[name], base[name], ref[name], naive[name]
        if name == "max_logit":
            same, g, nv, r = _finite_max_logit(g, nv, r)
            s = s.cpu()[torch.isfinite(ref[name])]
            if not same:
                checks.append(Check(name, math.inf, 0.0, False, "-inf (no visible pair) where the reference differs"))
                continue
        checks.append(compare(name, g, nv, r))  # the self-check's criterion against float64
        vs_shipped = compare(f"{name} vs shipped", g, s, r)  # err <= 2 * err(shipped config) + eps
        checks.append(vs_shipped)
    repeat = all(torch.equal(got[n], again[n]) for n in got)
    checks.append(Check("bitwise repeatable", 0.0 if repeat else 1.0, 0.0, repeat,
                        "" if repeat else "two runs of the candidate differ"))
    return Acceptance(all(c.passed for c in checks), checks)


__all__ = ["Acceptance", "accept", "make_inputs", "reference", "run", "EPS"]
