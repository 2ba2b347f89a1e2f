"""The torch backend's sparse attention inputs as its two paths read them: per-sample views, key sources, units.

``SparseProblem`` holds one call's tensors in the forms the block path (``sparse_blocks.py``) and
the per-unit path (``sparse_units.py``) share: ``[B, S, ...]`` views of q / dout / out / dq (thd:
one sample), ``[B, S, Hq]`` views of lse, and k (v) copied once into a ``[B * Sk + 1, Hkv, D]``
source in its own dtype whose last row is zeros (global key row ``b * Sk + j``; masked slots read
the zero row). A unit ``u = n * Hidx + h`` (token n, index head h) covers kv heads
``[h * Hu, (h + 1) * Hu)`` and their query heads ``[h * Hu * G, (h + 1) * Hu * G)``.
"""

from __future__ import annotations

import torch


def work_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def by_sample(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``[B, S, ...]`` view of a tensor in ``fmt`` (thd: one sample)."""
    if fmt == "thd":
        return x.unsqueeze(0)
    return x if fmt == "bshd" else x.transpose(0, 1)


def lse_by_sample(lse: torch.Tensor, fmt: str) -> torch.Tensor:
    """``[B, S, Hq]`` view of lse (thd ``[Hq, T]``, padded ``[B, Hq, S]``)."""
    return lse.t().unsqueeze(0) if fmt == "thd" else lse.transpose(1, 2)


def layout_shape(q: torch.Tensor, fmt: str) -> tuple[int, int]:
    """(samples B, query positions per sample S)."""
    batch = 1 if fmt == "thd" else (q.shape[0] if fmt == "bshd" else q.shape[1])
    return batch, by_sample(q, fmt).shape[1]


def new_lse(q: torch.Tensor, fmt: str) -> torch.Tensor:
    heads = q.shape[-2]
    if fmt == "thd":
        shape = (heads, q.shape[0])
    else:
        batch, seqlen = (q.shape[0], q.shape[1]) if fmt == "bshd" else (q.shape[1], q.shape[0])
        shape = (batch, heads, seqlen)
    return q.new_empty(shape, dtype=work_dtype(q))


def key_source(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``[B * S + 1, H, D]``: x's rows (sample-major) in x's dtype, then one zero row, which the
    slots that see nothing read: one copy of x per call instead of masking every gathered chunk
    (in x's dtype: a bf16 latent key of 8k x 576 is 9 MiB here, not 18 in float32)."""
    x_bs = by_sample(x, fmt)
    batch, seqlen, heads, dim = x_bs.shape
    src = torch.empty(batch * seqlen + 1, heads, dim, dtype=x.dtype, device=x.device)
    src[:-1].view(batch, seqlen, heads, dim).copy_(x_bs)
    src[-1].zero_()
    return src


class SparseProblem:
    """One call's shapes and views (see the module docstring)."""

    def __init__(self, q, k, v, topk, key_lo, key_hi, fmt: str, softmax_scale: float, v_dim: int):
        self.fmt, self.scale, self.v_dim = fmt, softmax_scale, v_dim
        self.topk, self.key_lo, self.key_hi = topk, key_lo, key_hi
        self.batch, self.seqlen_q = layout_shape(q, fmt)
        self.seqlen_k = by_sample(k, fmt).shape[1]
        self.hq, self.hkv, self.dqk = q.shape[-2], k.shape[-2], q.shape[-1]
        self.group = self.hq // self.hkv
        self.hidx, self.topk_k = topk.shape[1], topk.shape[2]
        self.hu = self.hkv // self.hidx  # kv heads per unit
        self.work = work_dtype(q)
        self.absorbed = v is None
        self.q_bs = by_sample(q, fmt)
        self.k_src = key_source(k, fmt)
        self.v_src = None if v is None else key_source(v, fmt)
        self.zero_row = self.batch * self.seqlen_k

    @property
    def units(self) -> int:
        return self.topk.shape[0] * self.hidx

    def kv_heads(self, head: int) -> slice:
        return slice(head * self.hu, (head + 1) * self.hu)

    def q_heads(self, head: int) -> slice:
        return slice(head * self.hu * self.group, (head + 1) * self.hu * self.group)

    def where(self, units: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sample, position, index head) of units ``[C]``: indices into ``unit_view`` views."""
        n, h = units // self.hidx, units % self.hidx
        return n // self.seqlen_q, n % self.seqlen_q, h

    def unit_view(self, x_bs: torch.Tensor) -> torch.Tensor:
        """``[B, S, Hidx, Hu * G, ...]`` view of a ``[B, S, Hq, ...]`` view: indexed by ``where``."""
        return x_bs.unflatten(2, (self.hidx, self.hu * self.group))

    def sample_base(self, units: torch.Tensor) -> torch.Tensor:
        """int64 ``[C]``: the global row of key 0 of each unit's sample."""
        return units // self.hidx // self.seqlen_q * self.seqlen_k

    def accumulator(self, src: torch.Tensor) -> torch.Tensor:
        """A zeroed work-dtype accumulator shaped like a key source."""
        return torch.zeros(src.shape, dtype=self.work, device=src.device)

    def finish(self, acc: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The accumulator's real rows in ``like``'s layout and dtype."""
        heads, dim = like.shape[-2], like.shape[-1]
        grad = acc[:self.zero_row].view(self.batch, self.seqlen_k, heads, dim)
        grad = grad[0] if self.fmt == "thd" else (grad if self.fmt == "bshd" else grad.transpose(0, 1))
        return grad.to(like.dtype)
