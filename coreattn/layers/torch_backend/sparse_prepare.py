"""A stand-in for ``coreattn.kernels.sparse_index.prepare_topk`` (the kernels' index preparation) until
that lands: the same contract, in torch ops, no host sync. Deleted when the kernels branch is merged.
"""

from __future__ import annotations

import torch

_INT32_MAX = 2**31 - 1


def prepare_topk(indices: torch.Tensor, topk_length: torch.Tensor | None = None) -> torch.Tensor:
    """int32 ``[N, Hidx, K]`` contiguous from integer ``indices [N, Hidx, K]``: each row sorted
    ascending, with every negative entry, every entry at slot >= ``topk_length[n]`` (``[N]``) and
    every repeat of a key set to -1 (set semantics: a key named twice counts once)."""
    idx = indices.to(torch.int64)
    if topk_length is not None:
        slot = torch.arange(idx.shape[-1], device=idx.device)
        idx = torch.where(slot < topk_length.to(torch.int64)[:, None, None], idx, -1)
    idx = idx.clamp(-1, _INT32_MAX)
    idx = idx.sort(dim=-1).values
    repeat = torch.zeros_like(idx, dtype=torch.bool)
    repeat[..., 1:] = idx[..., 1:] == idx[..., :-1]
    return idx.masked_fill(repeat, -1).sort(dim=-1).values.to(torch.int32).contiguous()
