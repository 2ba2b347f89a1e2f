"""The benchmark matrix: attention and mask configurations, full and quick, GPU and CPU sizes."""

from __future__ import annotations

import itertools
from typing import NamedTuple

from bench.flops import MODES

HEAD_DIMS = ((64, 64), (128, 128), (192, 128), (256, 256))
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DROPOUT_P = 0.1
# attention options a config may switch on: none, dropout with p = DROPOUT_P, learnable sinks
FEATURES = ("none", f"dropout{DROPOUT_P}", "sink")


class AttnConfig(NamedTuple):
    head_dim_qk: int
    head_dim_v: int
    heads_q: int
    heads_kv: int
    causal: bool
    dist: str  # see bench.seqlens.DISTRIBUTIONS
    total_tokens: int
    feature: str = "none"  # one of FEATURES

    @property
    def id(self) -> str:
        heads = "mha" if self.heads_q == self.heads_kv else f"gqa{self.heads_q // self.heads_kv}"
        tokens = f"{self.total_tokens // 1024}k" if self.total_tokens % 1024 == 0 else str(self.total_tokens)
        extra = "" if self.feature == "none" else f"-{self.feature}"
        return (f"hdim{self.head_dim_qk}x{self.head_dim_v}-{heads}-{'causal' if self.causal else 'full'}"
                f"-{self.dist}-{tokens}{extra}")

    @property
    def dropout_p(self) -> float:
        return DROPOUT_P if self.feature.startswith("dropout") else 0.0


class MaskConfig(NamedTuple):
    batch: int
    seqlen: int
    hidden: int  # feature size of the tensor that unpad/pad move

    @property
    def id(self) -> str:
        return f"b{self.batch}-s{self.seqlen}"


def attention_configs(on_gpu: bool, quick: bool) -> list[AttnConfig]:
    """GPU: 32 query heads, 16k/64k tokens. CPU: tiny shapes (for testing the suite, not timing).
    Dropout and sink rows: 128 and 192/128, causal, GQA, the first distribution and total. The full
    set ends with the many-short-sequences rows (``many_short_configs``)."""
    if on_gpu:
        heads = ((32, 32), (32, 8))
        totals = (16384, 65536)
        dists = ("uniform", "longtail", "equal")
    else:
        heads = ((4, 4), (4, 1))
        totals = (256,)
        dists = ("short", "equal")  # uniform would make 256 tokens one document: no multi-document paths
    features = [AttnConfig(dqk, dv, heads[1][0], heads[1][1], True, dists[0], totals[0], feature)
                for (dqk, dv), feature in itertools.product(((128, 128), (192, 128)), FEATURES[1:])]
    if quick:
        return [AttnConfig(dqk, dv, heads[1][0], heads[1][1], True, dists[0], totals[0])
                for dqk, dv in ((128, 128), (192, 128))] + features
    return [AttnConfig(dqk, dv, hq, hkv, causal, dist, total)
            for (dqk, dv), (hq, hkv), causal, dist, total
            in itertools.product(HEAD_DIMS, heads, (True, False), dists, totals)] + features + \
        many_short_configs(on_gpu)


# many short sequences: about 1M tokens as 4,096 x 256, 16,384 x 64 and 65,536 x 16
MANY_SHORT_DISTS = ("docs256", "docs64", "docs16")
MANY_SHORT_DIMS = ((128, 128), (192, 128))


def many_short_configs(on_gpu: bool) -> list[AttnConfig]:
    """Causal rows where the number of sequences, not their length, sets the cost of finding each
    tile's sequence: 1M tokens with 16 heads on GPU (q, k, v about 4-6 GiB each), 1,024 tokens on
    CPU (only that the rows build and run)."""
    total, heads = (1 << 20, 16) if on_gpu else (1024, 2)
    return [AttnConfig(dqk, dv, heads, heads, True, dist, total) for (dqk, dv) in MANY_SHORT_DIMS
            for dist in MANY_SHORT_DISTS]


def attention_modes(quick: bool) -> tuple[str, ...]:
    return ("fwd", "fwdbwd") if quick else MODES


def mask_configs(on_gpu: bool, quick: bool) -> list[MaskConfig]:
    hidden = 128 if on_gpu else 16
    if quick:
        return [MaskConfig(8, 2048, hidden)]
    return [MaskConfig(b, s, hidden) for b, s in itertools.product((8, 64, 256), (2048, 8192))]


def matches(config_id: str, filters: list[str] | None) -> bool:
    """Every filter must occur in the id (``--configs hdim192x128 causal`` selects both)."""
    return not filters or all(f in config_id for f in filters)
