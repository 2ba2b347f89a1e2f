"""Work per attention program does not grow with the number of sequences (issue 21).

Under Triton's interpreter, at a fixed token count cut into B one-block sequences, each attention
kernel (forward, dK/dV, dQ) is launched by its real launcher with the grid capped: at 1 program
and at 1 + EXTRA, so the difference of the fastest of three runs each (the batch sizes
alternating) is the time of EXTRA programs without the launch's fixed cost. Those programs are real tiles (each a whole one-token-block sequence), so every B
does the same attention work per program; only finding the sequence and checking the layout
could grow with B. The bound is generous (2x between the smallest and the largest B) and is on
interpreter time, which counts operations, not GPU speed. Before the tile map (each program
scanning all B entries of both sides) the per-program time grew about 5x from B = 256 to 2048
(notes/issue-21.md).
"""

import time

import pytest
import torch

from attn_cases import KERNEL_DEVICE
from coreattn.kernels import attn_bwd, attn_fwd, varlen_attn_bwd, varlen_attn_fwd
from coreattn.kernels.packing import packed

pytestmark = pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="counts interpreter work, not GPU time")

TOKENS = 2048
BATCHES = (256, 2048)  # one-block sequences of 8 and 1 tokens
EXTRA = 24  # programs timed on top of the first
KERNELS = {"fwd": (attn_fwd, "_varlen_attn_fwd_kernel"), "dkdv": (attn_bwd, "_attn_bwd_dkdv_kernel"),
           "dq": (attn_bwd, "_attn_bwd_dq_kernel")}


class _Capped:
    """Stands in for a kernel: each launch runs the real kernel on 1 and on 1 + EXTRA programs
    and records both times."""

    def __init__(self, real, seen: list):
        self.real, self.seen = real, seen

    def __getitem__(self, grid):
        assert len(grid) == 1 and grid[0] > EXTRA, grid

        def launch(*args, **kwargs):
            spent = []
            for n in (1, 1 + EXTRA):
                start = time.perf_counter()
                self.real[(n,)](*args, **kwargs)
                spent.append(time.perf_counter() - start)
            self.seen.append(spent)
        return launch


def _launch_times(monkeypatch, batch: int, seen: dict) -> None:
    """One forward + backward of ``batch`` one-block sequences, each kernel's times appended to
    ``seen[name][batch]``."""
    for name, (module, attr) in KERNELS.items():
        monkeypatch.setattr(module, attr, _Capped(getattr(module, attr), seen[name].setdefault(batch, [])))
    length = TOKENS // batch
    cu = torch.arange(0, TOKENS + 1, length, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(TOKENS, 1, 16, generator=gen) for _ in range(3))
    out, lse = varlen_attn_fwd(q, k, v, packed(cu), packed(cu), length, 0.25, -1, 0, True)
    varlen_attn_bwd(torch.ones_like(out), q, k, v, out, lse, packed(cu), packed(cu), length, length, 0.25, -1, 0,
                    True)
    monkeypatch.undo()


def per_program(monkeypatch, batches=BATCHES, runs: int = 3) -> dict:
    """{kernel: {batch: seconds per program}}: the fastest of ``runs`` runs, the batches
    alternating so that a shared machine's load falls on each alike."""
    seen = {name: {} for name in KERNELS}
    for _ in range(runs):
        for batch in batches:
            _launch_times(monkeypatch, batch, seen)
    return {name: {batch: (min(t[1] for t in times) - min(t[0] for t in times)) / EXTRA
                   for batch, times in by_batch.items()} for name, by_batch in seen.items()}


def test_time_per_program_does_not_grow_with_the_batch(monkeypatch):
    times = per_program(monkeypatch)
    first, last = BATCHES[0], BATCHES[-1]
    figures = {name: f"{t[first] * 1e3:.1f} -> {t[last] * 1e3:.1f} ms" for name, t in times.items()}
    assert all(t[last] <= 2 * t[first] for t in times.values()), figures
