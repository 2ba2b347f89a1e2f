"""One module per transformers model family that coreattn runs with its own code (as transformers lays out
``models/<name>/``): the models whose attention needs more than the attention function, their own modules
wrapped while "coreattn" runs them. Each module names the transformers methods it wraps or relies on and
the release it was written against, and refuses (``check_source``), naming the method, under a
transformers whose wrapped code differs.

Owns: ``inkling2.py`` (Inkling 2 and Inkling 2 Loop: the low-rank relative bias's factors, the
per-token sinks, the block-attention residuals), ``t5.py`` (the T5 family's bucketed relative
bias, its all-zeros cross-attention bias) and ``minimax_m3.py`` (MiniMax-M3, ``minimax_m3_vl``: its
indexer's block-max top-k and its block-sparse attention). Shared here: ``install`` (the one registry:
every family's wrappers, as ``register()`` installs them), ``PositionBias`` (what a wrapped bias module
hands the attention function instead of its ``[B, H, S, T]`` tensor), ``uses_coreattn`` and the source
check (``source_reason``). The shared machinery (the attention function, the mask builder) is the
package root's.

May import: ``coreattn.kernels``, ``coreattn.layers`` and ``coreattn.adapters.transformers``;
transformers inside functions only.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import textwrap

RELEASE = "5.25.0"  # the transformers release the modules here were written against


def install(name: str, sparse_backend=None) -> list[str]:
    """Wrap every family's modules (idempotent) for the attention implementation ``name``, MiniMax-M3's
    indexer pinned to ``sparse_backend``; the model types this transformers has."""
    from coreattn.adapters.transformers.models import inkling2, minimax_m3, t5

    installed = inkling2.install() + t5.install()
    if minimax_m3.install(name, sparse_backend):
        installed += list(minimax_m3.MODEL_TYPES)
    return installed


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


def source_hash(obj) -> str:
    """sha256 of a function's or method's source, dedented (the original of a coreattn wrapper)."""
    obj = getattr(obj, "coreattn_wrapped", obj)
    return hashlib.sha256(textwrap.dedent(inspect.getsource(obj)).encode()).hexdigest()


def model_module(model_type: str):
    """transformers' ``modeling_<model_type>`` module (ImportError without it)."""
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def source_reason(model_type: str, known: dict) -> str | None:
    """None if every ``known`` qualified name (``Class.method`` or ``function``) of ``model_type``'s
    modeling module has its recorded source hash, else why not, naming the first that differs."""
    try:
        module = model_module(model_type)
    except ImportError:
        return f"transformers has no {model_type} model"
    for qualname, want in known.items():
        obj = module
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        if obj is None or source_hash(obj) != want:
            return (f"{qualname} differs from the transformers release ({RELEASE}) coreattn's {model_type} path was "
                    "written against")
    return None
