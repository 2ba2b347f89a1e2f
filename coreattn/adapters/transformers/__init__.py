"""coreattn as a Hugging Face transformers attention implementation.

    import coreattn.adapters.transformers as coreattn_hf
    coreattn_hf.register()                      # once, before building the model
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="coreattn")
    model.set_attn_implementation("coreattn")   # or switch an existing model

Owns: ``attention.py`` (``attention_forward``, the attention function, and the tables of the
keyword arguments it honours, ignores and rejects), ``masks.py`` (``padding_mask``, the mask
builder, and the models and mask patterns it refuses), ``dsa.py`` (what the sparse-attention models
share: their masks, the wrapping of their indexers, their sparse attention), ``sources.py`` (the
source guard of the wrapped methods) and ``models/`` (one module per model family whose methods
coreattn wraps: DeepSeek-V3.2 / GLM-5, A.X-K2, dots3-note, Hy4 / Hy4-VL, Mistral Large 4,
GLM-5.3-Flash, DeepSeek-V4, MiniMax-M3, Inkling 2 and the T5 family: their relative position
biases as factors, Inkling 2's per-token sinks and block-attention residuals). ``register()`` adds ``attention_forward`` to
transformers' ``AttentionInterface`` and ``padding_mask`` to its ``AttentionMaskInterface`` under
the same name, and wraps those methods (``models.install``: they run coreattn's path when handed coreattn's mask or
under a coreattn implementation, transformers' own code otherwise). transformers is imported only
by ``register()`` and the functions it installs.

What a call runs (q ``[B, Hq, Sq, Dqk]``, k ``[B, Hkv, Sk, Dqk]``, v ``[B, Hkv, Sk, Dv]`` as the
model passes them; GQA/MQA and Dv != Dqk natively, the inputs used in place as bshd views):

- a ``[B, S]`` padding mask (left, right or with holes): ``coreattn.padded_attn`` with it as the
  q and k keep masks, read in the kernels (no unpadding, no S×S mask); padded query rows output
  zeros, as with flash attention;
- packed sequences given as ``cu_seq_lens_q/k`` (+ ``max_length_q/k``; transformers'
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``): ``coreattn.varlen_attn``;
- no mask and ``position_ids`` (which transformers' models always pass): the sequences are where
  the position ids do not go up by one (transformers' own packed-sequence rule); the op derives
  cu_seqlens from them when it runs. With B > 1, q/k/v are copied into the packed layout;
- neither: ``coreattn.padded_attn`` on the whole rows;
- the DSA models (``models.SPARSE_MASK_TYPES``): the indexer's ``indices`` through
  ``coreattn.sparse_padded_attn``, the mask as per-query key bounds, sinks as ``softmax_offset``
  (``dsa.py``); GLM-5.3-Flash: its layer's own index rows (``dsa.IndexRows``); DeepSeek-V4: its
  window and compressed entries as index rows (``models/deepseek_v4.py``); MiniMax-M3: its
  indexer's ``block_indices`` through ``coreattn.sparse_padded_attn``'s block mode, the same key
  bounds (``models/minimax_m3.py``);
- Inkling 2 and the T5 family (``models/inkling2.py``, ``models/t5.py``): ``position_bias`` as the
  bias's factors, computed in the kernels (``bias=``), ``sinks`` as per-token ``softmax_offset``,
  T5's zero cross-attention bias dropped.

Raises (NotImplementedError or ValueError, naming the feature and the model): keyword arguments
coreattn does not implement (``attention.REJECTED`` and any it does not know), a 4D attention mask
or BlockMask (a custom mask), a padding mask together with packed sequences, mask patterns other
than causal / bidirectional / sliding window / padding / packing, the sparse-attention models
coreattn does not serve and a served model under a transformers whose wrapped methods differ
(``masks.unsupported_model``). Under torch.compile the mask
builder cannot inspect transformers' mask closures: it still rejects overlays (``use_vmap``) and
chunked masks (``local_size``), but a blockwise overlay is detected in eager mode only.

May import: ``coreattn.kernels``, ``coreattn.layers`` and ``coreattn.adapters.transformers``;
transformers inside functions only.
"""

from __future__ import annotations

from coreattn.adapters.transformers.attention import HONOURED, IGNORED, REJECTED, attention_forward
from coreattn.adapters.transformers.dsa import IndexRows, SparseMask
from coreattn.adapters.transformers.masks import padding_mask

NAME = "coreattn"


def register(name: str = NAME, *, backend=None) -> str:
    """Register coreattn with transformers as ``attn_implementation=name`` (attention function and
    mask builder) and wrap the DSA models' indexers; ``backend`` pins a coreattn backend ("triton",
    "torch"; None: per device) for the attention and the DSA indexer. Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from coreattn.adapters.transformers import models
    from coreattn.adapters.transformers.masks import sparse_backend

    def coreattn_attention(module, query, key, value, attention_mask, **kwargs):
        return attention_forward(module, query, key, value, attention_mask, backend=backend, **kwargs)

    coreattn_attention.coreattn = True  # how the wrapped model modules know a call is coreattn's (models/)

    def coreattn_mask(*args, **kwargs):
        return padding_mask(*args, backend=backend, **kwargs)

    coreattn_attention.coreattn_backend = sparse_backend(backend)  # what dsa.attention_backend reads
    AttentionInterface.register(name, coreattn_attention)
    AttentionMaskInterface.register(name, coreattn_mask)
    models.install()
    return name


__all__ = ["NAME", "HONOURED", "IGNORED", "REJECTED", "IndexRows", "SparseMask", "attention_forward", "padding_mask",
           "register"]
