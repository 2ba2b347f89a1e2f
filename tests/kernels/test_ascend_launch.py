"""The Ascend launch (persistent core-count grid, Ascend block sizes, ``PERSISTENT`` kernels) under
Triton's interpreter on CPU, against the float64 oracle: ``COREATTN_TRITON_TARGET=ascend``.

The main lane runs this with upstream Triton; the Ascend CI lane runs it (and more) with the
triton-ascend frontend. Neither is a run on NPU hardware.
"""

import pytest
import torch

import coreattn
from attn_cases import (CASES, KERNEL_DEVICE, LENS_K, Case, assert_flash_criterion, assert_grad_criterion,
                        assert_lse_criterion, make_inputs)
from coreattn.kernels import attn_bwd, attn_fwd, varlen_attn_bwd, varlen_attn_fwd
from coreattn.kernels.configs.base import head_block, split_head_block
from coreattn.kernels.configs.dense import bwd_configs, bwd_step_bytes, fwd_config, fwd_step_bytes
from coreattn.kernels.configs.targets import ASCEND_STEP_BUDGET, ENV_TRITON_TARGET, INTERPRETER_ASCEND_CORES
from coreattn.kernels.packing import Packing, packed
from oracle import attention_ref, padded_attention_ref

pytestmark = pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="the forced Ascend launch runs under the interpreter")

ASCEND_CASES = [
    (CASES[0], torch.float16),  # 192/128, GQA, causal bottom-right, an empty sequence
    (CASES[0], torch.float32),
    (CASES[2], torch.float32),  # MQA, causal, Lq > Lk and Lq < Lk, an empty key sequence
    (CASES[4], torch.float32),  # causal top-left with q/k lengths differing
    (CASES[10], torch.float16),  # causal + left window, lengths differing
    (CASES[9], torch.float32),  # two-sided window, top-left
    (CASES[11], torch.float32),  # strided views
    (CASES[13], torch.float32),  # several blocks per sequence
]


@pytest.fixture
def launches(monkeypatch):
    """Force the Ascend target and record every launch's (grid, PERSISTENT)."""
    monkeypatch.setenv(ENV_TRITON_TARGET, "ascend")
    seen = []

    def spy(*args, **kwargs):
        result = launch(*args, **kwargs)
        seen.append(result)
        return result

    launch = attn_fwd.launch_grid
    monkeypatch.setattr(attn_fwd, "launch_grid", spy)
    monkeypatch.setattr(attn_bwd, "launch_grid", spy)
    return seen


def _assert_persistent(seen):
    assert seen, "no kernel was launched"
    for grid, persistent in seen:
        assert persistent and len(grid) == 1 and 1 <= grid[0] <= max(INTERPRETER_ASCEND_CORES)


def _alignment(case):
    return "bottom_right" if case.bottom_right else "top_left"


@pytest.mark.parametrize("case, dtype", ASCEND_CASES, ids=lambda x: getattr(x, "id", str(x).split(".")[-1]))
def test_forward_and_backward_match_oracle(launches, case, dtype):
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, dtype, "cpu", requires_grad=True)
    out, lse = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=case.causal, window_size=case.window,
                                    causal_alignment=_alignment(case), return_lse=True, backend="triton")
    opts = dict(causal=case.causal, window=case.window, bottom_right=case.bottom_right)
    ref, ref_lse = attention_ref(q, k, v, cu_q, cu_k, **opts)
    naive, naive_lse = attention_ref(q, k, v, cu_q, cu_k, upcast=False, **opts)
    assert_flash_criterion("out", out, naive, ref)
    assert_lse_criterion(lse, naive_lse.float(), ref_lse)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert_grad_criterion(out, ref, naive, (q, k, v), g)
    _assert_persistent(launches)
    assert len(launches) == 4  # forward, preprocess, dK/dV, dQ


def test_max_seqlen_is_only_a_hint(launches):
    case = Case(dqk=32, dv=32, causal=True, lens_q=(70, 3))
    q, k, v, cu_q, cu_k, _, _ = make_inputs(case, torch.float32, "cpu")
    out, lse = varlen_attn_fwd(q, k, v, packed(cu_q), packed(cu_k), 1, 32 ** -0.5, -1, 0, True)
    ref, ref_lse = attention_ref(q, k, v, cu_q, cu_k, causal=True)
    naive, naive_lse = attention_ref(q, k, v, cu_q, cu_k, causal=True, upcast=False)
    assert_flash_criterion("out", out, naive, ref)
    assert_lse_criterion(lse, naive_lse.float(), ref_lse)
    _assert_persistent(launches)


@pytest.mark.parametrize("cu_vals", [[1, 5, 10], [0, 7, 3, 10], [0, 5, 12]], ids=["not-from-0", "decreasing", "past-T"])
def test_malformed_cu_seqlens_poison_every_output(launches, cu_vals):
    case = Case(dqk=16, dv=16, lens_q=(10,))
    q, k, v, _, _, _, _ = make_inputs(case, torch.float32, "cpu")
    pack = packed(torch.tensor(cu_vals, dtype=torch.int32))
    out, lse = varlen_attn_fwd(q, k, v, pack, pack, 10, 0.25)
    assert out.isnan().all() and lse.isnan().all()
    dq, dk, dv = varlen_attn_bwd(torch.ones_like(out), q, k, v, torch.zeros_like(out), torch.zeros_like(lse),
                                 pack, pack, 10, 10, 0.25)
    assert dq.isnan().all() and dk.isnan().all() and dv.isnan().all()
    _assert_persistent(launches)


def test_every_gradient_element_is_written(launches):
    case = Case(dqk=40, dv=24, hq=4, hkv=2, causal=True, lens_k=LENS_K)
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, "cpu")
    pq, pk = packed(cu_q), packed(cu_k)
    out = torch.full((q.shape[0], 4, 24), float("nan"))
    lse = torch.full((4, q.shape[0]), float("nan"))
    varlen_attn_fwd(q, k, v, pq, pk, max_q, 40 ** -0.5, -1, 0, True, out=out, lse=lse)
    bufs = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    varlen_attn_bwd(torch.ones_like(out), q, k, v, out, lse, pq, pk, max_q, max_k, 40 ** -0.5, -1, 0, True, *bufs)
    assert not out.isnan().any() and not lse.isnan().any()
    assert not any(b.isnan().any() for b in bufs)


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_spans_and_keep_masks_on_padded_batches(launches, layout):
    gen = torch.Generator().manual_seed(0)
    b, s = 3, 21

    def rand(h, d):
        x = torch.randn(b, s, h, d, generator=gen).to(torch.float16)
        return (x.transpose(0, 1) if layout == "sbhd" else x).requires_grad_()

    q, k, v = rand(4, 40), rand(2, 40), rand(2, 24)
    keep = torch.rand(b, s, generator=gen) < 0.7
    keep[0, 15:] = False
    keep[2] = False
    start = torch.tensor([0, 4, 21], dtype=torch.int32)
    length = torch.tensor([15, 17, 0], dtype=torch.int32)
    in_span = (torch.arange(s)[None] >= start[:, None]) & (torch.arange(s)[None] < (start + length)[:, None])
    out = coreattn.padded_attn(q, k, v, layout=layout, q_start=start, q_len=length, k_start=start, k_len=length,
                               q_keep_mask=keep, k_keep_mask=keep, causal=True, backend="triton")
    bshd = (lambda x: x.transpose(0, 1)) if layout == "sbhd" else (lambda x: x)
    leaves = [bshd(t) for t in (q, k, v)]
    # equal q/k spans: causal visibility depends on position differences only, so the span can be
    # folded into the keep mask for the oracle
    both = keep & in_span
    ref = padded_attention_ref(*leaves, both, both, causal=True)
    naive = padded_attention_ref(*leaves, both, both, causal=True, upcast=False)
    assert_flash_criterion("out", bshd(out), naive, ref)
    g = torch.randn(bshd(out).shape, generator=gen).to(out.dtype)
    assert_grad_criterion(bshd(out), ref, naive, (q, k, v), g)
    _assert_persistent(launches)


def test_span_outside_the_batch_poisons_every_output(launches):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 29, 2, 16, generator=gen) for _ in range(3))
    pack = Packing("bshd", torch.tensor([0, 20, 0], dtype=torch.int32), torch.tensor([5, 20, 0], dtype=torch.int32))
    out, lse = varlen_attn_fwd(q, k, v, pack, pack, 29, 0.25)
    assert out.isnan().all() and lse.isnan().all()


def test_grid_is_the_core_count_capped_by_tasks(launches):
    case = Case(dqk=16, dv=16, hq=1, hkv=1, lens_q=(5,))
    q, k, v, cu_q, cu_k, max_q, _ = make_inputs(case, torch.float32, "cpu")
    varlen_attn_fwd(q, k, v, packed(cu_q), packed(cu_k), max_q, 0.25)
    assert launches[-1][0] == (1,)  # one task: one program
    case = Case(dqk=16, dv=16, hq=8, hkv=8, lens_q=(40, 40))
    q, k, v, cu_q, cu_k, max_q, _ = make_inputs(case, torch.float32, "cpu")
    varlen_attn_fwd(q, k, v, packed(cu_q), packed(cu_k), max_q, 0.25)
    assert launches[-1][0] == (INTERPRETER_ASCEND_CORES[0],)


@pytest.mark.parametrize("elem", [2, 4])
@pytest.mark.parametrize("dqk, dv", [(16, 16), (64, 64), (128, 128), (192, 128), (256, 128), (256, 256)])
def test_ascend_blocks_fit_the_on_chip_buffer(monkeypatch, dqk, dv, elem):
    monkeypatch.setenv(ENV_TRITON_TARGET, "ascend")
    bq, bv = sum(split_head_block(dqk)), head_block(dv)  # the widths the launchers pass
    cpu = torch.device("cpu")
    f, (b, b_dq) = fwd_config(cpu, bq, bv, elem), bwd_configs(cpu, bq, bv, elem)
    assert b == b_dq
    assert fwd_step_bytes(f.block_m, f.block_n, bq, bv, elem) <= ASCEND_STEP_BUDGET
    if (bq, bv, elem) == (256, 256, 4):  # the one documented overflow of the conservative count
        assert (b.block_m, b.block_n) == (16, 16)
    else:
        assert bwd_step_bytes(b.block_m, b.block_n, bq, bv, elem) <= ASCEND_STEP_BUDGET
