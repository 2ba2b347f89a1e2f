"""The pure-torch backend: bf16 on CPU against the oracle, gradcheck in float64, training gradients."""

import pytest
import torch

import coreattn
from attn_cases import LENS_K, Case, assert_matches_oracle, make_inputs
from oracle import attention_ref

TORCH_CASES = [
    Case(dqk=192, dv=128, hq=4, hkv=2, causal=True),
    Case(dqk=96, dv=64, hq=4, hkv=1, window=(3, 2), lens_k=LENS_K),
    Case(dqk=40, dv=59, hq=2, hkv=2, causal=True, bottom_right=False, lens_k=LENS_K, noncontig=True),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda c: c.id)
def test_torch_backend_matches_oracle(case, dtype):
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, dtype, "cpu", requires_grad=True)
    align = "bottom_right" if case.bottom_right else "top_left"
    out = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=case.causal, window_size=case.window,
                               causal_alignment=align, backend="torch")
    assert_matches_oracle(out, q, k, v, cu_q, cu_k, case)


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (1, 2))])
def test_gradcheck_float64(causal, window):
    case = Case(dqk=5, dv=3, hq=2, hkv=1, lens_q=(3, 0, 4), lens_k=(2, 3, 4))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float64, "cpu", requires_grad=True)

    def f(q, k, v):
        return coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window_size=window,
                                    backend="torch")

    assert torch.autograd.gradcheck(f, (q, k, v))


def _run_unchecked(q, k, v, cu_q, cu_k, max_q, max_k):
    """The torch backend as it runs where the public value checks are skipped (device tensors)."""
    from coreattn.layers.checks import check_options
    from coreattn.layers.dispatch import run_attention
    from coreattn.kernels.packing import packed

    params = check_options(q.shape[-1], 0.0, None, True, (-1, -1), "bottom_right")
    return run_attention(q, k, v, packed(cu_q), packed(cu_k), max_q, max_k, params, True, "torch")[0]


def test_torch_backend_never_trusts_max_seqlen():
    case = Case(dqk=16, dv=8, lens_q=(10, 2), lens_k=(3, 12))
    q, k, v, cu_q, cu_k, _, _ = make_inputs(case, torch.float32, "cpu")
    ref, _ = attention_ref(q, k, v, cu_q, cu_k, causal=True)
    out = _run_unchecked(q, k, v, cu_q, cu_k, 6, 1)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("cu_vals", [[1, 5, 10], [0, 7, 3, 10], [0, 5, 9]], ids=["not-from-0", "decreasing", "short"])
def test_torch_backend_raises_on_malformed_cu_seqlens_unchecked(cu_vals):
    q = torch.randn(10, 2, 8)
    cu = torch.tensor(cu_vals, dtype=torch.int32)
    with pytest.raises(ValueError, match="malformed cu_seqlens"):
        _run_unchecked(q, q, q, cu, cu, 10, 10)


@pytest.mark.parametrize("lens_q, lens_k", [((3, 2), (0, 0)), ((0, 0), (4, 1)), ((0,), (0,))],
                         ids=["no-keys", "no-queries", "nothing"])
def test_torch_backend_gradients_when_a_side_is_empty(lens_q, lens_k):
    """Zero gradients (not None, as the Triton path gives) when no query or no key exists at all."""
    case = Case(dqk=8, dv=4, lens_q=lens_q, lens_k=lens_k)
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, "cpu", requires_grad=True)
    out = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, backend="torch")
    assert not out.any()
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out), allow_unused=True)
    for g, leaf in zip(grads, (q, k, v)):
        assert g is not None and g.shape == leaf.shape and not g.any()
