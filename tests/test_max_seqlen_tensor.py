"""max_seqlen given as a 0-dim tensor (Transformer Engine's and Megatron's) is accepted and never read,
by every public entry: the tensors here live on the meta device, where reading a value raises.
(tests/test_gpu.py checks that CUDA tensors cost no host sync.)"""

import pytest
import torch

import coreattn
from coreattn.layers.checks import check_max_seqlen

LENS = (5, 0, 9, 3)
H, HKV, DQK, DV = 4, 2, 24, 16


def _meta(n: int) -> torch.Tensor:
    return torch.tensor(n, dtype=torch.int32, device="meta")


def _thd(seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(LENS)
    q, k, v = (torch.randn(t, h, d, generator=gen) for h, d in ((H, DQK), (HKV, DQK), (HKV, DV)))
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def test_meta_tensors_cannot_be_read():
    with pytest.raises(Exception):
        int(_meta(3))


def test_check_takes_the_bound_for_a_tensor():
    assert check_max_seqlen("max_seqlen_q", _meta(3), 40) == 40
    assert check_max_seqlen("max_seqlen_q", torch.tensor([7]), 40) == 40  # one element, as old Megatron kept it
    assert check_max_seqlen("max_seqlen_q", 7, 40) == 7
    for bad in (torch.tensor(3.0), torch.tensor([1, 2]), torch.tensor(True)):
        with pytest.raises(TypeError, match="max_seqlen_q must be an int or a 0-dim integer tensor"):
            check_max_seqlen("max_seqlen_q", bad, 40)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter_only(
    "the Triton kernels on CPU tensors (tests/test_gpu.py passes CUDA max_seqlen tensors)"))])
def test_varlen_attn_and_flash_attn_varlen_func(backend):
    q, k, v, cu = _thd()
    want = coreattn.varlen_attn(q, k, v, cu, cu, max(LENS), max(LENS), causal=True, backend=backend)
    got = coreattn.varlen_attn(q, k, v, cu, cu, _meta(9), _meta(9), causal=True, backend=backend)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if backend == "triton":
        flash = coreattn.flash_attn_varlen_func(q, k, v, cu, cu, _meta(9), _meta(9), causal=True)
        torch.testing.assert_close(flash, want, rtol=0, atol=0)


def test_cp_attn_without_a_group():
    q, k, v, cu = _thd()
    want = coreattn.varlen_attn(q, k, v, cu, cu, max(LENS), max(LENS), causal=True, backend="torch")
    got = coreattn.cp_attn(q, k, v, cp_group=None, layout="thd", cu_seqlens_q=cu, max_seqlen_q=_meta(9),
                           max_seqlen_kv=_meta(9), causal=True, backend="torch")
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_transformers_packed_kwargs():
    from coreattn.adapters.transformers import attention as hf

    q, k, v, cu = _thd()
    want = coreattn.varlen_attn(q, k, v, cu, cu, max(LENS), max(LENS), causal=True, backend="torch")
    opts = dict(dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1), backend="torch",
                softmax_offset=None)
    got = hf._packed_varlen(q[None], k[None], v[None], 1, dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                                              max_length_q=_meta(9), max_length_k=_meta(9)), opts)
    torch.testing.assert_close(got[0], want, rtol=0, atol=0)


def test_core_attention_thd():
    pytest.importorskip("megatron.core")
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from coreattn.layers import CoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=H * DQK, num_attention_heads=H, num_query_groups=HKV,
                               kv_channels=DQK, attention_dropout=0.0, hidden_dropout=0.0)
    layer = CoreAttention(config, 1, AttnMaskType.causal, "self", v_channels=DV, backend="torch")
    q, k, v, cu = _thd()
    want = coreattn.varlen_attn(q, k, v, cu, cu, max(LENS), max(LENS), causal=True, backend="torch")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=_meta(9),
                             max_seqlen_kv=_meta(9))
    got = layer(q, k, v, None, packed_seq_params=params)
    torch.testing.assert_close(got.view(want.shape), want, rtol=0, atol=0)
