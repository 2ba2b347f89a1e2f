"""Device and framework glue: backend selection, Ascend NPU detection (npu.py) and Megatron integration."""

from coreattn.layers.backends import Backend, select_backend

__all__ = ["Backend", "select_backend"]
