"""A.X-K2 (``axk2``, ``AXK2ForCausalLM``) under "coreattn".

Its indexer is DeepSeek-V3.2's (16 index heads of 128, half-split RoPE on the first
``qk_rope_head_dim`` dims, top-k as ``indices=``): ``AXK2Indexer.forward`` is wrapped as V3.2's is
(``deepseek_v32.rope_first``); its MLA attention (q/k 96, v 64, a sigmoid output gate the layer
applies itself) runs ``dsa.sparse_attention``. Written against transformers 5.25.0 (the same
source as 5.24.0): the hash below; another source makes the mask builder refuse the model.
"""

from __future__ import annotations

import functools

from coreattn.adapters.transformers import sources
from coreattn.adapters.transformers.models import deepseek_v32

NAME = "A.X-K2"
INDEXERS = {"axk2": ("transformers.models.axk2.modeling_axk2", "AXK2Indexer", "apply_rotary_pos_emb")}
MODEL_TYPES = tuple(INDEXERS)
KNOWN_SOURCES = {"AXK2Indexer.forward": "d661c778bc18998643fc502f795a1c65415a6b21e570a38bdb881ce7aa5033f0"}


@functools.lru_cache(maxsize=None)
def check_source(model_type: str) -> str | None:
    return sources.check_sources(INDEXERS["axk2"][0], KNOWN_SOURCES, NAME)


def install() -> list[str]:
    return deepseek_v32.install_rope_first(INDEXERS)
