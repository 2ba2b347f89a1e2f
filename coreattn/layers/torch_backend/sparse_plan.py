"""How the torch backend's sparse attention walks the query tokens: ranges of full rows and chunks of gathered rows.

A query token's row is **full** when the keys it may see are its whole bounds: every position of
``[lo, hi)`` (``key_lo``/``key_hi`` clipped to its sample) is named by every index head of its
prepared row. On a sequence shorter than the top-k (and on the first top-k tokens of any causal
sequence) every row is full: DSA is then plain causal attention. Consecutive full rows of one
sample are **range blocks**: their keys are one contiguous slice of k, read in place (no gather),
and the block's q heads take one product against it, masked per row to its own ``[lo, hi)``. The
other rows are **gather chunks**: each token's named keys gathered, as many slots per row as the
chunk's longest row holds (the prepared rows are compact, so unused slots are never visited).

The plan reads the indices and bounds on the host, so it is made only where coreattn may read
values (``coreattn.layers.checks.reads_values``: CPU by default). Elsewhere (a device, where a read
is a sync) the backend gathers every slot of every row in fixed chunks, as the kernels' prepared
rows allow without reading them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from coreattn.layers.checks import reads_values


class Segment(NamedTuple):
    """Query tokens ``[n0, n1)`` (flat n = b * S + s) of one sample ``b`` (range blocks) or of any
    samples (gather chunks)."""

    n0: int
    n1: int
    k0: int  # range block: the keys [k0, k1) of sample b every row of the block reads; gather: -1
    k1: int
    width: int  # gather chunk: slots visited per row (<= K); range block: 0
    b: int = 0

    @property
    def is_range(self) -> bool:
        return self.k0 >= 0


def uniform(tokens: int, step: int, n_slots: int) -> list[Segment]:
    """Gather chunks of ``step`` tokens visiting every slot: the plan when nothing may be read."""
    return [Segment(n0, min(n0 + step, tokens), -1, -1, n_slots) for n0 in range(0, tokens, max(1, step))]


def _full_rows(topk: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """bool [N]: every index head names all of the row's ``[lo, hi)`` (and it is not empty). The
    prepared entries are distinct, so counting those inside the bounds suffices."""
    inside = ((topk >= lo[:, None, None]) & (topk < hi[:, None, None])).sum(-1)  # [N, Hidx]
    return (inside == (hi - lo)[:, None]).all(-1) & (hi > lo)


def plan(topk: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, seqlen_q: int, seqlen_k: int,
         range_elements: int, max_range_rows: int, gather_slots: int, gather_step: int) -> list[Segment]:
    """The segments in token order. ``range_elements``: the most (rows x keys) one range block may
    hold; ``max_range_rows``: its most rows; ``gather_slots``: the most (rows x slots) one gather
    chunk may visit; ``gather_step``: the chunk size when nothing may be read (``uniform``)."""
    tokens, n_slots = topk.shape[0], topk.shape[-1]
    if not reads_values(topk):
        return uniform(tokens, gather_step, n_slots)
    lo = key_lo.to(torch.int64).clamp(0, seqlen_k)
    hi = torch.maximum(key_hi.to(torch.int64).clamp(max=seqlen_k), lo)
    full = _full_rows(topk, lo, hi).tolist()
    counts = (topk >= 0).sum(-1).amax(-1).tolist() if n_slots else [0] * tokens
    lo, hi = lo.tolist(), hi.tolist()
    per_sample = max(seqlen_q, 1)
    segments: list[Segment] = []
    n = 0
    while n < tokens:
        b = n // per_sample
        end_of_sample = min((b + 1) * per_sample, tokens)
        if full[n]:
            k0, k1, n1 = lo[n], hi[n], n + 1
            # a row joins while its keys touch the block's (the block's keys are then every key some row sees)
            while (n1 < end_of_sample and full[n1] and n1 - n < max_range_rows and lo[n1] <= k1
                   and hi[n1] >= k0):
                j0, j1 = min(k0, lo[n1]), max(k1, hi[n1])
                if (n1 + 1 - n) * (j1 - j0) > range_elements:
                    break
                k0, k1, n1 = j0, j1, n1 + 1
            segments.append(Segment(n, n1, k0, k1, 0, b))
        else:
            width, n1 = counts[n], n + 1
            while n1 < tokens and not full[n1]:
                w = max(width, counts[n1])
                if (n1 + 1 - n) * max(w, 1) > gather_slots:
                    break
                width, n1 = w, n1 + 1
            segments.append(Segment(n, n1, -1, -1, width))
        n = n1
    return segments
