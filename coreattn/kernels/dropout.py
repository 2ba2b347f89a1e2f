"""Attention dropout's keep mask: one counter-based function that every backend computes alike.

Whether probability P[h, i, j] is kept depends only on the call's RNG state (seed, offset), the
q head h and the global token ids of query i and key j, never on block sizes, grid shape or
backend, so the forward and the backward regenerate the same mask, Triton on a GPU, Ascend or
the interpreter and the torch backend give the same mask for a seed, and context-parallel ranks
(which pass global token ids) drop what a single device would.

The generator is Philox-4x32-10 (Salmon et al., SC'11), as Triton's ``tl.philox`` computes it:
key = the 64-bit seed (low word, high word), counter = (key token id, query token id, q head,
offset), all as uint32; the first output word r decides: kept iff ``(r >> 1) >= floor(p * 2**31)``.
Kept probabilities are scaled by ``1 / (1 - p)`` (flash-attn 2's definition); lse is unaffected.

Token ids (``Packing.gid``): token i of sequence b's span has id ``gid[b] + i``. Without an
explicit ``gid`` (``default_gid``): packed thd, its row in the q (or k) tensor; padded bshd/sbhd,
``b * S + position``.

The RNG state is an int64 ``[3]`` tensor (seed, offset, head offset) on the tensors' device: seed
and offset drawn from that device's torch generator (``rng_state``), so ``torch.manual_seed`` /
``torch.cuda.manual_seed`` make runs reproducible, each call advances the generator, and no value
is read on the host (the kernels load it; CUDA-graph capture draws it like any other random op).
The head offset (0 unless ``with_head_offset`` sets it) is added to every q head index: a call on
a slice of the heads (all-to-all context parallelism) draws the mask those heads have in the
whole layer.
"""

from __future__ import annotations

import math

import torch

PHILOX_ROUNDS = 10
_MASK32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57  # multipliers
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85  # Weyl key increments


def rng_state(device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """A fresh (seed, offset, head offset 0) int64 ``[3]`` tensor on ``device``, seed and offset from
    its default generator (or ``generator``); advances that generator like any random op."""
    drawn = torch.randint(-2**63, 2**63 - 1, (2,), dtype=torch.int64, device=device, generator=generator)
    return torch.cat([drawn, drawn.new_zeros(1)])


def with_head_offset(state: torch.Tensor, head_offset: int) -> torch.Tensor:
    """``state`` for a call whose q head 0 is head ``head_offset`` of the layer."""
    return torch.cat([state[:2], state.new_full((1,), head_offset)])


def keep_threshold(dropout_p: float) -> int:
    """The int31 threshold: a probability is kept iff its 31-bit random word is >= this."""
    return math.floor(dropout_p * 2**31)


def _mul_hi_lo(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of the 64-bit product a * x (a a uint32 constant, x uint32 values
    in int64), in 16-bit halves so nothing overflows int64."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    t_hi, t_lo = a_hi * x, a_lo * x  # < 2**48 each
    hi = (t_hi + (t_lo >> 16)) >> 16
    lo = (((t_hi & 0xFFFF) << 16) + t_lo) & _MASK32
    return hi, lo


def philox(seed: torch.Tensor, c0, c1, c2, c3, rounds: int = PHILOX_ROUNDS) -> tuple[torch.Tensor, ...]:
    """Philox-4x32 on int64 tensors holding uint32 values (broadcast together); ``seed`` an int64
    scalar tensor (its two's-complement bits are the 64-bit key). Returns the four output words."""
    k0 = seed & _MASK32
    k1 = (seed >> 32) & _MASK32
    c0, c1, c2, c3 = torch.broadcast_tensors(*(torch.as_tensor(c, dtype=torch.int64, device=seed.device) & _MASK32
                                              for c in (c0, c1, c2, c3)))
    for _ in range(rounds):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def keep_mask(state: torch.Tensor, dropout_p: float, head, q_ids, k_ids) -> torch.Tensor:
    """Bool keep mask for (q head, query token id, key token id), broadcast together (e.g. heads
    ``[H, 1, 1]``, query ids ``[1, Sq, 1]``, key ids ``[1, 1, Sk]``; the state's head offset is added
    to the heads). ``state`` is an RNG state from ``rng_state``. Memory is that of the broadcast
    shape: for tests and small shapes."""
    seed, offset = state[0], state[1] & _MASK32
    r = philox(seed, k_ids, q_ids, torch.as_tensor(head, device=state.device) + state[2], offset)[0]
    return (r >> 1) >= keep_threshold(dropout_p)


def check_dropout_p(dropout_p) -> float:
    """0 <= p < 1 as a float; anything else raises naming the argument."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return float(dropout_p)
