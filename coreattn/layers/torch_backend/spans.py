"""Where the torch backend's sequences sit: spans read once on the host and checked.

Each sequence b of a call is a span of q rows and a span of k rows in the layout
(coreattn/kernels/packing.py): packed thd (cu_seqlens, or start/length spans for seqused), or a
sample of a padded bshd/sbhd batch. The starts and lengths, and for ``[B, S]`` keep masks the
first kept position, the kept count and whether kept tokens leave holes, are computed on the
tensors' device and read in one transfer (free on the CPU, one host sync elsewhere). The torch
backend never relies on max_seqlen: everything it sizes comes from here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from coreattn.kernels.packing import Packing, seq_len_dim


class SideSpans(NamedTuple):
    """One side (q or k) of a call, as host int64 tensors [B]."""

    start: torch.Tensor  # first row of sequence b in the layout (thd row, or position in sample b)
    length: torch.Tensor  # rows in the span (positions inside count for causal/window alignment)
    kept_start: torch.Tensor  # keep masks: first kept position (start + length when none is kept)
    kept_len: torch.Tensor  # keep masks: kept positions in the span (length without a mask)
    holes: bool  # some span's kept positions are not contiguous


class Spans(NamedTuple):
    q: SideSpans
    k: SideSpans

    @property
    def batch(self) -> int:
        return self.q.start.numel()


def _starts_lengths(pack: Packing) -> tuple[torch.Tensor, torch.Tensor]:
    if not pack.spans:
        return pack.seq[:-1].long(), (pack.seq[1:] - pack.seq[:-1]).long()
    return pack.seq.long(), pack.lens.long()


def _kept_runs(pack: Packing, start: torch.Tensor, length: torch.Tensor) -> list[torch.Tensor]:
    """[first kept position, kept count, last kept position] per span ([B] each, on the device)."""
    keep = pack.keep
    pos = torch.arange(keep.shape[1], device=keep.device)[None, :]
    kept = (keep != 0) & (pos >= start[:, None]) & (pos < (start + length)[:, None])  # [B, S]
    n = kept.sum(1)
    first = torch.where(kept, pos, start[:, None] + length[:, None]).amin(1) if keep.shape[1] else start + length
    last = torch.where(kept, pos, start[:, None] - 1).amax(1) if keep.shape[1] else start - 1
    return [first, n, last]


def read_spans(q: torch.Tensor, k: torch.Tensor, q_pack: Packing, k_pack: Packing) -> Spans:
    """Both sides' spans on the host (one read of device values). Raises ValueError on malformed
    cu_seqlens or spans, which the public functions check only on CPU or with COREATTN_VALIDATE."""
    fields, layout = [], []
    for x, pack in ((q, q_pack), (k, k_pack)):
        start, length = _starts_lengths(pack)
        fields += [start, length]
        if pack.keep is not None and start.numel():
            fields += _kept_runs(pack, start, length)
        layout.append(pack.keep is not None and start.numel() > 0)
    host = torch.stack(fields).cpu() if fields[0].numel() else torch.zeros(len(fields), 0, dtype=torch.long)
    sides, i = [], 0
    for (x, pack), has_keep in zip(((q, q_pack), (k, k_pack)), layout):
        start, length = host[i], host[i + 1]
        i += 2
        n_tokens = seq_len_dim(x, pack.fmt)
        bad = (start < 0) | (length < 0) | (start + length > n_tokens)
        if not pack.spans and start.numel():
            cu_first, cu_last = int(start[0]), int(start[-1] + length[-1])
            bad = bad | (cu_first != 0) | (cu_last != n_tokens)
        if bool(bad.any()):
            what = "spans (start/length or seqused)" if pack.spans else "cu_seqlens"
            raise ValueError(f"malformed {what}: a sequence does not fit in the {n_tokens} tokens (or cu_seqlens "
                             "does not run from 0 to the token count without decreasing)")
        if has_keep:
            first, n, last = host[i], host[i + 1], host[i + 2]
            i += 3
            holes = bool(((n > 0) & (last - first + 1 != n)).any())
        else:
            first, n, holes = start, length, False
        sides.append(SideSpans(start, length, first, n, holes))
    return Spans(*sides)
