"""The sparse sweep: every configuration class of the sparse (top-k) attention, indexer and Hadamard kernels,
compiled for each architecture under the installed Triton, without a GPU.

``python -m bench.compile_sweep [--arch sm90 sm100 gfx90a gfx942 gfx950] [--dtype bf16 fp16 fp32] [--out DIR]``,
from a checkout, once per Triton release CI tests (coreattn/kernels/versions.py ``TESTED_TRITON``) with the
Python of an environment that holds it; each run writes ``DIR/triton-<version>.json`` (default DIR:
``bench/results/compile-report-sparse-sweep/``) and rewrites ``DIR/table.md`` from every release file there.
``--baseline DIR2`` puts an earlier sweep's figures beside them (before -> after); ``--table`` only rewrites the
table; ``--list`` prints the problems. One arch a run (``--arch sm100 --out DIR3``) and the problems whose configs
changed rerun alone (``--match``) are joined by ``--merge RUN.json ...`` into one release file: later runs replace
the problems they cover, and ``meta.configs`` keeps, per arch and problem, the launch configs each was compiled with.

Problems: ``bench.kernels.sweep_problems()`` (absorbed MLA at 576/512 and 512/512 with 8-128 q heads, per-head
K/V at 576/512, 512/512, 256/256 and 192/128, GQA 4 and 16, one kv head with a separate V at 512/512; bf16,
fp16 and fp32), each through the real launchers (coreattn/tune/compiler.py ``launch_sparse_problem``: the
forward, the delta preprocess, dQ, the deterministic dK/dV with its reduce and the atomic one, each MMA kernel
in the slot and the range mode, the key-centric dK/dV for the groups it may run for, the block mode's kernels for
its problems), and the indexer's top-k, block-score and Hadamard kernels (``INDEXER_SWEEP``, ``BLOCKS_SWEEP``,
``HADAMARD_SWEEP``). One row per distinct compiled kernel per arch, listing the problems that compile it.

What a row must show (``violations``): no spill (CUDA: ptxas's spill stores/loads; CDNA: spilled VGPRs, spill
instructions, scratch), shared memory (LDS) within the arch's limit, no pipelined-load hazard, no i32 stride
product on a pointer offset (the delta preprocess kernel's int32 lane offsets excepted: the dense kernel's
default variant, kernels/attn_common.py) and, for 16-bit inputs, every dot an MMA of the input type.
``fingerprint()`` identifies what the sweep compiled (the launch configs of every problem on every arch and the
kernels' source), so a committed sweep can be checked against today's code.
Static compiler output, not speed: nothing here ran on a GPU.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import inspect
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "compile-report-sparse-sweep"
ARCHS = ("sm90", "sm100", "gfx90a", "gfx942", "gfx950")
# the fields a row keeps (the rest of coreattn.tune.compiler.describe's are derived or per-launch)
FIELDS = ("arch", "triton", "kernel", "block_m", "block_n", "atomic", "range", "blocks", "num_warps", "num_stages",
          "smem", "smem_fits", "async_loads", "pipeline_hazards", "hazards", "i32_offsets", "regs", "spill_stores",
          "spill_loads", "mma", "mma_inputs", "mma_dup", "fma_dots", "vgprs", "agprs", "vgpr_spills", "scratch",
          "waves_per_simd", "ctas_per_sm", "hash")
SPARSE_KERNELS = ("_sparse_attn_fwd_kernel", "_sparse_attn_dq_kernel", "_sparse_attn_dkv_kernel",
                  "_sparse_attn_reduce_kernel", "_sparse_attn_dkv_keys_kernel", "_sparse_attn_block_dkv_kernel")
MMA_KERNELS = ("sparse_fwd", "sparse_dq", "sparse_dkv", "indexer_topk", "indexer_block_scores")
# a 16-bit MMA of each input type: its PTX operand types (compiler.mma_inputs) and CDNA's MFMA input (mfma_input)
MMA_TYPE = {"bf16": ({"bf16", "kind::f16"}, "bf16"), "fp16": ({"f16", "kind::f16"}, "f16")}


def _kernel_functions():
    from coreattn.kernels import attn_bwd, hadamard, indexer_blocks, indexer_topk, sparse_bwd, sparse_fwd

    return ([getattr(sparse_fwd, "_sparse_attn_fwd_kernel")]
            + [getattr(sparse_bwd, name) for name in SPARSE_KERNELS[1:]]
            + [attn_bwd._attn_bwd_preprocess_kernel, indexer_topk._indexer_topk_kernel,
               indexer_blocks._indexer_block_scores_kernel, hadamard._hadamard_kernel])


def _jit_sources(fn, seen: dict) -> None:
    """The source of a coreattn Triton JIT function and, recursively, of every coreattn JIT function it names
    (the same under TRITON_INTERPRET=1, where ``triton.jit`` makes InterpretedFunctions)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    JITFunction = (JITFunction, InterpretedFunction)  # noqa: N806
    name = f"{fn.fn.__module__}.{fn.fn.__qualname__}"
    if name in seen or not name.startswith("coreattn."):  # Triton's own (tl.max, ...) differ by release
        return
    source = inspect.getsource(fn.fn)
    seen[name] = source
    scope = fn.fn.__globals__
    for node in ast.walk(ast.parse(source.lstrip() if source[0].isspace() else source)):
        if isinstance(node, ast.Name) and isinstance(scope.get(node.id), JITFunction):
            _jit_sources(scope[node.id], seen)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):  # module.helper
            target = getattr(scope.get(node.value.id), node.attr, None)
            if isinstance(target, JITFunction):
                _jit_sources(target, seen)


def launch_configs(arch: str) -> dict:
    """{name: launch config} of every problem and indexer case of the sweep on ``arch`` (configs/sparse.py,
    configs/indexer.py): a sparse problem's [kernel, config] pairs, an indexer or Hadamard case's config, or the
    reason the tables refuse it. The names are the rows' problem names (``case_names``)."""
    from bench.kernels import BLOCKS_SWEEP, HADAMARD_SWEEP, INDEXER_SWEEP, sweep_problems
    from coreattn.kernels.configs.base import head_blocks
    from coreattn.kernels.configs.indexer import block_scores_config, hadamard_config, topk_config, topk_refusal
    from coreattn.kernels.configs.sparse import KERNELS, SparseRefused, sparse_config
    from coreattn.kernels.indexer_topk import topk_blocks
    from coreattn.tune.compiler import DTYPES, arch_target, topk_problem_name

    target, out = arch_target(arch), {}
    for p in sweep_problems():
        block_dqk, block_dqk2, block_dv = head_blocks(p.dim_qk, p.dim_v)
        elem = DTYPES[p.dtype].itemsize
        v_is_k = p.absorbed and block_dv == block_dqk
        try:
            out[p.id] = [[kernel, list(sparse_config(target, kernel, block_dqk + block_dqk2, block_dv, elem,
                                                     p.heads_q // p.heads_kv, v_is_k))] for kernel in KERNELS]
        except SparseRefused as exc:
            out[p.id] = str(exc)
    for case in INDEXER_SWEEP:
        heads, dim, topk, dtype, *_ = case
        elem = DTYPES[dtype].itemsize
        out[topk_problem_name(*case)] = topk_refusal(target, heads, dim, elem, topk) or list(
            topk_config(target, topk_blocks(topk, 16), heads, dim, elem))
    for heads, dim, block, dtype in BLOCKS_SWEEP:
        elem = DTYPES[dtype].itemsize
        out[_block_name(heads, dim, block, dtype)] = topk_refusal(target, heads, dim, elem) or list(
            block_scores_config(target, heads, dim, elem))
    for dim, dtype in HADAMARD_SWEEP:
        out[_hadamard_name(dim, dtype)] = list(hadamard_config(target))
    return json.loads(json.dumps(out, default=str))  # as a document stores it (tuples as lists)


def _block_name(heads: int, dim: int, block: int, dtype: str) -> str:
    return f"indexer-h{heads}xd{dim}-block{block}-{dtype}"


def _hadamard_name(dim: int, dtype: str) -> str:
    return f"hadamard-d{dim}-{dtype}"


def case_names(meta: dict) -> list[str]:
    """The problem names a sweep document covers (compiled or refused): its sparse problems, indexer top-k,
    block-score and Hadamard cases."""
    from coreattn.tune.compiler import topk_problem_name

    return (list(meta["problems"]) + [topk_problem_name(*c) for c in meta["indexer"]]
            + [_block_name(*c) for c in meta["blocks"]] + [_hadamard_name(*c) for c in meta["hadamard"]])


def fingerprint(archs=ARCHS) -> dict:
    """What the sweep compiles, independent of the Triton release: a hash of the launch configs of every
    problem on every arch (``configs``), and of the source of the kernels with every JIT function they call
    (``kernels``). A change to either makes the committed sweep stale; a document's ``configs`` (per arch, per
    problem: ``launch_configs``) says where."""
    sources: dict = {}
    for fn in _kernel_functions():
        _jit_sources(fn, sources)
    kernels = hashlib.sha256(json.dumps(sorted(sources.items())).encode()).hexdigest()[:16]
    configs = hashlib.sha256(json.dumps({a: launch_configs(a) for a in archs}).encode()).hexdigest()[:16]
    return dict(configs=configs, kernels=kernels)


def violations(row: dict) -> list[str]:
    """What a compiled kernel of the sweep must not show, one phrase each (empty: clean)."""
    from coreattn.tune.compiler import mfma_input

    found = []
    if row["arch"].startswith("gfx"):
        if row["vgpr_spills"] or row["spill_stores"] or row["spill_loads"] or row["scratch"]:
            found.append(f"spill {row['spill_stores']}/{row['spill_loads']} B, {row['vgpr_spills']} VGPRs, "
                         f"scratch {row['scratch']} B")
    elif row["spill_stores"] or row["spill_loads"]:
        found.append(f"spill {row['spill_stores']}/{row['spill_loads']} B at {row['regs']} registers")
    if not row["smem_fits"]:
        found.append(f"{row['smem']} B of shared memory over the limit")
    elif (row["waves_per_simd"] if row["arch"].startswith("gfx") else row["ctas_per_sm"]) == 0:
        found.append(f"cannot launch: {row['regs']} registers x {row['num_warps']} warps")
    if row["pipeline_hazards"]:
        found.append(f"{row['pipeline_hazards']} pipelined-load hazards")
    if row["i32_offsets"] and row["kernel"] != "sparse_pre":
        found.append(f"{row['i32_offsets']} i32 stride offsets")
    dtypes = set(row["dtypes"])
    if row["kernel"] in MMA_KERNELS and dtypes & set(MMA_TYPE):
        dtype, = dtypes  # a kernel compiles for one input type
        if row["arch"].startswith("gfx"):
            ok = row["mma"] and not row["fma_dots"] and all(mfma_input(k) == MMA_TYPE[dtype][1] for k in row["mma"])
        else:
            ok = row["mma"] and not row["fma_dots"] and row["mma_inputs"] and set(row["mma_inputs"]) <= MMA_TYPE[dtype][0]
        if not ok:
            found.append(f"16-bit dots not all MMAs of {dtype}: {row['mma']} {row.get('mma_inputs')}")
    return found


def compile_arch(arch: str, problems, topk_cases, hadamard_cases, log, refused: list, block_cases=()) -> list[dict]:
    """The sweep's rows of one arch: one per distinct compiled kernel, with the problems that compiled it; a
    problem the launch tables refuse (configs/sparse.py ``SparseRefused``) is appended to ``refused``."""
    from bench.kernels import indexer_rows
    from coreattn.kernels.configs.indexer import topk_refusal
    from coreattn.kernels.configs.sparse import SparseRefused
    from coreattn.tune.compiler import DTYPES, arch_target, compile_problem, emulate, topk_problem_name

    refused_cases = refused

    rows: dict = {}

    def add(r: dict, dtype: str) -> None:
        kernel = r["kernel"] + ("[atomic]" if r.get("atomic") else "[range]" if r.get("range") else
                                "[block]" if r.get("blocks") else "")
        row = rows.setdefault(r["hash"], dict({k: r.get(k) for k in FIELDS}, kernel=kernel, problems=[], dtypes=[]))
        if r["problem"] not in row["problems"]:
            row["problems"].append(r["problem"])
        if dtype not in row["dtypes"]:
            row["dtypes"].append(dtype)

    with emulate(arch) as launches:
        for i, problem in enumerate(problems):
            start = time.time()
            try:
                for r in compile_problem(problem, launches, arch):
                    add(r, problem.dtype)
            except SparseRefused as exc:  # the tables refuse it: recorded with the reason, nothing compiled
                refused.append(dict(problem=problem.id, arch=arch, reason=str(exc)))
            log(f"{arch} [{i + 1}/{len(problems)}] {problem.id}: {time.time() - start:.0f} s")
    start = time.time()
    target = arch_target(arch)
    for case in topk_cases:
        heads, dim, topk, dtype, *_ = case
        refused = topk_refusal(target, heads, dim, DTYPES[dtype].itemsize, topk)
        if refused:  # the launcher would raise: recorded with the reason, nothing compiled
            refused_cases.append(dict(problem=topk_problem_name(*case), arch=arch, reason=refused))
        else:
            for r in indexer_rows(arch, topk_cases=[case], hadamard_cases=[], block_cases=[]):
                add(r, r["dtype"])
    for case in block_cases:
        heads, dim, block, dtype = case
        refused = topk_refusal(target, heads, dim, DTYPES[dtype].itemsize)
        if refused:
            refused_cases.append(dict(problem=_block_name(heads, dim, block, dtype), arch=arch, reason=refused))
        else:
            for r in indexer_rows(arch, topk_cases=[], hadamard_cases=[], block_cases=[case]):
                add(r, r["dtype"])
    for r in indexer_rows(arch, topk_cases=[], hadamard_cases=hadamard_cases, block_cases=[]):
        add(r, r["dtype"])
    log(f"{arch} indexer and Hadamard: {time.time() - start:.0f} s")
    out = list(rows.values())
    for row in out:
        row["violations"] = violations(row)
    return out


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _matches(text: str, match) -> bool:
    return all(m in text for m in match or ())


def run(archs, dtypes, out: Path, match=None) -> Path:
    import torch
    import triton

    from bench.kernels import BLOCKS_SWEEP, HADAMARD_SWEEP, INDEXER_SWEEP, sweep_problems
    from coreattn.kernels import runs_in_interpreter

    if runs_in_interpreter():
        raise SystemExit("the sweep compiles the kernels: unset TRITON_INTERPRET")
    problems = [p for p in sweep_problems(dtypes) if _matches(p.id, match)]
    topk_cases = [c for c in INDEXER_SWEEP if c[3] in dtypes and _matches("indexer-" + "-".join(map(str, c)), match)]
    hadamard_cases = [c for c in HADAMARD_SWEEP if c[1] in dtypes and _matches(f"hadamard-{c[0]}-{c[1]}", match)]
    block_cases = [c for c in BLOCKS_SWEEP if c[3] in dtypes and _matches("blocks-" + "-".join(map(str, c)), match)]
    started, rows = time.time(), []

    def log(line: str) -> None:
        print(f"[{time.time() - started:6.0f} s] {line}", file=sys.stderr, flush=True)

    arch_seconds, refused = {}, []
    out.mkdir(parents=True, exist_ok=True)
    path, partial = out / f"triton-{triton.__version__}.json", out / f"partial-triton-{triton.__version__}.json"
    load_before = os.getloadavg()
    configs: dict = {}
    covered = set(case_names(dict(problems=[p.id for p in problems], indexer=topk_cases, blocks=block_cases,
                                  hadamard=hadamard_cases)))
    for i, arch in enumerate(archs):
        t0 = time.time()
        rows += compile_arch(arch, problems, topk_cases, hadamard_cases, log, refused, block_cases)
        configs[arch] = {name: c for name, c in launch_configs(arch).items() if name in covered}
        arch_seconds[arch] = round(time.time() - t0)
        done = i + 1 == len(archs)
        meta = dict(date=datetime.date.today().isoformat(), git_commit=_git("rev-parse", "--short", "HEAD"),
                    git_dirty=bool(_git("status", "--porcelain", "--untracked-files=no")), triton=triton.__version__,
                    torch=torch.__version__, python=platform.python_version(), archs=list(archs[:i + 1]),
                    dtypes=list(dtypes), problems=[p.id for p in problems], indexer=[list(c) for c in topk_cases],
                    hadamard=[list(c) for c in hadamard_cases], blocks=[list(c) for c in block_cases],
                    fingerprint=fingerprint(), configs=configs,
                    seconds=round(time.time() - started), arch_seconds=arch_seconds, cpus=os.cpu_count(),
                    load_average=[round(x, 1) for x in (*load_before, *os.getloadavg())],
                    triton_cache=os.environ.get("TRITON_CACHE_DIR", "default"),
                    command=f"python -m bench.compile_sweep --arch {' '.join(archs)} --dtype {' '.join(dtypes)}"
                            + (f" --match {' '.join(match)}" if match else ""))
        doc = dict(meta=meta, note="static compiler output, one row per distinct compiled kernel per arch; nothing "
                                   "here ran on a GPU", rows=rows, refused=refused)
        # after each arch a partial file (not read as a release's: see load), the release file at the end
        _write(path if done else partial, doc)
    partial.unlink(missing_ok=True)
    return path


def _write(path: Path, doc: dict) -> None:
    """A sweep document as JSON: one line per meta field, row and refusal."""
    meta = ",\n".join(f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'), default=str)}"
                       for k, v in doc["meta"].items())
    lines = ["{", f'"meta": {{\n{meta}\n}},', f'"note": {json.dumps(doc["note"])},']
    for key in ("rows", "refused"):
        items = ",\n".join(json.dumps(r, separators=(",", ":"), default=str) for r in doc[key])
        lines.append(f'"{key}": [\n{items}\n]' + ("," if key == "rows" else ""))
    path.write_text("\n".join(lines + ["}"]) + "\n")


def merge(paths, out: Path) -> Path:
    """One release's document from several runs of it (each arch run on its own, or a ``--match`` rerun of the
    problems whose configs changed): in order, a later run's rows, refusals and configs replace the earlier ones'
    for the problems it covers on its archs. Every run must have compiled today's kernels (``fingerprint``'s
    ``kernels``) under the same Triton and torch; the merged ``configs`` say, per arch and problem, which launch
    configs were compiled (tests/kernels/test_sparse_sweep.py holds them to today's)."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    metas = [d["meta"] for d in docs]
    for key in ("triton", "torch"):
        if len({m[key] for m in metas}) != 1:
            raise SystemExit(f"--merge: the runs differ in {key}: {sorted({m[key] for m in metas})}")
    if len({m["fingerprint"]["kernels"] for m in metas}) != 1:
        raise SystemExit("--merge: the runs compiled different kernel sources (fingerprint kernels)")
    if any("configs" not in m for m in metas):
        raise SystemExit("--merge: a run without per-problem configs (meta configs)")
    rows: dict = {}  # arch -> {hash: row}
    refused: dict = {}  # arch -> {problem: refusal}
    configs: dict = {}
    for doc in docs:
        meta = doc["meta"]
        names = set(case_names(meta))
        for arch in meta["archs"]:
            kept = {}
            for h, row in rows.get(arch, {}).items():
                row = dict(row, problems=[p for p in row["problems"] if p not in names])
                if row["problems"]:
                    kept[h] = row
            for row in doc["rows"]:
                if row["arch"] == arch:
                    was = kept.get(row["hash"])
                    kept[row["hash"]] = dict(row, problems=list(dict.fromkeys(
                        (was["problems"] if was else []) + row["problems"])))
            rows[arch] = kept
            refused[arch] = {p: r for p, r in refused.get(arch, {}).items() if p not in names}
            refused[arch].update({r["problem"]: r for r in doc.get("refused", []) if r["arch"] == arch})
            configs.setdefault(arch, {}).update(meta["configs"][arch])
    archs = [a for a in ARCHS if a in rows]
    first = metas[0]
    meta = dict(first, archs=archs, date=max(m["date"] for m in metas),
                git_commit="+".join(dict.fromkeys(m["git_commit"] for m in metas)),
                git_dirty=any(m["git_dirty"] for m in metas),
                dtypes=[d for d in ("bf16", "fp16", "fp32") if any(d in m["dtypes"] for m in metas)],
                problems=list(dict.fromkeys(p for m in metas for p in m["problems"])),
                indexer=list({json.dumps(c): c for m in metas for c in m["indexer"]}.values()),
                hadamard=list({json.dumps(c): c for m in metas for c in m["hadamard"]}.values()),
                blocks=list({json.dumps(c): c for m in metas for c in m["blocks"]}.values()),
                configs={a: configs[a] for a in archs},
                seconds=sum(m["seconds"] for m in metas),
                arch_seconds={a: sum(m["arch_seconds"].get(a, 0) for m in metas) for a in archs},
                arch_commits={a: "+".join(dict.fromkeys(m["git_commit"] for m in metas if a in m["archs"]))
                              for a in archs},
                command="python -m bench.compile_sweep --merge " + " ".join(Path(p).name for p in paths),
                parts=[{k: m[k] for k in ("date", "git_commit", "git_dirty", "archs", "seconds", "load_average",
                                          "triton_cache", "command") if k in m} for m in metas])
    meta.pop("load_average", None)
    meta.pop("triton_cache", None)
    doc = dict(meta=meta, note=docs[0]["note"], rows=[r for a in archs for r in rows[a].values()],
               refused=[r for a in archs for r in refused[a].values()])
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"triton-{meta['triton']}.json"
    _write(path, doc)
    return path


# ---------------------------------------------------------------------------------------------
# The table


def load(directory: Path) -> dict:
    """{triton version: document} of a sweep directory's release files."""
    docs = {}
    for path in sorted(directory.glob("triton-*.json")):
        doc = json.loads(path.read_text())
        docs[doc["meta"]["triton"]] = doc
    return docs


def _version_key(v: str):
    return tuple(int(x) for x in v.split(".") if x.isdigit())


def _spill(row: dict) -> int:
    """Spill bytes of a row (stores; CDNA: the largest of the spill stores, 4 B per spilled VGPR and scratch)."""
    if row["arch"].startswith("gfx"):
        return max(row["spill_stores"] or 0, 4 * (row["vgpr_spills"] or 0), row["scratch"] or 0)
    return row["spill_stores"] or 0


def problem_cells(doc: dict) -> dict:
    """{(problem, arch): (max spill bytes over its kernels, [violation lines])} of one release's document."""
    cells: dict = {}
    for row in doc["rows"]:
        for problem in row["problems"]:
            spill, lines = cells.get((problem, row["arch"]), (0, []))
            lines = lines + [f"{row['kernel']} {row['block_m']}x{row['block_n']} w{row['num_warps']}"
                             f"/s{row['num_stages']}: {v}" for v in violations(row)]  # today's rule
            cells[(problem, row["arch"])] = (max(spill, _spill(row)), lines)
    for r in doc.get("refused", []):
        cells[(r["problem"], r["arch"])] = ("refused", [])
    return cells


def _text(cell) -> str:
    if cell is None:
        return "-"
    if cell[0] == "refused":
        return "refused"
    return f"{cell[0]} B" if cell[0] else ("0" if not cell[1] else "X")


def _cell(after, before, with_baseline: bool) -> str:
    text = _text(after)
    if not with_baseline:
        return text
    was = _text(before)
    return text if was == text else f"{was} -> {text}"


def format_table(docs: dict, baseline: dict | None = None) -> str:
    """Markdown: per release and arch the kernels and violations, then per problem the largest spill of its
    kernels per arch and release (``before -> after`` where a baseline differs), then each violation."""
    baseline = baseline or {}
    versions = sorted(docs, key=_version_key)
    lines = ["# Sparse sweep: static compiler output (no GPU ran)", "",
             "Written by `python -m bench.compile_sweep` (bench/compile_sweep.py). Per release and arch: distinct "
             "compiled kernels, and those with a violation (spill, shared memory/LDS over the limit, pipelined-load "
             "hazard, i32 stride offset, a 16-bit dot not an MMA of its type).", "",
             "| Triton | commit | date | arch | kernels | with a violation | spilling | hazards / async loads | "
             "compile s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for v in versions:
        meta = docs[v]["meta"]
        for arch in meta["archs"]:
            mine = [r for r in docs[v]["rows"] if r["arch"] == arch]
            bad = [r for r in mine if violations(r)]
            spilling = [r for r in mine if _spill(r)]
            hazards = sum(r["pipeline_hazards"] or 0 for r in mine)
            loads = sum(r["async_loads"] or 0 for r in mine)
            commit = meta.get("arch_commits", {}).get(arch, meta["git_commit"])
            lines.append(f"| {v} | {commit}{' (dirty)' if meta['git_dirty'] else ''} | {meta['date']} | {arch} "
                         f"| {len(mine)} | {len(bad)} | {len(spilling)} | {hazards}/{loads} | "
                         f"{meta['arch_seconds'].get(arch, '-')} |")
    cells = {v: problem_cells(docs[v]) for v in versions}
    before = {v: problem_cells(baseline[v]) for v in baseline}
    archs = list(dict.fromkeys(a for v in versions for a in docs[v]["meta"]["archs"]))
    problems = list(dict.fromkeys(p for v in versions for p in docs[v]["meta"]["problems"] + [
        r for r in dict.fromkeys(p for row in docs[v]["rows"] for p in row["problems"])]))
    lines += ["", "Largest spill over each problem's kernels (CUDA: bytes stored by ptxas's spills; CDNA: the larger of "
              "the spill stores, 4 B per spilled VGPR and scratch), per arch, releases "
              f"{' / '.join(versions)}; `X`: another violation (listed below)"
              + ("; `a -> b`: the baseline sweep's figure, then this one's" if baseline else "") + ".", "",
              "| problem | " + " | ".join(archs) + " |", "| --- |" + " --- |" * len(archs)]
    for problem in problems:
        row = [" / ".join(_cell(cells[v].get((problem, a)), before.get(v, {}).get((problem, a)), v in before)
                          for v in versions) for a in archs]
        lines.append(f"| {problem} | " + " | ".join(row) + " |")
    details = [f"- Triton {v}, {a}, {p}: {line}" for v in versions for (p, a), (_, found) in cells[v].items()
               for line in found]
    lines += ["", "Violations:" if details else "No violations.", ""] + details
    reasons: dict = {}
    for v in versions:
        for r in docs[v].get("refused", []):
            reasons.setdefault(r["reason"].replace(f" on {r['arch']}", ""), set()).add((r["problem"], r["arch"]))
    if reasons:
        lines += ["", "Refused by the launch tables (coreattn/kernels/configs/sparse.py, indexer.py; the ops run these "
                  "on the torch backend, `backend=\"triton\"` raises):", ""]
        lines += [f"- {', '.join(sorted({p for p, _ in where}))} on {', '.join(sorted({a for _, a in where}))}: {reason}"
                  for reason, where in reasons.items()]
    if baseline:
        old = [f"- Triton {v}, {a}, {p}: {line}" for v in sorted(baseline, key=_version_key)
               for (p, a), (_, found) in before[v].items() for line in found]
        lines += ["", "Violations in the baseline sweep:" if old else "No violations in the baseline sweep.", ""] + old
    return "\n".join(lines).rstrip() + "\n"


def baseline_of(out: Path) -> dict | None:
    """The release files of the baseline a sweep directory names in its baseline.json (None: none)."""
    named = out / "baseline.json"
    return load(out / json.loads(named.read_text())["dir"]) if named.exists() else None


def write_table(out: Path, baseline: Path | None) -> Path:
    """DIR/table.md from DIR's release files; ``baseline`` (a sweep directory) is recorded in DIR/baseline.json,
    which later rewrites keep showing."""
    docs = load(out)
    if not docs:
        raise SystemExit(f"no triton-*.json in {out}")
    if baseline is not None:
        (out / "baseline.json").write_text(json.dumps(dict(dir=os.path.relpath(baseline, out))) + "\n")
    path = out / "table.md"
    path.write_text(format_table(docs, baseline_of(out)))
    return path


def main(argv=None) -> int:
    from bench.kernels import SWEEP_DTYPES, sweep_problems

    p = argparse.ArgumentParser(prog="python -m bench.compile_sweep", description=__doc__.splitlines()[0])
    p.add_argument("--arch", nargs="+", choices=ARCHS, default=list(ARCHS))
    p.add_argument("--dtype", nargs="+", choices=SWEEP_DTYPES, default=list(SWEEP_DTYPES))
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the sweep's directory")
    p.add_argument("--baseline", type=Path, help="an earlier sweep's directory, shown as before -> after")
    p.add_argument("--match", nargs="+", metavar="SUBSTR", help="only the problems (and indexer cases: "
                   "indexer-<heads>-<dim>-<topk>-<dtype>-..., blocks-<heads>-<dim>-<block>-<dtype>, "
                   "hadamard-<dim>-<dtype>) whose id holds every SUBSTR")
    p.add_argument("--table", action="store_true", help="only rewrite DIR/table.md from its release files")
    p.add_argument("--merge", nargs="+", type=Path, metavar="FILE", help="write DIR/triton-<version>.json from "
                   "runs of one release (per arch, or --match reruns): later runs replace the problems they cover")
    p.add_argument("--list", action="store_true", help="print the problems and exit")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(problem.id for problem in sweep_problems(args.dtype) if _matches(problem.id, args.match)))
        return 0
    if args.merge:
        print(f"wrote {merge(args.merge, args.out)}")
    elif not args.table:
        print(f"wrote {run(args.arch, args.dtype, args.out, args.match)}")
    print(f"wrote {write_table(args.out, args.baseline)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
