"""The tuner's candidate classes under the interpreter: tiles from the candidate spaces with the TMA
descriptor loads and the warp-specialized loop, forward and backward, against the float64 oracle;
the descriptor path equal to the pointer path bit for bit, also next to non-finite sequences; and the
launches that must fall back to pointer loads.

What the interpreter cannot show: warp specialization (its ``tl.range`` ignores ``warp_specialize``,
so the WARP_SPEC loop runs as a plain loop: this checks that loop's code, not Triton's partitioning)
and the TMA hardware (descriptor loads are emulated as masked pointer loads, zero-filled past the
tensor's bounds as TMA does). num_warps, num_stages, maxnreg and fp fusion are launch options it
ignores. The compiled variants are tests/tune/test_dry_run.py's.
"""

import pytest
import torch

import coreattn
from attn_cases import KERNEL_DEVICE, Case, assert_flash_criterion, make_inputs
from coreattn.kernels import attn_bwd, attn_fwd
from coreattn.kernels.configs.base import KERNELS, AttnConfig
from coreattn.kernels.configs.dense import shipped_config
from coreattn.kernels.configs.pick import forced_configs
from coreattn.kernels.configs.space import candidates, loop_flags
from oracle import attention_ref

pytestmark = pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="interpreter runs of forced configs")

# tiles of the sm90/sm100 spaces (forward/dQ: queries x keys; dK/dV: queries stepped x keys held)
VARIANTS = {
    "fwd128x64-dkdv16x128-dq128x32-tma": dict(fwd=AttnConfig(128, 64, 8, 3, tma=True),
                                              dkdv=AttnConfig(16, 128, 8, 2, tma=True),
                                              dq=AttnConfig(128, 32, 8, 2, tma=True)),
    "fwd64x128-dkdv64x128-dq64x64-tma-ws": dict(fwd=AttnConfig(64, 128, 4, 2, warp_specialize=True, tma=True),
                                                dkdv=AttnConfig(64, 128, 8, 2, warp_specialize=True, tma=True),
                                                dq=AttnConfig(64, 64, 4, 2, warp_specialize=True, tma=True)),
    # with the CUDA launch options (maxnreg, enable_fp_fusion), which the interpreter must ignore
    "fwd128x32-dkdv32x64-dq64x32-pointers": {kernel: cfg._replace(maxnreg=255, fp_fusion=True) for kernel, cfg in dict(
        fwd=AttnConfig(128, 32, 8, 3), dkdv=AttnConfig(32, 64, 4, 2), dq=AttnConfig(64, 32, 4, 3),
        preprocess=AttnConfig(32, 0, 4, None)).items()},
}
CASES = [Case(dqk=192, dv=128, hq=4, hkv=1, causal=True, lens_q=(0, 1, 17, 80, 5), lens_k=(3, 0, 40, 70, 30)),
         Case(dqk=64, dv=64, hq=2, hkv=2, window=(20, 7), lens_q=(140, 33))]


def _run(case, dtype, configs, inputs=None, dout=None):
    q, k, v, cu_q, cu_k, max_q, max_k = inputs or make_inputs(case, dtype, KERNEL_DEVICE, requires_grad=True)
    with forced_configs(**configs):
        out = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=case.causal, window_size=case.window,
                                   backend="triton")
        g = torch.randn_like(out) if dout is None else dout
        grads = torch.autograd.grad(out, (q, k, v), g)
    return out, grads, (q, k, v, cu_q, cu_k), g


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_oracle(variant, case):
    torch.manual_seed(0)
    out, grads, (q, k, v, cu_q, cu_k), g = _run(case, torch.float16, VARIANTS[variant])
    opts = dict(causal=case.causal, window=case.window)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_ref(*leaves, cu_q, cu_k, **opts)
    naive_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    naive, _ = attention_ref(*naive_leaves, cu_q, cu_k, upcast=False, **opts)
    assert_flash_criterion("out", out, naive, ref)
    refs = torch.autograd.grad(ref, leaves, g.double())
    naives = torch.autograd.grad(naive, naive_leaves, g.to(naive.dtype))
    for name, got, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        assert_flash_criterion(name, got, n, r)


@pytest.fixture
def descriptors(monkeypatch):
    """Records the (tensor shape, box) of every descriptor the launchers build."""
    built = []
    real = attn_fwd.row_descriptor

    def spy(x, rows, cols):
        built.append((tuple(x.shape), rows, cols))
        return real(x, rows, cols)

    for module in (attn_fwd, attn_bwd):
        monkeypatch.setattr(module, "row_descriptor", spy)
    monkeypatch.setattr("coreattn.kernels.descriptors.row_descriptor", spy)
    return built


@pytest.mark.parametrize("hkv, poison", [(2, float("inf")), (1, float("nan"))], ids=["mha-inf", "gqa2-nan"])
def test_descriptor_rows_past_a_sequence_never_reach_it(hkv, poison, descriptors):
    """Descriptor boxes run past a sequence's end into the next one's tokens. With the middle sequence
    non-finite, every other sequence's output and gradients are finite and equal the pointer path's
    to fp32 rounding: the descriptor path multiplies k as loaded ([N, D], transposed in the dot)
    where the pointer path loads it transposed, which numpy's matmul sums in another order (about
    1e-7 here), and with GQA the dK/dV kernel adds the heads' query blocks in another order (its
    descriptor loop moves a partial last block into the masked tail)."""
    case = Case(dqk=64, dv=32, hq=2, hkv=hkv, causal=True, lens_q=(40, 9, 37), lens_k=(38, 12, 45))
    tile = dict(fwd=AttnConfig(16, 16, 1, 1), dkdv=AttnConfig(16, 16, 1, 1), dq=AttnConfig(16, 16, 1, 1))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, KERNEL_DEVICE)
    with torch.no_grad():
        for t, cu in ((q, cu_q), (k, cu_k), (v, cu_k)):
            t[cu[1]:cu[2]] = poison
    dout = torch.randn(q.shape[0], case.hq, case.dv)
    dout[cu_q[1]:cu_q[2]] = poison
    results = {}
    for tma in (False, True):
        configs = {name: cfg._replace(tma=tma) for name, cfg in tile.items()}
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        results[tma] = _run(case, torch.float32, configs, (*leaves, cu_q, cu_k, max_q, max_k), dout)[:2]
    assert len(descriptors) == 6  # forward k, v; dK/dV q, dO; dQ k, v: the TMA run used descriptors
    keep_q = torch.ones(q.shape[0], dtype=torch.bool)
    keep_q[cu_q[1]:cu_q[2]] = False
    keep_k = torch.ones(k.shape[0], dtype=torch.bool)
    keep_k[cu_k[1]:cu_k[2]] = False
    (out_p, grads_p), (out_t, grads_t) = results[False], results[True]
    for got, ref, rows in ((out_t, out_p, keep_q), (grads_t[0], grads_p[0], keep_q), (grads_t[1], grads_p[1], keep_k),
                           (grads_t[2], grads_p[2], keep_k)):
        assert torch.isfinite(got[rows]).all()
        torch.testing.assert_close(got[rows], ref[rows], rtol=1e-5, atol=1e-5)


def test_launches_without_descriptors_fall_back_to_pointer_loads(descriptors):
    tma = {name: AttnConfig(16, 32, 1, 1, tma=True) for name in ("fwd", "dkdv", "dq")}
    for case in (Case(dqk=40, dv=32, causal=True),  # 40 pads its 64-wide block: the next head's columns
                 Case(dqk=64, dv=32, hq=4, hkv=2, causal=True, noncontig=True)):  # heads not contiguous
        _run(case, torch.float16, tma)
    q = torch.randn(2, 33, 2, 64, dtype=torch.float16, requires_grad=True)  # padded bshd with keep masks
    keep = torch.ones(2, 33, dtype=torch.bool)
    keep[1, 20:] = False
    with forced_configs(**tma):
        coreattn.padded_attn(q, q, q, layout="bshd", q_keep_mask=keep, k_keep_mask=keep, causal=True,
                             backend="triton").sum().backward()
    assert descriptors == []


def test_warp_specialization_needs_the_descriptor_loop():
    cfg = AttnConfig(64, 64, 4, 2, warp_specialize=True, tma=True)
    assert loop_flags(cfg, "sm100", True) == dict(TMA=True, WARP_SPEC=True)
    assert loop_flags(cfg, "sm100", False) == dict(TMA=False, WARP_SPEC=False)
    assert loop_flags(cfg, "sm80", True) == dict(TMA=False, WARP_SPEC=False)
    assert loop_flags(cfg._replace(tma=False), "sm90", True) == dict(TMA=False, WARP_SPEC=False)


def test_candidate_spaces():
    for target in ("sm80", "sm86", "sm89", "sm90", "sm100", "sm120"):
        for kernel in KERNELS:
            for widths in ((64, 64), (128, 128), (192, 128), (256, 256)):
                found = candidates(target, kernel, *widths)
                assert found[0] == shipped_config(target, kernel, *widths)
                assert len(found) == len(set(found)) >= 3
                assert all(c.tma == c.warp_specialize == False for c in found) or target in ("sm90", "sm100")
                assert not any(c.warp_specialize and not c.tma for c in found)
    assert candidates("sm90", "fwd", 128, 128, elem=4) == [shipped_config("sm90", "fwd", 128, 128, 4)]
    assert candidates("ascend", "fwd", 128, 128) == [shipped_config("ascend", "fwd", 128, 128)]


def test_fused_qkv_views_take_descriptors(descriptors):
    """q, k, v sliced out of one fused [T, 3, H, D] projection (token stride 3 * H * D, heads contiguous):
    strided, yet TMA's rules hold, so the descriptor path runs, and matches the oracle."""
    torch.manual_seed(0)
    lens = (7, 0, 29, 16)
    cu = torch.tensor([0, 7, 7, 36, 52], dtype=torch.int32)
    qkv = torch.randn(sum(lens), 3, 2, 32, dtype=torch.float16, requires_grad=True)
    q, k, v = qkv.unbind(1)
    assert not q.is_contiguous()
    cfg = AttnConfig(16, 16, 1, 1, tma=True)
    with forced_configs(fwd=cfg, dkdv=cfg, dq=cfg):
        out = coreattn.varlen_attn(q, k, v, cu, cu, 29, 29, causal=True, backend="triton")
        g = torch.randn_like(out)
        (grad,) = torch.autograd.grad(out, qkv, g)
    assert len(descriptors) == 6
    leaf = qkv.detach().requires_grad_()
    ref, _ = attention_ref(*leaf.unbind(1), cu, cu, causal=True)
    naive_leaf = qkv.detach().requires_grad_()
    naive, _ = attention_ref(*naive_leaf.unbind(1), cu, cu, causal=True, upcast=False)
    assert_flash_criterion("out", out, naive, ref)
    (ref_grad,) = torch.autograd.grad(ref, leaf, g.double())
    (naive_grad,) = torch.autograd.grad(naive, naive_leaf, g.to(naive.dtype))
    assert_flash_criterion("dqkv", grad, naive_grad, ref_grad)


def test_descriptors_reject_zero_and_overlapping_token_strides():
    """usable(): a token stride of 0 (a dO expanded along the tokens) or tokens closer than H * D
    elements (overlapping rows) is not a [T, H * D] tensor a descriptor can describe."""
    from coreattn.kernels.descriptors import usable
    from coreattn.kernels.packing import packed

    pack = (packed(torch.tensor([0, 8], dtype=torch.int32)),)
    base = torch.randn(8, 2, 32, dtype=torch.float16)
    assert usable(pack, ((base, 32),))
    expanded = torch.randn(1, 2, 32, dtype=torch.float16).expand(8, 2, 32)  # token stride 0
    assert expanded.stride(0) == 0 and not usable(pack, ((expanded, 32),))
    overlapping = torch.randn(288, dtype=torch.float16).as_strided((8, 2, 32), (32, 32, 1))  # token stride < H * D
    assert not usable(pack, ((overlapping, 32),))
    wider = torch.randn(8, 3, 2, 32, dtype=torch.float16)[:, 0]  # token stride 3 * H * D: fine
    assert usable(pack, ((wider, 32),))


def test_expanded_dout_takes_pointer_loads(descriptors):
    """A dO expanded along the tokens (out.sum() over a broadcast, or a user's expand) reaches the
    backward with token stride 0: the dK/dV kernel takes the pointer loads, and the result matches the
    same gradient materialized."""
    torch.manual_seed(0)
    cu = torch.tensor([0, 9, 25], dtype=torch.int32)
    q, k, v = (torch.randn(25, 2, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
    cfg = AttnConfig(16, 16, 1, 1, tma=True)
    g = torch.randn(1, 2, 32, dtype=torch.float16)
    with forced_configs(fwd=cfg, dkdv=cfg, dq=cfg):
        out = coreattn.varlen_attn(q, k, v, cu, cu, 16, 16, causal=True, backend="triton")
        descriptors.clear()
        got = torch.autograd.grad(out, (q, k, v), g.expand(25, 2, 32), retain_graph=True)
        assert len(descriptors) == 2  # the dQ kernel's k and v; no q or dO descriptor for dK/dV
        descriptors.clear()
        want = torch.autograd.grad(out, (q, k, v), g.expand(25, 2, 32).contiguous())
        assert len(descriptors) == 4
    for a, b in zip(got, want):
        assert torch.equal(a, b)
