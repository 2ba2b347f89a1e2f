"""DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``) under "coreattn".

Wraps ``DeepseekV32Indexer.forward`` and ``GlmMoeDsaIndexer.forward``: handed coreattn's
``SparseMask``, the indexer keeps the model's projections (``wq_b`` on the query residual, ``wk``),
``k_norm`` and RoPE on the first ``qk_rope_head_dim`` dims of q and k (half-split in V3.2,
interleaved in GLM-5: the model module's own function) and scores on ``coreattn.indexer_topk``
(``dsa.score_topk``). The attention layers pass the top-k as ``indices=`` (GLM-5's
``indexer_types="shared"`` layers the previous layer's): the attention function runs
``dsa.sparse_attention``. Written against transformers 5.25.0 (the same sources as 5.24.0): the
hashes below; another source makes the mask builder refuse the model.
"""

from __future__ import annotations

import functools
import sys

import torch

from coreattn.adapters.transformers import dsa, sources

NAME = "DeepSeek-V3.2 / GLM-5"
# model_type -> (the model's module, its indexer class, the RoPE function its indexer applies)
INDEXERS = {
    "deepseek_v32": ("transformers.models.deepseek_v32.modeling_deepseek_v32", "DeepseekV32Indexer",
                     "apply_rotary_pos_emb"),  # half-split RoPE
    "glm_moe_dsa": ("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaIndexer",
                    "apply_rotary_pos_emb_interleave"),
}
MODEL_TYPES = tuple(INDEXERS)
KNOWN_SOURCES = {
    "deepseek_v32": {"DeepseekV32Indexer.forward": "d661c778bc18998643fc502f795a1c65415a6b21e570a38bdb881ce7aa5033f0"},
    "glm_moe_dsa": {"GlmMoeDsaIndexer.forward": "5b484bc355c707d6a1f8c41e7c90ea3e5c3e0e25f81e0ec76e00aec385f384bb"},
}


def rope_first(rope_name: str):
    """``project`` for ``dsa.wrap_indexer`` of the indexers built like DeepSeek-V3.2's: q from
    ``wq_b(q_resid)``, k ``k_norm(wk(hidden_states))``, the model module's ``rope_name`` on their first
    ``qk_rope_head_dim`` dims."""
    def project(indexer, a):
        hidden_states = a["hidden_states"]
        batch, seqlen, _ = hidden_states.shape
        rope = getattr(sys.modules[type(indexer).__module__], rope_name)
        rope_dim = indexer.qk_rope_head_dim
        cos, sin = a["position_embeddings"]
        q = indexer.wq_b(a["q_resid"]).view(batch, seqlen, indexer.n_heads, indexer.head_dim)  # [B, S, H, D]
        k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)  # [B, S, 1, D]
        q_rot, k_rot = rope(q[..., :rope_dim], k[..., :rope_dim], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., rope_dim:]], dim=-1)
        return q, torch.cat([k_rot, k[..., rope_dim:]], dim=-1).squeeze(2)

    return project


@functools.lru_cache(maxsize=None)
def check_source(model_type: str) -> str | None:
    """None if this transformers' indexer of ``model_type`` is the one this module restates, else why not."""
    return sources.check_sources(INDEXERS[model_type][0], KNOWN_SOURCES[model_type], NAME)


def install_rope_first(indexers: dict) -> list[str]:
    """Wrap the indexers ``{model_type: (module, class, RoPE function)}`` built like V3.2's
    (``rope_first``); returns the model types this transformers has."""
    return dsa.install_indexers({model_type: (module, cls, rope_first(rope))
                                 for model_type, (module, cls, rope) in indexers.items()})


def install() -> list[str]:
    return install_rope_first(INDEXERS)
