"""Ascend NPU detection, at its old import path: it lives in ``coreattn.kernels.npu``."""

from coreattn.kernels.npu import (AscendCores, ascend_core_counts, cache_clear, npu_usable, torch_npu_module,
                                  torch_npu_reason, triton_ascend_installed, triton_backend, triton_distribution,
                                  triton_is_ascend)

__all__ = ["AscendCores", "ascend_core_counts", "cache_clear", "npu_usable", "torch_npu_module", "torch_npu_reason",
           "triton_ascend_installed", "triton_backend", "triton_distribution", "triton_is_ascend"]
