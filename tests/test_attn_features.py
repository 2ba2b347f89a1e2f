"""Dropout, softmax offsets (sinks) and max logits through the public functions, on the Triton
kernels (the interpreter without a GPU) and the torch backend, against the float64 oracle that
applies the same keep mask (coreattn.kernels.dropout.keep_mask, itself checked against Philox's
known answers and tl.philox in test_dropout_rng.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import coreattn
from attn_cases import (KERNEL_DEVICE, KERNEL_DTYPES, LENS_K, Case, assert_flash_criterion, assert_lse_criterion,
                        cu_from_lens, dtype_id, make_inputs, max_err)
from coreattn.kernels.configs import base, dense, targets
from coreattn.kernels import dropout
from oracle import attention_ref, max_logit_ref, padded_attention_ref

BACKENDS = ["triton", "torch"]


@dataclasses.dataclass(frozen=True)
class Features:
    dropout_p: float = 0.0
    sink: bool = False
    max_logit: bool = False

    @property
    def id(self) -> str:
        parts = ([f"drop{self.dropout_p}"] if self.dropout_p else []) + (["sink"] if self.sink else []) \
            + (["maxlogit"] if self.max_logit else [])
        return "+".join(parts)


ALL = Features(0.3, True, True)
CASES = [
    (Case(dqk=64, dv=64, hq=2, hkv=2), Features(dropout_p=0.2)),
    (Case(dqk=32, dv=16, hq=4, hkv=2, causal=True, lens_k=LENS_K), Features(sink=True)),
    (Case(dqk=96, dv=64, hq=4, hkv=1, window=(3, 2)), Features(max_logit=True)),
    # every feature together, with MLA head dims, GQA, both causal alignments, windows and empty sequences
    (Case(dqk=192, dv=128, hq=4, hkv=2, causal=True, lens_k=LENS_K), ALL),
    (Case(dqk=48, dv=32, hq=4, hkv=1, causal=True, window=(7, 0), bottom_right=False, lens_k=LENS_K), ALL),
    (Case(dqk=64, dv=64, hq=2, hkv=1, causal=True, lens_q=(70, 41)), Features(0.1, True, True)),
]


def _state(seed: int, device) -> torch.Tensor:
    """The RNG state a call draws first thing after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return dropout.rng_state(torch.device(device))


def _keep_fn(state: torch.Tensor, p: float):
    return lambda heads, q_ids, k_ids: dropout.keep_mask(state.cpu(), p, heads, q_ids, k_ids)


def _offset(hq: int, device, requires_grad=True) -> torch.Tensor:
    off = torch.linspace(-1.5, 2.0, hq, dtype=torch.float32, device=device)
    return off.requires_grad_() if requires_grad else off


def _ref(case, feats, q, k, v, cu_q, cu_k, offset, state, upcast):
    leaves = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    off = offset.detach().cpu().requires_grad_() if offset is not None else None
    out, lse = attention_ref(*leaves, cu_q.cpu(), cu_k.cpu(), causal=case.causal, window=case.window,
                             bottom_right=case.bottom_right, upcast=upcast, softmax_offset=off,
                             dropout_p=feats.dropout_p, keep_fn=_keep_fn(state, feats.dropout_p) if state is not None
                             else None)
    return out, lse, leaves, off


def _backend_dtypes():
    return [("triton", d) for d in KERNEL_DTYPES] + [("torch", torch.float32), ("torch", torch.float16)]


# without CUDA (KERNEL_DTYPES lacks bf16), bf16 on the Triton kernels runs on one case with every
# feature (192/128, GQA, causal, dropout, sinks, max logits) and on spans: each costs 4-12 s on the
# interpreter, see attn_cases.BF16_CPU_CASES
CPU_BF16 = torch.bfloat16 not in KERNEL_DTYPES


def _feature_params():
    combos = [(c, f, b, d) for c, f in CASES for b, d in _backend_dtypes()]
    if CPU_BF16:
        combos.append((*CASES[3], "triton", torch.bfloat16))
    return [pytest.param(c, f, b, d, id=f"{c.id}-{f.id}-{b}-{dtype_id(d)}") for c, f, b, d in combos]


@pytest.mark.parametrize("case, feats, backend, dtype", _feature_params())
def test_features_forward_backward_match_oracle(case, feats, backend, dtype):
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, dtype, KERNEL_DEVICE, requires_grad=True)
    offset = _offset(case.hq, q.device) if feats.sink else None
    seed = 11
    state = _state(seed, q.device) if feats.dropout_p else None
    torch.manual_seed(seed)
    res = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=feats.dropout_p, causal=case.causal,
                               window_size=case.window, causal_alignment="bottom_right" if case.bottom_right
                               else "top_left", return_lse=True, return_max_logit=feats.max_logit,
                               softmax_offset=offset, backend=backend)
    out, lse = res[:2]
    ref, ref_lse, ref_leaves, ref_off = _ref(case, feats, q, k, v, cu_q, cu_k, offset, state, upcast=True)
    naive, naive_lse, naive_leaves, naive_off = _ref(case, feats, q, k, v, cu_q, cu_k, offset, state, upcast=False)
    assert out.dtype == dtype
    assert_flash_criterion("out", out.cpu(), naive, ref)
    assert_lse_criterion(lse, naive_lse, ref_lse)
    if feats.max_logit:
        max_logit = res[2]
        assert max_logit.dtype == torch.float32 and max_logit.shape == (case.hq,)
        want = max_logit_ref(q.detach().cpu(), k.detach().cpu(), cu_q.cpu(), cu_k.cpu(), causal=case.causal,
                             window=case.window, bottom_right=case.bottom_right)
        naive_max = max_logit_ref(q.detach().cpu().float(), k.detach().cpu().float(), cu_q.cpu(), cu_k.cpu(),
                                  causal=case.causal, window=case.window, bottom_right=case.bottom_right)
        assert_flash_criterion("max_logit", max_logit.cpu(), naive_max, want)

    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype).to(out.device)
    leaves = [q, k, v] + ([offset] if offset is not None else [])
    grads = torch.autograd.grad(out, leaves, g)
    refs = torch.autograd.grad(ref, ref_leaves + ([ref_off] if ref_off is not None else []), g.cpu().double())
    naives = torch.autograd.grad(naive, naive_leaves + ([naive_off] if naive_off is not None else []),
                                 g.cpu().to(naive.dtype))
    for name, got, r, n in zip(("dq", "dk", "dv", "d_offset"), grads, refs, naives):
        assert got.dtype == (dtype if name != "d_offset" else torch.float32)
        assert_flash_criterion(name, got.cpu(), n, r)


def _one_hot_problem(device, hq=2, hkv=1, lens=(24, 9), dtype=torch.float32):
    """q = k = 0 (every visible key equally likely) and V = the identity over each sequence's keys:
    out[i, h, j] * Lk * (1 - p) is exactly the keep mask of (h, i, key j)."""
    total = sum(lens)
    width = max(lens)
    q = torch.zeros(total, hq, 16, dtype=dtype, device=device)
    k = torch.zeros(total, hkv, 16, dtype=dtype, device=device)
    pos = torch.cat([torch.arange(n) for n in lens])
    v = torch.nn.functional.one_hot(pos, width).to(dtype)[:, None, :].expand(total, hkv, width).contiguous().to(device)
    return q, k, v, cu_from_lens(lens, device), width


def _recovered_mask(out, cu, p):
    """[Hq, T, Lmax] keep mask read back from the one-hot output (per sequence, keys padded with 0)."""
    lens = (cu[1:] - cu[:-1]).tolist()
    scale = torch.cat([torch.full((n,), n * (1 - p)) for n in lens])  # [T]
    return (out.detach().cpu().double() * scale[:, None, None]).round().permute(1, 0, 2)


def _expected_mask(state, p, cu, hq, width):
    lens = (cu[1:] - cu[:-1]).tolist()
    rows = []
    start = 0
    for n in lens:
        keep = dropout.keep_mask(state.cpu(), p, torch.arange(hq)[:, None, None],
                                 torch.arange(start, start + n)[None, :, None],
                                 torch.arange(start, start + n)[None, None, :]).double()  # [H, n, n]
        rows.append(torch.nn.functional.pad(keep, (0, width - n)))
        start += n
    return torch.cat(rows, dim=1)  # [H, T, width]


LAUNCHES = {
    "interpreter-16x32": lambda mp: None,
    "interpreter-32x16": lambda mp: mp.setattr(dense, "_INTERPRETER", base.AttnConfig(32, 16, 1, 1)),
    "ascend-persistent": lambda mp: mp.setenv(targets.ENV_TRITON_TARGET, "ascend"),
    "torch": lambda mp: None,
}


def _launch_params():
    """On a GPU the interpreter's tile and the forced Ascend launch do not apply: the launch takes the GPU's table."""
    only = {"interpreter-32x16": "sets the interpreter's tile (interpreter-16x32 runs the GPU's own tile there)",
            "ascend-persistent": "forces the Ascend launch, whose core count comes from the interpreter here"}
    return [pytest.param(name, marks=[pytest.mark.interpreter_only(only[name])] if name in only else [])
            for name in LAUNCHES]


@pytest.mark.parametrize("launch", _launch_params())
def test_dropout_mask_is_the_shared_function_whatever_the_blocks_grid_or_backend(launch, monkeypatch):
    """The keep mask read back from the output equals keep_mask(seed, offset, q head, query id, key id):
    the same for two block shapes, the Ascend persistent grid and the torch backend."""
    LAUNCHES[launch](monkeypatch)
    p = 0.4
    q, k, v, cu, width = _one_hot_problem(KERNEL_DEVICE)
    state = _state(5, q.device)
    torch.manual_seed(5)
    out = coreattn.varlen_attn(q, k, v, cu, cu, width, width, dropout_p=p,
                               backend="torch" if launch == "torch" else "triton")
    got = _recovered_mask(out, cu.cpu(), p)
    want = _expected_mask(state, p, cu.cpu(), q.shape[1], width)
    assert torch.equal(got, want)
    kept = want.sum().item() / (sum(n * n for n in (24, 9)) * q.shape[1])
    assert 0.5 < kept < 0.7  # 1 - p = 0.6 over 1314 draws (the binomial bound is test_dropout_rng.py's)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_seeds(backend):
    """Same seed: bitwise-equal outputs and gradients; another seed or the next call: different."""
    case = Case(dqk=32, dv=16, hq=4, hkv=2, causal=True, lens_q=(19, 0, 7))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, KERNEL_DEVICE, requires_grad=True)
    g = torch.randn(q.shape[0], case.hq, case.dv, generator=torch.Generator().manual_seed(1)).to(q.device)

    def run(seed=None):
        if seed is not None:
            torch.manual_seed(seed)
        out = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.25, causal=True, backend=backend)
        return (out, *torch.autograd.grad(out, (q, k, v), g))

    a, b, c = run(7), run(7), run(8)
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y)
        assert not torch.equal(x, z)
    d, e = run(9), run()  # successive calls advance the generator
    assert not torch.equal(d[0], e[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_dropout_is_no_dropout(backend):
    case = Case(dqk=32, dv=16, hq=2, hkv=2, causal=True, lens_q=(9, 4))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, KERNEL_DEVICE)
    a = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend=backend)
    b = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, dropout_p=0.0, backend=backend)
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sink_rows_without_keys_and_lse(backend):
    """A row that sees no key outputs zeros with lse = its head's offset, and gets zero gradient."""
    case = Case(dqk=16, dv=8, hq=2, hkv=1, causal=True, lens_q=(4, 3), lens_k=(0, 2))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, KERNEL_DEVICE, requires_grad=True)
    offset = torch.tensor([0.0, -0.5], device=q.device, requires_grad=True)
    out, lse, max_logit = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True,
                                               return_max_logit=True, softmax_offset=offset, backend=backend)
    # sequence 0 has no key; in sequence 1 (3 queries, 2 keys, bottom-right) query 0 sees no key
    empty = torch.tensor([1, 1, 1, 1, 1, 0, 0], dtype=torch.bool, device=q.device)
    assert not out[empty].any() and not out.isnan().any()
    assert torch.allclose(lse[:, empty].cpu(), offset.detach().cpu()[:, None].expand(2, 5), rtol=0, atol=1e-6)
    dq, = torch.autograd.grad(out.sum(), q)
    assert not dq[empty].any()
    assert torch.isfinite(max_logit).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_logit_ignores_masked_pairs_and_dropout(backend):
    case = Case(dqk=16, dv=8, hq=2, hkv=2, window=(1, 0), lens_q=(6,))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, KERNEL_DEVICE)
    k = k.clone()
    k[0] = 50.0 * q[5]  # a huge logit for (query 5, key 0), outside the window
    opts = dict(window_size=case.window, return_max_logit=True, backend=backend)
    _, plain = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **opts)
    _, dropped = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.5, **opts)
    _, unmasked = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, return_max_logit=True, backend=backend)
    want = max_logit_ref(q.cpu(), k.cpu(), cu_q.cpu(), cu_k.cpu(), window=case.window)
    want_unmasked = max_logit_ref(q.cpu(), k.cpu(), cu_q.cpu(), cu_k.cpu())
    assert max_err(plain.cpu(), want) < 1e-4 and torch.equal(plain, dropped)
    assert max_err(unmasked.cpu(), want_unmasked) < 1e-3 and (want_unmasked > want + 1).all()
    # no visible pair at all: -inf per head
    empty_k = torch.zeros(1, dtype=torch.int32, device=q.device).repeat(2)
    _, none = coreattn.varlen_attn(q, k[:0], v[:0], cu_q, empty_k, max_q, 0, **opts)
    assert torch.isneginf(none).all()


def _padded_params():
    combos = [(b, d, p) for p in ("keep-masks", "spans") for b, d in _backend_dtypes()]
    if CPU_BF16:
        combos.append(("triton", torch.bfloat16, "spans"))
    return [pytest.param(b, d, p, id=f"{b}-{dtype_id(d)}-{p}") for b, d, p in combos]


@pytest.mark.parametrize("backend, dtype, padding", _padded_params())
def test_padded_batches_with_every_feature(backend, dtype, padding):
    """padded_attn with [B, S] keep masks (holes, left and right padding, an empty row) or spans (left and
    right padding, an empty span), dropout on b * S + position ids, sinks, max logits, GQA and 192/128,
    against the padded oracle with the same keep mask."""
    b, s, hq, hkv = 3, 21, 4, 2
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(b, s, h, 192, generator=gen).to(dtype) for h in (hq, hkv))
    v = torch.randn(b, s, hkv, 128, generator=gen).to(dtype)
    keep = torch.zeros(b, s, dtype=torch.bool)
    keep[0, :15] = True  # right padding
    keep[1, 2:] = True  # left padding (an empty third sample)
    where = dict(q_start=torch.tensor([0, 2, 21], dtype=torch.int32), q_len=torch.tensor([15, 19, 0], dtype=torch.int32))
    if padding == "keep-masks":
        keep[1, [7, 8, 9, 20]] = False  # holes
        where = dict(q_keep_mask=keep, k_keep_mask=keep)
    else:
        where.update(k_start=where["q_start"], k_len=where["q_len"])
    where = {name: t.to(KERNEL_DEVICE) for name, t in where.items()}
    q, k, v = (t.to(KERNEL_DEVICE).requires_grad_() for t in (q, k, v))
    offset = _offset(hq, q.device)
    p = 0.3
    state = _state(21, q.device)
    torch.manual_seed(21)
    out, max_logit = coreattn.padded_attn(q, k, v, causal=True, dropout_p=p, softmax_offset=offset,
                                          return_max_logit=True, backend=backend, **where)
    leaves = [[t.detach().cpu().requires_grad_() for t in (q, k, v, offset)] for _ in range(2)]
    ref, naive = (padded_attention_ref(*lv[:3], keep, keep, causal=True, upcast=up, softmax_offset=lv[3],
                                       dropout_p=p, keep_fn=_keep_fn(state, p))
                  for lv, up in zip(leaves, (True, False)))
    assert_flash_criterion("out", out.cpu(), naive, ref)
    assert torch.isfinite(max_logit).all()
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype).to(out.device)
    grads = torch.autograd.grad(out, (q, k, v, offset), g)
    refs = torch.autograd.grad(ref, leaves[0], g.cpu().double())
    naives = torch.autograd.grad(naive, leaves[1], g.cpu().to(naive.dtype))
    for name, got, r, n in zip(("dq", "dk", "dv", "d_offset"), grads, refs, naives):
        assert_flash_criterion(name, got.cpu(), n, r)


def test_flash_attn_varlen_func_takes_dropout():
    case = Case(dqk=32, dv=32, hq=2, hkv=2, lens_q=(5, 8))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, KERNEL_DEVICE)
    torch.manual_seed(3)
    out, lse, probs = coreattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.1,
                                                      return_attn_probs=True)
    torch.manual_seed(3)
    same = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.1)
    assert torch.equal(out, same) and probs is None and lse.shape == (2, 13)
