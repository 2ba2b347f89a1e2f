"""coreattn.masks against the naive loop builders in mask_naive.py (bit-exact), plus bad inputs.

The Triton gather/scatter and token-id kernels run here under the interpreter, called directly
and through the autograd Functions; the public functions use the torch path on the CPU.
"""

import pytest
import torch

import coreattn.layers.masks.padding as padding_function
import mask_naive as naive
from coreattn import masks
from coreattn.kernels.masks import gather_rows, scatter_rows, token_ids

# (seed, batch, seqlen): B=1, length-1 rows, odd and power-of-two lengths
BATCHES = [(0, 1, 1), (1, 1, 9), (2, 3, 7), (3, 5, 16), (4, 8, 13), (5, 2, 32)]
BATCH_IDS = [f"b{b}-s{s}" for _, b, s in BATCHES]
MASK_DTYPES = [torch.bool, torch.int64, torch.int32, torch.uint8, torch.int8]


def random_lengths(seed: int, batch: int, seqlen: int) -> list[int]:
    """Random lengths in [0, seqlen] that include an empty and a full-length sample when batch >= 3."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, seqlen + 1, (batch,), generator=g).tolist()
    if batch >= 3:
        lens[0], lens[-1] = 0, seqlen
    return lens


def holey_mask(seed: int, batch: int, seqlen: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 100)
    return torch.rand(batch, seqlen, generator=g) < 0.6


def keep_masks(seed, batch, seqlen):
    """(name, bool keep mask): right padding, left padding, and random holes."""
    lens = random_lengths(seed, batch, seqlen)
    return [("right", naive.padding_mask(lens, seqlen)), ("left", naive.padding_mask(lens, seqlen, True)),
            ("holes", holey_mask(seed, batch, seqlen))]


# these launch the Triton mask kernels on CPU tensors; on a GPU test_builders_do_not_sync_on_cuda runs them on CUDA
MASK_KERNELS_ON_CPU = pytest.mark.interpreter_only("the Triton mask kernels on CPU tensors (on a GPU, "
                                                   "test_builders_do_not_sync_on_cuda runs them on CUDA)")


def use_triton_everywhere(monkeypatch):
    """Route the public functions through the Triton launchers (the interpreter on the CPU)."""
    monkeypatch.setattr(padding_function, "use_triton", lambda device: True)


# ---- seqlens, padding masks, cu_seqlens


@pytest.mark.parametrize("seed,batch,seqlen", BATCHES, ids=BATCH_IDS)
@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
@pytest.mark.parametrize("len_dtype", [torch.int64, torch.int32, torch.uint8], ids=str)
def test_padding_mask_from_seqlens(seed, batch, seqlen, left, len_dtype):
    lens = random_lengths(seed, batch, seqlen)
    got = masks.padding_mask_from_seqlens(torch.tensor(lens, dtype=len_dtype), seqlen, left_padding=left)
    assert got.dtype == torch.bool
    assert torch.equal(got, naive.padding_mask(lens, seqlen, left))


def test_padding_mask_large_max_len_with_uint8_lengths():
    lens = [200, 0, 255]
    got = masks.padding_mask_from_seqlens(torch.tensor(lens, dtype=torch.uint8), 300, left_padding=True)
    assert torch.equal(got, naive.padding_mask(lens, 300, True))


@pytest.mark.parametrize("seed,batch,seqlen", BATCHES, ids=BATCH_IDS)
def test_cu_seqlens_round_trip(seed, batch, seqlen):
    lens = random_lengths(seed, batch, seqlen)
    cu = masks.cu_seqlens_from_seqlens(torch.tensor(lens))
    assert torch.equal(cu, naive.cu_seqlens(lens))
    assert torch.equal(masks.seqlens_from_cu_seqlens(cu), naive.seqlens_from_cu(cu.tolist()))
    assert torch.equal(masks.seqlens_from_cu_seqlens(cu.long()), torch.tensor(lens, dtype=torch.int32))


def test_cu_seqlens_empty_batch():
    assert torch.equal(masks.cu_seqlens_from_seqlens(torch.zeros(0, dtype=torch.int64)),
                       torch.zeros(1, dtype=torch.int32))
    assert masks.seqlens_from_cu_seqlens(torch.zeros(1, dtype=torch.int32)).numel() == 0


@pytest.mark.parametrize("seed,batch,seqlen", BATCHES, ids=BATCH_IDS)
@pytest.mark.parametrize("mask_dtype", MASK_DTYPES, ids=str)
def test_seqlens_and_spans_from_keep_mask(seed, batch, seqlen, mask_dtype):
    for name, keep in keep_masks(seed, batch, seqlen):
        m = keep.to(mask_dtype)
        assert torch.equal(masks.seqlens_from_padding_mask(m), naive.kept_count(keep)), name
        ref = naive.spans(keep)
        if ref is None:
            with pytest.raises(ValueError, match="keep_mask has holes"):
                masks.spans_from_keep_mask(m)
            with pytest.raises(ValueError, match="keep_mask has holes"):
                masks.seqlens_from_padding_mask(m, contiguous=True)
            continue
        spans = masks.spans_from_keep_mask(m)
        assert isinstance(spans, masks.KeepSpans)
        assert torch.equal(spans.start, ref[0]) and torch.equal(spans.length, ref[1]), name
        assert torch.equal(masks.seqlens_from_padding_mask(m, contiguous=True), ref[1]), name


def test_spans_reports_holes_by_row():
    keep = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        masks.spans_from_keep_mask(keep)
    spans = masks.spans_from_keep_mask(keep[[0, 2, 3]])
    assert spans.start.tolist() == [0, 1, 0] and spans.length.tolist() == [2, 2, 0]


def test_spans_zero_length_rows():
    spans = masks.spans_from_keep_mask(torch.zeros(3, 0, dtype=torch.bool))
    assert spans.start.tolist() == [0, 0, 0] and spans.length.tolist() == [0, 0, 0]


# ---- unpad / pad


def make_x(seed, batch, seqlen, tail, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed + 7)
    return torch.randn((batch, seqlen) + tail, generator=g).to(dtype)


@pytest.mark.parametrize("seed,batch,seqlen", BATCHES, ids=BATCH_IDS)
@pytest.mark.parametrize("tail", [(), (3,), (2, 5)], ids=["bs", "bsd", "bshd"])
def test_unpad_pad_match_naive(seed, batch, seqlen, tail):
    x = make_x(seed, batch, seqlen, tail)
    for name, keep in keep_masks(seed, batch, seqlen):
        ref_packed, ref_idx, ref_cu, ref_max = naive.unpad(x, keep)
        for m in (keep, keep.to(torch.int64), keep.to(torch.uint8)):
            out = masks.unpad(x, m)
            assert isinstance(out, masks.Unpadded)
            assert torch.equal(out.x_packed, ref_packed), name
            assert torch.equal(out.indices, ref_idx), name
            assert torch.equal(out.cu_seqlens, ref_cu), name
            assert type(out.max_seqlen) is int and out.max_seqlen == ref_max, name
        given = masks.unpad(x, keep, total=ref_idx.numel(), max_seqlen=seqlen)
        assert torch.equal(given.x_packed, ref_packed) and torch.equal(given.indices, ref_idx)
        assert given.max_seqlen == seqlen
        back = masks.pad(out.x_packed, out.indices, batch, seqlen)
        assert torch.equal(back, naive.pad(ref_packed, ref_idx.tolist(), batch, seqlen)), name
        assert torch.equal(masks.pad(out.x_packed, out.indices.int(), batch, seqlen), back), name


def test_unpad_noncontiguous_and_int_data():
    x = make_x(0, 4, 6, (3, 8))[:, :, :, ::2]  # strided head dim
    keep = naive.padding_mask([2, 6, 0, 1], 6)
    out = masks.unpad(x, keep)
    assert torch.equal(out.x_packed, naive.unpad(x, keep)[0])
    xi = torch.arange(24).reshape(4, 6)
    assert torch.equal(masks.unpad(xi, keep).x_packed, naive.unpad(xi, keep)[0])


def test_unpad_pad_gradcheck_float64():
    keep = naive.padding_mask([3, 0, 5], 5) | holey_mask(1, 3, 5)
    x = make_x(1, 3, 5, (2,), torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: masks.unpad(t, keep).x_packed, (x,))
    out = masks.unpad(x.detach(), keep)
    packed = out.x_packed.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda p: masks.pad(p, out.indices, 3, 5), (packed,))


# ---- Triton launchers under the interpreter


@MASK_KERNELS_ON_CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("tail", [(), (5,), (3, 4)], ids=["w1", "w5", "w12"])
def test_gather_scatter_kernels_match_naive(dtype, tail):
    batch, seqlen = 3, 7
    x = make_x(2, batch, seqlen, tail)
    x = (x > 0) if dtype == torch.bool else (x * 10).to(dtype)
    keep = holey_mask(2, batch, seqlen)
    ref_packed, ref_idx, _, _ = naive.unpad(x, keep)
    rows = x.reshape((batch * seqlen,) + tail)
    for idx in (ref_idx, ref_idx.int()):
        assert torch.equal(gather_rows(rows, idx), ref_packed)
        assert torch.equal(scatter_rows(ref_packed, idx, batch * seqlen).reshape(x.shape),
                           naive.pad(ref_packed, ref_idx.tolist(), batch, seqlen))


@MASK_KERNELS_ON_CPU
def test_gather_kernel_strided_rows():
    base = make_x(3, 9, 4, (6,))  # [9, 4, 6]
    src = base[::2, 1]  # [5, 6] rows with stride 48
    idx = torch.tensor([4, 0, 2, 2])
    assert torch.equal(gather_rows(src, idx), src[idx])
    assert gather_rows(src, idx[:0]).shape == (0, 6)


@MASK_KERNELS_ON_CPU
@pytest.mark.parametrize("seed,batch,seqlen", BATCHES, ids=BATCH_IDS)
def test_unpad_pad_through_triton_autograd(monkeypatch, seed, batch, seqlen):
    keep = holey_mask(seed, batch, seqlen)
    x = make_x(seed, batch, seqlen, (3,))
    g = torch.Generator().manual_seed(seed + 11)
    ref_x = x.clone().requires_grad_()
    ref = masks.unpad(ref_x, keep)
    w = torch.randn(ref.x_packed.shape, generator=g)
    (ref.x_packed * w).sum().backward()
    ref_padded_in = ref.x_packed.detach().clone().requires_grad_()
    ref_padded = masks.pad(ref_padded_in, ref.indices, batch, seqlen)
    w2 = torch.randn(ref_padded.shape, generator=g)
    (ref_padded * w2).sum().backward()

    use_triton_everywhere(monkeypatch)
    tx = x.clone().requires_grad_()
    out = masks.unpad(tx, keep)
    (out.x_packed * w).sum().backward()
    assert torch.equal(out.x_packed, ref.x_packed) and torch.equal(tx.grad, ref_x.grad)
    t_in = ref.x_packed.detach().clone().requires_grad_()
    padded = masks.pad(t_in, out.indices, batch, seqlen)
    (padded * w2).sum().backward()
    assert torch.equal(padded, ref_padded) and torch.equal(t_in.grad, ref_padded_in.grad)


TOKEN_CASES = [([0], 0), ([0], 3), ([0, 5], 5), ([0, 0, 3, 3, 9, 10], 10), ([0, 2, 2, 2], 7),
               ([0, 1, 9, 9, 30, 31, 40], 40), ([0, 0], 0)]


@MASK_KERNELS_ON_CPU
@pytest.mark.parametrize("cu,total", TOKEN_CASES, ids=[f"cu{len(c) - 1}-t{t}" for c, t in TOKEN_CASES])
def test_token_ids_kernel_and_public(monkeypatch, cu, total):
    ref_pos, ref_seq = naive.token_ids(cu, total)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    pos, seq = token_ids(cu_t, total, torch.int64, torch.int32)
    assert torch.equal(pos, ref_pos) and torch.equal(seq, ref_seq)
    pos_only, none = token_ids(cu_t, total, torch.int32, None)
    assert none is None and torch.equal(pos_only, ref_pos.int())
    for triton_path in (False, True):
        if triton_path:
            use_triton_everywhere(monkeypatch)
        assert torch.equal(masks.position_ids_from_cu_seqlens(cu_t, total), ref_pos)
        assert torch.equal(masks.sequence_ids_from_cu_seqlens(cu_t, total), ref_seq)
        if total == cu[-1]:
            assert torch.equal(masks.position_ids_from_cu_seqlens(cu_t.long()), ref_pos)
            assert torch.equal(masks.sequence_ids_from_cu_seqlens(cu_t, dtype=torch.int64), ref_seq.long())


@MASK_KERNELS_ON_CPU
def test_triton_paths_take_strided_index_views(monkeypatch):
    """cu_seqlens and pad indices that are strided views (every other entry of a bigger tensor)."""
    use_triton_everywhere(monkeypatch)
    cu = [0, 3, 5, 9]
    cu_strided = torch.tensor([c for c in cu for _ in (0, 1)], dtype=torch.int32)[::2]
    ref_pos, ref_seq = naive.token_ids(cu, 9)
    assert torch.equal(masks.position_ids_from_cu_seqlens(cu_strided, 9), ref_pos)
    assert torch.equal(masks.sequence_ids_from_cu_seqlens(cu_strided, 9), ref_seq)
    x = torch.randn(3, 4, 2)
    keep = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1], [1, 0, 1, 0]], dtype=torch.bool)
    ref = masks.unpad(x, keep)
    strided = torch.stack([ref.indices, torch.zeros_like(ref.indices)], dim=1)[:, 0]
    assert torch.equal(masks.pad(ref.x_packed, strided, 3, 4), x * keep[:, :, None])


@MASK_KERNELS_ON_CPU
@pytest.mark.parametrize("seed,batch,seqlen", BATCHES, ids=BATCH_IDS)
def test_token_ids_random_batches(seed, batch, seqlen):
    cu = naive.cu_seqlens(random_lengths(seed, batch, seqlen))
    ref_pos, ref_seq = naive.token_ids(cu.tolist(), int(cu[-1]))
    pos, seq = token_ids(cu, int(cu[-1]), torch.int64, torch.int32)
    assert torch.equal(pos, ref_pos) and torch.equal(seq, ref_seq)
    assert torch.equal(masks.position_ids_from_cu_seqlens(cu), ref_pos)


# ---- Megatron alignment


@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (3, 2), (8, 4), (6, 4)])
def test_align_seqlens(tp, cp):
    lens = random_lengths(4, 8, 37) + [1, tp, 2 * cp]
    got = masks.align_seqlens(torch.tensor(lens), tp, cp)
    ref_padded, ref_multiple = naive.align(lens, tp, cp)
    assert isinstance(got, masks.AlignedSeqlens) and got.multiple == ref_multiple
    assert torch.equal(got.seqlens, torch.tensor(lens, dtype=torch.int32))
    assert torch.equal(got.seqlens_padded, ref_padded)
    assert torch.equal(got.cu_seqlens, naive.cu_seqlens(lens))
    assert torch.equal(got.cu_seqlens_padded, naive.cu_seqlens(ref_padded.tolist()))


# ---- context-parallel partition


CP_LENS = [8, 0, 24, 16, 0, 8]  # multiples of 2*cp for cp in 1, 2, 4, with empty sequences


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_partition_indices(cp):
    cu = naive.cu_seqlens(CP_LENS)
    held = []
    for rank in range(cp):
        got = masks.cp_partition_indices(cu, cp, rank)
        assert got.dtype == torch.int64 and torch.equal(got, naive.cp_partition(CP_LENS, cp, rank))
        assert torch.equal(masks.cp_partition_indices(cu, cp, rank, total=sum(CP_LENS)), got)
        held.append(got)
    assert torch.equal(torch.cat(held).sort().values, torch.arange(sum(CP_LENS)))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_partition_indices_sbhd_and_shard_roundtrip(cp):
    seqlen = 8 * cp
    idx = [masks.cp_partition_indices_sbhd(seqlen, cp, r) for r in range(cp)]
    for rank in range(cp):
        assert torch.equal(idx[rank], naive.cp_partition([seqlen], cp, rank))
    x = torch.randn(seqlen, 3, 2, 5, requires_grad=True)  # sbhd
    shards = [masks.cp_shard(x, i) for i in idx]
    back = masks.cp_unshard(shards, idx)
    assert torch.equal(back, x)
    back.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    xb = x.detach().transpose(0, 1)  # bshd: the sequence is dim 1
    assert torch.equal(masks.cp_unshard([masks.cp_shard(xb, i, dim=1) for i in idx], idx, dim=1, size=seqlen), xb)


# ---- 4D masks


@pytest.mark.parametrize("seed,batch,seqlen", BATCHES, ids=BATCH_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_megatron_mask_and_back(seed, batch, seqlen, causal):
    for name, keep in keep_masks(seed, batch, seqlen):
        ref = naive.megatron_mask(keep, causal)
        for m in (keep, keep.to(torch.int64), keep.to(torch.uint8)):
            got = masks.megatron_mask_from_keep_mask(m, causal)
            assert got.dtype == torch.bool and torch.equal(got, ref), name
        if not keep.any():
            continue
        for mask_dtype in MASK_DTYPES:
            meg = ref.to(mask_dtype)
            assert torch.equal(masks.keep_mask_from_4d(meg, "megatron"), naive.keep_from_4d(meg, "megatron")), name
            assert torch.equal(masks.keep_mask_from_4d(meg, "megatron"), keep), name
            kept = (~ref).to(mask_dtype)  # the same mask in the keep convention
            assert torch.equal(masks.keep_mask_from_4d(kept, "keep"), keep), name


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES, ids=str)
def test_keep_mask_from_key_mask_and_2d(mask_dtype):
    keep = naive.padding_mask([3, 5, 0, 1], 5, left_padding=True)
    key_megatron = (~keep)[:, None, None, :].to(mask_dtype)  # TE's [b, 1, 1, s] padding mask
    assert torch.equal(masks.keep_mask_from_4d(key_megatron, "megatron"), naive.keep_from_4d(key_megatron, "megatron"))
    assert torch.equal(masks.keep_mask_from_4d(key_megatron, "megatron"), keep)
    assert torch.equal(masks.keep_mask_from_4d(keep[:, None, None, :].to(mask_dtype), "keep"), keep)
    assert torch.equal(masks.keep_mask_from_4d(keep.to(mask_dtype), "keep"), keep)
    assert torch.equal(masks.keep_mask_from_4d((~keep).to(mask_dtype), "megatron"), keep)


def test_keep_mask_from_hf_style_key_padding_causal_mask():
    # HF-style: only key columns (and the future) are masked; padded query rows are not
    keep = naive.padding_mask([2, 4], 4)
    causal = torch.ones(4, 4, dtype=torch.bool).triu(1)
    meg = (~keep[:, None, None, :]) | causal
    assert torch.equal(masks.keep_mask_from_4d(meg.to(torch.int32), "megatron"), keep)


def test_int_4d_mask_regression_ms_swift():
    # (~mask).sum(dim=(1, 2)) > 0 is always False for int masks; the diagonal is right for both
    keep = naive.padding_mask([3, 1], 4)
    meg = masks.megatron_mask_from_keep_mask(keep, causal=True).to(torch.int64)
    assert torch.equal(masks.keep_mask_from_4d(meg, "megatron"), keep)


def test_npu_compressed_causal_mask():
    m = masks.npu_compressed_causal_mask("cpu")
    assert m.shape == (2048, 2048) and m.dtype == torch.bool
    assert torch.equal(m, torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1))
    assert masks.npu_compressed_causal_mask(torch.device("cpu")) is m


# ---- bad input

B3 = torch.tensor([1, 2, 3])
KEEP = naive.padding_mask([1, 2, 3], 4)
X = torch.zeros(3, 4, 2)
CU = torch.tensor([0, 1, 3, 6], dtype=torch.int32)

BAD = [
    ("seqlens-float", lambda: masks.padding_mask_from_seqlens(B3.float(), 4), TypeError, "seqlens"),
    ("seqlens-bool", lambda: masks.padding_mask_from_seqlens(B3 > 0, 4), TypeError, "seqlens"),
    ("seqlens-list", lambda: masks.padding_mask_from_seqlens([1, 2], 4), TypeError, "seqlens"),
    ("seqlens-2d", lambda: masks.padding_mask_from_seqlens(B3[None], 4), ValueError, "seqlens"),
    ("seqlens-negative", lambda: masks.padding_mask_from_seqlens(torch.tensor([1, -1]), 4), ValueError, "seqlens"),
    ("seqlens-too-long", lambda: masks.padding_mask_from_seqlens(B3, 2), ValueError, "max_len"),
    ("max_len-tensor", lambda: masks.padding_mask_from_seqlens(B3, torch.tensor(4)), TypeError, "max_len"),
    ("max_len-negative", lambda: masks.padding_mask_from_seqlens(B3, -1), ValueError, "max_len"),
    ("left_padding-int", lambda: masks.padding_mask_from_seqlens(B3, 4, left_padding=1), TypeError, "left_padding"),
    ("cu-negative", lambda: masks.cu_seqlens_from_seqlens(torch.tensor([2, -1])), ValueError, "seqlens"),
    ("cu-overflow", lambda: masks.cu_seqlens_from_seqlens(torch.tensor([2**31 - 1, 1])), ValueError, "int32"),
    ("cu-start", lambda: masks.seqlens_from_cu_seqlens(torch.tensor([1, 2])), ValueError, "cu_seqlens"),
    ("cu-decreasing", lambda: masks.seqlens_from_cu_seqlens(torch.tensor([0, 3, 2])), ValueError, "cu_seqlens"),
    ("cu-float", lambda: masks.seqlens_from_cu_seqlens(torch.tensor([0.0, 1.0])), TypeError, "cu_seqlens"),
    ("cu-empty", lambda: masks.seqlens_from_cu_seqlens(torch.zeros(0, dtype=torch.int32)), ValueError, "cu_seqlens"),
    ("keep-3d", lambda: masks.seqlens_from_padding_mask(KEEP[None]), ValueError, "keep_mask"),
    ("keep-1d", lambda: masks.spans_from_keep_mask(KEEP[0]), ValueError, "keep_mask"),
    ("keep-float", lambda: masks.seqlens_from_padding_mask(KEEP.float()), TypeError, "keep_mask"),
    ("keep-int-values", lambda: masks.seqlens_from_padding_mask(KEEP.long() * 2), ValueError, "keep_mask"),
    ("keep-additive", lambda: masks.spans_from_keep_mask(KEEP.long() - 1), ValueError, "keep_mask"),
    ("keep-not-tensor", lambda: masks.spans_from_keep_mask([[1, 0]]), TypeError, "keep_mask"),
    ("unpad-batch", lambda: masks.unpad(X[:2], KEEP), ValueError, "keep_mask"),
    ("unpad-seqlen", lambda: masks.unpad(X[:, :3], KEEP), ValueError, "keep_mask"),
    ("unpad-x-1d", lambda: masks.unpad(X[0, 0], KEEP), ValueError, "x must"),
    ("unpad-total", lambda: masks.unpad(X, KEEP, total=5), ValueError, "total"),
    ("unpad-total-float", lambda: masks.unpad(X, KEEP, total=6.0), TypeError, "total"),
    ("unpad-max_seqlen", lambda: masks.unpad(X, KEEP, max_seqlen=2), ValueError, "max_seqlen"),
    ("unpad-max_seqlen-tensor", lambda: masks.unpad(X, KEEP, max_seqlen=torch.tensor(3)), TypeError, "max_seqlen"),
    ("pad-rows", lambda: masks.pad(torch.zeros(5, 2), torch.arange(6), 3, 4), ValueError, "indices"),
    ("pad-range", lambda: masks.pad(torch.zeros(2, 2), torch.tensor([0, 12]), 3, 4), ValueError, "indices"),
    ("pad-negative", lambda: masks.pad(torch.zeros(2, 2), torch.tensor([-1, 0]), 3, 4), ValueError, "indices"),
    ("pad-duplicate", lambda: masks.pad(torch.zeros(2, 2), torch.tensor([3, 3]), 3, 4), ValueError, "unique"),
    ("pad-float-idx", lambda: masks.pad(torch.zeros(2, 2), torch.tensor([0.0, 1.0]), 3, 4), TypeError, "indices"),
    ("pad-batch", lambda: masks.pad(torch.zeros(2, 2), torch.tensor([0, 1]), -1, 4), ValueError, "batch"),
    ("pad-seqlen", lambda: masks.pad(torch.zeros(2, 2), torch.tensor([0, 1]), 3, None), TypeError, "seqlen"),
    ("pos-total", lambda: masks.position_ids_from_cu_seqlens(CU, 5), ValueError, "total"),
    ("pos-cu-2d", lambda: masks.position_ids_from_cu_seqlens(CU[None], 6), ValueError, "cu_seqlens"),
    ("seq-cu-decreasing", lambda: masks.sequence_ids_from_cu_seqlens(torch.tensor([0, 4, 3]), 4), ValueError,
     "cu_seqlens"),
    ("align-tp", lambda: masks.align_seqlens(B3, 0, 1), ValueError, "tp_size"),
    ("align-cp", lambda: masks.align_seqlens(B3, 2, 0), ValueError, "cp_size"),
    ("align-negative", lambda: masks.align_seqlens(torch.tensor([-2]), 2, 1), ValueError, "seqlens"),
    ("cp-not-multiple", lambda: masks.cp_partition_indices(torch.tensor([0, 4, 10]), 2, 0), ValueError,
     "sequence 1 has length 6, not a multiple of 2 \\* cp_size = 4"),
    ("cp-rank", lambda: masks.cp_partition_indices(torch.tensor([0, 4]), 2, 2), ValueError, "cp_rank"),
    ("cp-size", lambda: masks.cp_partition_indices(torch.tensor([0, 4]), 0, 0), ValueError, "cp_size"),
    ("cp-total", lambda: masks.cp_partition_indices(torch.tensor([0, 4]), 2, 0, total=8), ValueError, "total"),
    ("cp-sbhd-seqlen", lambda: masks.cp_partition_indices_sbhd(6, 2, 0), ValueError, "multiple of 2 \\* cp_size"),
    ("cp-unshard-count", lambda: masks.cp_unshard([torch.zeros(2)], [torch.arange(3)]), ValueError, "indices"),
    ("4d-convention", lambda: masks.keep_mask_from_4d(KEEP, "keep_mask"), ValueError, "convention"),
    ("4d-convention-missing", lambda: masks.keep_mask_from_4d(KEEP), TypeError, "convention"),
    ("4d-3d", lambda: masks.keep_mask_from_4d(KEEP[:, None], "keep"), ValueError, "mask"),
    ("4d-heads", lambda: masks.keep_mask_from_4d(torch.zeros(3, 2, 4, 4, dtype=torch.bool), "megatron"),
     ValueError, "dim 1"),
    ("4d-not-square", lambda: masks.keep_mask_from_4d(torch.zeros(3, 1, 3, 4, dtype=torch.bool), "megatron"),
     ValueError, "mask"),
    ("4d-float", lambda: masks.keep_mask_from_4d(torch.zeros(3, 1, 4, 4), "megatron"), TypeError, "additive"),
    ("4d-int-values", lambda: masks.keep_mask_from_4d(torch.full((3, 1, 1, 4), -10000), "megatron"), ValueError,
     "0 and 1"),
    ("4d-all-masked", lambda: masks.keep_mask_from_4d(torch.ones(3, 1, 4, 4, dtype=torch.int64), "megatron"),
     ValueError, "convention"),
    ("4d-wrong-convention", lambda: masks.keep_mask_from_4d(masks.megatron_mask_from_keep_mask(
        naive.padding_mask([4, 4], 4)), "keep"), ValueError, "convention"),
    ("megatron-keep-3d", lambda: masks.megatron_mask_from_keep_mask(KEEP[None]), ValueError, "keep_mask"),
    ("megatron-causal", lambda: masks.megatron_mask_from_keep_mask(KEEP, causal="yes"), TypeError, "causal"),
]


@pytest.mark.parametrize("call,exc,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ---- GPU: no host sync


@pytest.mark.gpu
def test_builders_do_not_sync_on_cuda(monkeypatch):
    monkeypatch.delenv("COREATTN_VALIDATE", raising=False)
    dev = torch.device("cuda")
    lens = random_lengths(3, 5, 16)
    seqlens = torch.tensor(lens, device=dev)
    total, max_seqlen = sum(lens), max(lens)
    x = make_x(3, 5, 16, (4, 8)).to(dev).requires_grad_()
    cp_total = int(naive.align(lens, 2, 2)[0].sum())
    ref_keep = naive.padding_mask(lens, 16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        keep = masks.padding_mask_from_seqlens(seqlens, 16)
        left = masks.padding_mask_from_seqlens(seqlens, 16, left_padding=True)
        cu = masks.cu_seqlens_from_seqlens(seqlens)
        lens_back = masks.seqlens_from_cu_seqlens(cu)
        counted = masks.seqlens_from_padding_mask(keep.long())
        spans = masks.spans_from_keep_mask(left)
        out = masks.unpad(x, keep, total=total, max_seqlen=max_seqlen)
        padded = masks.pad(out.x_packed, out.indices, 5, 16)
        padded.sum().backward()
        pos = masks.position_ids_from_cu_seqlens(cu, total)
        seq = masks.sequence_ids_from_cu_seqlens(cu, total)
        aligned = masks.align_seqlens(seqlens, 2, 2)
        cp_idx = masks.cp_partition_indices(aligned.cu_seqlens_padded, 2, 1, total=cp_total)
        meg = masks.megatron_mask_from_keep_mask(keep, causal=True)
        back = masks.keep_mask_from_4d(meg.int(), "megatron")
        npu = masks.npu_compressed_causal_mask(dev)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(keep.cpu(), ref_keep) and torch.equal(back.cpu(), ref_keep)
    assert torch.equal(left.cpu(), naive.padding_mask(lens, 16, True))
    assert torch.equal(lens_back.cpu(), torch.tensor(lens, dtype=torch.int32))
    assert torch.equal(counted.cpu(), torch.tensor(lens, dtype=torch.int32))
    assert torch.equal(spans.length.cpu(), torch.tensor(lens, dtype=torch.int32))
    ref_packed, ref_idx, ref_cu, _ = naive.unpad(x.detach().cpu(), ref_keep)
    assert torch.equal(out.x_packed.detach().cpu(), ref_packed) and torch.equal(out.indices.cpu(), ref_idx)
    assert torch.equal(padded.detach().cpu(), x.detach().cpu() * ref_keep[:, :, None, None])
    assert torch.equal(x.grad.cpu(), ref_keep[:, :, None, None].expand(x.shape).float())
    ref_pos, ref_seq = naive.token_ids(ref_cu.tolist(), total)
    assert torch.equal(pos.cpu(), ref_pos) and torch.equal(seq.cpu(), ref_seq)
    assert torch.equal(aligned.seqlens_padded.cpu(), naive.align(lens, 2, 2)[0])
    assert torch.equal(cp_idx.cpu(), naive.cp_partition(naive.align(lens, 2, 2)[0].tolist(), 2, 1))
    assert npu.device.type == "cuda" and npu.shape == (2048, 2048)


# ---- device semantics, simulated on the CPU: value checks off unless asked for


def act_like_a_device(monkeypatch):
    """Value checks behave as for a device tensor: only with COREATTN_VALIDATE=1 or check=True."""
    from coreattn.layers.masks import checks as mask_checks
    from coreattn.layers.checks import validation_enabled

    monkeypatch.setattr(mask_checks, "reads_values", lambda t: validation_enabled())


def test_holes_on_a_device_are_reported_only_when_asked(monkeypatch):
    act_like_a_device(monkeypatch)
    monkeypatch.delenv("COREATTN_VALIDATE", raising=False)
    keep = torch.tensor([[0, 1, 0, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.int32)
    spans = masks.spans_from_keep_mask(keep)  # no sync, no error: documented values
    assert spans.start.tolist() == [1, 0] and spans.length.tolist() == [3, 2]
    with pytest.raises(ValueError, match=r"holes .* rows \[0\]"):
        masks.spans_from_keep_mask(keep, check=True)
    with pytest.raises(ValueError, match="holes"):
        masks.seqlens_from_padding_mask(keep, contiguous=True)  # asking for spans is asking for the check
    assert masks.seqlens_from_padding_mask(keep).tolist() == [3, 2]
    monkeypatch.setenv("COREATTN_VALIDATE", "1")
    with pytest.raises(ValueError, match="holes"):
        masks.spans_from_keep_mask(keep)


def test_validate_env_turns_on_device_value_checks(monkeypatch):
    act_like_a_device(monkeypatch)
    monkeypatch.delenv("COREATTN_VALIDATE", raising=False)
    assert masks.padding_mask_from_seqlens(torch.tensor([1, 2]), 2).shape == (2, 2)
    x, keep = make_x(0, 2, 3, ()), naive.padding_mask([1, 3], 3)
    assert masks.unpad(x, keep, total=4, max_seqlen=3).x_packed.numel() == 4
    monkeypatch.setenv("COREATTN_VALIDATE", "1")
    with pytest.raises(ValueError, match="max_len"):
        masks.padding_mask_from_seqlens(torch.tensor([1, 3]), 2)
    with pytest.raises(ValueError, match="total"):
        masks.unpad(x, keep, total=3, max_seqlen=3)
    with pytest.raises(ValueError, match="0 and 1"):
        masks.keep_mask_from_4d(torch.full((2, 1, 1, 3), 2), "keep")
