"""The npu_fused backend and Ascend detection, on CPU: a fake torch_npu (tests/fake_torch_npu.py)
implements npu_fusion_attention's documented semantics and records what coreattn passes it.

There is no ``npu`` device type without torch_npu, so the backend's logic runs on CPU tensors
(``attn_npu_fused`` directly, or through the public functions with the dispatch pinned to
npu_fused) and device selection is tested with a stand-in device object.
"""

import math
import sys
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

import coreattn
from attn_cases import (CASES, KERNEL_DEVICE, LENS_K, Case, assert_flash_criterion, assert_grad_criterion,
                        assert_matches_oracle, make_inputs)
from coreattn.layers import backends
from coreattn.kernels import npu
from coreattn.layers.backends import Backend, is_available, select_backend
from coreattn.kernels.configs.targets import ENV_TRITON_TARGET, target_of
from coreattn.kernels.packing import Packing, packed
from coreattn.layers import dispatch
from coreattn.layers.checks import VarlenParams
from coreattn.layers.torch_backend.dense_mask import dense_mask_attn
from coreattn.layers.npu_fused.attention import INT_MAX, MAX_VARLEN_SEQUENCES, attn_npu_dense_mask, attn_npu_fused
from fake_torch_npu import FakeTorchNpu
from oracle import attention_ref, padded_attention_ref

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


class Device(NamedTuple):
    """Stands in for torch.device("npu"), which needs torch_npu to exist."""

    type: str
    index: int | None = 0


NPU = Device("npu")


@pytest.fixture
def fake_npu(monkeypatch):
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake.module)
    npu.cache_clear()
    yield fake
    npu.cache_clear()


@pytest.fixture
def no_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ImportError
    npu.cache_clear()
    yield
    npu.cache_clear()


def _params(case: Case) -> VarlenParams:
    right = 0 if case.causal else case.window[1]
    return VarlenParams(case.dqk ** -0.5, case.window[0], right, case.bottom_right)


def _used(case: Case) -> list[tuple[int, int]]:
    """(Lq, Lk) of the sequences the op gets: those with queries and keys."""
    lens_k = case.lens_k if case.lens_k is not None else case.lens_q
    return [(lq, lk) for lq, lk in zip(case.lens_q, lens_k) if lq and lk]


def _expected_error(case: Case):
    if case.dv > case.dqk:
        return ValueError, "Dqk >= Dv"
    params = _params(case)
    window = not (params.window_left < 0 and params.window_right in (-1, 0))
    if window and not case.bottom_right and any(lq != lk for lq, lk in _used(case)):
        return NotImplementedError, "aligned bottom-right"
    return None


def _expected_mode(params: VarlenParams, longest: int) -> tuple[int, int, int]:
    """(sparse_mode, pre_tockens, next_tockens) coreattn must pass; ``longest``: the longest
    sequence the op sees, which caps both sides of a band."""
    left, right = params.window_left, params.window_right
    if left < 0 and right < 0:
        return 0, INT_MAX, INT_MAX
    if left < 0 and right == 0:
        return (3 if params.bottom_right else 2), INT_MAX, INT_MAX
    return 4, (longest if left < 0 else min(left, longest)), (longest if right < 0 else min(right, longest))


def _check_call(call, params, hq, longest):
    mode, pre, nxt = _expected_mode(params, longest)
    assert call["sparse_mode"] == mode and call["head_num"] == hq
    assert call["scale"] == params.softmax_scale and call["keep_prob"] == 1.0
    if mode in (2, 3, 4):
        assert call["atten_mask"] is coreattn.masks.npu_compressed_causal_mask("cpu")
        assert call["atten_mask"].shape == (2048, 2048) and call["atten_mask"].dtype == torch.bool
    if mode == 4:
        assert (call["pre_tockens"], call["next_tockens"]) == (pre, nxt)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", CASES + [
    Case(dqk=64, dv=32, hq=4, hkv=2, lens_q=(0, 0, 9, 0), lens_k=(0, 4, 9, 0)),
    Case(dqk=32, dv=16, hq=2, hkv=1, causal=True, lens_q=(0, 3, 4, 0), lens_k=(2, 0, 4, 0)),  # gathers q and k
    Case(dqk=32, dv=32, hq=2, hkv=2, window=(2, -1), lens_q=(6, 9, 1), lens_k=(11, 4, 7)),
    Case(dqk=32, dv=32, hq=2, hkv=2, window=(-1, 1), lens_q=(6, 9, 1), lens_k=(11, 4, 7)),
], ids=lambda c: c.id)
def test_packed_matches_oracle_and_passes_tnd(fake_npu, case, dtype):
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, dtype, "cpu", requires_grad=True)
    params = _params(case)
    err = _expected_error(case)
    if err is not None:
        with pytest.raises(err[0], match=err[1]):
            attn_npu_fused(q, k, v, packed(cu_q), packed(cu_k), max_q, max_k, params)
        return
    out, lse = attn_npu_fused(q, k, v, packed(cu_q), packed(cu_k), max_q, max_k, params)
    assert lse is None and out.dtype == dtype and out.shape == (q.shape[0], case.hq, case.dv)

    (call,) = fake_npu.calls
    assert call["input_layout"] == "TND"
    used = _used(case)  # sequences empty on either side are left out
    assert call["actual_seq_qlen"] == torch.tensor([lq for lq, _ in used]).cumsum(0).tolist()
    assert call["actual_seq_kvlen"] == torch.tensor([lk for _, lk in used]).cumsum(0).tolist()
    assert all(type(x) is int for x in call["actual_seq_qlen"] + call["actual_seq_kvlen"])
    _check_call(call, params, case.hq, max(max(pair) for pair in used))

    assert_matches_oracle(out, q, k, v, cu_q, cu_k, case)


def test_rows_without_keys_are_zeroed_with_invalid_row_handling(fake_npu):
    """Bottom-right causal with Lq > Lk: the first rows see no key and are the op's business (the
    fake averages V there); coreattn asks for inner_precise=2 and zeroes them. The sequence with
    no key is left out of the call; its rows are zeros too."""
    case = Case(dqk=32, dv=32, hq=2, hkv=1, causal=True, lens_q=(6, 3), lens_k=(2, 0))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, "cpu")
    out, _ = attn_npu_fused(q, k, v, packed(cu_q), packed(cu_k), max_q, max_k, _params(case))
    (call,) = fake_npu.calls
    assert call["inner_precise"] == 2 and call["actual_seq_qlen"] == [6] and call["query"].shape[0] == 6
    assert not out[:4].any() and not out[6:].any() and out[4:6].abs().sum() > 0
    ref, _ = attention_ref(q, k, v, cu_q, cu_k, causal=True)
    torch.testing.assert_close(out, ref.float(), rtol=0, atol=1e-5)


def test_full_rows_ask_no_invalid_row_handling(fake_npu):
    case = Case(dqk=32, dv=16, hq=2, hkv=2, causal=True, lens_q=(5, 7))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, "cpu")
    attn_npu_fused(q, k, v, packed(cu_q), packed(cu_k), max_q, max_k, _params(case))
    assert fake_npu.calls[0]["inner_precise"] == 0


def test_many_sequences_run_in_groups(fake_npu):
    """More than MAX_VARLEN_SEQUENCES sequences: groups of contiguous tokens, one call each."""
    n = MAX_VARLEN_SEQUENCES + 20
    lens_q = [0 if i % 100 == 0 else i % 3 + 1 for i in range(n)]  # 11 sequences without a query
    lens_k = [i % 4 + 1 for i in range(n)]
    case = Case(dqk=16, dv=8, hq=2, hkv=1, causal=True, lens_q=tuple(lens_q), lens_k=tuple(lens_k))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, "cpu", requires_grad=True)
    params = _params(case)
    out, _ = attn_npu_fused(q, k, v, packed(cu_q), packed(cu_k), max_q, max_k, params)
    used = _used(case)
    assert len(used) == MAX_VARLEN_SEQUENCES + 9 and len(fake_npu.calls) == 2
    for g, call in enumerate(fake_npu.calls):
        group = used[g * MAX_VARLEN_SEQUENCES:(g + 1) * MAX_VARLEN_SEQUENCES]
        assert call["actual_seq_qlen"] == torch.tensor([lq for lq, _ in group]).cumsum(0).tolist()
        assert call["actual_seq_kvlen"] == torch.tensor([lk for _, lk in group]).cumsum(0).tolist()
    ref, _ = dispatch.attn_torch(q, k, v, packed(cu_q), packed(cu_k), params)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name, cu_q, cu_k, match", [
    ("start", [1, 3, 5], [0, 2, 5], "cu_seqlens_q must start at 0"),
    ("order", [0, 3, 5], [0, 4, 2, 5], "cu_seqlens_k must be non-decreasing"),
    ("total", [0, 3, 4], [0, 2, 5], r"cu_seqlens_q\[-1\] = 4 must equal the token count 5"),
])
def test_malformed_cu_seqlens_raise(fake_npu, name, cu_q, cu_k, match):
    q, k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    cu_q, cu_k = (torch.tensor(cu, dtype=torch.int32) for cu in (cu_q, cu_k))
    with pytest.raises(ValueError, match=match):
        attn_npu_fused(q, k, v, packed(cu_q), packed(cu_k), 5, 5, VarlenParams(0.25, -1, -1, True))
    assert not fake_npu.calls


@pytest.mark.parametrize("ends_q, ends_k", [([0, 3], [2, 3]), ([1, 1, 3], [1, 2, 3]), ([3], [2])],
                         ids=["leading-0", "empty-sequence", "wrong-total"])
def test_fake_rejects_malformed_tnd_lists(fake_npu, ends_q, ends_k):
    q, k = torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    with pytest.raises(ValueError, match="strictly increasing"):
        fake_npu.module.npu_fusion_attention(q, k, k, 1, "TND", actual_seq_qlen=ends_q, actual_seq_kvlen=ends_k)


@pytest.mark.parametrize("window, pre, nxt", [((3, -1), 3, 9), ((-1, 2), 9, 2), ((2**31 - 1, 2**31 - 1), 9, 9)],
                         ids=["left", "right", "int32-max"])
def test_unlimited_band_sides_are_capped_at_the_longest_sequence(fake_npu, window, pre, nxt):
    case = Case(dqk=16, dv=16, hq=1, hkv=1, window=window, lens_q=(5, 9, 2), lens_k=(7, 3, 2))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, "cpu")
    params = _params(case)
    out, _ = attn_npu_fused(q, k, v, packed(cu_q), packed(cu_k), max_q, max_k, params)
    (call,) = fake_npu.calls
    assert (call["sparse_mode"], call["pre_tockens"], call["next_tockens"]) == (4, pre, nxt)
    ref, _ = dispatch.attn_torch(q, k, v, packed(cu_q), packed(cu_k), params)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_no_token_at_all_needs_no_op_call(fake_npu):
    case = Case(dqk=16, dv=8, lens_q=(0, 0), lens_k=(3, 0))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, "cpu", requires_grad=True)
    out, _ = attn_npu_fused(q, k, v, packed(cu_q), packed(cu_k), max_q, max_k, _params(case))
    assert out.shape == (0, 2, 8) and not fake_npu.calls


def test_missing_torch_npu_raises(no_npu):
    case = Case(dqk=16, dv=16, lens_q=(3,))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="needs torch_npu"):
        attn_npu_fused(q, k, v, packed(cu_q), packed(cu_k), max_q, max_k, _params(case))


# padded batches -----------------------------------------------------------------------------

B, S, HQ, HKV = 3, 13, 4, 2


def _padded(layout, dqk, dv, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(h, d):
        x = torch.randn(B, S, h, d, generator=gen).to(dtype)
        return (x.transpose(0, 1) if layout == "sbhd" else x).requires_grad_()

    return rand(HQ, dqk), rand(HKV, dqk), rand(HKV, dv)


def _bshd(x, layout):
    return x.transpose(0, 1) if layout == "sbhd" else x


def _pin_npu_fused(monkeypatch):
    """Route the public functions' dispatch to npu_fused for CPU tensors."""
    monkeypatch.setattr(dispatch, "select_backend", lambda device, override=None: Backend.NPU_FUSED)


def _check_padded(out, q, k, v, keep, causal, window=(-1, -1), layout="bshd"):
    leaves = [_bshd(t, layout) for t in (q, k, v)]
    g = torch.randn(_bshd(out, layout).shape, generator=torch.Generator().manual_seed(4)).to(out.dtype)
    opts = dict(causal=causal, window=window)
    ref = padded_attention_ref(*leaves, keep, keep, **opts)
    naive = padded_attention_ref(*leaves, keep, keep, upcast=False, **opts)
    assert_flash_criterion("out", _bshd(out, layout), naive, ref)
    assert_grad_criterion(_bshd(out, layout), ref, naive, (q, k, v), g)


@pytest.mark.parametrize("layout, dqk, dv, expected", [("sbhd", 32, 32, "SBH"), ("sbhd", 48, 32, "BSND"),
                                                        ("bshd", 48, 32, "BSND")])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_whole_rows_use_the_padded_layouts(fake_npu, monkeypatch, layout, dqk, dv, expected, causal):
    _pin_npu_fused(monkeypatch)
    q, k, v = _padded(layout, dqk, dv)
    out = coreattn.padded_attn(q, k, v, layout=layout, causal=causal, causal_alignment="top_left")
    (call,) = fake_npu.calls
    assert call["input_layout"] == expected and call["actual_seq_qlen"] is None
    if expected == "SBH":
        assert call["query"].shape == (S, B, HQ * dqk) and call["value"].shape == (S, B, HKV * dv)
    else:
        assert call["query"].shape == (B, S, HQ, dqk)
    _check_call(call, VarlenParams(1 / math.sqrt(dqk), -1, 0 if causal else -1, False), HQ, S)
    assert out.shape == q.shape[:3] + (dv,)
    _check_padded(out, q, k, v, torch.ones(B, S, dtype=torch.bool), causal, layout=layout)


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_spans_gather_into_tnd(fake_npu, monkeypatch, layout):
    _pin_npu_fused(monkeypatch)
    q, k, v = _padded(layout, 40, 24)
    start = torch.tensor([0, 5, 13], dtype=torch.int32)  # right padding, left padding, an empty sample
    length = torch.tensor([9, 8, 0], dtype=torch.int32)
    out = coreattn.padded_attn(q, k, v, layout=layout, q_start=start, q_len=length, k_start=start, k_len=length,
                               causal=True)
    (call,) = fake_npu.calls
    assert call["input_layout"] == "TND" and call["query"].shape == (17, HQ, 40)
    assert call["actual_seq_qlen"] == [9, 17] and call["actual_seq_kvlen"] == [9, 17]
    _check_call(call, VarlenParams(1 / math.sqrt(40), -1, 0, True), HQ, 9)
    keep = (torch.arange(S)[None] >= start[:, None]) & (torch.arange(S)[None] < (start + length)[:, None])
    assert not _bshd(out, layout)[~keep].any(), "padding rows are zero"
    _check_padded(out, q, k, v, keep, causal=True, layout=layout)


def test_spans_on_packed_tensors_match_torch_backend(fake_npu):
    gen = torch.Generator().manual_seed(7)
    t = 40
    q, k = (torch.randn(t, 2, 32, generator=gen).requires_grad_() for _ in range(2))
    v = torch.randn(t, 2, 16, generator=gen).requires_grad_()
    i32 = dict(dtype=torch.int32)
    q_pack = Packing("thd", torch.tensor([0, 10, 25], **i32), torch.tensor([10, 15, 0], **i32))
    k_pack = Packing("thd", torch.tensor([0, 0, 25], **i32), torch.tensor([12, 25, 3], **i32))  # overlapping
    params = VarlenParams(32 ** -0.5, -1, 0, True)
    out, _ = attn_npu_fused(q, k, v, q_pack, k_pack, 15, 25, params)
    ref, _ = dispatch.attn_torch(q, k, v, q_pack, k_pack, params)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    # the third span has keys but no query: left out of the call
    assert fake_npu.calls[0]["actual_seq_qlen"] == [10, 25] and fake_npu.calls[0]["actual_seq_kvlen"] == [12, 37]
    g = torch.randn(out.shape, generator=gen)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def _holey_keep():
    gen = torch.Generator().manual_seed(5)
    keep = torch.rand(B, S, generator=gen) < 0.7  # holes
    keep[0, 10:] = False
    keep[1, :4] = False
    keep[2] = False
    return keep


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64], ids=["bool", "int64"])
@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 2))],
                         ids=["full", "causal", "window"])
def test_keep_masks_become_a_b1ss_mask_and_stay_intact(fake_npu, monkeypatch, layout, causal, window, mask_dtype):
    _pin_npu_fused(monkeypatch)
    q, k, v = _padded(layout, 40, 24, torch.float16)
    keep = _holey_keep().to(mask_dtype)
    snapshot = keep.clone()
    out = coreattn.padded_attn(q, k, v, layout=layout, q_keep_mask=keep, k_keep_mask=keep, causal=causal,
                               window_size=window)
    assert torch.equal(keep, snapshot) and keep.dtype == mask_dtype, "the caller's [B, S] mask is untouched"
    (call,) = fake_npu.calls
    mask = call["atten_mask"]
    assert call["input_layout"] == "BSND" and call["sparse_mode"] == 0 and call["inner_precise"] == 2
    assert mask.shape == (B, 1, S, S) and mask.dtype == torch.bool
    # the derived Megatron-convention mask gives the keep mask back for post-processing
    assert torch.equal(coreattn.masks.keep_mask_from_4d(mask, "megatron"), snapshot != 0)
    derived = mask.clone()
    _check_padded(out, q, k, v, keep, causal, window, layout)
    assert torch.equal(mask, derived) and torch.equal(keep, snapshot), "backward leaves both masks intact"
    assert not _bshd(out, layout)[~snapshot.bool()].any(), "dropped query rows are zero"


def test_megatron_padding_mask_survives_keep_mask_round_trip(fake_npu, monkeypatch):
    """A Megatron [B, 1, 1, S] padding mask (True = masked) -> keep mask -> npu_fused: the
    caller's mask is unchanged and recoverable from the 4D mask the op received."""
    _pin_npu_fused(monkeypatch)
    q, k, v = _padded("sbhd", 32, 32)
    megatron = ~_holey_keep()[:, None, None, :]
    snapshot = megatron.clone()
    keep = coreattn.masks.keep_mask_from_4d(megatron, "megatron")
    coreattn.padded_attn(q, k, v, layout="sbhd", q_keep_mask=keep, k_keep_mask=keep, causal=True,
                         causal_alignment="top_left")
    assert torch.equal(megatron, snapshot)
    recovered = coreattn.masks.keep_mask_from_4d(fake_npu.calls[0]["atten_mask"], "megatron")
    assert torch.equal(recovered, keep) and torch.equal(~recovered[:, None, None, :], snapshot)


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 2))],
                         ids=["full", "causal", "window"])
def test_keep_masks_without_holes_become_spans(fake_npu, monkeypatch, layout, causal, window):
    """Right/left padding (Megatron's [b, 1, 1, s] case): TND over the kept runs, no S×S mask."""
    _pin_npu_fused(monkeypatch)
    q, k, v = _padded(layout, 40, 24)
    pos = torch.arange(S)[None]
    keep = torch.cat([pos < 9, pos >= 4, pos < 0])  # right padding, left padding, an empty row
    snapshot = keep.clone()
    out = coreattn.padded_attn(q, k, v, layout=layout, q_keep_mask=keep, k_keep_mask=keep, causal=causal,
                               window_size=window)
    (call,) = fake_npu.calls
    assert call["input_layout"] == "TND" and call["actual_seq_qlen"] == call["actual_seq_kvlen"] == [9, 18]
    assert call["atten_mask"] is None or call["atten_mask"].shape == (2048, 2048)
    assert torch.equal(keep, snapshot)
    _check_padded(out, q, k, v, keep, causal, window, layout)
    assert not _bshd(out, layout)[~keep].any(), "dropped query rows are zero"


_POS = torch.arange(S)[None]
_RUNS = dict(none=None, right=_POS < torch.tensor([9, 13, 0])[:, None], left=_POS >= torch.tensor([4, 0, 13])[:, None])


@pytest.mark.parametrize("q_keep, k_keep, window, bottom_right, spans, expected", [
    ("right", "right", (-1, 0), False, False, "TND"),
    ("right", "right", (-1, 0), False, True, "TND"),  # runs cut to the spans
    ("left", "left", (3, 2), True, True, "TND"),
    ("none", "right", (-1, -1), True, False, "TND"),  # no band: any runs
    ("none", "left", (-1, 0), True, False, "TND"),  # bottom-right band: the ends stay put
    ("none", "right", (-1, 0), True, False, "BSND"),  # ... k's end moves
    ("none", "left", (-1, 0), False, False, "BSND"),  # top-left band: k's start moves
    ("right", "right", (2, 2), False, False, "TND"),  # top-left window, equal lengths
    ("none", "right", (2, 2), False, False, "BSND"),  # top-left window, lengths differ
])
def test_keep_runs_fold_into_spans_only_where_the_band_stays(fake_npu, q_keep, k_keep, window, bottom_right, spans,
                                                            expected):
    q, k, v = (t.detach().requires_grad_() for t in _padded("bshd", 32, 16))
    start = torch.tensor([2, 0, 1] if spans else [0, 0, 0], dtype=torch.int32)
    length = torch.tensor([11, 12, 5] if spans else [S, S, S], dtype=torch.int32)
    q_pack, k_pack = (Packing("bshd", start, length, None if _RUNS[m] is None else _RUNS[m].to(torch.uint8))
                      for m in (q_keep, k_keep))
    params = VarlenParams(32 ** -0.5, *window, bottom_right)
    out, _ = attn_npu_fused(q, k, v, q_pack, k_pack, S, S, params)
    (call,) = fake_npu.calls
    assert call["input_layout"] == expected
    if expected == "BSND":
        assert call["atten_mask"].shape == (B, 1, S, S)
    ref, _ = dispatch.attn_torch(q, k, v, q_pack, k_pack, params)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mask_type, layout", [("arbitrary", "sbhd"), ("padding_causal", "sbhd"),
                                               ("arbitrary", "bshd")])
def test_core_attention_dense_mask_runs_the_op(fake_npu, monkeypatch, mask_type, layout):
    """CoreAttention's dense [b, 1, sq, sk] mask (arbitrary, or a dense padding mask, as verl and
    ms-swift pass on Ascend) goes to the op as one B1SS mask with the causal band folded in."""
    pytest.importorskip("megatron.core")
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from coreattn.layers.core_attention import CoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=HQ, num_query_groups=HKV,
                               kv_channels=40, attention_dropout=0.0, hidden_dropout=0.0)
    mask_type = AttnMaskType[mask_type]
    layer = CoreAttention(config, 1, mask_type, "self", v_channels=24)
    monkeypatch.setattr(layer, "_backend_for", lambda device: Backend.NPU_FUSED)
    torch_layer = CoreAttention(config, 1, mask_type, "self", v_channels=24, backend="torch")
    sq, sk = 11, 14
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(B, s, h, d, generator=gen).requires_grad_()
               for s, h, d in ((sq, HQ, 40), (sk, HKV, 40), (sk, HKV, 24)))
    masked = torch.rand(B, 1, sq, sk, generator=gen) < 0.4
    masked[1, 0, 4] = True  # a row that sees nothing: zeros
    args = [_bshd(t, layout) for t in (q, k, v)] + [masked]
    kw = dict(packed_seq_params=PackedSeqParams(qkv_format=layout)) if layout == "bshd" else {}
    out, ref = layer(*args, **kw), torch_layer(*args, **kw)

    (call,) = fake_npu.calls
    band = torch.ones(sq, sk, dtype=torch.bool).triu(1) if mask_type == AttnMaskType.padding_causal else False
    assert call["input_layout"] == "BSND" and call["sparse_mode"] == 0 and call["scale"] == layer.softmax_scale
    assert call["atten_mask"].dtype == torch.bool and torch.equal(call["atten_mask"], masked | band)
    assert not _bshd(out, layout)[1, 4].any()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    g = torch.randn(out.shape, generator=gen)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_per_head_dense_mask_is_bnss(fake_npu):
    q, k, v = _padded("sbhd", 32, 16)
    masked = torch.rand(B, HQ, S, S, generator=torch.Generator().manual_seed(9)) < 0.5
    out = attn_npu_dense_mask(q, k, v, masked, "sbhd", 0.3)
    assert fake_npu.calls[0]["atten_mask"].shape == (B, HQ, S, S)
    torch.testing.assert_close(out, dense_mask_attn(q, k, v, masked, "sbhd", 0.3), rtol=0, atol=1e-5)


def test_varlen_attn_through_dispatch_returns_no_lse(fake_npu, monkeypatch):
    _pin_npu_fused(monkeypatch)
    case = Case(dqk=64, dv=32, hq=4, hkv=2, causal=True, lens_k=LENS_K)
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float16, "cpu")
    out, lse = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True)
    assert lse is None and fake_npu.calls[0]["sparse_mode"] == 3
    ref, _ = attention_ref(q, k, v, cu_q, cu_k, causal=True)
    naive, _ = attention_ref(q, k, v, cu_q, cu_k, causal=True, upcast=False)
    assert_flash_criterion("out", out, naive, ref)


def test_dropout_maps_to_keep_prob_and_sinks_raise(fake_npu, monkeypatch):
    """Dropout goes to the op's keep_prob (its own RNG: masks differ from the other backends'); the op has
    no sinks and no max logit, so those raise instead of being dropped silently."""
    _pin_npu_fused(monkeypatch)
    case = Case(dqk=32, dv=32, hq=2, hkv=2, causal=True, lens_q=(5, 9))
    q, k, v, cu_q, cu_k, max_q, max_k = make_inputs(case, torch.float32, "cpu", requires_grad=True)
    out = coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, dropout_p=0.25)
    assert fake_npu.calls[0]["keep_prob"] == 0.75
    out.sum().backward()  # the op's own autograd
    assert torch.isfinite(q.grad).all()
    padded = [t.detach().reshape(1, 14, *t.shape[1:]) for t in (q, k, v)]
    coreattn.padded_attn(*padded, dropout_p=0.5)
    assert fake_npu.calls[-1]["keep_prob"] == 0.5
    with pytest.raises(NotImplementedError, match="softmax_offset"):
        coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_offset=torch.zeros(2))
    with pytest.raises(NotImplementedError, match="return_max_logit"):
        coreattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, return_max_logit=True)


# selection and detection --------------------------------------------------------------------

def test_npu_defaults_to_npu_fused(fake_npu, monkeypatch):
    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    assert select_backend(NPU) is Backend.NPU_FUSED
    assert select_backend(NPU, "torch") is Backend.TORCH


def test_npu_without_torch_npu_falls_back(no_npu, monkeypatch):
    """No torch_npu: the kernels through triton-ascend if it is the active Triton, else torch."""
    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    expected = Backend.TRITON if is_available(Backend.TRITON, NPU).ok else Backend.TORCH
    assert select_backend(NPU) is expected
    with pytest.raises(RuntimeError, match="backend='npu_fused' cannot run on npu: torch_npu cannot be imported"):
        select_backend(NPU, "npu_fused")


def test_npu_fused_override_needs_an_npu_tensor(fake_npu, monkeypatch):
    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    with pytest.raises(RuntimeError, match="backend='npu_fused' cannot run on cpu"):
        select_backend(torch.device("cpu"), "npu_fused")
    monkeypatch.setenv(backends.ENV_BACKEND, "npu_fused")
    with pytest.raises(RuntimeError, match="COREATTN_BACKEND='npu_fused' cannot run on cpu"):
        select_backend(torch.device("cpu"))


def test_triton_on_npu_needs_triton_ascend(fake_npu, monkeypatch):
    import coreattn.kernels

    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    monkeypatch.setattr(coreattn.kernels, "runs_in_interpreter", lambda: False)
    monkeypatch.setattr(npu, "triton_backend", lambda: "cuda")
    with pytest.raises(RuntimeError, match="backend='triton' cannot run on npu: the active Triton is not triton-ascend"):
        select_backend(NPU, "triton")
    monkeypatch.setattr(npu, "triton_backend", lambda: "npu")
    assert select_backend(NPU, "triton") is Backend.TRITON
    assert select_backend(NPU) is Backend.NPU_FUSED  # Triton only by explicit choice


@pytest.mark.interpreter_only("checks the refusal under TRITON_INTERPRET=1")
def test_triton_on_npu_is_refused_under_the_interpreter(fake_npu, monkeypatch):
    monkeypatch.setattr(npu, "triton_backend", lambda: "npu")
    avail = is_available(Backend.TRITON, NPU)
    assert not avail.ok and "interpreter" in avail.reason


def _fake_driver(monkeypatch, active):
    import triton.runtime

    monkeypatch.setattr(triton.runtime, "driver", SimpleNamespace(active=active))
    npu.cache_clear()


def test_detection_never_raises_without_a_driver(monkeypatch):
    class Missing:  # what both Tritons do on a machine without a device
        def __getattr__(self, name):
            raise RuntimeError("0 active drivers ([]). There should only be one.")

    _fake_driver(monkeypatch, Missing())
    assert npu.triton_backend() is None and not npu.triton_is_ascend()
    npu.cache_clear()


def test_triton_ascend_is_recognised_by_its_target(monkeypatch):
    target = SimpleNamespace(backend="npu", arch="Ascend910B", warp_size=0)
    _fake_driver(monkeypatch, SimpleNamespace(get_current_target=lambda: target))
    assert npu.triton_is_ascend()
    npu.cache_clear()


def test_core_counts_come_from_the_driver(monkeypatch):
    props = {"num_aicore": 24, "num_vectorcore": 48, "max_shared_mem": 1}
    _fake_driver(monkeypatch, SimpleNamespace(utils=SimpleNamespace(get_device_properties=lambda dev: props)))
    assert npu.ascend_core_counts(0) == (24, 48)
    npu.cache_clear()


def test_torch_npu_import_is_lazy_and_cached(fake_npu):
    assert npu.torch_npu_module() is fake_npu.module and npu.torch_npu_reason() == "torch_npu imported"


def test_no_torch_npu_import_at_coreattn_import():
    import subprocess

    code = "import sys, coreattn; assert 'torch_npu' not in sys.modules; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"


def test_ascend_target_for_npu_tensors_and_the_env_hook(monkeypatch):
    monkeypatch.delenv(ENV_TRITON_TARGET, raising=False)
    assert target_of(NPU) == "ascend"
    assert target_of(torch.device(KERNEL_DEVICE)) != "ascend"  # the interpreter on CPU, the GPU's family on CUDA
    monkeypatch.setenv(ENV_TRITON_TARGET, "ascend")
    assert target_of(torch.device("cpu")) == "ascend"
    monkeypatch.setenv(ENV_TRITON_TARGET, "sm90")
    with pytest.raises(ValueError, match="only 'ascend' can be forced"):
        target_of(torch.device("cpu"))
