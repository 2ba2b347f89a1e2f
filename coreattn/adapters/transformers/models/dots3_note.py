"""dots3-note (``dots3_note``; its text model ``dots3_note_text``, ``Dots3NoteForCausalLM``) under "coreattn".

Its ``indexed_attention`` layers run GLM-5's indexer (interleaved RoPE on the first
``qk_rope_head_dim`` dims, the query residual rescaled by the layer before it reaches the indexer):
``Dots3NoteTextIndexer.forward`` is wrapped as GLM-5's is (``deepseek_v32.rope_first``), and the
layer's attention runs ``dsa.sparse_attention``. Its ``sliding_attention`` layers (a 512-token
window, their own head dims) ask the mask builder for a sliding-window mask: they get the dense
path's padding mask and run ``coreattn.padded_attn`` with the window (layers typed
``full_attention``, without an indexer, run the dense path on the ``SparseMask``'s keep mask).
Written against transformers 5.25.0 (the same source as 5.24.0): the hash below; another source
makes the mask builder refuse the model.
"""

from __future__ import annotations

import functools

from coreattn.adapters.transformers import sources
from coreattn.adapters.transformers.models import deepseek_v32

NAME = "dots3-note"
INDEXERS = {"dots3_note_text": ("transformers.models.dots3_note.modeling_dots3_note", "Dots3NoteTextIndexer",
                                "apply_rotary_pos_emb_interleave")}
MODEL_TYPES = tuple(INDEXERS)
KNOWN_SOURCES = {"Dots3NoteTextIndexer.forward": "5b484bc355c707d6a1f8c41e7c90ea3e5c3e0e25f81e0ec76e00aec385f384bb"}


@functools.lru_cache(maxsize=None)
def check_source(model_type: str) -> str | None:
    return sources.check_sources(INDEXERS["dots3_note_text"][0], KNOWN_SOURCES, NAME)


def install() -> list[str]:
    return deepseek_v32.install_rope_first(INDEXERS)
