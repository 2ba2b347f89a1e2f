"""The sparse launch tables' refusals (coreattn/kernels/configs/sparse.py ``refusal``): the configurations no config
compiles without spilling, which the sparse ops run on the torch backend with the reason. What the tables compile to
is held by the sparse sweep (``python -m bench.compile_sweep``, every configuration class on sm90, sm100 and CDNA,
static compiler output); the compile tests of the CI lanes (test_kernel_structure.py, test_indexer_structure.py,
test_pipeline_hazards.py) compile a representative subset live under every release.
"""

import pytest


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
