"""Packed attention inputs for one configuration (one input set per seed)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from bench.configs import AttnConfig
from bench.seqlens import draw_seqlens


class AttnInputs(NamedTuple):
    q: torch.Tensor  # [T, Hq, Dqk]
    k: torch.Tensor  # [T, Hkv, Dqk]
    v: torch.Tensor  # [T, Hkv, Dv]
    cu_seqlens: torch.Tensor  # int32 [B+1], the same for q and k (self-attention)
    seqlens: list[int]
    max_seqlen: int
    softmax_scale: float


def make_inputs(cfg: AttnConfig, dtype: torch.dtype, device: torch.device, seed: int,
                requires_grad: bool = True) -> AttnInputs:
    seqlens = draw_seqlens(cfg.dist, cfg.total_tokens)  # the batch is fixed; only the values vary
    gen = torch.Generator(device=device).manual_seed(seed)
    t = cfg.total_tokens

    def randn(*shape):
        x = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
        return x.requires_grad_(requires_grad)

    cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(seqlens).cumsum(0)
    return AttnInputs(randn(t, cfg.heads_q, cfg.head_dim_qk), randn(t, cfg.heads_kv, cfg.head_dim_qk),
                      randn(t, cfg.heads_kv, cfg.head_dim_v), cu.to(device), seqlens, max(seqlens),
                      1.0 / math.sqrt(cfg.head_dim_qk))


def input_set_bytes(cfg: AttnConfig, dtype: torch.dtype) -> int:
    """Bytes of one input set with its gradients and the output (what each extra set costs)."""
    elt = torch.empty((), dtype=dtype).element_size()
    per_token = cfg.heads_q * cfg.head_dim_qk + cfg.heads_kv * (cfg.head_dim_qk + cfg.head_dim_v)
    return cfg.total_tokens * (2 * per_token + 2 * cfg.heads_q * cfg.head_dim_v) * elt
