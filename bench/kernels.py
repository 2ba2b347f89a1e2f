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


# The sparse sweep (bench/compile_sweep.py, ``python -m bench.compile_sweep``): every configuration class of the
# supported set, compiled under each Triton CI tests. What selects a sparse kernel's config and its register
# pressure: the padded widths, whether V is the gathered key block (absorbed, V_IS_K) or a second tile, the dtype
# and the q heads per tile (the group rounded up to a power of two, at least 16, capped by the table's rows;
# the range mode splits the rows into tokens x heads by the group). Lengths, top-k and the head count beyond the
# group change only the grid.
SWEEP_DTYPES = ("bf16", "fp16", "fp32")
SWEEP_ABSORBED = ((576, 512), (512, 512))  # DeepSeek-V3.2 / GLM-5's absorbed MLA, DeepSeek-V4's K = V
SWEEP_HEADS = (8, 16, 32, 64, 128)  # q heads on the one latent kv head (128 heads at TP 1 to 16)
SWEEP_PERHEAD = ((576, 512), (512, 512), (256, 256), (192, 128))  # K/V per q head, separate V (group 1)
SWEEP_GQA = tuple((qk, v, group) for qk, v in ((256, 256), (192, 128)) for group in (4, 16))  # 4 kv heads
SWEEP_MQA = tuple((512, 512, heads) for heads in (16, 32, 128))  # one kv head with a separate V (K passed as V)
# the block mode (BLOCK_SIZE-key blocks): MiniMax-M3's 64 q heads of 128 on 4 kv heads, GQA 4 at 128/128, 192/128
# and 256/256 (separate V), absorbed 576/512 with 16 and 128 q heads (V the key block)
SWEEP_BLOCKS = ((128, 128, 64, 4, False), (128, 128, 16, 4, False), (192, 128, 16, 4, False), (256, 256, 16, 4, False),
                (576, 512, 16, 1, True), (576, 512, 128, 1, True))


def sweep_problems(dtypes=SWEEP_DTYPES) -> list[SparseProblem]:
    """The sparse sweep's problems per dtype: absorbed 576/512 and 512/512 at 8-128 q heads, per-head K/V
    at 576/512, 512/512, 256/256 and 192/128, GQA 4 and 16 at 256/256 and 192/128 (groups of 16 and more
    compile the same kernels there), one kv head with a separate 512-wide V at 16, 32 and 128 q heads, and the
    block mode's ``SWEEP_BLOCKS``."""
    cases = []
    for dtype in dtypes:
        cases += [SparseProblem(qk, v, heads, 1, True, dtype) for qk, v in SWEEP_ABSORBED for heads in SWEEP_HEADS]
        cases += [SparseProblem(qk, v, 16, 16, False, dtype) for qk, v in SWEEP_PERHEAD]
        cases += [SparseProblem(qk, v, 4 * group, 4, False, dtype) for qk, v, group in SWEEP_GQA]
        cases += [SparseProblem(qk, v, heads, 1, False, dtype) for qk, v, heads in SWEEP_MQA]
        cases += [SparseProblem(qk, v, heads, kv, absorbed, dtype, BLOCK_SIZE)
                  for qk, v, heads, kv, absorbed in SWEEP_BLOCKS]
    return cases


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


# The sweep's: every dtype at DeepSeek-V3.2's shape (64 heads x 128, top-k 2048) and GLM-5's (32 heads, no ReLU),
# the largest q tile each dtype runs (32 KB: 128 x 128 and 64 x 256 in 16 bits, 64 x 128 in fp32: CUDA refuses it
# and fp32 at top-k 4096, and runs 32 x 128 at 2048) at the largest top-k (4096), the kernel's limits (128 heads of
# 256), which configs/indexer.py refuses, a top-k of 256 (the smallest table row) and the scores' output
# (RETURN_SCORES); the Hadamard at each padded width (64-256, and 192: a
# dim below its power of two) in every dtype.
INDEXER_SWEEP = (*((64, 128, 2048, dtype, True) for dtype in SWEEP_DTYPES), (32, 128, 2048, "bf16", False),
                 (128, 128, 4096, "bf16", True), (64, 256, 4096, "fp16", True), (64, 128, 4096, "fp32", True),
                 *((128, 256, 4096, dtype, True) for dtype in SWEEP_DTYPES), (64, 128, 256, "bf16", True),
                 (64, 128, 2048, "bf16", True, True), (32, 128, 2048, "fp32", True))
HADAMARD_SWEEP = tuple((dim, dtype) for dim in (64, 128, 192, 256) for dtype in SWEEP_DTYPES)
# the block-max scores (MiniMax-M3's indexer) as INDEXER_BLOCKS: its 4 x 128 in blocks of 128 in every dtype, 16 x 64
# in blocks of 64, the q tiles the top-k kernel's limit allows (32 KB: 128 x 128 and 64 x 256 in 16 bits, 64 x
# 128 in fp32) and the kernel's largest (128 x 256), which that limit refuses
BLOCKS_SWEEP = (*((4, 128, 128, dtype) for dtype in SWEEP_DTYPES), (16, 64, 64, "bf16"), (128, 128, 128, "bf16"),
                (64, 256, 128, "fp16"), (64, 128, 128, "fp32"), (128, 256, 128, "bf16"))


def indexer_rows(arch: str, quick: bool = False, blocks: int | None = None, topk_cases=INDEXER_TOPK,
                 hadamard_cases=HADAMARD, block_cases=INDEXER_BLOCKS) -> list[dict]:
    """Compile-report rows of the indexer kernels on ``arch`` (quick: the first problem of each; ``blocks``:
    the first that many block-score problems): ``topk_cases`` (heads, dim, top-k, dtype, ReLU[, scores]),
    ``block_cases`` (heads, dim, block, dtype), ``hadamard_cases`` (dim, dtype)."""
    from coreattn.tune.compiler import describe, emulate, launch_block_scores, launch_hadamard, launch_indexer_topk

    rows = []
    with emulate(arch) as launches:
        for case in topk_cases[:1] if quick else topk_cases:
            start = len(launches)
            problem = launch_indexer_topk(*case)
            rows += [dict(describe(launch, arch), kernel="indexer_topk", block_m=1, dtype=case[3], problem=problem)
                     for launch in launches[start:]]
        for case in block_cases[:1 if quick else blocks]:
            start = len(launches)
            problem = launch_block_scores(*case)
            rows += [dict(describe(launch, arch), kernel="indexer_block_scores", block_m=1, dtype=case[3],
                          problem=problem) for launch in launches[start:]]
        for dim, dtype in hadamard_cases[:1] if quick else hadamard_cases:
            start = len(launches)
            problem = launch_hadamard(dim, dtype)
            rows += [dict(describe(launch, arch), kernel="hadamard", block_m=launch["constants"]["BLOCK_R"],
                          block_n=None, dtype=dtype, problem=problem) for launch in launches[start:]]
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
