"""The committed sparse sweep (bench/results/compile-report-sparse-sweep/, ``python -m bench.compile_sweep``): every
configuration class of the sparse attention, indexer and Hadamard kernels compiled for sm90, sm100, gfx90a, gfx942
and gfx950 under each Triton CI tests, with no spill, nothing over shared memory (LDS), no pipelined-load hazard, no
i32 stride product on a pointer offset and every 16-bit dot an MMA of its type (bench/compile_sweep.py
``violations``), every kernel launchable, and the configurations the tables refuse refused with their reason; and
the tables' refusals themselves.

Nothing is compiled here: the sweep takes 20-60 minutes per arch and release on this project's 2-CPU machine, so it
is committed, and this module holds it to the code: each committed arch's launch configs, problem by problem, and
the kernels' source (with the JIT functions they call) must be today's. A change to a sparse, indexer or Hadamard
kernel or to their tables fails here until the sweep is rerun (docs/compile-report.md: per arch, then ``--merge``).
``COVERED``: every arch under every release CI tests must stay committed (a new release fails here until swept). The
compile tests of the CI lanes (test_kernel_structure.py, test_indexer_structure.py, test_pipeline_hazards.py)
compile a representative subset live under every release.
"""

import pytest

from bench import compile_sweep
from bench.kernels import BLOCKS_SWEEP, HADAMARD_SWEEP, INDEXER_SWEEP, sweep_problems
from coreattn.kernels.versions import TESTED_TRITON

SWEEP = compile_sweep.DEFAULT_OUT
# the (release: archs) the committed sweep covers, at least: every arch under every release CI tests
COVERED = {version: compile_sweep.ARCHS for version in TESTED_TRITON}


@pytest.fixture(scope="module")
def docs():
    return compile_sweep.load(SWEEP)


@pytest.fixture(scope="module")
def today():
    return {arch: compile_sweep.launch_configs(arch) for arch in compile_sweep.ARCHS}


def _rerun(version: str, arch: str) -> str:
    return (f"rerun the sweep on {arch} under Triton {version} (`python -m bench.compile_sweep --arch {arch}` with "
            f"the Python of an environment holding triton=={version}, then --merge: docs/compile-report.md)")


def test_the_committed_sweep_covers_what_it_did(docs):
    missing = {v: sorted(set(archs) - set(docs[v]["meta"]["archs"] if v in docs else ())) for v, archs in COVERED.items()}
    assert not any(missing.values()), missing


@pytest.mark.parametrize("version", TESTED_TRITON)
def test_a_committed_release_compiled_todays_kernels_and_configs(docs, today, version):
    doc = docs.get(version) or pytest.skip(f"no sweep committed for Triton {version} (docs/compile-report.md)")
    meta = docs[version]["meta"]
    assert meta["triton"] == version and set(meta["archs"]) <= set(compile_sweep.ARCHS)
    assert meta["fingerprint"]["kernels"] == compile_sweep.fingerprint()["kernels"], \
        "a sparse, indexer or Hadamard kernel changed since the sweep: " + _rerun(version, "every arch")
    for arch in meta["archs"]:
        stale = sorted(name for name in today[arch] if meta["configs"][arch].get(name) != today[arch][name])
        assert not stale, f"{len(stale)} problems' launch configs changed on {arch} ({stale[:4]}): " \
                          + _rerun(version, arch) + " with --match"
    assert [p.id for p in sweep_problems()] == meta["problems"]
    assert [list(c) for c in INDEXER_SWEEP] == meta["indexer"]
    assert [list(c) for c in HADAMARD_SWEEP] == meta["hadamard"]
    assert [list(c) for c in BLOCKS_SWEEP] == meta["blocks"]
    assert meta["dtypes"] == ["bf16", "fp16", "fp32"]


@pytest.mark.parametrize("version", TESTED_TRITON)
def test_every_problem_compiled_or_refused_on_every_arch(docs, version):
    doc = docs.get(version) or pytest.skip(f"no sweep committed for Triton {version}")
    seen = {(p, r["arch"]) for r in doc["rows"] for p in r["problems"]}
    refused = {(r["problem"], r["arch"]) for r in doc.get("refused", [])}
    missing = [(p, a) for p in compile_sweep.case_names(doc["meta"]) for a in doc["meta"]["archs"]
               if (p, a) not in seen | refused]
    assert not missing, missing[:10]
    assert not seen & refused
    kinds = {k: {r["kernel"] for r in doc["rows"] if r["arch"] == k} for k in doc["meta"]["archs"]}
    every = {"sparse_fwd", "sparse_fwd[range]", "sparse_pre", "sparse_dq", "sparse_dq[range]", "sparse_dkv",
             "sparse_dkv[atomic]", "sparse_dkv[range]", "sparse_reduce", "sparse_dkv_keys", "sparse_fwd[block]",
             "sparse_dq[block]", "sparse_dkv[block]", "indexer_topk", "indexer_block_scores", "hadamard"}
    assert not {a: every - k for a, k in kinds.items() if every - k}
    assert all(r["reason"] for r in doc.get("refused", []))


@pytest.mark.parametrize("version", TESTED_TRITON)
def test_no_kernel_of_the_sweep_spills_overflows_or_has_a_hazard(docs, version):
    doc = docs.get(version) or pytest.skip(f"no sweep committed for Triton {version}")
    bad = [f"{r['arch']} {r['kernel']} {r['block_m']}x{r['block_n']} w{r['num_warps']} ({r['problems'][0]}): "
           + "; ".join(r["violations"]) for r in doc["rows"] if r["violations"]]
    assert not bad, f"{len(bad)} kernels under Triton {version}:\n" + "\n".join(bad[:40])
    # the violations were computed when the sweep ran: recomputed with today's rule, they hold too
    assert not [r for r in doc["rows"] if compile_sweep.violations(r)]


def test_the_table_is_the_sweeps(docs):
    """table.md is what ``python -m bench.compile_sweep --table`` writes from the committed release files."""
    table = (SWEEP / "table.md").read_text()
    assert table == compile_sweep.format_table(docs, compile_sweep.baseline_of(SWEEP))


def test_the_tables_refuse_float32_past_256_columns_on_cuda_and_cdna():
    """configs/sparse.py ``refusal``: float32 spills at wider head blocks (absorbed 576/512, 512/512) on every CUDA
    and CDNA target, so the launchers refuse it by name (the ops take the torch backend); 16-bit inputs, 256
    columns, the interpreter and Ascend (sized by its buffer) are not refused."""
    from coreattn.kernels.configs.sparse import CUDA_TARGETS, SparseRefused, refusal, sparse_config
    from coreattn.kernels.configs.targets import CDNA_TARGETS

    for target in (*CUDA_TARGETS, *CDNA_TARGETS):
        assert "float32 with head blocks 576/512" in refusal(target, 576, 512, 4)
        assert refusal(target, 512, 512, 4) and refusal(target, 256, 512, 4)
        assert refusal(target, 256, 256, 4) is None and refusal(target, 576, 512, 2) is None
        with pytest.raises(SparseRefused, match=f"on {target}"):
            sparse_config(target, "dkv", 576, 512, 4, 16, True)
    assert refusal("interpreter", 576, 512, 4) is None and refusal("ascend", 576, 512, 4) is None


def test_the_indexer_tables_refuse_what_spills():
    """configs/indexer.py ``topk_refusal``: a q tile past 32 KB on CUDA and CDNA (both the top-k and the block-score
    kernel), and on CUDA float32's top-k kernel past a 16 KB tile or top-k 2048; not the block-score kernel there."""
    from coreattn.kernels.configs.indexer import topk_refusal

    assert topk_refusal("sm90", 128, 256, 2, 2048) and topk_refusal("gfx942", 128, 256, 2) and \
        topk_refusal("sm90", 128, 256, 2) is not None
    assert topk_refusal("sm90", 128, 128, 2, 4096) is None and topk_refusal("gfx942", 64, 128, 4, 4096) is None
    assert "float32 64 heads x 128 at top-k 2048 on sm100" in topk_refusal("sm100", 64, 128, 4, 2048)
    assert topk_refusal("sm90", 32, 128, 4, 4096) and topk_refusal("sm90", 32, 128, 4, 2048) is None
    assert topk_refusal("sm90", 64, 128, 4) is None and topk_refusal("interpreter", 64, 128, 4, 4096) is None
