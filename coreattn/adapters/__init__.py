"""Framework glue, the top layer: what a training stack imports to use coreattn.

Owns: ``megatron.py`` (``use_coreattn`` swaps CoreAttention into a Megatron-Core spec;
``patch_mla_native_value_dim`` lets MLA pass V unpadded), ``transformers.py``
(``attn_implementation="coreattn"``, imported only by ``register()``), and the old import paths of
backend selection (``backends.py`` -> ``coreattn.layers.backends``) and Ascend detection
(``npu.py`` -> ``coreattn.kernels.npu``). megatron-core and transformers are imported only by
the module that needs them.

May import: ``coreattn.kernels`` and ``coreattn.layers`` (nothing imports adapters from below).
"""

from coreattn.layers.backends import Backend, select_backend

__all__ = ["Backend", "select_backend"]
