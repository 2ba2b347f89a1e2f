"""Backend selection per device, at its old import path: it lives in ``coreattn.layers.backends``."""

from coreattn.layers.backends import (ENV_BACKEND, Availability, Backend, is_available, parse_backend,
                                      select_backend)

__all__ = ["Backend", "Availability", "ENV_BACKEND", "is_available", "parse_backend", "select_backend"]
