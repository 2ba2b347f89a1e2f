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
  as ``block_indices=``, run by the sparse op's block mode (``BlockMask``);
- ``inkling2``: Inkling 2 and Inkling 2 Loop (the low-rank relative bias's factors, the per-token
  sinks, the block-attention residuals); ``t5``: the T5 family (the bucketed relative bias, its
  all-zeros cross-attention bias): their bias modules hand the attention function a ``PositionBias``
  (defined here) instead of their ``[B, H, S, T]`` tensor.

The shared machinery (the attention function, the mask builder, ``dsa.py``, ``sources.py``) is the
package root's.

May import: ``coreattn.kernels``, ``coreattn.layers`` and ``coreattn.adapters.transformers``; transformers inside
functions only.
"""

from __future__ import annotations

from coreattn.adapters.transformers import sources


class PositionBias:
    """A bias module's output under coreattn: ``bias``, a ``coreattn.LowRankRelativeBias`` or
    ``coreattn.BucketedRelativeBias`` (q's bshd token layout), computed in the attention kernels'
    registers. ``model``: the model type, for messages."""

    __slots__ = ("bias", "model")

    def __init__(self, bias, model: str):
        self.bias, self.model = bias, model

    def __repr__(self) -> str:
        return f"PositionBias({type(self.bias).__name__}, model={self.model!r})"


def uses_coreattn(config) -> bool:
    """Whether this model config's attention implementation is one ``register()`` installed."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = getattr(config, "_attn_implementation", None)
    return name is not None and getattr(ALL_ATTENTION_FUNCTIONS.get(name), "coreattn", False)


def model_module(model_type: str):
    """transformers' ``modeling_<model_type>`` module (ImportError without it)."""
    import importlib

    return importlib.import_module(_module_name(model_type))


def _module_name(model_type: str) -> str:
    return f"transformers.models.{model_type}.modeling_{model_type}"


def source_reason(model_type: str, known: dict) -> str | None:
    """None if every ``known`` qualified name (``Class.method`` or ``function``) of ``model_type``'s
    modeling module has its recorded (dedented) source hash, else why not, naming the first that differs."""
    return sources.check_sources(_module_name(model_type), known, model_type, dedent=True)


# the families (below the helpers above, which inkling2 and t5 import from here)
from coreattn.adapters.transformers.models import (axk2, deepseek_v4, deepseek_v32, dots3_note,  # noqa: E402
                                                   glm5_next, hy_v4, inkling2, minimax_m3, mistral_large4, t5)

FAMILIES = (deepseek_v32, axk2, dots3_note, hy_v4, mistral_large4, glm5_next, deepseek_v4, minimax_m3, inkling2, t5)
# the families whose attention layers run their indexer on the mask builder's SparseMask
SPARSE_MASK_FAMILIES = (deepseek_v32, axk2, dots3_note, hy_v4, mistral_large4)
SPARSE_MASK_TYPES = tuple(t for family in SPARSE_MASK_FAMILIES for t in family.MODEL_TYPES)


def family(model_type: str | None):
    """The module serving ``model_type`` (a config's), or None."""
    return next((f for f in FAMILIES if model_type in f.MODEL_TYPES), None)


def install() -> list[str]:
    """Wrap every family's methods this transformers ships (idempotent); returns the model types."""
    return [model_type for f in FAMILIES for model_type in f.install()]
