"""Mistral Large 4 (``mistral_large4``; its text model ``mistral_large4_text``,
``MistralLarge4ForConditionalGeneration``) under "coreattn".

Wraps ``MistralLarge4TextIndexer.forward``. What its indexer computes differently from
DeepSeek-V3.2's, each expressed in ``coreattn.indexer_topk``'s inputs:

- no query residual: q is ``wq_b(q_input_norm(hidden_states))`` (the forward takes no ``q_resid``);
- q scaled per head by ``scale_h * log(pos + 1) + bias_h`` (the model's ``softmax_scaling`` module,
  called on q before the op: a factor that may be negative, so it stays inside the ReLU);
- NoPE layers (``no_rope_layers``): their indexer applies no RoPE; the others interleaved RoPE on the
  first ``qk_rope_head_dim`` dims;
- ``position_ids`` reach the indexer and the attention function (the sparse path ignores them there:
  the mask's bounds hold the sequences).

KV reuse across layers (``kv_source_layers``: a layer attends to an earlier layer's latent K/V) and
top-k reuse (``indexer_types="shared"``) happen in the model's code; the attention function sees the
K/V and indices it is handed (``dsa.sparse_attention``). Written against transformers 5.25.0 (the
same source as 5.24.0): the hash below; another source makes the mask builder refuse the model.
"""

from __future__ import annotations

import functools

import torch

from coreattn.adapters.transformers import dsa, sources

NAME = "Mistral Large 4"
INDEXERS = {"mistral_large4_text": ("transformers.models.mistral_large4.modeling_mistral_large4",
                                    "MistralLarge4TextIndexer")}
MODEL_TYPES = tuple(INDEXERS)
KNOWN_SOURCES = {"MistralLarge4TextIndexer.forward": "cc77e0d2bf12a2bd9093aef4e1568f07c415cf1446f1de4b8d22b1d7f1244545"}


def _project(indexer, a):
    """q and k as ``MistralLarge4TextIndexer.forward`` computes them."""
    from transformers.models.mistral_large4.modeling_mistral_large4 import apply_rotary_pos_emb_interleave

    hidden_states = a["hidden_states"]
    batch, seqlen, _ = hidden_states.shape
    q = indexer.wq_b(indexer.q_input_norm(hidden_states)).view(batch, seqlen, indexer.n_heads, indexer.head_dim)
    q = indexer.softmax_scaling(q, a["position_ids"], head_dim_first=False)  # [B, S, H, D]
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)  # [B, S, 1, D]
    if indexer.use_rope:
        rope_dim = indexer.qk_rope_head_dim
        cos, sin = a["position_embeddings"]
        q_rot, k_rot = apply_rotary_pos_emb_interleave(q[..., :rope_dim], k[..., :rope_dim], cos, sin,
                                                       unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., rope_dim:]], dim=-1)
        k = torch.cat([k_rot, k[..., rope_dim:]], dim=-1)
    return q, k.squeeze(2)


@functools.lru_cache(maxsize=None)
def check_source(model_type: str) -> str | None:
    return sources.check_sources(INDEXERS["mistral_large4_text"][0], KNOWN_SOURCES, NAME)


def install() -> list[str]:
    return dsa.install_indexers({model_type: (module, cls, _project) for model_type, (module, cls) in INDEXERS.items()})
