"""Every bad input to sparse_varlen_attn / sparse_padded_attn raises a clear error naming the argument."""

import pytest
import torch

import coreattn

T, H, HKV, D, DV, K = 10, 4, 2, 16, 8, 3
CU = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731


def _args(**over):
    a = dict(q=torch.randn(T, H, D), k=torch.randn(T, HKV, D), v=torch.randn(T, HKV, DV),
             topk_indices=torch.zeros(T, K, dtype=torch.int64), cu_seqlens_q=CU(0, 4, 10), cu_seqlens_k=CU(0, 4, 10),
             backend="torch")
    a.update(over)
    return a


BAD = [
    ("q-not-tensor", dict(q=[[1.0]]), TypeError, "q must be a torch.Tensor"),
    ("q-2d", dict(q=torch.randn(T, D)), ValueError, "q must have 3 dims"),
    ("dtype-int", dict(q=torch.ones(T, H, D, dtype=torch.int32)), TypeError, "q has dtype"),
    ("dtype-mismatch-k", dict(k=torch.randn(T, HKV, D, dtype=torch.float16)), TypeError, "dtype mismatch.*k"),
    ("dtype-mismatch-v", dict(v=torch.randn(T, HKV, DV, dtype=torch.float64)), TypeError, "dtype mismatch.*v"),
    ("dqk-mismatch", dict(k=torch.randn(T, HKV, D + 1)), ValueError, "head dim mismatch"),
    ("kv-tokens", dict(v=torch.randn(T - 1, HKV, DV)), ValueError, "k .* and v .* must agree"),
    ("gqa-not-divisible", dict(k=torch.randn(T, 3, D), v=torch.randn(T, 3, DV)), ValueError, "multiple of k/v heads"),
    ("head-dim-300", dict(q=torch.randn(T, H, 300), k=torch.randn(T, HKV, 300)), ValueError,
     "q/k head dim is 300; supported head dims are 1..256, 512 or 576"),
    ("v-head-dim-513", dict(v=torch.randn(T, HKV, 513)), ValueError, "v head dim is 513; supported head dims are 1..512"),
    ("last-stride", dict(q=torch.randn(T, H, D * 2)[:, :, ::2]), ValueError, "q must have stride 1"),
    ("absorbed-no-v-head-dim", dict(v=None), ValueError, "v is None .* v_head_dim must be given"),
    ("absorbed-v-head-dim-too-big", dict(v=None, v_head_dim=D + 1), ValueError, "v_head_dim = 17 must be in 1..min"),
    ("absorbed-v-head-dim-zero", dict(v=None, v_head_dim=0), ValueError, "v_head_dim = 0"),
    ("absorbed-v-head-dim-float", dict(v=None, v_head_dim=8.0), TypeError, "v_head_dim must be an int"),
    ("v-head-dim-mismatch", dict(v_head_dim=DV + 1), ValueError, "v_head_dim = 9 but v has head dim 8"),
    ("topk-not-tensor", dict(topk_indices=[[0]] * T), TypeError, "topk_indices must be a torch.Tensor"),
    ("topk-float", dict(topk_indices=torch.zeros(T, K)), TypeError, "topk_indices must be an integer tensor, got "
                                                                    "torch.float32"),
    ("topk-bool", dict(topk_indices=torch.zeros(T, K, dtype=torch.bool)), TypeError, "topk_indices must be an integer"),
    ("topk-device", dict(topk_indices=torch.zeros(T, K, dtype=torch.int64, device="meta")), ValueError,
     "topk_indices is on meta but q is on cpu"),
    ("topk-tokens", dict(topk_indices=torch.zeros(T + 1, K, dtype=torch.int64)), ValueError,
     r"topk_indices has shape \(11, 3\); expected q's token dims \(10,\)"),
    ("topk-1d", dict(topk_indices=torch.zeros(T, dtype=torch.int64)), ValueError, "topk_indices has shape"),
    ("topk-5d", dict(topk_indices=torch.zeros(T, 1, 1, K, dtype=torch.int64)), ValueError, "topk_indices has shape"),
    ("topk-index-heads", dict(topk_indices=torch.zeros(T, 3, K, dtype=torch.int64)), ValueError,
     "topk_indices has 3 index heads; expected 1 or Hkv = 2"),
    ("topk-length-float", dict(topk_length=torch.ones(T)), TypeError, "topk_length must be an integer tensor"),
    ("topk-length-shape", dict(topk_length=torch.ones(T, 1, dtype=torch.int32)), ValueError,
     r"topk_length has shape \(10, 1\); expected q's token dims \(10,\)"),
    ("topk-length-device", dict(topk_length=torch.ones(T, dtype=torch.int32, device="meta")), ValueError,
     "topk_length is on meta"),
    ("bounds-not-pair", dict(key_bounds=torch.zeros(2, T, dtype=torch.int64)), TypeError,
     "key_bounds must be a pair"),
    ("bounds-three", dict(key_bounds=(torch.zeros(T, dtype=torch.int64),) * 3), TypeError, "key_bounds must be a pair"),
    ("bounds-float", dict(key_bounds=(torch.zeros(T), torch.ones(T))), TypeError,
     r"key_bounds\[0\] \(starts\) must be an integer tensor"),
    ("bounds-shape", dict(key_bounds=(torch.zeros(T, dtype=torch.int64), torch.ones(T - 1, dtype=torch.int64))),
     ValueError, r"key_bounds\[1\] \(ends\) has shape \(9,\)"),
    ("bounds-device", dict(key_bounds=(torch.zeros(T, dtype=torch.int64, device="meta"),) * 2), ValueError,
     r"key_bounds\[0\] \(starts\) is on meta"),
    ("cu-dtype", dict(cu_seqlens_q=torch.tensor([0, 4, 10])), TypeError, "cu_seqlens_q must be int32"),
    ("cu-device", dict(cu_seqlens_k=CU(0, 4, 10).to("meta")), ValueError, "cu_seqlens_k is on meta"),
    ("batch-mismatch", dict(cu_seqlens_k=CU(0, 2, 4, 10)), ValueError, "q and k batch sizes must match"),
    ("cu-not-from-0", dict(cu_seqlens_q=CU(1, 4, 10)), ValueError, "cu_seqlens_q must start at 0"),
    ("cu-decreasing", dict(cu_seqlens_k=CU(0, 7, 3, 10), cu_seqlens_q=CU(0, 4, 4, 10)), ValueError, "non-decreasing"),
    ("cu-last-not-T", dict(cu_seqlens_q=CU(0, 4, 9)), ValueError, "must equal the token count 10"),
    ("max-seqlen-float", dict(max_seqlen_q=6.0), TypeError, "max_seqlen_q must be an int"),
    ("causal-not-bool", dict(causal=1), TypeError, "causal must be a bool"),
    ("alignment", dict(causal_alignment="middle"), ValueError, "causal_alignment"),
    ("scale-negative", dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    ("scale-nan", dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ("return-lse-type", dict(return_lse=1), TypeError, "return_lse must be a bool"),
    ("backend-unknown", dict(backend="cuda"), ValueError, "backend='cuda' is not a coreattn backend"),
    ("backend-npu-fused", dict(backend="npu_fused"), RuntimeError, "npu_fused' cannot run sparse attention on cpu"),
]


@pytest.mark.parametrize("name, over, exc, match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises(name, over, exc, match):
    with pytest.raises(exc, match=match):
        coreattn.sparse_varlen_attn(**_args(**over))


def test_good_arguments_run():
    """The base arguments of the table are valid (each row breaks exactly one thing), also absorbed."""
    coreattn.sparse_varlen_attn(**_args())
    coreattn.sparse_varlen_attn(**_args(v=None, v_head_dim=DV, topk_indices=torch.zeros(T, 2, K, dtype=torch.int32)))


B, S = 2, 5


def _padded(**over):
    a = dict(q=torch.randn(B, S, H, D), k=torch.randn(B, S, HKV, D), v=torch.randn(B, S, HKV, DV),
             topk_indices=torch.zeros(B, S, K, dtype=torch.int64), backend="torch")
    a.update(over)
    return a


BAD_PADDED = [
    ("layout", dict(layout="thd"), ValueError, "layout must be 'bshd' or 'sbhd'"),
    ("q-3d", dict(q=torch.randn(S, H, D)), ValueError, "q must have 4 dims"),
    ("batch-mismatch", dict(k=torch.randn(B + 1, S, HKV, D), v=torch.randn(B + 1, S, HKV, DV)), ValueError,
     "batch mismatch"),
    ("topk-sbhd-dims", dict(layout="sbhd", q=torch.randn(S, B + 1, H, D), k=torch.randn(S, B + 1, HKV, D),
                            v=torch.randn(S, B + 1, HKV, DV), topk_indices=torch.zeros(B + 1, S, K, dtype=torch.int64)),
     ValueError, r"topk_indices has shape \(3, 5, 3\); expected q's token dims \(5, 3\)"),
    ("topk-length-shape", dict(topk_length=torch.ones(S, B, dtype=torch.int32)), ValueError,
     r"topk_length has shape \(5, 2\); expected q's token dims \(2, 5\)"),
    ("span-dtype", dict(q_len=torch.tensor([5, 3])), TypeError, "q_len must be int32"),
    ("span-count", dict(k_start=torch.zeros(3, dtype=torch.int32)), ValueError, "k_start has 3 entries"),
    ("span-too-long", dict(q_len=torch.tensor([6, 3], dtype=torch.int32)), ValueError,
     r"span 0 \(q_start=0, q_len=6\) does not fit"),
    ("span-negative", dict(k_start=torch.tensor([0, -1], dtype=torch.int32)), ValueError, "span 1 .*k_start=-1"),
]


@pytest.mark.parametrize("name, over, exc, match", BAD_PADDED, ids=[b[0] for b in BAD_PADDED])
def test_bad_padded_input_raises(name, over, exc, match):
    with pytest.raises(exc, match=match):
        coreattn.sparse_padded_attn(**_padded(**over))


def test_good_padded_arguments_run():
    coreattn.sparse_padded_attn(**_padded())
    coreattn.sparse_padded_attn(**_padded(layout="sbhd", q=torch.randn(S, B, H, D), k=torch.randn(S, B, HKV, D),
                                          v=None, v_head_dim=DV, topk_indices=torch.zeros(S, B, HKV, K,
                                                                                          dtype=torch.int64)))
