"""Packed sequences given by position ids (transformers' packed SFT without a mask): cu_seqlens are
derived on the device without a host sync, at a fixed capacity of T + 1 entries, and nothing is
cached on the tensor (a CUDA graph that copies new ids into its static input reads them afresh).
The GPU side (capture and replay against eager) is in tests/test_gpu.py."""

import pytest
import torch

import coreattn
from coreattn.layers import function
from coreattn.layers.function import POSITION_IDS, cu_seqlens_from_position_ids
from coreattn.kernels.packing import Packing
from coreattn.layers.checks import VarlenParams

from attn_cases import max_err

ROWS = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0, 1, 2]])


@pytest.mark.parametrize("compact", [True, False])
def test_cu_seqlens_from_position_ids(compact):
    cu = cu_seqlens_from_position_ids(ROWS, 18, compact)
    want = [0, 3, 5, 9, 15, 18]
    assert cu.dtype == torch.int32
    assert cu.tolist() == (want if compact else want + [18] * (19 - len(want)))
    # one row standing for every row of the batch, and a 1D row
    one = cu_seqlens_from_position_ids(torch.arange(4), 8, compact)
    assert one.tolist() == ([0, 4, 8] if compact else [0, 4, 8] + [8] * 6)


def test_no_cache_on_the_tensor():
    pos = ROWS.clone()
    first = cu_seqlens_from_position_ids(pos, 18, compact=False)
    pos.copy_(torch.arange(9).expand(2, 9))  # a graph replay's new ids, copied into the same tensor
    second = cu_seqlens_from_position_ids(pos, 18, compact=False)
    assert first[:6].tolist() == [0, 3, 5, 9, 15, 18]
    assert second[:3].tolist() == [0, 9, 18] and (second[3:] == 18).all()


def test_device_path_reads_nothing_back(monkeypatch):
    """The fixed-capacity form never asks for a value on the host (nonzero, item, tolist, bool)."""
    def forbidden(*args, **kwargs):
        raise AssertionError("host read in the position-ids path")

    pos = ROWS.clone()
    for name in ("nonzero", "item", "tolist", "__bool__", "__int__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    monkeypatch.setattr(torch, "nonzero", forbidden)
    cu_seqlens_from_position_ids(pos, 18, compact=False)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_capacity_padded_cu_seqlens_match_compact(backend):
    """The kernels and the torch backend on the T + 1 capacity (trailing zero-length sequences)
    give what the compact cu_seqlens give, forward and backward."""
    torch.manual_seed(0)
    tokens, heads, dim = 18, 2, 16
    q, k, v = (torch.randn(tokens, heads, dim, requires_grad=True) for _ in range(3))
    dout = torch.randn(tokens, heads, dim)
    results = []
    for compact in (True, False):
        cu = cu_seqlens_from_position_ids(ROWS, tokens, compact)
        out = coreattn.varlen_attn(q, k, v, cu, cu, tokens, tokens, causal=True, backend=backend)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        results.append((out, *grads))
    for a, b in zip(*results):
        assert max_err(a, b) == 0


def test_position_ids_layout_through_the_op():
    """coreattn's op on the thd_position_ids layout equals varlen_attn on the compact cu_seqlens."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(18, 2, 16) for _ in range(3))
    pack = Packing(POSITION_IDS, ROWS)
    params = VarlenParams(16 ** -0.5, -1, 0, True)
    out, _, _ = function.attention(q, k, v, pack, pack, 18, 18, params)
    cu = cu_seqlens_from_position_ids(ROWS, 18)
    want = coreattn.varlen_attn(q, k, v, cu, cu, 18, 18, causal=True)
    assert max_err(out, want) == 0
