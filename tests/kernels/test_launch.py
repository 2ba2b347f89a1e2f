"""The one launch seam (coreattn/kernels/launch.py): every grid fitted to its target's limits.

CUDA's grid x <= 2**31 - 1 and y/z <= 65,535 (the interpreter checks the same), HIP's programs x 64 x
num_warps < 2**32 work-items per dispatch, Ascend's 65,535 programs. A launch past them loops (its
kernel's ``PERSISTENT`` mode over the largest grid that fits) or raises naming the limit; nothing is
launched past it. The looped launch computes what the one-program-per-task launch computes: checked
bitwise on the dense and sparse kernels under the interpreter with the limit shrunk to a few programs.
"""

from __future__ import annotations

import pytest
import torch

from attn_cases import KERNEL_DEVICE
from coreattn.kernels import launch as seam
from coreattn.kernels.launch import GridLimitError, fit_grid, fits, max_programs


def test_limits_per_target():
    assert max_programs("sm90") == max_programs("interpreter") == 2**31 - 1
    assert max_programs("gfx942", 4) == (2**32 - 1) // 256 == 2**24 - 1  # 2**24 programs at 4 waves fail
    assert max_programs("gfx942", 8) == 2**23 - 1 and max_programs("gfx90a", 1) == 2**26 - 1
    assert max_programs("ascend") == 65535
    assert fits("sm90", (2**31 - 1,)) and not fits("sm90", (2**31,))
    assert fits("sm90", (1, 65535, 65535)) and not fits("sm90", (1, 65536)) and not fits("sm100", (1, 1, 65536))
    assert fits("gfx942", (2**24 - 1,), 4) and not fits("gfx942", (2**24,), 4)
    assert not fits("gfx942", (2**23, 2), 4)  # work-items count the whole grid


def test_a_grid_past_the_limit_loops_or_raises_naming_it():
    assert fit_grid("sm90", (1000,), 4, loops=False) == ((1000,), False)
    assert fit_grid("gfx942", (2**24,), 4, loops=True) == ((2**24 - 1,), True)
    with pytest.raises(GridLimitError, match="HIP's 2\\*\\*32 work-items"):
        fit_grid("gfx942", (2**24,), 4, loops=False)
    with pytest.raises(GridLimitError, match="CUDA's grid x"):
        fit_grid("sm90", (2**31,), 4, loops=False)
    with pytest.raises(GridLimitError, match="int32 task counter"):  # the looped counter would pass 2**31 - 1
        fit_grid("gfx942", (2**31 - 2**23,), 4, loops=True)
    with pytest.raises(GridLimitError, match="cannot loop"):  # a 2D grid cannot be looped
        fit_grid("sm90", (4, 70000), 4, loops=True)


class _Kernel:
    """Stands in for a Triton kernel: records the grid and the options it is launched with."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, kwargs))


def test_launch_passes_the_fitted_grid_and_persistent():
    kernel = _Kernel()
    seam.launch("gfx942", kernel, (2**25,), 1, 2, num_warps=2, PERSISTENT=False)
    seam.launch("gfx942", kernel, (2**20,), num_warps=2, PERSISTENT=False)
    seam.launch("sm90", kernel, (2**25,), PERSISTENT=False)
    assert kernel.calls == [((2**25 - 1,), dict(num_warps=2, PERSISTENT=True)),
                            ((2**20,), dict(num_warps=2, PERSISTENT=False)), ((2**25,), dict(PERSISTENT=False))]
    with pytest.raises(GridLimitError):  # no PERSISTENT mode: never launched past the limit
        seam.launch("gfx942", kernel, (2**25,), num_warps=4)
    assert len(kernel.calls) == 3


def _shrunk(monkeypatch, programs: int):
    """The interpreter's limit shrunk to ``programs``: its launches past it loop."""
    real = seam.max_programs
    monkeypatch.setattr(seam, "max_programs", lambda target, num_warps=4: programs if target == "interpreter"
                        else real(target, num_warps))


@pytest.mark.interpreter_only("runs the kernels' looped mode under the interpreter")
def test_looped_launches_equal_one_program_per_task(monkeypatch):
    """Dense varlen forward + backward and sparse forward + backward (both dK/dV schedules) with every
    launch past 3 programs looped: bitwise the results of the unlooped launches."""
    from coreattn.kernels import attn_bwd, attn_fwd, sparse_bwd, sparse_fwd
    from coreattn.kernels.packing import packed
    from coreattn.kernels.sparse_index import prepare_topk

    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=KERNEL_DEVICE)
    q, k, v, dout = (torch.randn(12, h, 16, generator=gen).to(KERNEL_DEVICE) for h in (2, 1, 1, 2))
    topk = prepare_topk(torch.randint(-1, 12, (12, 6), generator=gen).to(KERNEL_DEVICE), "thd")
    lo = torch.zeros(12, dtype=torch.int32, device=KERNEL_DEVICE)
    hi = torch.arange(1, 13, dtype=torch.int32, device=KERNEL_DEVICE)

    def run():
        out, lse = attn_fwd.varlen_attn_fwd(q, k, v, packed(cu), packed(cu), 7, 0.25, -1, 0, True)
        dense = (out, lse, *attn_bwd.varlen_attn_bwd(dout, q, k, v, out, lse, packed(cu), packed(cu), 7, 7, 0.25,
                                                     -1, 0, True))
        s_out, s_lse = sparse_fwd.sparse_attn_fwd(q, k, v, topk, lo, hi, "thd", 0.25)
        sparse = [s_out, s_lse]
        for schedule in sparse_bwd.SCHEDULES:
            sparse += sparse_bwd.sparse_attn_bwd(dout, q, k, v, s_out, s_lse, topk, lo, hi, "thd", 0.25,
                                                 schedule=schedule)
        return [*dense, *sparse]

    plain = run()
    looped_grids = []
    real_fit = seam.fit_grid

    def spy(*args, **kwargs):
        grid, looped = real_fit(*args, **kwargs)
        looped_grids.append(looped)
        return grid, looped

    _shrunk(monkeypatch, 3)
    monkeypatch.setattr(seam, "fit_grid", spy)
    looped = run()
    assert sum(looped_grids) >= 6, looped_grids  # the attention and sparse kernels' launches looped
    for a, b in zip(plain, looped):
        assert torch.equal(a, b)


@pytest.mark.interpreter_only("runs the indexer's and the Hadamard kernels under the interpreter")
def test_kernels_without_a_looped_mode_launch_per_slice(monkeypatch):
    """The indexer's top-k and the Hadamard rotation, whose grids follow the tokens and which have no
    looped mode: past the limit (shrunk to 2 programs) one launch per slice of rows, bitwise the same."""
    from coreattn.kernels.hadamard import hadamard_fwd
    from coreattn.kernels.indexer_topk import indexer_topk_fwd

    gen = torch.Generator().manual_seed(1)
    q, k, w = (torch.randn(*s, generator=gen).to(KERNEL_DEVICE) for s in ((7, 2, 16), (7, 16), (7, 2)))
    lo = torch.zeros(7, dtype=torch.int32, device=KERNEL_DEVICE)
    hi = torch.arange(1, 8, dtype=torch.int32, device=KERNEL_DEVICE)
    x = torch.randn(37, 24, generator=gen).to(KERNEL_DEVICE)

    def run():
        return (*indexer_topk_fwd(q, k, w, lo, hi, 4, "thd", return_scores=True), hadamard_fwd(x, 0.5))

    plain = run()
    assert seam.slices("interpreter", 7) == [(0, 7)]
    _shrunk(monkeypatch, 2)
    assert seam.slices("interpreter", 7) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    for a, b in zip(plain, run()):
        assert torch.equal(a, b)
