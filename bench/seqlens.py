"""Document-length distributions for packed batches, drawn from a fixed seed.

Every distribution fills exactly ``total`` tokens: documents are drawn until the budget is
spent and the last one is cut to fit, so two runs (and two machines) see the same batch.
"""

from __future__ import annotations

import random

DISTRIBUTIONS = ("uniform", "longtail", "equal", "short", "docs256", "docs64", "docs16")
# "docsN": documents of exactly N tokens (many short sequences: RL rollouts, short-chat SFT packing)
DOCS_PREFIX = "docs"
SEED = 1234
EQUAL_DOC_LEN = 4096
UNIFORM_RANGE = (128, 4096)
SHORT_RANGE = (16, 128)  # CPU runs: a tiny batch still packs several documents of different lengths
# (probability, low, high): mostly short documents with a few long ones
LONGTAIL_MIX = ((0.75, 64, 1024), (0.20, 1024, 8192), (0.05, 8192, 16384))


def _draw_one(rng: random.Random, dist: str) -> int:
    if dist == "uniform":
        return rng.randint(*UNIFORM_RANGE)
    if dist == "short":
        return rng.randint(*SHORT_RANGE)
    if dist == "longtail":
        u = rng.random()
        for prob, low, high in LONGTAIL_MIX:
            if u < prob:
                return rng.randint(low, high)
            u -= prob
        return rng.randint(*LONGTAIL_MIX[-1][1:])
    raise ValueError(f"unknown distribution {dist!r}; choose one of {DISTRIBUTIONS}")


def draw_seqlens(dist: str, total: int, seed: int = SEED, equal_len: int = EQUAL_DOC_LEN) -> list[int]:
    """Document lengths summing to ``total``; ``equal`` uses ``min(equal_len, total)`` for all,
    ``docsN`` ``min(N, total)``."""
    if total <= 0:
        raise ValueError(f"total must be positive, got {total}")
    if dist == "equal" or dist.startswith(DOCS_PREFIX):
        length = min(equal_len if dist == "equal" else int(dist[len(DOCS_PREFIX):]), total)
        if total % length:
            raise ValueError(f"equal-length batch: {total} tokens is not a multiple of {length}")
        return [length] * (total // length)
    rng = random.Random(f"{dist}-{total}-{seed}")
    lens, left = [], total
    while left > 0:
        length = min(_draw_one(rng, dist), left)
        lens.append(length)
        left -= length
    return lens
