"""Compile report: ``python -m bench --what kernels [--arch sm90 sm80 ...]``.

For each CUDA architecture (all of ``coreattn.tune.compiler.ARCHS`` by default) the kernels of every
problem below are compiled through the real launchers with that arch's configs, without a GPU
(coreattn/tune/compiler.py), and tabulated: tile, warps/stages, registers, spill bytes, shared memory
against the arch's per-block limit, MMA kind x PTX instruction count, duplicated MMA work and an
occupancy estimate. Static compiler output: it shows whether a config fits an arch, not how fast
it runs.
"""

from __future__ import annotations

from coreattn.tune.compiler import ARCHS, Problem, compile_report

MAIN_DIMS = ((64, 64), (128, 128), (192, 128), (256, 256))
FEATURE_DIMS = MAIN_DIMS


def problems(quick: bool = False) -> list[Problem]:
    """bf16 MHA and fp16 GQA-4 at every main head dim, causal and not; one fp32 row; dropout,
    softmax offset (with the sink-gradient dQ) and max logit (causal bf16) at every main head dim.
    quick: the bf16 causal problems only."""
    if quick:
        return [Problem(qk, v, "bf16", True) for qk, v in MAIN_DIMS]
    cases = [Problem(qk, v, "bf16", causal) for qk, v in MAIN_DIMS for causal in (False, True)]
    cases += [Problem(qk, v, "fp16", causal, group=4) for qk, v in MAIN_DIMS for causal in (False, True)]
    cases.append(Problem(128, 128, "fp32", False))
    cases += [Problem(qk, v, "bf16", True, feature=f) for qk, v in FEATURE_DIMS for f in ("dropout", "sink", "max_logit")]
    return cases


def run_kernels(archs, quick: bool = False, bar=None) -> list[dict]:
    """One row per compiled kernel launch (kind "kernels")."""
    from coreattn.kernels import runs_in_interpreter

    if runs_in_interpreter():
        raise SystemExit("--what kernels compiles the kernels: unset TRITON_INTERPRET")
    rows = []
    for arch in archs:
        arch_rows = compile_report([arch], problems(quick))
        rows += [dict(r, kind="kernels", status="ok", provider="triton") for r in arch_rows]
        if bar is not None:
            bar.update(len(problems(quick)))
    return rows


def _mma(row: dict) -> str:
    text = " ".join(f"{kind} x{n}" for kind, n in row["mma"].items()) or "-"
    return text + (f" DUP {row['mma_dup']}x" if row["mma_dup"] > 1 else "")


def _kernel(row: dict) -> str:
    if row["kernel"] == "dkdv" and not (row["dk"] and row["dv"]):
        return "dkdv[dK]" if row["dk"] else "dkdv[dV]"  # the two passes of a split dK/dV
    return row["kernel"]


def format_tables(rows: list[dict]) -> str:
    """One table per arch; a compiled kernel identical to one already listed for that arch (the
    preprocess kernel, a feature's unchanged backward) is not repeated."""
    parts = []
    for arch in dict.fromkeys(r["arch"] for r in rows):
        limits, seen, lines = ARCHS[arch], set(), []
        for r in (r for r in rows if r["arch"] == arch):
            if r["hash"] in seen:
                continue
            seen.add(r["hash"])
            smem = f"{r['smem'] / 1024:g}K" + ("" if r["smem_fits"] else " OVER")
            tile = f"{r['block_m']}x{r['block_n']}" if r["block_n"] else f"{r['block_m']} rows" if r["block_m"] else "-"
            occ = f"{r.get('ctas_per_sm', '-')} ({r.get('occupancy_limit', '-')})"
            lines.append([_kernel(r), r["problem"], tile, f"{r['num_warps']}/{r['num_stages']}", str(r["regs"]),
                          f"{r['spill_stores']}/{r['spill_loads']}", smem, _mma(r), occ])
        header = ["kernel", "problem", "tile", "warps/stages", "regs", "spill st/ld B", "smem", "MMA (PTX)",
                  "CTAs/SM (limit)"]
        widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        title = (f"{arch} (compiled for capability {limits.capability / 10:.1f}; smem per block "
                 f"{limits.smem_per_block // 1024} KB, per SM {limits.smem_per_sm // 1024} KB):")
        parts.append("\n".join([title, fmt.format(*header), fmt.format(*("-" * w for w in widths))] +
                               [fmt.format(*line) for line in lines]))
    parts.append("STATIC COMPILER OUTPUT for emulated targets (no GPU ran): registers and spills from ptxas -v, "
                 "shared memory from Triton, MMA instructions counted in the PTX, DUP = an MMA layout wider than "
                 "its tile (the same MMA in several warps), CTAs/SM from registers, shared memory (+1 KB per "
                 "block), warps and the block cap. Not speed.")
    return "\n\n".join(parts)
