"""GPU only (skipped without CUDA): CoreAttention against Megatron-Core's own local DotProductAttention.

Kept apart from test_megatron_models.py, whose CPU shims (torch.cuda.current_device -> "cpu")
would put Megatron's score buffer on the CPU.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("megatron.core")

from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from coreattn.layers import CoreAttention  # noqa: E402
from megatron_env import megatron_cpu  # noqa: E402,F401  (Megatron's parallel state over a one-rank gloo group)


@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.no_mask], ids=["causal", "no_mask"])
def test_matches_megatron_local_attention(megatron_cpu, mask_type):  # noqa: F811
    """sbhd, bf16, GQA: CoreAttention (Triton) against DotProductAttention (gradients are checked
    against the float64 oracle elsewhere)."""
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # DotProductAttention forks this RNG around its dropout
    config = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                               kv_channels=64, attention_dropout=0.0, hidden_dropout=0.0, bf16=True,
                               params_dtype=torch.bfloat16)
    ours = CoreAttention(config, 1, mask_type, "self")
    theirs = DotProductAttention(config, 1, mask_type, "self")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(256, 2, h, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (4, 2, 2))
    torch.testing.assert_close(ours(q, k, v, None), theirs(q, k, v, None), atol=2e-2, rtol=2e-2)
