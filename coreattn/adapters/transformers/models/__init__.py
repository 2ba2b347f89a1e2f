"""One module per model family of transformers whose attention coreattn serves by wrapping some of
the model's own methods (as transformers lays out ``models/<name>/``).

Each module's docstring says which of the model's methods it wraps and what they compute under
coreattn; each names the transformers sources it restates or replaces with their sha256
(``KNOWN_SOURCES``, checked by ``check_source(model_type)``: under a transformers whose method
differs the model is refused naming the method, never run on changed math) and has
``MODEL_TYPES`` (the ``config.model_type`` values of the configs its layers see: a composite
model's text config), ``NAME`` and ``install()`` (wrap the methods, idempotent; a transformers
without the model is skipped).

- ``deepseek_v32``: DeepSeek-V3.2 and GLM-5; ``axk2``: A.X-K2; ``dots3_note``: dots3-note;
  ``hy_v4``: Hy4 and Hy4-VL; ``mistral_large4``: Mistral Large 4 (DSA indexers inside the attention
  layer, top-k passed as ``indices=``: the mask builder hands them a ``dsa.SparseMask``);
- ``glm5_next``: GLM-5.3-Flash (a pooled indexer whose layer builds its own mask: ``dsa.IndexRows``);
- ``deepseek_v4``: DeepSeek-V4's hybrid attention (``HybridMask``);
- ``minimax_m3``: MiniMax-M3 (``minimax_m3_vl``, text and VL): its indexer's block-max top-k passed
  as ``block_indices=``, run by the sparse op's block mode (``BlockMask``).

The shared machinery (the attention function, the mask builder, ``dsa.py``, ``sources.py``) is the
package root's.

May import: ``coreattn.layers`` and ``coreattn.adapters.transformers``; transformers inside
functions only.
"""

from __future__ import annotations

from coreattn.adapters.transformers.models import (axk2, deepseek_v4, deepseek_v32, dots3_note, glm5_next, hy_v4,
                                                   minimax_m3, mistral_large4)

FAMILIES = (deepseek_v32, axk2, dots3_note, hy_v4, mistral_large4, glm5_next, deepseek_v4, minimax_m3)
# the families whose attention layers run their indexer on the mask builder's SparseMask
SPARSE_MASK_FAMILIES = (deepseek_v32, axk2, dots3_note, hy_v4, mistral_large4)
SPARSE_MASK_TYPES = tuple(t for family in SPARSE_MASK_FAMILIES for t in family.MODEL_TYPES)


def family(model_type: str | None):
    """The module serving ``model_type`` (a config's), or None."""
    return next((f for f in FAMILIES if model_type in f.MODEL_TYPES), None)


def install() -> list[str]:
    """Wrap every family's methods this transformers ships (idempotent); returns the model types."""
    return [model_type for f in FAMILIES for model_type in f.install()]
