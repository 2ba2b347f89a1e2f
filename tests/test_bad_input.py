"""Every bad input to varlen_attn / flash_attn_varlen_func raises a clear error naming the argument."""

import pytest
import torch

import coreattn
from attn_cases import KERNEL_DEVICE

T, H, D = 10, 4, 16


def _args(**over):
    a = dict(q=torch.randn(T, H, D), k=torch.randn(T, 2, D), v=torch.randn(T, 2, 8),
             cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32),
             cu_seqlens_k=torch.tensor([0, 4, 10], dtype=torch.int32), max_seqlen_q=6, max_seqlen_k=6)
    a.update(over)
    return a


CU = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731

BAD = [
    ("q-not-tensor", dict(q=[[1.0]]), TypeError, "q must be a torch.Tensor"),
    ("q-2d", dict(q=torch.randn(T, D)), ValueError, "q must have 3 dims"),
    ("dtype-int", dict(q=torch.ones(T, H, D, dtype=torch.int32)), TypeError, "q has dtype"),
    ("dtype-mismatch-k", dict(k=torch.randn(T, 2, D, dtype=torch.float16)), TypeError, "dtype mismatch.*k"),
    ("dtype-mismatch-v", dict(v=torch.randn(T, 2, 8, dtype=torch.float64)), TypeError, "dtype mismatch.*v"),
    ("dqk-mismatch", dict(k=torch.randn(T, 2, D + 1)), ValueError, "head dim mismatch"),
    ("kv-tokens", dict(v=torch.randn(T - 1, 2, 8)), ValueError, "k .* and v .* must agree"),
    ("kv-heads", dict(v=torch.randn(T, 1, 8)), ValueError, "k .* and v .* must agree"),
    ("gqa-not-divisible", dict(k=torch.randn(T, 3, D), v=torch.randn(T, 3, 8)), ValueError, "multiple of k/v heads"),
    ("head-dim-257", dict(q=torch.randn(T, H, 257), k=torch.randn(T, 2, 257)), ValueError, "q/k head dim is 257"),
    ("v-head-dim-300", dict(v=torch.randn(T, 2, 300)), ValueError, "v head dim is 300"),
    ("last-stride", dict(q=torch.randn(T, H, D * 2)[:, :, ::2]), ValueError, "q must have stride 1"),
    ("cu-dtype", dict(cu_seqlens_q=torch.tensor([0, 4, 10])), TypeError, "cu_seqlens_q must be int32"),
    ("cu-dim", dict(cu_seqlens_k=CU(0, 4, 10)[None]), ValueError, "cu_seqlens_k must have 1 dims"),
    ("cu-too-short", dict(cu_seqlens_q=CU(0)), ValueError, "cu_seqlens_q must have B\\+1 >= 2"),
    ("cu-strided", dict(cu_seqlens_k=CU(0, 9, 4, 9, 10)[::2]), ValueError, "cu_seqlens_k must be contiguous"),
    ("batch-mismatch", dict(cu_seqlens_k=CU(0, 2, 4, 10)), ValueError, "q and k batch sizes must match"),
    ("cu-not-from-0", dict(cu_seqlens_q=CU(1, 4, 10)), ValueError, "cu_seqlens_q must start at 0"),
    ("cu-decreasing-2", dict(cu_seqlens_q=CU(0, 7, 3, 10), cu_seqlens_k=CU(0, 4, 4, 10)), ValueError, "non-decreasing"),
    ("cu-last-not-T", dict(cu_seqlens_q=CU(0, 4, 9)), ValueError, "must equal the token count 10"),
    ("max-seqlen-small", dict(max_seqlen_q=5), ValueError, "max_seqlen_q = 5 is smaller"),
    ("max-seqlen-float", dict(max_seqlen_k=6.0), TypeError, "max_seqlen_k must be an int"),
    ("max-seqlen-negative", dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be >= 0"),
    ("max-seqlen-bool", dict(max_seqlen_q=True), TypeError, "max_seqlen_q must be an int"),
    ("dropout-one", dict(dropout_p=1.0), ValueError, "dropout_p must be in \\[0, 1\\)"),
    ("dropout-negative", dict(dropout_p=-0.1), ValueError, "dropout_p must be in"),
    ("dropout-nan", dict(dropout_p=float("nan")), ValueError, "dropout_p must be in"),
    ("dropout-type", dict(dropout_p="0.1"), TypeError, "dropout_p must be a float"),
    ("offset-shape", dict(softmax_offset=torch.zeros(H + 1)), ValueError, "softmax_offset has 5 entries but q has 4"),
    ("offset-dim", dict(softmax_offset=torch.zeros(1, H)), ValueError, r"softmax_offset has shape \(1, 4\); expected \[Hq\]"),
    ("offset-int", dict(softmax_offset=torch.zeros(H, dtype=torch.int32)), TypeError, "softmax_offset must be a floating"),
    ("offset-type", dict(softmax_offset=[0.0] * H), TypeError, "softmax_offset must be a torch.Tensor"),
    ("offset-device", dict(softmax_offset=torch.zeros(H, device="meta")), ValueError, "softmax_offset is on meta"),
    ("max-logit-type", dict(return_max_logit=1), TypeError, "return_max_logit must be a bool"),
    ("window-type", dict(window_size=5), TypeError, "window_size"),
    ("window-negative", dict(window_size=(-2, 0)), ValueError, "window_size"),
    ("causal-not-bool", dict(causal=1), TypeError, "causal must be a bool"),
    ("scale-negative", dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    ("scale-nan", dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ("alignment", dict(causal_alignment="middle"), ValueError, "causal_alignment"),
    ("backend-unknown", dict(backend="cuda"), ValueError, "backend='cuda' is not a coreattn backend"),
    ("seqused-dtype", dict(seqused_q=torch.tensor([4, 6])), TypeError, "seqused_q must be int32"),
    ("seqused-count", dict(seqused_k=CU(4, 6, 0)), ValueError, "seqused_k has 3 entries"),
    ("seqused-too-long", dict(seqused_q=CU(5, 6)), ValueError, "seqused_q\\[0\\] = 5 does not fit"),
    ("seqused-negative", dict(seqused_k=CU(4, -1)), ValueError, "seqused_k\\[1\\] = -1"),
    ("seqused-strided", dict(seqused_q=CU(4, 0, 6, 0)[::2]), ValueError, "seqused_q must be contiguous"),
    ("seqused-above-max", dict(seqused_q=CU(4, 6), max_seqlen_q=5), ValueError, "max_seqlen_q = 5 is smaller than the longest used"),
]


@pytest.mark.parametrize("name, over, exc, match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises(name, over, exc, match):
    with pytest.raises(exc, match=match):
        coreattn.varlen_attn(**_args(**over))


def test_device_mismatch_raises():
    a = _args()
    a["k"] = a["k"].to("meta")
    with pytest.raises(ValueError, match="device mismatch"):
        coreattn.varlen_attn(**a)
    a = _args()
    a["cu_seqlens_q"] = a["cu_seqlens_q"].to("meta")
    with pytest.raises(ValueError, match="cu_seqlens_q is on meta"):
        coreattn.varlen_attn(**a)


def test_float64_only_on_torch_backend():
    a = _args(q=torch.randn(T, H, D, dtype=torch.float64), k=torch.randn(T, 2, D, dtype=torch.float64),
              v=torch.randn(T, 2, 8, dtype=torch.float64))
    a = {name: x.to(KERNEL_DEVICE) if isinstance(x, torch.Tensor) else x for name, x in a.items()}  # Triton runs there
    coreattn.varlen_attn(**a, backend="torch")
    with pytest.raises(TypeError, match="Triton backend supports"):
        coreattn.varlen_attn(**a, backend="triton")


@pytest.mark.parametrize("kw, match", [(dict(softcap=1.0), "softcap"),
                                       (dict(alibi_slopes=torch.ones(H)), "alibi_slopes"),
                                       (dict(block_table=torch.zeros(1, 1, dtype=torch.int32)), "block_table")])
def test_flash_attn_unsupported_options_raise(kw, match):
    a = _args()
    with pytest.raises(NotImplementedError, match=match):
        coreattn.flash_attn_varlen_func(*a.values(), **kw)
