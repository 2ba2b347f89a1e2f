"""The dropout keep-mask function (coreattn/kernels/dropout.py): Philox-4x32-10 in torch integer ops,
checked against the published known-answer vectors and against Triton's own tl.philox."""

import math

import pytest
import torch
import triton
import triton.language as tl

from attn_cases import KERNEL_DEVICE
from coreattn.kernels.dropout import check_dropout_p, keep_mask, keep_threshold, philox, rng_state, with_head_offset

# Random123's known-answer vectors for philox4x32-10: counter, key (k0, k1), output
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def _seed(k0: int, k1: int) -> torch.Tensor:
    """The int64 whose two's-complement bits are the key (k1 high, k0 low)."""
    value = (k1 << 32) | k0
    return torch.tensor(value - 2**64 if value >= 2**63 else value, dtype=torch.int64)


@pytest.mark.parametrize("ctr, key, expected", KAT, ids=["zeros", "ones", "pi"])
def test_philox_known_answers(ctr, key, expected):
    out = philox(_seed(*key), *(torch.tensor(c, dtype=torch.int64) for c in ctr))
    assert [int(w) for w in out] == list(expected)


@triton.jit
def _philox_kernel(out_ptr, seed_ptr, c0_ptr, c1_ptr, c2, c3, N: tl.constexpr):
    offs = tl.arange(0, N)
    c0 = tl.load(c0_ptr + offs)
    r0, _, _, _ = tl.philox(tl.load(seed_ptr), c0, tl.load(c1_ptr + offs), c2 + c0 * 0, c3 + c0 * 0)
    tl.store(out_ptr + offs, r0.to(tl.int32, bitcast=True))


def test_philox_matches_triton():
    """On the kernels' device: the interpreter on CPU, the compiled tl.philox on a GPU."""
    gen = torch.Generator().manual_seed(1)
    n = 64
    seed = torch.randint(-2**63, 2**63 - 1, (1,), dtype=torch.int64, generator=gen)
    c0 = torch.randint(0, 2**31 - 1, (n,), dtype=torch.int32, generator=gen)
    c1 = torch.randint(0, 2**31 - 1, (n,), dtype=torch.int32, generator=gen)
    out = torch.empty(n, dtype=torch.int32, device=KERNEL_DEVICE)
    _philox_kernel[(1,)](out, seed.to(KERNEL_DEVICE), c0.to(KERNEL_DEVICE), c1.to(KERNEL_DEVICE), 7, 12345, N=n)
    assert torch.equal(out.cpu().long() & 0xFFFFFFFF, philox(seed[0], c0.long(), c1.long(), 7, 12345)[0])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_within_binomial_bound(p):
    state = rng_state(torch.device("cpu"), torch.Generator().manual_seed(3))
    keep = keep_mask(state, p, torch.arange(4)[:, None, None], torch.arange(96)[None, :, None],
                     torch.arange(128)[None, None, :])
    n = keep.numel()
    rate = keep.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) < 6 * sigma, f"keep rate {rate} for p={p} over {n} draws"


def test_zero_dropout_keeps_everything_and_threshold_is_exact():
    state = rng_state(torch.device("cpu"), torch.Generator().manual_seed(0))
    assert keep_mask(state, 0.0, 0, torch.arange(50)[:, None], torch.arange(50)[None, :]).all()
    assert keep_threshold(0.5) == 2**30 and keep_threshold(0.0) == 0


def test_rng_state_follows_the_generator():
    a = rng_state(torch.device("cpu"), torch.Generator().manual_seed(5))
    b = rng_state(torch.device("cpu"), torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(5)
    first, second = rng_state(torch.device("cpu"), gen), rng_state(torch.device("cpu"), gen)
    assert torch.equal(a, b) and torch.equal(a, first) and not torch.equal(first, second)
    assert a.dtype == torch.int64 and a.shape == (3,) and a[2] == 0  # seed, offset, head offset


@pytest.mark.parametrize("bad, exc", [(1.0, ValueError), (-0.1, ValueError), (float("nan"), ValueError),
                                      (True, TypeError), ("0.1", TypeError)])
def test_check_dropout_p_rejects(bad, exc):
    with pytest.raises(exc, match="dropout_p"):
        check_dropout_p(bad)


def test_head_offset_shifts_the_heads():
    """A call on heads [2, 4) of a layer with the state's head offset 2 draws those heads' mask."""
    state = rng_state(torch.device("cpu"), torch.Generator().manual_seed(4))
    q_ids, k_ids = torch.arange(16)[None, :, None], torch.arange(16)[None, None, :]
    whole = keep_mask(state, 0.5, torch.arange(4)[:, None, None], q_ids, k_ids)
    part = keep_mask(with_head_offset(state, 2), 0.5, torch.arange(2)[:, None, None], q_ids, k_ids)
    assert torch.equal(part, whole[2:]) and not torch.equal(part, whole[:2])
