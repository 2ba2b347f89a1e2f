"""The indexer loss with the attention heads split over tensor-parallel ranks (``tp_group``, as Megatron
splits them): on a 2-process gloo group, each rank holding half of the query heads and the whole
(duplicated) indexer side, the top-k, the loss and the gradients equal one process with all heads,
dense and sparse. The summed attention target is all-reduced chunk by chunk."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from coreattn.layers.dsa import indexer as ix

WORLD, TOKENS, HEADS, TOPK = 2, 29, 8, 5
CU = [0, 11, 11, 29]


def _inputs():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(TOKENS, 4, 16, generator=g), torch.randn(TOKENS, 16, generator=g),
            torch.rand(TOKENS, 4, generator=g) - 0.3, torch.randn(TOKENS, HEADS, 24, generator=g),
            torch.randn(TOKENS, 1, 24, generator=g))


def _run(query, key, sparse: bool, group=None):
    q, k, w, _, _ = _inputs()
    leaves = [t.requires_grad_() for t in (q, k, w)]
    idx, loss = ix.indexer_topk_and_loss(*leaves, query, key, TOPK, 0.2, 0.5, sparse=sparse, layout="thd",
                                         cu_seqlens=torch.tensor(CU, dtype=torch.int32), tp_group=group,
                                         backend="torch")
    loss.backward()
    return [idx, loss.detach(), *(t.grad for t in leaves)]


def _worker(rank: int, init_file: str, out_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        _, _, _, query, key = _inputs()
        local = query[:, rank * HEADS // WORLD:(rank + 1) * HEADS // WORLD]  # this rank's attention heads
        results = {sparse: _run(local, key, sparse, dist.group.WORLD) for sparse in (False, True)}
        if rank == 0:
            torch.save(results, out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_tensor_parallel_heads(sparse, tmp_path_factory):
    out = tmp_path_factory.getbasetemp() / "indexer_tp.pt"
    if not out.exists():
        mp.spawn(_worker, args=(str(tmp_path_factory.mktemp("tp") / "init"), str(out)), nprocs=WORLD, join=True)
    split = torch.load(out)[sparse]
    _, _, _, query, key = _inputs()
    whole = _run(query, key, sparse)
    assert torch.equal(split[0], whole[0])
    for name, a, b in zip(("loss", "dq", "dk", "dw"), split[1:], whole[1:]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7 * b.abs().max()), name
