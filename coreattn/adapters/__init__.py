"""Device and framework glue: backend selection (and later Megatron and NPU integration)."""

from coreattn.adapters.backends import Backend, select_backend

__all__ = ["Backend", "select_backend"]
