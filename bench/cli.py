"""Command line: ``python -m bench [--quick] [--out DIR] [--dtype bf16] [--what attention masks] ...``.

``python -m bench --what cpu`` runs the CPU attention section alone (bench/cpu_attention.py):
performance data for the torch backend, written to bench/results/<cpu>_<date>/ by default.
``python -m bench --what sparse`` runs the sparse (top-k, DeepSeek Sparse Attention) section alone
(bench/sparse.py): time and peak memory over T at fixed top-k, coreattn against Megatron-Core's own
DSA path and dense attention (Megatron's rows need megatron-core >= 0.19 in the interpreter).
``python -m bench --what bias`` runs the attention-bias section (bench/bias.py): Inkling 2's and T5's
relative biases, coreattn against eager attention with the materialized bias and FlexAttention.
``python -m bench --what kernels [--arch sm90 gfx942 ...] [--int64-lanes]`` is the compile report
(bench/kernels.py): static compiler output per CUDA or AMD CDNA architecture, no GPU needed, written to
bench/results/compile-report_<date>/ (compile-report-cdna_<date>/ when every arch is a CDNA one)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
from pathlib import Path

import torch

from bench import bias as bias_bench
from bench import configs, cpu_attention, masks
from bench import sparse as sparse_bench
from bench import kernels as kernels_report
from bench import layer as layer_bench
from bench import context_parallel as cp_bench
from coreattn.selfcheck import positive
from coreattn.tune.compiler import CDNA_ARCHS
from bench.env import REPO_ROOT, device_slug, run_metadata
from bench.isolation import DEFAULT_TIMEOUT, plan, run_in_process, run_isolated
from bench.flops import MODES
from bench.providers import PRIMARY, PROVIDERS
from bench.report import NOT_PERF, add_speedups, format_table, write_json

WHAT = ("attention", "masks", "cp", "layer", "cpu", "sparse", "bias", "kernels")
# cpu, sparse and bias (minutes of CPU time) and kernels (the compile report, minutes of compiling) run when asked for
DEFAULT_WHAT = ("attention", "masks", "cp", "layer")


# argparse type: seconds and budgets, a number > 0
positive_number = positive(float)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description="coreattn benchmarks: attention against the kernels users would use instead, "
                                "mask builders against per-sample loops, context-parallel communication "
                                "volumes (computed) and per-rank compute, and one transformers decoder layer "
                                "with coreattn, SDPA and flash attention; with --what cpu, the CPU backend "
                                "against PyTorch's CPU attention (time and peak memory).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a minimal set that runs in seconds")
    p.add_argument("--out", type=Path, help="output directory (default: bench/results/<device>_<date> on GPU and "
                                           "for --what cpu alone, bench/local/<device>_<date> otherwise)")
    p.add_argument("--dtype", nargs="+", choices=list(configs.DTYPES), default=["bf16"])
    p.add_argument("--what", nargs="+", choices=WHAT, default=list(DEFAULT_WHAT))
    p.add_argument("--providers", nargs="+", choices=list(PROVIDERS), default=list(PROVIDERS),
                   help="attention providers")
    p.add_argument("--mask-providers", nargs="+", choices=list(masks.PROVIDERS), default=list(masks.PROVIDERS))
    p.add_argument("--cpu-providers", nargs="+", choices=list(cpu_attention.PROVIDERS),
                   default=list(cpu_attention.PROVIDERS), help="providers of the CPU attention section")
    p.add_argument("--sparse-providers", nargs="+", choices=list(sparse_bench.PROVIDERS),
                   default=list(sparse_bench.PROVIDERS), help="providers of the sparse attention section")
    p.add_argument("--bias-providers", nargs="+", choices=list(bias_bench.PROVIDERS),
                   default=list(bias_bench.PROVIDERS), help="providers of the attention-bias section")
    p.add_argument("--cpu-threads", type=int, help="torch threads in the CPU and sparse sections' workers (default: "
                   "torch's choice, one per core); 1 gives steadier ratios on a loaded machine")
    p.add_argument("--arch", nargs="+", choices=list(kernels_report.ALL_ARCHS), default=list(kernels_report.ALL_ARCHS),
                   help="CUDA and AMD CDNA architectures of the compile report (--what kernels)")
    p.add_argument("--int64-lanes", action="store_true",
                   help="compile report: every attention kernel in its INT64_LANES variant (64-bit lane offsets, "
                        "what launches with strides past the int32 bound take), to compare with the default report")
    p.add_argument("--configs", nargs="+", metavar="SUBSTR",
                   help="keep configs whose id contains every SUBSTR (e.g. hdim192x128 causal 16k; b64)")
    p.add_argument("--modes", nargs="+", choices=MODES, help="attention modes (default: all; fwd fwdbwd with --quick)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--isolation", choices=("auto", "process", "none"), default="auto",
                   help="process: the attention, cp, layer and mask sections run in a worker process, and a unit "
                        "that faults (a CUDA fault poisons its process), dies or hangs is recorded and the run goes "
                        "on in a fresh one (bench/isolation.py); none: all in this process; auto: process on a GPU")
    p.add_argument("--timeout", type=positive_number, metavar="SECONDS",
                   help=f"with isolation, a unit running longer is killed and recorded (default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--time-limit", type=positive_number, metavar="SECONDS",
                   help="start no attention/cp/layer/mask unit after this many seconds (the rest are skipped)")
    p.add_argument("--list", action="store_true", help="print the selected configs and providers, then exit")
    return p.parse_args(argv)


def _device(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    return torch.device(choice)


def _default_out(device: torch.device, performance_data: bool, name: str | None = None) -> Path:
    parent = REPO_ROOT / "bench" / ("results" if performance_data or name else "local")
    base = parent / f"{name or device_slug(device)}_{datetime.date.today().isoformat()}"
    out, n = base, 2
    while out.exists():
        out, n = base.with_name(f"{base.name}_{n}"), n + 1
    return out


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return contextlib.nullcontext()
    return tqdm(total=total, desc="bench", unit="case", file=sys.stderr, dynamic_ncols=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = _device(args.device)
    on_gpu = device.type == "cuda"
    attn_cfgs = [c for c in configs.attention_configs(on_gpu, args.quick) if configs.matches(c.id, args.configs)]
    mask_cfgs = [c for c in configs.mask_configs(on_gpu, args.quick) if configs.matches(c.id, args.configs)]
    cp_cfgs = [c for c in cp_bench.cp_configs() if configs.matches(c.id, args.configs)]
    layer_cfgs = [c for c in layer_bench.layer_configs(on_gpu, args.quick) if configs.matches(c.id, args.configs)]
    cpu_cases = [c for c in cpu_attention.cpu_cases(args.quick) if configs.matches(c.id, args.configs)]
    sparse_cases = [c for c in sparse_bench.sparse_cases(args.quick, on_gpu) if configs.matches(c.id, args.configs)]
    bias_cases = [c for c in bias_bench.bias_cases(args.quick, on_gpu) if configs.matches(c.id, args.configs)]
    modes = tuple(args.modes or configs.attention_modes(args.quick))
    run_attn, run_masks, run_cp = "attention" in args.what, "masks" in args.what, "cp" in args.what
    run_layer, run_cpu, run_kernels = "layer" in args.what, "cpu" in args.what, "kernels" in args.what
    run_sparse, run_bias = "sparse" in args.what, "bias" in args.what
    sparse_device = device if on_gpu else torch.device("cpu")
    cpu_modes = tuple(m for m in (args.modes or cpu_attention.MODES) if m in cpu_attention.MODES)
    cpu_only = set(args.what) <= {"cpu", "sparse", "bias"} and not ((run_sparse or run_bias) and on_gpu)
    if cpu_only:
        device = torch.device("cpu")  # the sections measure the CPU whatever else is there

    if args.list:
        print(f"device: {device}" + ("" if on_gpu or cpu_only else f"  ({NOT_PERF})"))
        if run_attn:
            print(f"attention modes: {' '.join(modes)}; dtypes: {' '.join(args.dtype)}")
            for name in args.providers:
                reason = PROVIDERS[name].unavailable(device)
                print(f"  provider {name:15s} {'unavailable: ' + reason if reason else PROVIDERS[name].description}")
            for c in attn_cfgs:
                print(f"  {c.id}")
        if run_masks:
            _, missing = masks.import_masks()
            print(f"mask providers: {' '.join(args.mask_providers)}" + (f"  (skipped: {missing})" if missing else ""))
            for c in mask_cfgs:
                print(f"  {c.id} hidden={c.hidden}")
        if run_cp:
            print(f"context parallelism (cp {' '.join(map(str, cp_bench.CP_SIZES))}): communication "
                  f"{cp_bench.COMPUTED}; per-rank compute timed on CUDA only")
            for c in cp_cfgs:
                print(f"  {c.id}")
        if run_layer:
            print("end-to-end layer (transformers decoder layer, forward + backward; timed on CUDA only):")
            for impl in layer_bench.IMPLS:
                reason = layer_bench.unavailable(impl, device, getattr(torch, configs.DTYPES[args.dtype[0]]))
                print(f"  attn_implementation {impl:17s} {'unavailable: ' + reason if reason else 'ok'}")
            for c in layer_cfgs:
                print(f"  {c.id}")
        if run_cpu:
            print(f"CPU attention (performance data): modes {' '.join(cpu_modes)}; "
                  f"providers {' '.join(args.cpu_providers)}")
            for c in cpu_cases:
                print(f"  {c.id} ({len(c.seqlens)} sequences, {sum(c.seqlens)} tokens)")
        if run_sparse:
            print(f"sparse attention on {sparse_device.type}: providers {' '.join(args.sparse_providers)}")
            for c in sparse_cases:
                reasons = {p: sparse_bench.skip_reason(c, p, "fwdbwd", sparse_device) for p in args.sparse_providers}
                skipped = "; ".join(f"{p} skipped: {r}" for p, r in reasons.items() if r)
                print(f"  {c.id}" + (f"  ({skipped})" if skipped else ""))
        if run_bias:
            print(f"attention with a relative bias on {sparse_device.type}: providers {' '.join(args.bias_providers)}")
            for c in bias_cases:
                reasons = {p: bias_bench.skip_reason(c, p, m, sparse_device) for p in args.bias_providers
                           for m in bias_bench.MODES}
                skipped = "; ".join(sorted({f"{p} skipped: {r}" for p, r in reasons.items() if r}))
                print(f"  {c.id}" + (f"  ({skipped})" if skipped else ""))
        if run_kernels:
            print(f"compile report (static compiler output, no GPU): archs {' '.join(args.arch)}")
            for problem in kernels_report.problems(args.quick):
                print(f"  {problem.id}")
        return 0

    meta = run_metadata(device)
    meta["performance_data"] = meta["performance_data"] or cpu_only
    # the compile report alone is static compiler output for named archs, kept with the results
    report_name = None
    if set(args.what) == {"kernels"}:
        report_name = "compile-report-cdna" if set(args.arch) <= set(CDNA_ARCHS) else "compile-report"
    elif set(args.what) == {"sparse"}:
        report_name = f"sparse-{device_slug(sparse_device)}"
    elif set(args.what) == {"bias"}:
        report_name = f"bias-{device_slug(sparse_device)}"
    out = args.out or _default_out(device, meta["performance_data"], report_name)
    out.mkdir(parents=True, exist_ok=True)
    total = (len(attn_cfgs) * len(modes) * len(args.providers) * len(args.dtype) if run_attn else 0) + \
            (len(mask_cfgs) * len(masks.OPS) * len(args.mask_providers) if run_masks else 0) + \
            (len(cp_cfgs) * len(cp_bench.CP_SIZES) * len(args.dtype) if run_cp else 0) + \
            (len(layer_cfgs) * len(layer_bench.IMPLS) * len(args.dtype) if run_layer else 0) + \
            (cpu_attention.count(cpu_cases, args.cpu_providers, cpu_modes) if run_cpu else 0) + \
            (sparse_bench.count(sparse_cases, args.sparse_providers, sparse_device) if run_sparse else 0) + \
            (bias_bench.count(bias_cases, args.bias_providers, sparse_device) if run_bias else 0) + \
            (len(kernels_report.problems(args.quick)) * len(args.arch) if run_kernels else 0)
    isolate = args.isolation == "process" or (args.isolation == "auto" and on_gpu)
    meta["isolation"] = "worker process, a fresh one after a fault" if isolate else "none (this process)"
    units = plan(args.dtype, {"attention": run_attn, "cp": run_cp, "layer": run_layer, "masks": run_masks},
                 attn_cfgs, modes, args.providers, cp_cfgs, layer_cfgs, mask_cfgs, args.mask_providers)
    rows: list[dict] = []
    with _progress(total) as bar:
        if isolate:
            rows += run_isolated(units, device, args.quick, bar, args.time_limit, args.timeout)
        else:
            rows += run_in_process(units, device, args.quick, bar, args.time_limit)
        if run_cpu:
            rows += cpu_attention.run_cpu(cpu_cases, args.cpu_providers, args.quick, bar, cpu_modes, args.cpu_threads)
        if run_sparse:
            sparse_modes = tuple(m for m in (args.modes or sparse_bench.MODES) if m in sparse_bench.MODES)
            rows += sparse_bench.run_sparse(sparse_cases, args.sparse_providers, args.quick, sparse_device, bar,
                                            sparse_modes, args.cpu_threads)
        if run_bias:
            bias_modes = tuple(m for m in (args.modes or bias_bench.MODES) if m in bias_bench.MODES)
            rows += bias_bench.run_bias(bias_cases, args.bias_providers, args.quick, sparse_device, bar, bias_modes,
                                        args.cpu_threads)
        if run_kernels:
            rows += kernels_report.run_kernels(args.arch, args.quick, bar, int64_lanes=args.int64_lanes)
    add_speedups(rows, PRIMARY)
    print(format_table(rows, meta, PRIMARY))
    args_record = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    write_json(out / "results.json", meta, args_record, rows)
    written = [out / "results.json"]
    if not args.no_plots:
        try:
            from bench.plots import write_plots
        except ImportError as exc:
            print(f"plots skipped: {exc}")
        else:
            written += write_plots(out, rows, meta, PRIMARY)
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0
