"""coreattn.padded_attn: padded bshd/sbhd batches with per-sample spans, against the packed path."""

import pytest
import torch

import coreattn
from attn_cases import KERNEL_DEVICE
from coreattn.kernels import varlen_attn_bwd, varlen_attn_fwd
from coreattn.kernels.packing import Packing

B, S, HQ, HKV, DQK, DV = 3, 29, 4, 2, 40, 24
STARTS = (0, 6, 29)  # right padding, left padding (6 + 23 = S), an empty sample
LENS = (17, 23, 0)


def _padded_inputs(layout, device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(h, d):
        x = torch.randn(B, S, h, d, generator=gen).to(dtype).to(device)
        return x.transpose(0, 1) if layout == "sbhd" else x  # sbhd as a strided view, no copy

    q, k, v = rand(HQ, DQK), rand(HKV, DQK), rand(HKV, DV)
    return [t.requires_grad_() for t in (q, k, v)]


def _sample(x, layout, b):
    return x[b] if layout == "bshd" else x[:, b]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_padded_matches_packed_per_sample(layout, causal, backend):
    q, k, v = _padded_inputs(layout, KERNEL_DEVICE)
    start = torch.tensor(STARTS, dtype=torch.int32, device=q.device)
    length = torch.tensor(LENS, dtype=torch.int32, device=q.device)
    out, lse = coreattn.padded_attn(q, k, v, layout=layout, q_start=start, q_len=length, k_start=start,
                                    k_len=length, causal=causal, return_lse=True, backend=backend)
    assert out.shape == q.shape[:3] + (DV,) and lse.shape == (B, HQ, S)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    for b, (s0, n) in enumerate(zip(STARTS, LENS)):
        span = slice(s0, s0 + n)
        outside = torch.ones(S, dtype=torch.bool)
        outside[span] = False
        assert not _sample(out, layout, b)[outside].any(), "padding positions must be zero"
        assert torch.isneginf(lse[b][:, outside]).all()
        for grad in grads:
            assert not _sample(grad, layout, b)[outside].any(), "padding positions get no gradient"
        if n == 0:
            continue
        qb, kb, vb = (_sample(t, layout, b)[span].detach().requires_grad_() for t in (q, k, v))
        cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)
        ob, lb = coreattn.varlen_attn(qb, kb, vb, cu, cu, n, n, causal=causal, return_lse=True, backend=backend)
        torch.testing.assert_close(_sample(out, layout, b)[span], ob, rtol=0, atol=2e-6)
        torch.testing.assert_close(lse[b][:, span], lb, rtol=0, atol=2e-6)
        gb = torch.autograd.grad(ob, (qb, kb, vb), _sample(g, layout, b)[span])
        for grad, ref in zip(grads, gb):
            torch.testing.assert_close(_sample(grad, layout, b)[span], ref, rtol=0, atol=2e-5)


def test_whole_rows_when_no_spans_given():
    q, k, v = _padded_inputs("bshd", KERNEL_DEVICE)
    out = coreattn.padded_attn(q, k, v, causal=True, backend="triton")
    ref = coreattn.padded_attn(q, k, v, causal=True, backend="torch")
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)


def test_span_outside_the_batch_gives_nan_on_device_path():
    """Kernel-level answer to bad spans when the host checks are off (GPU default): every output is NaN,
    forward and backward (one bad span poisons the whole call, as malformed cu_seqlens do)."""
    q, k, v = (t.detach() for t in _padded_inputs("bshd", KERNEL_DEVICE))
    start = torch.tensor([0, 20, 0], dtype=torch.int32, device=q.device)
    length = torch.tensor([5, 20, 0], dtype=torch.int32, device=q.device)  # sample 1 ends at 40 > S
    pack = Packing("bshd", start, length)
    out, lse = varlen_attn_fwd(q, k, v, pack, pack, S, DQK ** -0.5)
    assert out.isnan().all() and lse.isnan().all()
    grads = varlen_attn_bwd(torch.ones_like(out), q, k, v, torch.zeros_like(out), torch.zeros_like(lse), pack, pack,
                            S, S, DQK ** -0.5)
    assert all(g.isnan().all() for g in grads)


@pytest.mark.parametrize("bad, match", [
    (dict(layout="thd"), "layout"),
    (dict(q_start=torch.tensor([0, 0], dtype=torch.int32)), "q_start has 2 entries"),
    (dict(q_len=torch.tensor([0, 0, 0], dtype=torch.int64)), "q_len must be int32"),
    (dict(k_start=torch.tensor([0, 5, 0], dtype=torch.int32), k_len=torch.tensor([1, 25, 0], dtype=torch.int32)),
     "does not fit"),
    (dict(q_len=torch.tensor([-1, 0, 0], dtype=torch.int32)), "does not fit"),
    (dict(k_len=torch.tensor([4, 9, 5, 9, 6], dtype=torch.int32)[::2]), "k_len must be contiguous"),
])
def test_bad_spans_raise(bad, match):
    q, k, v = _padded_inputs("bshd", "cpu")
    with pytest.raises((ValueError, TypeError), match=match):
        coreattn.padded_attn(q, k, v, backend="torch", **bad)


def test_batch_mismatch_raises():
    q, k, v = _padded_inputs("bshd", "cpu")
    with pytest.raises(ValueError, match="batch mismatch"):
        coreattn.padded_attn(q, k[:2], v[:2], backend="torch")


def _keep_masks(device, int_dtype=None):
    gen = torch.Generator().manual_seed(5)
    keep = torch.rand(B, S, generator=gen) < 0.7  # holes everywhere
    keep[0, 20:] = False  # right padding
    keep[1, :9] = False  # left padding
    keep[2] = False  # an empty sample
    keep = keep.to(device)
    return keep.to(int_dtype) if int_dtype is not None else keep


@pytest.mark.parametrize("mask_dtype", [None, torch.int64], ids=["bool", "int64"])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (4, 3))],
                         ids=["full", "causal", "window"])
def test_keep_masks_match_dense_oracle(causal, window, mask_dtype):
    from attn_cases import assert_flash_criterion
    from oracle import padded_attention_ref

    q, k, v = _padded_inputs("bshd", KERNEL_DEVICE, torch.float16)
    keep = _keep_masks(q.device, mask_dtype)
    out = coreattn.padded_attn(q, k, v, q_keep_mask=keep, k_keep_mask=keep, causal=causal, window_size=window,
                               backend="triton")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype).to(out.device)
    grads = torch.autograd.grad(out, (q, k, v), g)
    leaves = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    opts = dict(causal=causal, window=window)
    ref = padded_attention_ref(*leaves, keep.cpu(), keep.cpu(), **opts)
    naive = padded_attention_ref(*leaves, keep.cpu(), keep.cpu(), upcast=False, **opts)
    assert_flash_criterion("out", out.cpu(), naive, ref)
    assert not out[~keep.bool()].any(), "dropped query rows output zeros"
    refs = torch.autograd.grad(ref, leaves, g.cpu().double())
    naives = torch.autograd.grad(naive, leaves, g.cpu())
    for name, got, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        assert_flash_criterion(name, got.cpu(), n, r)
    torch_out = coreattn.padded_attn(*leaves, q_keep_mask=keep.cpu(), k_keep_mask=keep.cpu(), causal=causal,
                                     window_size=window, backend="torch")
    assert_flash_criterion("torch backend", torch_out, naive, ref)


def test_all_true_keep_mask_equals_no_mask():
    q, k, v = (t.detach() for t in _padded_inputs("sbhd", KERNEL_DEVICE))
    ones = torch.ones(B, S, dtype=torch.bool, device=q.device)
    a = coreattn.padded_attn(q, k, v, layout="sbhd", causal=True, backend="triton")
    b = coreattn.padded_attn(q, k, v, layout="sbhd", q_keep_mask=ones, k_keep_mask=ones, causal=True,
                             backend="triton")
    assert torch.equal(a, b)


@pytest.mark.parametrize("bad, exc, match", [
    (dict(k_keep_mask=torch.ones(B, S + 1, dtype=torch.bool)), ValueError, "k_keep_mask has shape"),
    (dict(q_keep_mask=torch.ones(B, S)), TypeError, "q_keep_mask must be bool or integer"),
    (dict(q_keep_mask=torch.ones(B, S, 1, dtype=torch.bool)), ValueError, "q_keep_mask must have 2 dims"),
    (dict(k_keep_mask=-torch.ones(B, S, dtype=torch.int64)), ValueError, "k_keep_mask is an integer mask.*only 0 and 1"),
])
def test_bad_keep_masks_raise(bad, exc, match):
    q, k, v = _padded_inputs("bshd", "cpu")
    with pytest.raises(exc, match=match):
        coreattn.padded_attn(q, k, v, backend="torch", **bad)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_spans_on_packed_tensors(backend):
    """Span descriptors on a thd tensor (stride_b = 0): each query chunk sees only the first
    ``k_len`` keys of its sequence, bottom-right causal, as context-parallel chunks need."""
    gen = torch.Generator().manual_seed(7)
    t, dqk, dv = 40, 32, 16
    q, k = (torch.randn(t, 2, dqk, generator=gen).to(KERNEL_DEVICE) for _ in range(2))
    v = torch.randn(t, 2, dv, generator=gen).to(KERNEL_DEVICE)
    i32 = dict(dtype=torch.int32, device=q.device)
    q_start, q_len = torch.tensor([0, 10, 25], **i32), torch.tensor([10, 15, 0], **i32)
    k_start, k_len = torch.tensor([0, 0, 25], **i32), torch.tensor([12, 25, 3], **i32)
    from coreattn.layers.checks import VarlenParams
    from coreattn.layers.dispatch import run_attention

    params = VarlenParams(dqk ** -0.5, -1, 0, True)
    out, lse, _ = run_attention(q, k, v, Packing("thd", q_start, q_len), Packing("thd", k_start, k_len), 15, 25,
                             params, True, backend)
    assert out.shape == (t, 2, dv) and lse.shape == (2, t)
    assert not out[35:].any() and torch.isneginf(lse[:, 35:]).all(), "rows outside every span stay empty"
    for b in range(3):
        qs, ql, ks, kl = (int(x[b]) for x in (q_start, q_len, k_start, k_len))
        if ql == 0:
            continue
        cq = torch.tensor([0, ql], **i32)
        ck = torch.tensor([0, kl], **i32)
        ref = coreattn.varlen_attn(q[qs:qs + ql], k[ks:ks + kl], v[ks:ks + kl], cq, ck, ql, kl, causal=True,
                                   backend="torch")
        torch.testing.assert_close(out[qs:qs + ql], ref, rtol=0, atol=2e-6)
