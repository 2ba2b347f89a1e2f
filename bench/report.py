"""Speedups, the terminal table and the JSON result file."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

NOT_PERF = "NOT PERFORMANCE DATA (CPU run: it checks the suite, not the kernels)"
CPU_PERF = "the CPU attention section is performance data for the torch backend (python -m bench --what cpu)"
BIAS_PERF = ("the bias section is performance data for the torch backend, eager attention and FlexAttention on this "
             "CPU (python -m bench --what bias)")
SPARSE_PERF = ("the sparse section is performance data for the torch backend, Megatron's own DSA path, dense "
               "attention and transformers' eager DeepSeek-V4 and MiniMax-M3 attention on this CPU (python -m bench --what sparse)")
KERNELS_NOTE = ("the compile report is static compiler output for emulated CUDA and AMD CDNA targets "
                "(python -m bench --what kernels)")
MEMORY_LIMIT_GIB = 8  # the CPU section's 32k-token memory check


def add_speedups(rows: list[dict], primary: str = "coreattn") -> None:
    """Attention: speedup of ``primary`` over each provider (their ms / its ms), same config/mode/dtype.
    Masks: speedup of each provider over the per-sample loop."""
    ok = [r for r in rows if r.get("status") == "ok"]
    ref_attn = {(r["config"], r["mode"], r["dtype"]): r["ms"] for r in ok
                if r["kind"] == "attention" and r["provider"] == primary}
    ref_mask = {(r["config"], r["op"]): r["ms"] for r in ok if r["kind"] == "masks" and r["provider"] == "loop"}
    for r in ok:
        if r["kind"] == "attention":
            ref = ref_attn.get((r["config"], r["mode"], r["dtype"]))
            if ref and r["provider"] != primary:
                r[f"speedup_of_{primary}"] = r["ms"] / ref
        elif r["kind"] == "masks":
            ref = ref_mask.get((r["config"], r["op"]))
            if ref and r["provider"] != "loop":
                r["speedup_over_loop"] = ref / r["ms"]


def _fmt(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def _table(header: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*l) for l in lines])


def format_table(rows: list[dict], meta: dict, primary: str = "coreattn") -> str:
    parts = [f"device: {meta['device']} | torch {meta['torch']} | triton {meta['triton']} | commit {meta['git_commit']}"]
    if not meta["performance_data"]:
        parts.append(not_perf_note(rows))
    attn = [r for r in rows if r["kind"] == "attention" and r["status"] != "skipped"]
    if attn:
        lines = []
        for r in attn:
            if r["status"] != "ok":
                status = f"{r['status']}: {r['reason']}"
            else:  # padded-v names the kernel it wraps
                status = f"via {r['info']['inner']}" if "inner" in r.get("info", {}) else ""
            lines.append([r["config"], r["mode"], r["dtype"], r["provider"], _fmt(r.get("ms"), ".3f"),
                          _fmt(r.get("tflops"), ".4g"), _fmt(r.get(f"speedup_of_{primary}"), ".2f"), status])
        parts.append(_table(["config", "mode", "dtype", "provider", "ms", "TFLOP/s", f"{primary} x", "note"], lines))
    masks = [r for r in rows if r["kind"] == "masks" and r["status"] != "skipped"]
    if masks:
        lines = []
        for r in masks:
            status = "" if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
            lines.append([r["config"], r["op"], r["provider"], _fmt(r.get("ms"), ".3f"),
                          _fmt(r.get("speedup_over_loop"), ".2f"), _fmt(r.get("output_bytes"), ",d"), status])
        parts.append(_table(["masks", "op", "provider", "ms", "vs loop x", "out bytes", "note"], lines))
    cp = _cp_lines(rows)
    if cp:
        parts.append("context parallelism, per layer per rank (bytes COMPUTED from shapes, not measured; each rank "
                     "sends what it receives):\n" +
                     _table(["config", "cp", "comm", "dtype", "fwd sent MiB", "bwd sent MiB", "K/V saved MiB",
                             "K/V peak MiB", "own K/V MiB", "rank fwd+bwd ms", "TFLOP/s", "note"], cp))
    layer = [r for r in rows if r["kind"] == "layer" and r["status"] != "skipped"]
    if layer:
        lines = []
        for r in layer:
            note = r.get("timing", "") if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
            info = r.get("info", {})
            lines.append([r["config"], r["dtype"], r["provider"], _fmt(r.get("ms"), ".3f"),
                          _fmt(r.get("tokens_per_s"), ",.0f"), _fmt(r.get(f"speedup_of_{primary}"), ".2f"),
                          str(info.get("mask", "-")), note])
        parts.append("end-to-end layer (one transformers decoder layer, forward + backward, packed batch):\n" +
                     _table(["config", "dtype", "attn_implementation", "ms", "tokens/s", f"{primary} x",
                             "mask", "note"], lines))
    cpu = _cpu_lines(rows)
    if cpu:
        threads = sorted({r["threads"] for r in rows if r["kind"] == "cpu" and r.get("threads")})
        parts.append("CPU attention, performance data for the torch backend (fp32, causal; one subprocess per row, "
                     f"{'/'.join(map(str, threads)) or '?'} torch threads; peak RSS = the process's peak over the "
                     "timed calls, extra = peak minus RSS before them; x = coreattn / the fastest PyTorch path):\n" +
                     _table(["config", "mode", "provider", "ms", "peak RSS MiB", "extra MiB", "note"], cpu))
    sparse = _sparse_lines(rows)
    if sparse:
        threads = sorted({r["threads"] for r in rows if r["kind"] == "sparse" and r.get("threads")})
        parts.append("sparse (top-k) attention, one sequence, causal (regime: full = every token names its whole "
                     "causal range, sparse = not; time: every provider of a (config, mode) in one subprocess, calls "
                     f"interleaved, default allocator, {'/'.join(map(str, threads)) or '?'} torch threads; "
                     "x megatron / x dense / x eager = this time over Megatron's / dense attention's / transformers' eager "
                     "path's (DeepSeek-V4's attention on v4-csa rows, MiniMax-M3's block mask and attention on blocks "
                     "rows) from that process; extra = "
                     "the call's peak memory on top of its inputs, from its own subprocess under the memory "
                     "allocator settings; growth = this row / the same provider at T/2: x2 linear, x4 quadratic):\n" +
                     _table(["config", "regime", "mode", "provider", "ms", "x megatron", "x dense", "x eager", "GFLOP/s",
                             "extra MiB", "time growth", "memory growth", "note"], sparse))
    bias = _bias_lines(rows)
    if bias:
        parts.append("attention with a relative bias, one causal sequence (time: every provider of a (config, mode) in "
                     "one subprocess, calls interleaved; x eager / x flex / x nobias = this time over eager attention's "
                     "(the materialized bias) / FlexAttention's / coreattn's without the bias, from that process; "
                     "extra = the call's peak memory on top of its inputs, from its own subprocess):\n" +
                     _table(["config", "mode", "provider", "ms", "x eager", "x flex", "x nobias", "extra MiB", "note"],
                            bias))
    if any(r["kind"] == "kernels" for r in rows):
        from bench.kernels import format_tables

        parts.append("compile report, per architecture:\n" + format_tables([r for r in rows if r["kind"] == "kernels"]))
    faults = fault_lines(rows)
    if faults:
        parts.append("faults and timeouts (the units after each ran in a fresh process; bench/isolation.py):\n"
                     + "\n".join(faults))
    skipped = Counter((r["kind"], r["provider"], r["reason"]) for r in rows if r["status"] == "skipped")
    if skipped:
        parts.append("skipped:\n" + "\n".join(f"  {kind} {provider}: {reason} ({n} case{'s' if n > 1 else ''})"
                                                for (kind, provider, reason), n in skipped.items()))
    if not meta["performance_data"]:
        parts.append(not_perf_note(rows))
    return "\n\n".join(parts)


def fault_lines(rows: list[dict]) -> list[str]:
    """One entry per unit that faulted, died or hung: what happened and the kernel launch it was in."""
    lines, seen = [], set()
    for r in rows:
        fault = r.get("fault")
        if r["status"] not in ("fault", "timeout") or not fault or fault["unit"] in seen:
            continue
        seen.add(fault["unit"])
        lines.append(f"  {r['status'].upper()} {fault['unit']}: {fault['how']}\n    kernel launch: {fault['where']}")
    return lines


def not_perf_note(rows: list[dict]) -> str:
    """The label of a CPU run's figures: none are performance data but the CPU attention section."""
    if rows and all(r["kind"] == "kernels" for r in rows):
        return KERNELS_NOTE
    return NOT_PERF + ("; " + CPU_PERF if any(r["kind"] == "cpu" for r in rows) else "") + \
        ("; " + SPARSE_PERF if any(r["kind"] == "sparse" for r in rows) else "") + \
        ("; " + BIAS_PERF if any(r["kind"] == "bias" for r in rows) else "") + \
        ("; " + KERNELS_NOTE if any(r["kind"] == "kernels" for r in rows) else "")


def _cpu_lines(rows: list[dict]) -> list[list[str]]:
    lines = []
    for r in rows:
        if r["kind"] != "cpu" or r["status"] == "skipped":
            continue
        note = "" if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
        if "time_ratio" in r:
            note = f"vs {r['best_pytorch']}: time x{r['time_ratio']:.2f}, peak x{_fmt(r.get('mem_ratio'), '.2f')}"
        if r.get("memory_check") and r["status"] == "ok" and r["provider"] == "coreattn":
            under = r["peak_rss_mib"] < MEMORY_LIMIT_GIB * 1024
            note = (note + "; " if note else "") + f"{'under' if under else 'OVER'} {MEMORY_LIMIT_GIB} GiB"
        lines.append([r["config"], r["mode"], r["provider"], _fmt(r.get("ms"), ".1f"), _fmt(r.get("peak_rss_mib"), ".0f"),
                      _fmt(r.get("extra_mib"), ".0f"), note])
    return lines


def _bias_lines(rows: list[dict]) -> list[list[str]]:
    lines = []
    for r in rows:
        if r["kind"] != "bias" or r["status"] == "skipped":
            continue
        note = "" if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
        if r.get("memory_error"):
            note = (note + "; " if note else "") + f"memory: {r['memory_error']}"
        lines.append([r["config"], r["mode"], r["provider"], _fmt(r.get("ms"), ".1f"), _fmt(r.get("x_eager"), ".2f"),
                      _fmt(r.get("x_flex"), ".2f"), _fmt(r.get("x_nobias"), ".2f"), _fmt(r.get("extra_mib"), ".0f"),
                      note])
    return lines


def _sparse_lines(rows: list[dict]) -> list[list[str]]:
    lines = []
    for r in rows:
        if r["kind"] != "sparse" or r["status"] == "skipped":
            continue
        note = "" if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
        if r["status"] == "ok" and r["provider"] == "dense":
            kv = r["heads"] // 4 if r.get("pattern") == "blocks" else r["heads"]  # bench/sparse.py BLOCK_GROUP
            note = f"dense {r['head_dim_qk']}/{r['head_dim_v']}, {max(kv, 1)} kv heads"
        if r.get("memory_error"):
            note = (note + "; " if note else "") + f"memory: {r['memory_error']}"
        lines.append([r["config"], r.get("regime", "-"), r["mode"], r["provider"], _fmt(r.get("ms"), ".1f"),
                      _fmt(r.get("x_megatron"), ".2f"), _fmt(r.get("x_dense"), ".2f"), _fmt(r.get("x_eager"), ".2f"),
                      _fmt(r.get("gflops"), ".1f"),
                      _fmt(r.get("extra_mib"), ".0f"), _fmt(r.get("time_growth"), ".2f"),
                      _fmt(r.get("memory_growth"), ".2f"), note])
    return lines


def _mib(value) -> str:
    return _fmt(value / 2**20 if isinstance(value, (int, float)) else None, ".1f")


def _cp_lines(rows: list[dict]) -> list[list[str]]:
    """One line per (config, cp, comm, dtype): the computed volumes and, where timed, the rank's compute."""
    timed = {(r["config"], r["cp_size"], r["comm"], r["dtype"]): r for r in rows
             if r["kind"] == "cp" and r.get("op") == "rank_fwdbwd" and r["status"] == "ok"}
    lines = []
    for r in rows:
        if r["kind"] != "cp" or r.get("op") != "comm":
            continue
        head = [r["config"], str(r["cp_size"]), r["comm"], r["dtype"]]
        if r["status"] != "ok":
            lines.append(head + ["-"] * 7 + [f"{r['status']}: {r['reason']}"])
            continue
        t = timed.get((r["config"], r["cp_size"], r["comm"], r["dtype"]), {})
        note = ""
        if "bwd_fallback_bytes" in r:
            note = f"bwd {_mib(r['bwd_fallback_bytes'])} MiB via the all_reduce fallback"
        elif "fwd_outer_bytes" in r:
            note = (f"inner (a2a) fwd/bwd {_mib(r['fwd_inner_bytes'])}/{_mib(r['bwd_inner_bytes'])} MiB, outer (p2p) "
                    f"{_mib(r['fwd_outer_bytes'])}/{_mib(r['bwd_outer_bytes'])} MiB, "
                    f"{_mib(r['outer_hop_bytes'])} MiB a hop")
        elif "qo_saved_bytes" in r:
            note = f"also saves q/out of its heads: {_mib(r['qo_saved_bytes'])} MiB"
        lines.append(head + [_mib(r["fwd_bytes"]), _mib(r["bwd_bytes"]), _mib(r["kv_saved_bytes"]),
                             _mib(r["kv_peak_bytes"]), _mib(r["kv_local_bytes"]), _fmt(t.get("ms"), ".3f"),
                             _fmt(t.get("tflops"), ".4g"), note])
    return lines


def write_json(path: Path, meta: dict, args: dict, rows: list[dict]) -> None:
    doc = {
        "meta": meta,
        "note": None if meta["performance_data"] else not_perf_note(rows),
        "flop_model": ("visible (q, k) pairs counted exactly per sequence; per query head forward "
                       "2*pairs*(Dqk+Dv), backward 2*pairs*(3*Dqk+2*Dv); the same useful FLOPs for every "
                       "provider (padding and zero-padded V count as overhead, not work)"),
        "forward_timing": "training forward: inputs require grad, autograd records the graph",
        "args": args,
        "results": rows,
    }
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
