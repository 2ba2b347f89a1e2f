"""The pure-torch backend: bf16 on CPU against the oracle, gradcheck in float64, training gradients."""

import pytest
import torch

import coreattn
from attn_cases import LENS_K, Case, assert_flash_criterion, make_inputs
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
    opts = dict(causal=case.causal, window=case.window, bottom_right=case.bottom_right)
    ref, _ = attention_ref(q, k, v, cu_q, cu_k, **opts)
    naive, _ = attention_ref(q, k, v, cu_q, cu_k, upcast=False, **opts)
    assert_flash_criterion("out", out, naive, ref)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), g)
    refs = torch.autograd.grad(ref, (q, k, v), g.double())
    naives = torch.autograd.grad(naive, (q, k, v), g)
    for name, got, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        assert_flash_criterion(name, got, n, r)


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (1, 2))])
def test_gradcheck_float64(causal, window):
    case = Case(dqk=5, dv=3, hq=2, hkv=1, lens_q=(3, 0, 4), lens_k=(2, 3, 4))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float64, "cpu", requires_grad=True)

    def f(q, k, v):
        return coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window_size=window,
                                    backend="torch")

    assert torch.autograd.gradcheck(f, (q, k, v))
