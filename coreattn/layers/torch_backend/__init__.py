"""The torch backend: attention with the kernels' semantics in PyTorch ops, for CPU and any device.

Owns: ``attention.py`` (the backend pair ``attn_torch_fwd`` / ``attn_torch_bwd`` and the choice
between the two paths), ``fused.py`` (PyTorch's fused CPU flash kernel per sequence), ``blocked.py``
(an online softmax over key blocks in torch ops, for what the fused kernel cannot express) with
``bias.py`` (an additive bias's table window per tile),
``spans.py`` (reading the sequence lengths and spans), ``dense_mask.py`` (the O(S^2) path for
arbitrary dense masks, Megatron's ``arbitrary`` mask type), ``sparse.py`` (top-k sparse attention's
pair ``sparse_attn_torch_fwd`` / ``sparse_attn_torch_bwd`` on the kernels' prepared indices) with
``sparse_plan.py`` (per-token key counts and ranges, and how tokens are grouped), ``sparse_blocks.py``
(tokens sharing a key range: one product per block), ``sparse_units.py`` (each token gathering its
own keys, cut to their count) and ``sparse_inputs.py`` (the views and key sources they share),
``indexer_topk.py`` / ``indexer_loss.py`` / ``hadamard.py`` (the DSA
indexer's top-k, its loss chunk by chunk, the Hadamard rotation).

May import: torch, ``coreattn.kernels`` (packing, dropout's keep mask, the sink gradient) and
``coreattn.layers.checks``; nothing from the other backends, context parallelism or adapters.
"""

from coreattn.layers.torch_backend.attention import attn_torch_bwd, attn_torch_fwd, visible_mask
from coreattn.layers.torch_backend.dense_mask import dense_mask_attn

__all__ = ["attn_torch_fwd", "attn_torch_bwd", "visible_mask", "dense_mask_attn"]
