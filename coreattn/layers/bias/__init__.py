"""Additive attention biases computed in registers, never as an [S, T] tensor.

Owns: ``relative.py`` (the public descriptors ``LowRankRelativeBias``, Inkling 2's low-rank relative
bias, and ``BucketedRelativeBias``, T5's bucketed relative bias; their checks, and their form for
the attention ops: a ``TableBias``, coreattn/kernels/attn_common.py).

May import: torch, ``coreattn.kernels`` and ``coreattn.layers.checks``.
"""

from coreattn.layers.bias.relative import BucketedRelativeBias, LowRankRelativeBias, check_bias, t5_buckets

__all__ = ["LowRankRelativeBias", "BucketedRelativeBias", "check_bias", "t5_buckets"]
