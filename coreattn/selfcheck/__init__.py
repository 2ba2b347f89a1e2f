"""Self-check: ``python -m coreattn.selfcheck`` runs coreattn's correctness cases on this machine.

Every case goes through the public functions (``coreattn.varlen_attn``, ``coreattn.padded_attn``)
with the Triton backend and is compared, output and gradients, with a float64 naive attention
applying the same mask, under flash-attention's criterion: ``err <= 2 * err_same_dtype + eps``,
where ``err_same_dtype`` is the error of the naive attention computed in the input dtype (fp32
scores and softmax, P rounded to the input dtype before P @ V, output rounded). Outputs and
gradients must be finite, and rows that see no key must be zero. On CUDA it also checks that new
packed batches do not recompile the kernels. The cases run the launch configs the kernels use on
this device, a tuned cache's (``python -m coreattn.tune``) where it has an entry for the case, else
the shipped table, and the report names each config and its source.

On ROCm's PyTorch an AMD GPU is a ``cuda`` device: everything above runs there alike, and the
report prints the HIP version and the gcnArchName.

``python -m coreattn.selfcheck`` runs each (case, dtype) row in its own child process
(``isolated.py``): a CUDA fault poisons its process, and one bad kernel must not hide the other
rows; a row that faults, dies or hangs is reported with the kernel launch it was in. ``faults.py``
holds what the self-check, the benchmark suite and the tuner share for that: the launch trace, the
child processes and their events, and the test-only fault injection. ``--in-process`` runs the
rows here (``run``), for compute-sanitizer or a debugger.

Without a GPU the kernels run under Triton's CPU interpreter. ``TRITON_INTERPRET=1`` must be set
before the kernels are defined, and ``python -m coreattn.selfcheck`` has imported coreattn (and
its kernels) before this module runs, so the children get the variable (and ``--in-process``
re-runs itself in a child process with it set).

May import: anything in coreattn (it sits above the public API and tests it through it); nothing
in coreattn imports it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

import coreattn
from coreattn.kernels import runs_in_interpreter
from coreattn.kernels.configs.base import KERNELS
from coreattn.kernels.configs.pick import record_configs

EPS = 1e-5
CPU_MESSAGE = "CPU run under the Triton interpreter: checks the kernels' logic, not your GPU"
NUMPY_HINT = "pip install numpy"


@dataclass(frozen=True)
class Case:
    name: str
    dqk: int
    dv: int
    hq: int = 4
    hkv: int = 4
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    padded: bool = False  # a bshd batch with [B, S] keep masks instead of packed sequences
    sink: bool = False  # a softmax offset [Hq], checked with its gradient
    other_k_lens: bool = False  # packed keys of other lengths than the queries (an empty one included)
    quick: bool = False  # also run by --quick


CASES = [
    Case("hdim64-causal-qk-lens-differ", 64, 64, causal=True, other_k_lens=True, quick=True),
    Case("hdim128-full-gqa2", 128, 128, hkv=2),
    Case("hdim192x128-causal-gqa4", 192, 128, hkv=1, causal=True, quick=True),
    Case("hdim256-window16_4", 256, 256, window=(16, 4)),
    Case("hdim128-padded-keepmask-causal", 128, 128, causal=True, padded=True, quick=True),
    Case("hdim192x128-sink-causal-gqa2", 192, 128, hkv=2, causal=True, sink=True, quick=True),
]
FP32_CASE = CASES[0]  # fp32 (IEEE) runs once, on this case


def case_dtypes(device: torch.device) -> tuple[list[torch.dtype], str | None]:
    """The dtypes every case runs in on ``device``, and why one is left out (None if none is)."""
    if device.type == "cpu":
        return [torch.float16], ("bf16 skipped on CPU: the Triton interpreter's bf16 tl.dot and casts are wrong "
                                 "(pytest corrects them with tests/interpreter_bf16.py and runs bf16 that way)")
    return [torch.bfloat16, torch.float16], None


def seq_lens(device: torch.device) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Query lengths and other key lengths (an empty key sequence, Lq > Lk and Lq < Lk); small on
    CPU, where the interpreter runs each program in Python."""
    if device.type == "cpu":
        return (0, 1, 17, 40), (3, 0, 17, 29)
    return (0, 1, 37, 128, 300), (3, 0, 37, 90, 301)


# ---- the reference: naive attention of one sequence under an explicit [Lq, Lk] visibility mask

def band_mask(len_q: int, len_k: int, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """[Lq, Lk] bool: key j visible to query i, diagonal aligned bottom-right (coreattn's default)."""
    i = torch.arange(len_q)[:, None] + (len_k - len_q)
    j = torch.arange(len_k)[None, :]
    left, right = window[0], 0 if causal else window[1]
    mask = torch.ones(len_q, len_k, dtype=torch.bool)
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    return mask


def naive_attention(q, k, v, mask, offset=None, exact=True, keep=None, dropout_p=0.0):
    """q [Lq, Hq, Dqk], k [Lk, Hkv, Dqk], v [Lk, Hkv, Dv], mask [Lq, Lk] bool, offset [Hq] sink logits.
    exact: float64 throughout; else the same-dtype baseline (fp32 scores and softmax, P rounded to
    q's dtype before P @ V, output rounded). Rows that see nothing output zeros. ``keep``: dropout's
    [Hq, Lq, Lk] keep mask (kept probabilities scaled by 1 / (1 - dropout_p)). Differentiable."""
    work = torch.float64 if exact else torch.float32
    group = q.shape[1] // k.shape[1]
    qw, kw, vw = q.to(work), k.to(work).repeat_interleave(group, 1), v.to(work).repeat_interleave(group, 1)
    s = (torch.einsum("ihd,jhd->hij", qw, kw) / math.sqrt(q.shape[-1])).masked_fill(~mask, float("-inf"))
    if offset is not None:  # the sink: a virtual key with logit offset[h] and a zero value
        s = torch.cat([s, offset.to(work)[:, None, None].expand(-1, s.shape[1], 1)], -1)
    seen = torch.isfinite(s).any(-1, keepdim=True)  # [Hq, Lq, 1]
    p = torch.softmax(torch.where(seen, s, 0.0), -1) * seen
    p = p[..., :k.shape[0]]
    if keep is not None:
        p = p * keep.to(p.device) / (1.0 - dropout_p)
    if not exact:
        p = p.to(q.dtype).to(work)
    out = torch.einsum("hij,jhd->ihd", p, vw)  # [Lq, Hq, Dv]
    return out if exact else out.to(q.dtype)


# ---- checks

class Check(NamedTuple):
    name: str
    err: float
    bound: float
    passed: bool
    note: str = ""

    def as_json(self) -> dict:
        return {**self._asdict(), "err": self.err if math.isfinite(self.err) else None}


def compare(name: str, got: torch.Tensor, naive: torch.Tensor, ref: torch.Tensor, eps: float = EPS) -> Check:
    """Flash-attention's criterion: got finite and max|got - ref| <= 2 * max|naive - ref| + eps +
    2 * finfo(naive's dtype).eps * max|ref| (two units of rounding at the value's magnitude: the
    absolute eps alone is below one ulp of a large value, and a naive result that happens to round
    well would hold a correct one to a fraction of an ulp)."""
    rounding = 2 * torch.finfo(naive.dtype).eps if naive.is_floating_point() else 0.0
    got, naive, ref = got.detach().cpu().double(), naive.detach().cpu().double(), ref.detach().cpu().double()
    if got.shape != ref.shape:
        return Check(name, math.inf, 0.0, False, f"shape {tuple(got.shape)} != {tuple(ref.shape)}")
    if not torch.isfinite(got).all():
        return Check(name, math.inf, 0.0, False, "non-finite values")
    err = (got - ref).abs().max().item() if got.numel() else 0.0
    finite = ref[torch.isfinite(ref)]
    bound = (2 * ((naive - ref).abs().max().item() if naive.numel() else 0.0) + eps
             + (rounding * finite.abs().max().item() if finite.numel() else 0.0))
    return Check(name, err, bound, err <= bound, "" if err <= bound else f"error {err:.3e} > allowed {bound:.3e}")


def zero_rows(name: str, got: torch.Tensor, blind: torch.Tensor) -> Check:
    """Rows of ``got`` (first dim, flattened like ``blind``) whose query sees no key must be exactly 0."""
    rows = got.detach().cpu().reshape(blind.numel(), -1)[blind.reshape(-1)]
    worst = rows.abs().max().item() if rows.numel() else 0.0
    return Check(name, worst, 0.0, worst == 0.0, "" if worst == 0.0 else "nonzero row for a query that sees no key")


def _rand(gen, shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype)


def _cu(lens) -> torch.Tensor:
    return coreattn.masks.cu_seqlens_from_seqlens(torch.tensor(lens, dtype=torch.int32))


def _varlen_inputs(case: Case, lens_q, lens_k, dtype, gen):
    q = _rand(gen, (sum(lens_q), case.hq, case.dqk), dtype)
    k = _rand(gen, (sum(lens_k), case.hkv, case.dqk), dtype)
    v = _rand(gen, (sum(lens_k), case.hkv, case.dv), dtype)
    return q, k, v


def run_case(case: Case, dtype: torch.dtype, device: torch.device, seed: int = 0) -> list[Check]:
    """Forward and backward of one case on ``device`` against the references on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    lens_q, other = seq_lens(device)
    lens_k = other if case.other_k_lens else lens_q
    if case.padded:
        batch, seqlen = 3, max(lens_q)
        keep = torch.zeros(batch, seqlen, dtype=torch.bool)
        keep[0, :seqlen * 2 // 3] = True  # right padding
        keep[1] = torch.rand(seqlen, generator=gen) < 0.7  # holes; row 2 keeps nothing
        q = _rand(gen, (batch, seqlen, case.hq, case.dqk), dtype)
        k = _rand(gen, (batch, seqlen, case.hkv, case.dqk), dtype)
        v = _rand(gen, (batch, seqlen, case.hkv, case.dv), dtype)
        band = band_mask(seqlen, seqlen, case.causal, case.window)
        masks = [band & keep[b][:, None] & keep[b][None, :] for b in range(batch)]
    else:
        q, k, v = _varlen_inputs(case, lens_q, lens_k, dtype, gen)
        masks = [band_mask(lq, lk, case.causal, case.window) for lq, lk in zip(lens_q, lens_k)]
    offset = torch.randn(case.hq, generator=gen) if case.sink else None
    leaves = [t for t in (q, k, v, offset) if t is not None]

    dev = [t.to(device).requires_grad_() for t in leaves]
    dev_offset = dev[3] if case.sink else None
    if case.padded:
        keep_dev = keep.to(device)
        out = coreattn.padded_attn(*dev[:3], layout="bshd", q_keep_mask=keep_dev, k_keep_mask=keep_dev,
                                   causal=case.causal, window_size=case.window, softmax_offset=dev_offset,
                                   backend="triton")
    else:
        out = coreattn.varlen_attn(*dev[:3], _cu(lens_q).to(device), _cu(lens_k).to(device), max(lens_q),
                                   max(lens_k), causal=case.causal, window_size=case.window,
                                   softmax_offset=dev_offset, backend="triton")
    grad_out = _rand(gen, out.shape, dtype)
    grads = torch.autograd.grad(out, dev, grad_out.to(device))

    def reference(exact):
        cpu = [t.detach().clone().requires_grad_() for t in leaves]
        off = cpu[3] if case.sink else None
        if case.padded:
            res = torch.stack([naive_attention(cpu[0][b], cpu[1][b], cpu[2][b], masks[b], off, exact)
                               * keep[b][:, None, None] for b in range(batch)])
        else:
            cq, ck = _cu(lens_q).tolist(), _cu(lens_k).tolist()
            res = torch.cat([naive_attention(cpu[0][cq[b]:cq[b + 1]], cpu[1][ck[b]:ck[b + 1]],
                                             cpu[2][ck[b]:ck[b + 1]], masks[b], off, exact)
                             for b in range(len(masks))])
        return res, torch.autograd.grad(res, cpu, grad_out.to(res.dtype))

    (ref, ref_grads), (naive, naive_grads) = reference(True), reference(False)
    names = ["out", "dq", "dk", "dv", "d_offset"]
    checks = [compare(n, g, nv, r) for n, g, nv, r in zip(names, (out, *grads), (naive, *naive_grads),
                                                          (ref, *ref_grads))]
    blind = torch.cat([~m.any(-1) for m in masks])  # [rows]: queries that see no key
    return checks + [zero_rows("zero rows (out)", out, blind), zero_rows("zero rows (dq)", grads[0], blind)]


# ---- no recompiles across packed batches (CUDA only)

def _compiled_count(kernel) -> int | None:
    """Compiled variants held by a JITFunction: Triton >= 3.2 keeps ``device_caches`` (device ->
    (kernel_cache, kernel_key_cache, target, backend, binder)), older ones ``cache`` (device -> dict)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    caches = getattr(kernel, "cache", None)
    return None if caches is None else sum(len(c) for c in caches.values())


def check_recompiles(device: torch.device, dtype: torch.dtype) -> Check:
    """A warm-up packed batch, then two with other lengths and token counts: no kernel compiles again."""
    if device.type != "cuda":
        return Check("no recompiles", 0.0, 0.0, True, "skipped: compile caches are not meaningful under the interpreter")
    from coreattn.kernels.attn_bwd import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_bwd_preprocess_kernel
    from coreattn.kernels.attn_fwd import _varlen_attn_fwd_kernel

    kernels = (_varlen_attn_fwd_kernel, _attn_bwd_preprocess_kernel, _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel)
    case = Case("recompile", 192, 128, hkv=2, causal=True)
    counts = []
    for i, lens in enumerate([(100, 37, 512), (5, 0, 1000, 77), (1, 300, 17, 9, 1)]):  # totals 649, 1082, 328
        q, k, v = (t.to(device).requires_grad_() for t in _varlen_inputs(case, lens, lens, dtype,
                                                                          torch.Generator().manual_seed(i)))
        cu = _cu(lens).to(device)
        out = coreattn.varlen_attn(q, k, v, cu, cu, max(lens), max(lens), causal=True, backend="triton")
        out.backward(torch.ones_like(out))
        counts.append([_compiled_count(kern) for kern in kernels])
    if None in counts[0]:
        return Check("no recompiles", 0.0, 0.0, True, "skipped: this Triton keeps no compile cache we can read")
    grew = counts[-1] != counts[0]
    return Check("no recompiles", float(grew), 0.0, not grew,
                 f"compiled kernels per launch site {counts[0]} -> {counts[-1]}" if grew else "")


# ---- the report

def configs_report(uses) -> str:
    """The launch configs the cases ran, per kernel and launch class, and their source: the shipped
    table of this device's config family, or a tuned cache file (python -m coreattn.tune). ``uses``:
    ConfigUse.as_json() dicts (each row's ``configs``)."""
    lines = ["launch configs the kernels used (tile, warps, stages; source):"]
    unique = {(u["kernel"], u["class"]): u for u in uses}.values()
    for use in sorted(unique, key=lambda u: (u["class"] or "", KERNELS.index(u["kernel"]))):
        cfg = use["config"]
        tile = f"{cfg['block_m']}x{cfg['block_n']}" if cfg["block_n"] else f"{cfg['block_m']} rows"
        extra = (" tma" if cfg["tma"] else "") + (" warp-specialized" if cfg["warp_specialize"] else "")
        lines.append(f"  {use['kernel']:<10} {use['class'] or '-':<32} {tile} w{cfg['num_warps']} "
                     f"s{cfg['num_stages'] or '-'}{extra}  ({use['source']})")
    return "\n".join(lines)


def environment(device: torch.device) -> dict:
    """Device and versions; on ROCm's PyTorch (AMD GPUs are ``cuda`` devices there) the HIP version
    and the device's gcnArchName too."""
    import triton

    info = {"device": platform.processor() or platform.machine(), "compute_capability": None,
            "torch": torch.__version__, "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
            "gcn_arch": None, "triton": triton.__version__, "coreattn": coreattn.__version__,
            "python": platform.python_version(), "interpreter": device.type == "cpu"}
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
        info["compute_capability"] = "{}.{}".format(*torch.cuda.get_device_capability(device))
        if info["hip"]:
            info["gcn_arch"] = torch.cuda.get_device_properties(device).gcnArchName
    return info


def environment_keys(env: dict) -> list[str]:
    """The keys the report prints: CUDA's version, or ROCm's HIP version and gcnArchName."""
    toolkit = ["hip", "gcn_arch"] if env["hip"] else ["cuda"]
    return ["device", "compute_capability", "torch", *toolkit, "triton", "coreattn", "python"]


def _cell(check: Check) -> str:
    if not check.passed:
        return "FAIL"
    return f"{check.err / check.bound:.2f}" if check.bound else "ok"


# ---- which rows run, and how a row is printed

DTYPE_ARGS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
STATUS = {"pass": "PASS", "wrong": "WRONG", "fault": "FAULT", "timeout": "TIMEOUT", "error": "ERROR",
          "not-run": "NOT RUN"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_arg(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPE_ARGS.items() if v == dtype)


def select_rows(device: torch.device, quick: bool = False, names=None, dtypes=None) -> list[tuple[Case, torch.dtype]]:
    """The (case, dtype) rows to run: every case (``quick``: the quick ones) in the device's dtypes
    and FP32_CASE in fp32; ``names`` (--case) and ``dtypes`` (--dtype, of DTYPE_ARGS) narrow it.
    ValueError naming the option for an unknown case or a dtype this device does not run."""
    known = [c.name for c in CASES]
    unknown = [n for n in names or () if n not in known]
    if unknown:
        raise ValueError(f"--case: unknown {unknown}; choose from {known}")
    cases = [c for c in CASES if c.name in names] if names else [c for c in CASES if c.quick or not quick]
    device_dtypes, skipped = case_dtypes(device)
    if dtypes:
        for name in dtypes:
            if DTYPE_ARGS[name] not in device_dtypes + [torch.float32]:
                raise ValueError(f"--dtype {name}: {skipped}")
        return [(c, DTYPE_ARGS[name]) for name in dict.fromkeys(dtypes) for c in cases]
    return [(c, d) for d in device_dtypes for c in cases] + ([(FP32_CASE, torch.float32)] if FP32_CASE in cases else [])


def table_header() -> str:
    return f"{'case':<32} {'dtype':<8} {'out':>5} {'dq':>5} {'dk':>5} {'dv':>5} {'dsink':>5} {'zero':>5}  result"


def row_line(name: str, dname: str, checks: list[Check], status: str) -> str:
    """One table row: max error / allowed per output and gradient, the zero-rows check, the status."""
    by_name = {c.name: c for c in checks}
    cells = [_cell(by_name[n]) if n in by_name else "-" for n in ("out", "dq", "dk", "dv", "d_offset")]
    zero = [c for c in checks if c.name.startswith("zero")]
    cells.append(("ok" if all(c.passed for c in zero) else "FAIL") if zero else "-")
    return f"{name:<32} {dname:<8} " + " ".join(f"{x:>5}" for x in cells) + f"  {STATUS[status]}"


def preamble(env: dict, quick: bool, skipped: str | None, isolation: str | None = None) -> list[str]:
    lines = [f"coreattn self-check{' (--quick)' if quick else ''}"]
    if env["interpreter"]:
        lines.append(CPU_MESSAGE)
    lines += [f"  {key:<19} {env[key]}" for key in environment_keys(env)]
    if isolation:
        lines.append(isolation)
    if skipped:
        lines.append(skipped)
    lines.append("cells: max error / allowed (2 * same-dtype error + 1e-5), pass <= 1; zero: rows that see no key are 0")
    return lines


def recompile_line(recompile: dict) -> str:
    status = "FAIL" if not recompile["passed"] else "SKIPPED" if recompile["note"].startswith("skipped") else "PASS"
    note = recompile["note"].removeprefix("skipped: ")
    return f"no recompiles across packed batches: {status}" + (f" ({note})" if note else "")


def run(quick: bool = False, out=sys.stdout, rows=None, recompile: bool = True) -> dict:
    """Runs the cases in this process on this machine's device (CUDA, else the interpreter on CPU),
    prints the table and returns the results as a dict (``passed`` says whether everything passed).
    ``rows``: the (case, dtype) rows (default: ``select_rows``); ``recompile``: also check that new
    packed batches do not recompile (CUDA only). A fault here ends the process's use of the device:
    ``python -m coreattn.selfcheck`` runs each row in its own process instead (selfcheck/isolated.py)."""
    if not (runs_in_interpreter() or torch.cuda.is_available()):
        raise RuntimeError("no CUDA device and coreattn's kernels were not built for the interpreter: "
                           "run `python -m coreattn.selfcheck`, which sets TRITON_INTERPRET=1")
    device = torch.device("cpu" if runs_in_interpreter() else "cuda")
    dtypes, skipped = case_dtypes(device)
    rows = select_rows(device, quick) if rows is None else rows
    env = environment(device)
    say = lambda line="": print(line, file=out, flush=True)  # noqa: E731
    for line in preamble(env, quick, skipped, "all rows in this process (--in-process)"):
        say(line)
    say()
    say(table_header())
    say("-" * len(table_header()))
    results, used = [], {}
    for case, dtype in rows:
        dname = dtype_name(dtype)
        try:
            with record_configs() as uses:
                checks = run_case(case, dtype, device)
            status = "pass" if all(c.passed for c in checks) else "wrong"
        except Exception as exc:  # report and go on: one broken case should not hide the others
            checks = [Check("run", math.inf, 0.0, False, f"{type(exc).__name__}: {exc}")]
            status = "error"
        used.update(uses)
        say(row_line(case.name, dname, checks, status))
        results.append({"case": asdict(case), "dtype": dname, "status": status, "passed": status == "pass",
                        "checks": [c.as_json() for c in checks], "configs": [u.as_json() for u in uses.values()],
                        "fault": None})
    say()
    say(configs_report([u.as_json() for u in used.values()]))
    check = check_recompiles(device, dtypes[0]) if recompile else Check(
        "no recompiles", 0.0, 0.0, True, "skipped: --case runs the named cases only")
    say()
    say(recompile_line(check.as_json()))
    return summarize(results, check.as_json(), env, skipped, quick, out, "in-process")


def summarize(results: list[dict], recompile: dict, env: dict, skipped, quick: bool, out, isolation: str,
              faults: list[dict] = ()) -> dict:
    """Prints what failed (the faults with their kernel launch and how to rerun them alone) and
    the last line; returns the results document (``--json``)."""
    say = lambda line="": print(line, file=out, flush=True)  # noqa: E731
    for r in results:
        if r["status"] == "wrong":
            for c in r["checks"]:
                if not c["passed"]:
                    say(f"FAILED {r['case']['name']} {r['dtype']} {c['name']}: {c['note']}")
        elif r["status"] != "pass" and not r.get("fault"):
            say(f"{STATUS[r['status']]} {r['case']['name']} {r['dtype']}: "
                + "; ".join(c["note"] for c in r["checks"] if not c["passed"]))
    faults = [r["fault"] for r in results if r.get("fault")] + list(faults)
    for fault in faults:
        say(f"{STATUS[fault['status']]} {fault['row']}: {fault['how']}\n  kernel launch: {fault['where']}\n"
            f"  rerun it alone: {fault['rerun']}\n  under compute-sanitizer: {fault['sanitizer']}")
    passed = all(r["status"] == "pass" for r in results) and recompile["passed"]
    say(f"{'PASSED' if passed else 'FAILED'}: {sum(r['status'] == 'pass' for r in results)}/{len(results)} case rows "
        "passed" + ("" if not env["interpreter"] else f" ({CPU_MESSAGE})"))
    return {"passed": passed, "environment": env, "skipped": skipped, "quick": quick, "isolation": isolation,
            "rows": results, "recompile": recompile, "faults": faults,
            "message": CPU_MESSAGE if env["interpreter"] else None}


def check_from_json(c: dict) -> Check:
    return Check(c["name"], math.inf if c["err"] is None else c["err"], c["bound"], c["passed"], c.get("note", ""))


def positive(kind):
    """argparse type: a ``kind`` (int, float) > 0, or exit 2 naming the option (also bench's)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m coreattn.selfcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--case", nargs="+", metavar="NAME", help="run only these cases (names as in the table)")
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPE_ARGS), help="run the cases in these dtypes only")
    parser.add_argument("--in-process", action="store_true",
                        help="run every row in this process (for compute-sanitizer or a debugger); by default each "
                             "row runs in its own process, so a fault in one cannot hide the others")
    parser.add_argument("--timeout", type=positive(float), metavar="SECONDS",
                        help="kill a row's process after this long (default 300 on a GPU, 1800 on CPU)")
    parser.add_argument("--jobs", type=positive(int), metavar="N",
                        help="rows run at once, each in its own process (default 4 on a GPU, 2 on CPU)")
    parser.add_argument("--time-limit", type=positive(float), metavar="SECONDS",
                        help="start no row after this long; a row still running then is killed (timeout)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one row, in a child of the run above
    parser.add_argument("--events", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        from coreattn.selfcheck.isolated import child_main

        return child_main(args.child, args.events)
    interpreted = runs_in_interpreter() or not torch.cuda.is_available()
    if interpreted and not runs_in_interpreter():
        if os.environ.get("TRITON_INTERPRET") == "1":  # set, yet the kernels were not interpreted: don't loop
            print("TRITON_INTERPRET=1 is set but coreattn's kernels were not built for the interpreter", file=sys.stderr)
            return 2
        if importlib.util.find_spec("numpy") is None:  # Triton's interpreter imports it
            print(f"No GPU here: the self-check would run the kernels under Triton's CPU interpreter, which needs "
                  f"numpy ({NUMPY_HINT})", file=sys.stderr)
            return 2
        if args.in_process:  # the kernels must be defined under the interpreter: this process is too late
            argv = sys.argv[1:] if argv is None else argv
            env = dict(os.environ, TRITON_INTERPRET="1")
            return subprocess.call([sys.executable, "-m", "coreattn.selfcheck", *argv], env=env)
    device = torch.device("cpu" if interpreted else "cuda")
    try:
        rows = select_rows(device, args.quick, args.case, args.dtype)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.in_process:
        results = run(quick=args.quick, rows=rows, recompile=not args.case)
    else:
        from coreattn.selfcheck.isolated import run_isolated

        results = run_isolated(rows, device, quick=args.quick, recompile=not args.case, timeout=args.timeout,
                               jobs=args.jobs, time_limit=args.time_limit)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0 if results["passed"] else 1
