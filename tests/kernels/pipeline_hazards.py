"""Compile kernel variants for CUDA or AMD CDNA architectures, without a device, and print as JSON one row
per compiled kernel with its asynchronous loads and pipelined-load hazards (coreattn/tune/hazards.py)
and its i32 stride products on pointer offsets (coreattn/tune/offsets.py); run as a script,
TRITON_INTERPRET must be unset.

``python tests/kernels/pipeline_hazards.py sm90:128,192/128+gqa+dropout,128+gqa@tma sm100:128@ws canary``:
arch, then cases: head dims (q/k[/v]), ``+`` features (compiler.FEATURES, ``gqa``: 4 q heads per kv
head, ``full``: not causal) and ``@tma`` / ``@ws`` for the tuner's TMA or warp-specialized TMA loop
variant of each attention kernel (kernels/configs/space.py ``candidates``), compiled through the real
launchers in bf16; ``s576/512a128[@fp32]``: the sparse kernels (compiler.sparse_problem_of);
``indexer``: the DSA indexer's top-k and Hadamard kernels (``INDEXER_CASES``, ``HADAMARD_CASES``); each
arch also compiles the mask utilities' kernels. A launch that does not
compile is listed under ``errors``, not fatal. ``canary``: a small kernel
with the dK/dV loop's shape, its divisor unclamped and clamped with ``tl.maximum(n, 1)``, compiled
for sm90 with 3 stages: what the scanner must and must not find in this Triton's output; and one
that loads and stores rows through the kernels' lane-offset helpers in both variants (INT64_LANES
off and on): what the offset scan must and must not find. ``int64-lanes`` (anywhere among the
arguments): every attention launch takes the INT64_LANES variant (kernels/attn_common.py), and the
CUDA rows carry registers and spill bytes.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import contextlib  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from coreattn.kernels.attn_common import _load_keep, _load_rows, _store_rows, forced_int64_lanes  # noqa: E402
from coreattn.kernels.configs.base import head_blocks  # noqa: E402
from coreattn.kernels.configs.pick import forced_configs  # noqa: E402
from coreattn.kernels.configs.space import candidates  # noqa: E402
from coreattn.tune import compiler, hazards, offsets  # noqa: E402

FLAGS = ("DK", "DV", "TMA", "WARP_SPEC", "HAS_LEFT", "HAS_RIGHT", "PACKED", "SPANS", "HAS_Q_KEEP", "HAS_K_KEEP",
         "DROPOUT", "HAS_SINK", "RETURN_MAX", "SINK_GRAD", "GATHER", "WRITE_POS", "WRITE_SEQ", "ATOMIC", "V_IS_K",
         "RANGE", "INT64_LANES", "RELU", "RETURN_SCORES", "BLOCK_M", "BLOCK_N", "BLOCK_T", "BLOCK_H", "BIAS",
         "BIAS_COEF", "BIAS_CLAMP", "BIAS_GRAD", "SINK_ROWS")


def parse_case(case: str) -> tuple:
    """A dense case (compiler.Problem and its loop variant) or a sparse one, ``s576/512a128[@fp32]``
    (compiler.sparse_problem_of, bf16 unless told; no variant)."""
    if case.startswith("s"):
        spec, _, dtype = case[1:].partition("@")
        return compiler.sparse_problem_of(spec, dtype or "bf16"), ""
    case, _, variant = case.partition("@")
    dims, *features = case.split("+")
    qk, _, v = dims.partition("/")
    group = 4 if "gqa" in features else 1
    causal = "full" not in features
    feature = "+".join(f for f in features if f not in ("gqa", "full"))
    return compiler.Problem(int(qk), int(v or qk), "bf16", causal, group, feature), variant


def variant_configs(arch: str, problem: compiler.Problem, variant: str) -> dict:
    """The first candidate of each attention kernel with the variant's loop (none: the tables)."""
    if not variant:
        return {}
    target = compiler.arch_target(arch)
    block_dqk, block_dqk2, block_dv = head_blocks(problem.dim_qk, problem.dim_v)
    wanted = dict(tma=(True, False), ws=(True, True))[variant]
    forced = {}
    for kernel in ("fwd", "dkdv", "dq"):
        found = [c for c in candidates(target, kernel, block_dqk + block_dqk2, block_dv,
                                              dropout="dropout" in problem.features)
                 if (c.tma, c.warp_specialize) == wanted]
        if not found:
            raise SystemExit(f"{arch} has no {variant} candidate for {kernel}")
        forced[kernel] = found[0]
    return forced


# the DSA indexer's kernels the ``indexer`` case compiles: the top-k in each dtype (DeepSeek-V3.2's 64 x 128 at
# top-k 2048; fp32 at 16 x 64, top-k 64) with and without ReLU and scores, the Hadamard rotation in each dtype
INDEXER_CASES = ((64, 128, 2048, "bf16", True), (32, 128, 2048, "fp16", False, True), (16, 64, 64, "fp32", True))
HADAMARD_CASES = ((128, "bf16"), (256, "fp16"), (64, "fp32"))


def launch_indexer() -> None:
    for case in INDEXER_CASES:
        compiler.launch_indexer_topk(*case)
    for case in HADAMARD_CASES:
        compiler.launch_hadamard(*case)


def rows_for(arch: str, cases: list[str], errors: list[dict], spills: bool = False) -> list[dict]:
    """One row per distinct compiled kernel of ``cases`` on ``arch``; a launch that fails to compile
    appends (arch, case, kernel, error) to ``errors`` (a loop variant is compiled kernel by kernel,
    so one that this Triton cannot compile leaves the others)."""
    rows, seen = [], {}
    with compiler.emulate(arch) as launches:
        labels = []
        for case in cases:
            problem, variant = ("indexer", "") if case == "indexer" else parse_case(case)
            forced = variant_configs(arch, problem, variant)
            for kernels in ([{k} for k in forced] if forced else [None]):
                start = len(launches)
                try:
                    with forced_configs(**{k: forced[k] for k in kernels or ()}):
                        if problem == "indexer":
                            launch_indexer()
                        elif isinstance(problem, compiler.SparseProblem):
                            compiler.launch_sparse_problem(problem)
                        else:
                            compiler.launch_problem(problem, kernels)
                except Exception as exc:  # reported, and asserted on by the test
                    last = (str(exc).strip().splitlines() or [""])[-1]
                    errors.append(dict(arch=arch, case=case, kernels=sorted(kernels or ()),
                                       error=f"{type(exc).__name__}: {last.strip()[:300]}"))
                    if kernels:  # the variant's other classes (features, GQA) on the table's config
                        compiler.launch_problem(problem, kernels)
                labels += [case] * (len(launches) - start)
        start = len(launches)
        compiler.launch_mask_kernels()
        labels += ["masks"] * (len(launches) - start)
    for launch, case in zip(launches, labels):
        kernel = launch["kernel"]
        if kernel.hash in seen:  # the same compiled kernel (the tile map of every case): scanned once
            seen[kernel.hash]["cases"].append(case)
            continue
        graph = hazards.Graph(kernel.asm["ttgir"])
        row = dict(arch=arch, cases=[case], kernel=compiler.KERNEL_NAMES.get(launch["fn"], launch["fn"]),
                   fn=launch["fn"], num_stages=kernel.metadata.num_stages, hash=kernel.hash,
                   flags={k: v for k, v in launch["constants"].items() if k in FLAGS},
                   hazards=[h.describe() for h in hazards.scan(graph)], unresolved=graph.unresolved[:5],
                   i32_offsets=[s.describe() for s in offsets.scan(graph)], **hazards.load_counts(graph))
        if spills and arch in compiler.ARCHS:  # registers and spill bytes (ptxas -v; reruns ptxas when cached)
            row.update(compiler.ptxas_stats(launch["ptxas_log"], kernel, compiler.ARCHS[arch].capability))
        seen[kernel.hash] = row
        rows.append(row)
    return rows


@triton.jit
def _canary_kernel(x_ptr, out_ptr, lo, hi, group, CLAMP: tl.constexpr):
    """The dK/dV kernel's flat loop over (head, query block): head = step // n with n possibly 0."""
    n = tl.cdiv(hi - lo, 16)
    if CLAMP:
        n = tl.maximum(n, 1)
    offs = tl.arange(0, 16)
    cols = tl.arange(0, 64)
    acc = tl.zeros([16, 64], tl.float32)
    w = tl.load(x_ptr + cols[:, None] * 64 + cols[None, :])
    for step in range(0, tl.cdiv(hi - lo, 16) * group):
        head = step // n
        rows = lo + (step % n) * 16 + offs
        a = tl.load(x_ptr + head * 4096 + rows[:, None] * 64 + cols[None, :], mask=rows[:, None] < hi, other=0.0)
        acc += tl.dot(a, w)
    tl.store(out_ptr + offs[:, None] * 64 + cols[None, :], acc)


@triton.jit
def _lanes_canary_kernel(x_ptr, keep_ptr, out_ptr, r0, seqlen, stride_t, stride_s, INT64_LANES: tl.constexpr):
    """A tile's rows in and out through the kernels' lane-offset helpers, in a loop."""
    acc = tl.zeros([32, 64], tl.float32)
    for r in range(r0, seqlen, 32):
        rows_ok = r + tl.arange(0, 32) < seqlen
        x, _ = _load_rows(x_ptr, stride_t, r, rows_ok, seqlen - 1, 64, 64, 0, 32, INT64_LANES)
        keep = _load_keep(keep_ptr, stride_s, r, tl.arange(0, 32), seqlen, INT64_LANES)
        acc += tl.where(keep[:, None], x.to(tl.float32), 0.0)
    _store_rows(out_ptr, stride_t, r0, r0 + tl.arange(0, 32) < seqlen, seqlen - 1, acc, acc, 64, 64, 0, 32,
                INT64_LANES)


def lanes_canary_rows() -> list[dict]:
    """The lane-offset canary compiled for sm90 (3 stages) with INT64_LANES off and on."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rows = []
    signature = {"x_ptr": "*fp16", "keep_ptr": "*u8", "out_ptr": "*fp16", "r0": "i32", "seqlen": "i32",
                 "stride_t": "i32", "stride_s": "i32", "INT64_LANES": "constexpr"}
    aligned = {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
    for wide in (False, True):
        src = ASTSource(_lanes_canary_kernel, signature, {"INT64_LANES": wide}, aligned)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_stages=3, num_warps=4, enable_fp_fusion=True))
        graph = hazards.Graph(kernel.asm["ttgir"])
        rows.append(dict(arch="sm90", cases=[f"lanes-canary-int64{int(wide)}"], kernel="lanes_canary",
                         fn="_lanes_canary_kernel", num_stages=kernel.metadata.num_stages, hash=kernel.hash,
                         flags=dict(INT64_LANES=wide), hazards=[h.describe() for h in hazards.scan(graph)],
                         unresolved=graph.unresolved[:5],
                         i32_offsets=[s.describe() for s in offsets.scan(graph)], **hazards.load_counts(graph)))
    return rows


def canary_rows() -> list[dict]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rows = []
    signature = {"x_ptr": "*fp16", "out_ptr": "*fp32", "lo": "i32", "hi": "i32", "group": "i32", "CLAMP": "constexpr"}
    aligned = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}  # as a launch's 16-byte tensors
    for clamp in (False, True):
        src = ASTSource(_canary_kernel, signature, {"CLAMP": clamp}, aligned)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_stages=3, num_warps=4, enable_fp_fusion=True))
        graph = hazards.Graph(kernel.asm["ttgir"])
        rows.append(dict(arch="sm90", cases=[f"canary-clamp{int(clamp)}"], kernel="canary", fn="_canary_kernel",
                         num_stages=kernel.metadata.num_stages, hash=kernel.hash, flags=dict(CLAMP=clamp),
                         hazards=[h.describe() for h in hazards.scan(graph)], unresolved=graph.unresolved[:5],
                         i32_offsets=[s.describe() for s in offsets.scan(graph)], **hazards.load_counts(graph)))
    return rows + lanes_canary_rows()


def main(specs: list[str]) -> None:
    rows, errors = [], []
    with forced_int64_lanes(True) if "int64-lanes" in specs else contextlib.nullcontext():
        for spec in specs:
            if spec == "int64-lanes":
                continue
            if spec == "canary":
                rows += canary_rows()
                continue
            arch, _, cases = spec.partition(":")
            rows += rows_for(arch, [c for c in cases.split(",") if c], errors, spills="int64-lanes" in specs)
    json.dump(dict(triton=triton.__version__, rows=rows, errors=errors), sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
