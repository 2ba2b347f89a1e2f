"""Compile report: ``python -m bench --what kernels [--arch sm90 gfx942 ...]``.

For each architecture, CUDA (``coreattn.tune.compiler.ARCHS``) and AMD CDNA (``CDNA_ARCHS``; all of
them by default), the kernels of every problem below are compiled through the real launchers with
that arch's configs, without a GPU (coreattn/tune/compiler.py), and tabulated: tile, warps/stages,
registers, spill bytes, shared memory (LDS on CDNA) against the arch's per-block limit, MMA kind x
instruction count (PTX; AMDGCN for CDNA), duplicated MMA work, an occupancy estimate (CTAs per
SM; waves per SIMD on CDNA), pipelined-load hazards (divisions by a value that may be zero on
the address of an asynchronous load: coreattn/tune/hazards.py; listed under the tables) and i32
stride offsets (i32 multiplies of a runtime stride on a pointer offset, which wrap past 2**31:
coreattn/tune/offsets.py). ``--int64-lanes`` compiles every attention kernel in its
``INT64_LANES`` variant (what a launch whose strides need 64-bit lane offsets takes:
kernels/attn_common.py), so the two reports side by side give that variant's cost. Every row
and each arch's table name the Triton release that compiled it: the figures differ by release (it
runs under any installed Triton; CI tests 3.6.0 to 3.9.0, coreattn/kernels/versions.py). Static
compiler output: it shows whether a config fits an arch, not how fast it runs.
"""

from __future__ import annotations

from coreattn.tune.compiler import ARCHS, CDNA_ARCHS, Problem, SparseProblem, compile_report

ALL_ARCHS = (*ARCHS, *CDNA_ARCHS)

MAIN_DIMS = ((64, 64), (128, 128), (192, 128), (256, 256))
FEATURE_DIMS = MAIN_DIMS
# the sparse (top-k) kernels: absorbed MLA (DeepSeek-V3.2, GLM-5) at 576/512 with 16 to 128 q heads on one
# latent key head (BLOCK_H 16, 32, 64: configs/sparse.py), GQA 4 with separate V at 192/128, 128 and 64
SPARSE_HEADS = (16, 32, 64, 128)
SPARSE_V4_HEADS = (16, 64)  # DeepSeek-V4's one 512-wide head, K = V (absorbed at v_head_dim 512)
SPARSE_GQA_DIMS = ((192, 128), (128, 128), (64, 64))
# the block mode (block-sparse rows): MiniMax-M3's 64 q heads of 128 on 4 kv heads (group 16) in blocks of 128 keys,
# a GQA-4 group at 128 and 192/128, absorbed MLA's 576/512 on one latent key head; fp16 and fp32 at MiniMax's dims
BLOCK_SIZE = 128


def block_problems() -> list[SparseProblem]:
    """The block mode's problems (``SparseProblem.block_size``): see BLOCK_SIZE's comment."""
    return [SparseProblem(128, 128, 64, 4, block_size=BLOCK_SIZE), SparseProblem(128, 128, 16, 4, block_size=BLOCK_SIZE),
            SparseProblem(192, 128, 16, 4, block_size=BLOCK_SIZE),
            SparseProblem(576, 512, 16, 1, True, block_size=BLOCK_SIZE),
            SparseProblem(128, 128, 64, 4, dtype="fp16", block_size=BLOCK_SIZE),
            SparseProblem(128, 128, 64, 4, dtype="fp32", block_size=BLOCK_SIZE)]


def sparse_problems(quick: bool = False) -> list[SparseProblem]:
    """bf16 absorbed 576/512 at each head count, DeepSeek-V4's 512/512 (K = V) at 16 and 64, and GQA 4 at each dim; fp16 absorbed at 128 heads and
    GQA at 128; one fp32 row; the block mode's problems (``block_problems``). quick: absorbed 576/512 at 128 heads
    and GQA 4 at 128, bf16."""
    if quick:
        return [SparseProblem(576, 512, 128, 1, True), SparseProblem(128, 128, 16, 4)]
    cases = [SparseProblem(576, 512, heads, 1, True) for heads in SPARSE_HEADS]
    cases += [SparseProblem(qk, v, 16, 4) for qk, v in SPARSE_GQA_DIMS]
    cases += [SparseProblem(512, 512, heads, 1, True) for heads in SPARSE_V4_HEADS]  # DeepSeek-V4: K = V
    cases += [SparseProblem(576, 512, 128, 1, True, "fp16"), SparseProblem(128, 128, 16, 4, dtype="fp16"),
              SparseProblem(128, 128, 16, 4, dtype="fp32")]
    return cases + block_problems()


def problems(quick: bool = False) -> list:
    """bf16 MHA and fp16 GQA-4 at every main head dim, causal and not; one fp32 row; dropout,
    softmax offset (with the sink-gradient dQ), max logit, a padded batch with keep masks, the two
    additive biases (Inkling 2's low-rank, T5's bucketed: with the table-gradient kernel) and per-token
    sinks (causal bf16) at every main head dim;
    then the sparse kernels' problems (``sparse_problems``). quick: the bf16 causal problems only
    and the quick sparse ones."""
    if quick:
        return [Problem(qk, v, "bf16", True) for qk, v in MAIN_DIMS] + sparse_problems(quick=True)
    cases = [Problem(qk, v, "bf16", causal) for qk, v in MAIN_DIMS for causal in (False, True)]
    cases += [Problem(qk, v, "fp16", causal, group=4) for qk, v in MAIN_DIMS for causal in (False, True)]
    cases.append(Problem(128, 128, "fp32", False))
    cases += [Problem(qk, v, "bf16", True, feature=f) for qk, v in FEATURE_DIMS
              for f in ("dropout", "sink", "max_logit", "keep", "bias_rel", "bias_t5", "token_sink")]
    return cases + sparse_problems()


# The DSA indexer's kernels: the fused scores + top-k as (indexer heads, head dim, top-k, dtype,
# ReLU) — DeepSeek-V3.2's 64 x 128 with top-k 2048 and ReLU first, a GLM-5-like 32 x 128 without —
# and the Hadamard rotation as (dim, dtype). Lengths do not change the compiled kernels.
INDEXER_TOPK = ((64, 128, 2048, "bf16", True), (32, 128, 2048, "bf16", False), (64, 128, 512, "fp16", True),
                (16, 64, 64, "fp32", True))
HADAMARD = ((128, "bf16"), (256, "bf16"), (64, "fp16"), (128, "fp32"))
# the block-max scores of MiniMax-M3's indexer as (index heads, head dim, block, dtype): its 4 x 128 in blocks of 128
INDEXER_BLOCKS = ((4, 128, 128, "bf16"), (4, 128, 128, "fp16"), (4, 128, 128, "fp32"), (16, 64, 64, "bf16"))


def indexer_rows(arch: str, quick: bool = False, blocks: int | None = None) -> list[dict]:
    """Compile-report rows of the indexer kernels on ``arch`` (quick: the first problem of each; ``blocks``:
    the first that many block-score problems)."""
    import torch

    from coreattn.kernels.hadamard import hadamard_fwd
    from coreattn.kernels.indexer_blocks import indexer_block_scores
    from coreattn.kernels.indexer_topk import indexer_topk_fwd
    from coreattn.tune.compiler import DTYPES, describe, emulate

    tokens, rows = 4096, []
    with emulate(arch) as launches:
        for heads, dim, topk, dtype, relu in INDEXER_TOPK[:1] if quick else INDEXER_TOPK:
            q = torch.empty(tokens, heads, dim, dtype=DTYPES[dtype])  # [T, H, D]
            k = torch.empty(tokens, dim, dtype=DTYPES[dtype])  # [T, D]
            bounds = torch.zeros(tokens, dtype=torch.int32)
            start = len(launches)
            indexer_topk_fwd(q, k, torch.empty(tokens, heads, dtype=DTYPES[dtype]), bounds, bounds, topk, "thd",
                             relu=relu)
            rows += [dict(describe(launch, arch), kernel="indexer_topk", block_m=1,
                          problem=f"indexer-h{heads}xd{dim}-topk{topk}-{dtype}" + ("-relu" if relu else ""))
                     for launch in launches[start:]]
        for heads, dim, block, dtype in INDEXER_BLOCKS[:1 if quick else blocks]:
            q = torch.empty(1, tokens, heads, dim, dtype=DTYPES[dtype])  # [B, S, H, D]
            k = torch.empty(1, tokens, dim, dtype=DTYPES[dtype])  # [B, Sk, D]
            bounds = torch.zeros(tokens, dtype=torch.int32)
            start = len(launches)
            indexer_block_scores(q, k, bounds, bounds, "bshd", 0, 64, block_size=block, n_blocks=tokens // block)
            rows += [dict(describe(launch, arch), kernel="indexer_block_scores", block_m=1,
                          problem=f"indexer-h{heads}xd{dim}-block{block}-{dtype}") for launch in launches[start:]]
        for dim, dtype in HADAMARD[:1] if quick else HADAMARD:
            start = len(launches)
            hadamard_fwd(torch.empty(tokens, dim, dtype=DTYPES[dtype]), dim ** -0.5)
            rows += [dict(describe(launch, arch), kernel="hadamard", block_m=launch["constants"]["BLOCK_R"],
                          block_n=None, problem=f"hadamard-d{dim}-{dtype}") for launch in launches[start:]]
    return rows


def run_kernels(archs, quick: bool = False, bar=None, int64_lanes: bool = False) -> list[dict]:
    """One row per compiled kernel launch (kind "kernels"): the attention problems', then the indexer's;
    ``int64_lanes``: every dense attention kernel in its INT64_LANES variant (else the launchers' choice
    for these ordinary strides: int32 lanes)."""
    from coreattn.kernels import runs_in_interpreter

    if runs_in_interpreter():
        raise SystemExit("--what kernels compiles the kernels: unset TRITON_INTERPRET")
    rows = []
    for arch in archs:
        arch_rows = compile_report([arch], problems(quick), True if int64_lanes else None) + indexer_rows(arch, quick)
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
    if row.get("atomic"):
        return row["kernel"] + "[atomic]"  # the sparse backward's atomic dK/dV variant
    if row.get("range"):
        return row["kernel"] + "[range]"  # the sparse kernels' range mode: full rows over contiguous keys
    if row.get("blocks"):
        return row["kernel"] + "[block]"  # the sparse kernels' block mode: named blocks of contiguous keys
    return row["kernel"]


def _tile(row: dict) -> str:
    """block_m x block_n (the sparse kernels: q heads x top-k slots), rows (the preprocess kernels) or
    columns (the sparse reduce)."""
    if row["kernel"] == "sparse_reduce":
        return f"{row['block_n']} cols"
    if row["block_n"]:
        return f"{row['block_m']}x{row['block_n']}"
    return f"{row['block_m']} rows" if row["block_m"] else "-"


def _unique(rows: list[dict], arch: str):
    """The arch's rows, each compiled kernel once."""
    seen = set()
    for r in rows:
        if r["arch"] == arch and r["hash"] not in seen:
            seen.add(r["hash"])
            yield r


def _cdna_table(rows: list[dict], arch: str) -> str:
    limits, lines = CDNA_ARCHS[arch], []
    for r in _unique(rows, arch):
        lds = f"{r['smem'] / 1024:g}K" + ("" if r["smem_fits"] else " OVER")
        tile = _tile(r)
        mma = " ".join(f"{kind.removeprefix('v_mfma_')} x{n}" for kind, n in r["mma"].items()) or "-"
        mma += f" DUP {r['mma_dup']}x" if r["mma_dup"] > 1 else ""
        mma += f" FMA dots {r['fma_dots']}" if r["fma_dots"] else ""
        lines.append([_kernel(r), r["problem"], tile, f"{r['num_warps']}/{r['num_stages']}",
                      str(r["matrix_instr_nonkdim"] or "-"),
                      f"{r['vgprs']}/{r['agprs']}/{r['sgprs']}", f"{r['vgpr_spills']}/{r['sgpr_spills']}",
                      f"{r['spill_stores']}/{r['spill_loads']}", lds, mma,
                      f"{r['waves_per_simd']} ({r['occupancy_limit']})", _hazards(r), _offsets(r)])
    header = ["kernel", "problem", "tile", "warps/stages", "nonkdim", "VGPR/AGPR/SGPR", "spilled v/s",
              "spill st/ld B", "LDS", "MFMA (AMDGCN)", "waves/SIMD (limit)", "hazards", "i32 offs"]
    title = (f"{arch} (compiled for AMD {arch}, wave64, by Triton {_triton(rows, arch)}; "
             f"LDS per workgroup {limits.lds_per_workgroup // 1024} KB, "
             f"per CU {limits.lds_per_cu // 1024} KB; {limits.vgprs_per_simd} VGPRs per SIMD lane):")
    return title + "\n" + _table(header, lines)


def _hazards(row: dict) -> str:
    """Division sites on pipelined-load addresses over the kernel's asynchronous loads ("0/24"); "-"
    for rows recorded before the column existed."""
    if "pipeline_hazards" not in row:
        return "-"
    return f"{row['pipeline_hazards']}/{row['async_loads']}" + (" HAZARD" if row["pipeline_hazards"] else "")


def _offsets(row: dict) -> str:
    """The kernel's i32 stride products on pointer offsets, with ``(i64)`` when it is the INT64_LANES
    variant ("0 (i64)"); "-" for rows recorded before the column existed."""
    if "i32_offsets" not in row:
        return "-"
    return f"{row['i32_offsets']}" + (" (i64)" if row.get("int64_lanes") else "")


def _hazard_list(rows: list[dict]) -> str:
    """One line per hazard of each distinct compiled kernel ("" when there is none)."""
    lines, seen = [], set()
    for r in rows:
        if r["hash"] in seen or not r.get("pipeline_hazards"):
            continue
        seen.add(r["hash"])
        lines += [f"{r['arch']} {_kernel(r)} {r['problem']} ({r['num_warps']}/{r['num_stages']}): {h}"
                  for h in r["hazards"]]
    return "PIPELINED-LOAD HAZARDS (each can fault on a GPU; see coreattn/tune/hazards.py):\n" + "\n".join(lines) \
        if lines else ""


def _triton(rows: list[dict], arch: str) -> str:
    """The Triton release(s) that compiled an arch's rows (rows written before they recorded it: "?")."""
    return ", ".join(dict.fromkeys(str(r.get("triton", "?")) for r in rows if r["arch"] == arch))


def _table(header: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    rule = fmt.format(*("-" * w for w in widths))
    return "\n".join([fmt.format(*header), rule] + [fmt.format(*line) for line in lines])


def format_tables(rows: list[dict]) -> str:
    """One table per arch; a compiled kernel identical to one already listed for that arch (the
    preprocess kernel, a feature's unchanged backward) is not repeated."""
    parts = []
    archs = list(dict.fromkeys(r["arch"] for r in rows))
    for arch in archs:
        if arch in CDNA_ARCHS:
            parts.append(_cdna_table(rows, arch))
            continue
        limits, lines = ARCHS[arch], []
        for r in _unique(rows, arch):
            smem = f"{r['smem'] / 1024:g}K" + ("" if r["smem_fits"] else " OVER")
            tile = _tile(r)
            occ = f"{r.get('ctas_per_sm', '-')} ({r.get('occupancy_limit', '-')})"
            lines.append([_kernel(r), r["problem"], tile, f"{r['num_warps']}/{r['num_stages']}", str(r["regs"]),
                          f"{r['spill_stores']}/{r['spill_loads']}", smem, _mma(r), occ, _hazards(r), _offsets(r)])
        header = ["kernel", "problem", "tile", "warps/stages", "regs", "spill st/ld B", "smem", "MMA (PTX)",
                  "CTAs/SM (limit)", "hazards", "i32 offs"]
        title = (f"{arch} (compiled for capability {limits.capability / 10:.1f} by Triton {_triton(rows, arch)}; "
                 f"smem per block {limits.smem_per_block // 1024} KB, per SM {limits.smem_per_sm // 1024} KB):")
        parts.append(title + "\n" + _table(header, lines))
    if any(arch in ARCHS for arch in archs):
        parts.append("STATIC COMPILER OUTPUT for emulated targets (no GPU ran): registers and spills from ptxas -v, "
                     "shared memory from Triton, MMA instructions counted in the PTX, DUP = an MMA layout wider than "
                     "its tile (the same MMA in several warps; the sparse kernels' 512-column tiles duplicate their "
                     "score dots: configs/sparse.py), tile = rows x columns of the key loop (sparse_*: q heads x "
                     "top-k slots), CTAs/SM from registers, shared memory (+1 KB per "
                     "block), warps and the block cap, hazards = divisions by a value that may be zero on the "
                     "addresses of the kernel's asynchronous (pipelined: cp.async) loads / those loads, from the "
                     "TTGIR (TMA loads are bounds-checked by the hardware and not counted), i32 offs = source "
                     "lines whose i32 multiply of a runtime stride feeds a pointer offset (TTGIR; they wrap once "
                     "a product reaches 2**31: the launchers take the INT64_LANES variant, marked (i64), when a "
                     "stride needs it). Not speed.")
    if any(arch in CDNA_ARCHS for arch in archs):
        parts.append(CDNA_LEGEND)
    hazard_list = _hazard_list(rows)
    if hazard_list:
        parts.append(hazard_list)
    return "\n\n".join(parts)


CDNA_LEGEND = ("STATIC COMPILER OUTPUT for AMD CDNA targets (no AMD GPU ran; Triton's HIP backend without ROCm): "
               "nonkdim = the matrix_instr_nonkdim launch option (the MFMA's M = N; - = Triton's choice), "
               "VGPR/AGPR/SGPR from the AMDGCN's kernel info, spilled v/s = VGPRs and SGPRs spilled (SGPRs go to "
               "VGPR lanes, no memory), spill st/ld B = bytes per lane of the spill stores and reloads to scratch "
               "in the code, LDS from Triton (allocated at launch), MFMA instructions counted in the AMDGCN, "
               "DUP = an MFMA layout wider than its tile, FMA dots = dots without an MFMA layout, waves/SIMD "
               "from registers (the 512-entry unified file), LDS and the 8-wave cap, a workgroup's waves spread "
               "over 4 SIMDs, hazards = divisions by a value that may be zero on the addresses of asynchronous "
               "(direct-to-LDS) loads / those loads (none at num_stages 1), i32 offs as on CUDA. Not speed.")
