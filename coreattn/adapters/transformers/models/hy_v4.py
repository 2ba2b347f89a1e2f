"""Hy4 (``hy_v4``, ``HYV4ForCausalLM``) and Hy4-VL (``hy_v4_vl``; its text model ``hy_v4_vl_text``,
``HYV4VLForConditionalGeneration``) under "coreattn".

Wraps ``HYV4Indexer.forward`` and ``HYV4VLIndexer.forward``. What their indexer computes
differently from DeepSeek-V3.2's, each expressed in ``coreattn.indexer_topk``'s inputs:

- RoPE (interleaved, the model module's function) on the **last** ``qk_rope_head_dim`` dims of q
  and k: applied to q and k before the op;
- ``k_norm`` in float32 (its weights are float32; the normed key cast back to the hidden dtype) and
  ``weights_proj`` in float32: the key and the head weights given to the op are those tensors;
- the softmax scale multiplies the head weights, not the logits inside the ReLU: the same
  ``sum_h (w_h * scale) * relu(q_h . k)`` the op computes with the scale in the weights
  (``dsa.head_weights``).

Its ``indexer_types="shared"`` layers reuse the previous layer's top-k (the layer passes it on);
its per-head sinks arrive as ``s_aux`` (eager: an extra logit dropped after the softmax) and become
the sparse attention's ``softmax_offset`` (``dsa.sparse_attention``). Written against transformers
5.25.0 (5.24.0's indexer applied half-split RoPE: another source, refused): the hashes below;
another source makes the mask builder refuse the model.
"""

from __future__ import annotations

import functools
import sys

import torch

from coreattn.adapters.transformers import dsa, sources

NAME = "Hy4"
INDEXERS = {
    "hy_v4": ("transformers.models.hy_v4.modeling_hy_v4", "HYV4Indexer"),
    "hy_v4_vl_text": ("transformers.models.hy_v4_vl.modeling_hy_v4_vl", "HYV4VLIndexer"),
}
MODEL_TYPES = tuple(INDEXERS)
KNOWN_SOURCES = {
    "hy_v4": {"HYV4Indexer.forward": "36f7efb47d796d53d53375faf4dd0d4ff78acf85540957d6e187546cc401acfa"},
    "hy_v4_vl_text": {"HYV4VLIndexer.forward": "36f7efb47d796d53d53375faf4dd0d4ff78acf85540957d6e187546cc401acfa"},
}
ROPE = "apply_rotary_pos_emb_interleave"


def _project(indexer, a):
    """q and k as ``HYV4Indexer.forward`` computes them: RoPE on the last dims, k_norm in its dtype."""
    hidden_states = a["hidden_states"]
    batch, seqlen, _ = hidden_states.shape
    rope = getattr(sys.modules[type(indexer).__module__], ROPE)
    plain = indexer.head_dim - indexer.qk_rope_head_dim
    cos, sin = a["position_embeddings"]
    q = indexer.wq_b(a["q_resid"]).view(batch, seqlen, indexer.n_heads, indexer.head_dim)  # [B, S, H, D]
    k = indexer.k_norm(indexer.wk(hidden_states).to(indexer.k_norm.weight.dtype)).to(hidden_states.dtype)
    k = k.unsqueeze(2)  # [B, S, 1, D]
    q_rot, k_rot = rope(q[..., plain:], k[..., plain:], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q[..., :plain], q_rot], dim=-1)
    return q, torch.cat([k[..., :plain], k_rot], dim=-1).squeeze(2)


@functools.lru_cache(maxsize=None)
def check_source(model_type: str) -> str | None:
    return sources.check_sources(INDEXERS[model_type][0], KNOWN_SOURCES[model_type], NAME)


def install() -> list[str]:
    return dsa.install_indexers({model_type: (module, cls, _project) for model_type, (module, cls) in INDEXERS.items()})
