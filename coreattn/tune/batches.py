"""The packed batches the tuner times each candidate on, and their tensors.

Shaped like the packed batches training sees: long documents (4 x 16,384 tokens) and short
documents (32 x 2,048), a 64K-token micro-batch each, and the many-short-sequences batches of RL
rollouts and short-chat SFT packing, about 1M tokens each (4,096 x 256, 16,384 x 64 and 65,536 x
16: issue 21's scheduling rows). ``--quick`` takes a quarter of every batch; on a GPU with little
memory the token counts shrink to fit (``fit_tokens``). Every candidate of a kernel is timed on
every batch; the tuner ranks them by the geometric mean of their time ratios to the shipped
config, so each batch shape counts alike.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from coreattn.kernels.packing import Packing, packed

HEADS_Q = 8  # q heads; kv heads are HEADS_Q, or HEADS_Q // GQA_GROUP for a GQA class
GQA_GROUP = 4
# (name, sequence length, tokens at full size); the sequence count follows
SHAPES = (("long-docs-16k", 16384, 2**16), ("short-docs-2k", 2048, 2**16), ("many-short-256", 256, 2**20),
          ("many-short-64", 64, 2**20), ("many-short-16", 16, 2**20))
MAX_TOKENS = max(tokens for _, _, tokens in SHAPES)


class Batch(NamedTuple):
    name: str
    seqlens: tuple[int, ...]

    @property
    def id(self) -> str:
        return f"{self.name} ({len(self.seqlens)} x {self.seqlens[0]})"


def batches(quick: bool = False, max_tokens: int = MAX_TOKENS) -> list[Batch]:
    """The batches, a quarter of each with ``quick``, none over ``max_tokens`` tokens (``fit_tokens``)."""
    out = []
    for name, length, tokens in SHAPES:
        tokens = min(tokens // 4 if quick else tokens, max_tokens)
        out.append(Batch(name, (length,) * max(1, tokens // length)))
    return out


def bytes_per_token(dim_qk: int, dim_v: int, elem: int, heads_kv: int) -> int:
    """Device bytes per token of a timed backward: q, dq (Hq x Dqk); k, dk (Hkv x Dqk); v, dv
    (Hkv x Dv); out, dout (Hq x Dv); lse, delta (fp32 per q head); x 1.5 for the forward's copy."""
    per = elem * (2 * HEADS_Q * dim_qk + 2 * heads_kv * (dim_qk + dim_v) + 2 * HEADS_Q * dim_v) + 8 * HEADS_Q
    return per * 3 // 2


def fit_tokens(free_bytes: int, dim_qk: int, dim_v: int, elem: int, heads_kv: int,
               requested: int = MAX_TOKENS) -> int:
    """The largest batch's token count, halved until one batch takes at most half the free memory."""
    tokens = requested
    while tokens > 4096 and tokens * bytes_per_token(dim_qk, dim_v, elem, heads_kv) > free_bytes // 2:
        tokens //= 2
    return tokens


class BatchTensors(NamedTuple):
    q: torch.Tensor  # [T, Hq, Dqk]
    k: torch.Tensor  # [T, Hkv, Dqk]
    v: torch.Tensor  # [T, Hkv, Dv]
    dout: torch.Tensor  # [T, Hq, Dv]
    pack: Packing
    max_seqlen: int


def make_tensors(batch: Batch, dim_qk: int, dim_v: int, dtype: torch.dtype, heads_kv: int, device,
                 seed: int = 0) -> BatchTensors:
    gen = torch.Generator(device=device).manual_seed(seed)
    total = sum(batch.seqlens)
    cu = torch.zeros(len(batch.seqlens) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(torch.tensor(batch.seqlens, dtype=torch.int32, device=device), 0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    return BatchTensors(rand(total, HEADS_Q, dim_qk), rand(total, heads_kv, dim_qk), rand(total, heads_kv, dim_v),
                        rand(total, HEADS_Q, dim_v), packed(cu), max(batch.seqlens))
