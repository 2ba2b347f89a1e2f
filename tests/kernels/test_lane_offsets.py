"""Token strides past the int32 range inside one tile (issue 36): the kernels' INT64_LANES variant.

A tile's rows are an int64 base plus ``lane * stride`` (kernels/attn_common.py ``_lane_offsets``);
with an i32 stride that product wrapped once ``lane * stride`` reached 2**31, e.g. an sbhd token
stride of B*H*D >= ~16.9M elements at 128-row tiles. The interpreter wraps int32 products the same
way, so views whose token stride is ``BIG`` elements (lane 15 of the interpreter's 16-row query
tiles times it passes 2**31) show it on CPU: before the variant, the padded sbhd case below died
with SIGSEGV (the interpreter memcheck now stops such a load first). The views are narrow slices of
one ``[rows, BIG]`` buffer, 4.6 GiB of virtual memory that torch allocates lazily: only the few
rows written are touched, the test's resident memory stays small. Each result must equal the same
call on contiguous copies, bit for bit (the same arithmetic, only the addresses differ).

The launchers choose the variant from strides and tiles alone (``int64_lanes``): a new packed batch
never changes it; in sbhd the token stride is B*H*D, so a batch size crossing the bound compiles the
other variant once."""

from __future__ import annotations

import pytest
import torch

import coreattn
from coreattn.kernels import attn_bwd, attn_fwd, varlen_attn_bwd, varlen_attn_fwd
from coreattn.kernels.attn_common import INT32_MAX, forced_int64_lanes, int64_lanes
from coreattn.kernels.packing import Packing, packed

pytestmark = pytest.mark.interpreter_only("huge strided views of lazily allocated CPU storage under the interpreter")
BIG = 2**31 // 15 + 1  # token stride in elements: 15 * BIG passes 2**31
H, HKV, D = 2, 1, 16  # GQA 2; a 16-wide head
ROWS = 18  # tokens: a 16-token sequence fills one query tile


def _huge_views(widths, dtype=torch.float16, seed=0):
    """Views [ROWS, w] of one [ROWS, BIG] buffer, random on their rows: token stride BIG."""
    buf = torch.empty(ROWS, BIG, dtype=dtype)  # virtual; written only where the views lie
    gen = torch.Generator().manual_seed(seed)
    views, col = [], 0
    for w in widths:
        view = buf[:, col:col + w]
        view.copy_(torch.randn(ROWS, w, generator=gen).to(dtype))
        views.append(view)
        col += w
    return buf, views


def test_the_bound():
    assert not int64_lanes(128, [2**24], 256)  # 127 * 16.8M + 256 < 2**31
    assert int64_lanes(128, [2**24 + 2**18], 0)  # sbhd B*H*D at 17M
    assert not int64_lanes(128, [2**31 // 127], 0) and int64_lanes(128, [2**31 // 127 + 1], 0)
    assert int64_lanes(16, [BIG], 0) and not int64_lanes(16, [BIG - 1], 0)  # 15 * BIG > INT32_MAX >= 15 * (BIG - 1)
    assert (16 - 1) * BIG > INT32_MAX >= (16 - 1) * (BIG - 1)
    assert int64_lanes(2, [-(2**31)], 0)  # negative strides count by their size
    assert not int64_lanes(1, [2**40], 0)  # one row: no lane offset
    with forced_int64_lanes(True):
        assert int64_lanes(2, [1], 0)
    with forced_int64_lanes(False):
        assert not int64_lanes(128, [2**40], 0)


@pytest.fixture
def lanes(monkeypatch):
    """The INT64_LANES each attention kernel launch of the call received, by kernel (launches run)."""
    seen: dict = {}
    for module, name in ((attn_fwd, "_varlen_attn_fwd_kernel"), (attn_bwd, "_attn_bwd_preprocess_kernel"),
                         (attn_bwd, "_attn_bwd_dkdv_kernel"), (attn_bwd, "_attn_bwd_dq_kernel")):
        kernel = getattr(module, name)

        class Spy:
            def __init__(self, kernel, name):
                self.kernel, self.name = kernel, name

            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    seen.setdefault(self.name, set()).add(kwargs["INT64_LANES"])
                    return self.kernel[grid](*args, **kwargs)
                return launch

        monkeypatch.setattr(module, name, Spy(kernel, name))
    return seen


@pytest.mark.parametrize("which", ["fwd", "bwd"])
def test_packed_thd_with_a_huge_token_stride(lanes, which):
    """Every tensor the kernels address row by row (q, k, v, out, dO, dQ, dK, dV) a view with token
    stride BIG, one 16-token sequence among others (thd, cu_seqlens); causal, GQA 2. The forward, or
    the backward on the contiguous forward's out and lse."""
    widths = (H * D, HKV * D, HKV * D, H * D, H * D, H * D, HKV * D, HKV * D)
    _, views = _huge_views(widths)
    views = [x.view(ROWS, -1, D) for x in views]
    q, k, v, out, dout, dq, dk, dv = views
    copies = [x.contiguous() for x in views]
    pack = packed(torch.tensor([0, 1, 17, ROWS], dtype=torch.int32))  # lengths 1, 16, 1
    scale = D ** -0.5
    fwd = lambda q, k, v, out: varlen_attn_fwd(q, k, v, pack, pack, 16, scale, -1, 0, True, out=out)  # noqa: E731
    ref_out, ref_lse = fwd(*copies[:4])
    if which == "fwd":
        lanes.clear()
        got, ref = fwd(q, k, v, out), (ref_out, ref_lse)
        kernels = ["_varlen_attn_fwd_kernel"]
    else:
        out.copy_(ref_out)
        bwd = lambda dout, q, k, v, out, dq, dk, dv: varlen_attn_bwd(  # noqa: E731
            dout, q, k, v, out, ref_lse, pack, pack, 16, 16, scale, -1, 0, True, dq=dq, dk=dk, dv=dv)
        lanes.clear()
        got = bwd(dout, q, k, v, out, dq, dk, dv)
        kernels = ["_attn_bwd_preprocess_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"]
    assert lanes == {name: {True} for name in kernels}
    if which == "bwd":
        ref = bwd(*(copies[i] for i in (4, 0, 1, 2)), ref_out, *(torch.zeros_like(copies[i]) for i in (5, 6, 7)))
    for i, (a, b) in enumerate(zip(got, ref)):
        assert torch.equal(a, b), f"{which} output {i}"


def test_padded_sbhd_fwd_bwd_with_a_huge_token_stride_and_keep_masks(lanes):
    """The public padded path (autograd) on sbhd views with token stride BIG (what B*H*D >= 16.9M gives
    at 128-row tiles), keep masks whose position stride is 2 * BIG bytes, and dO with the same stride."""
    buf, (q, k, v, dout) = _huge_views((H * D, HKV * D, HKV * D, H * D))
    q, k, v, dout = (x.view(ROWS, 1, -1, D) for x in (q, k, v, dout))  # [S, B=1, H, D]
    keep_bytes = buf.view(torch.uint8)[:, 8 * H * D:8 * H * D + 2]  # [S, 2] bytes past the views' columns
    keep_bytes.copy_(torch.ones(ROWS, 2, dtype=torch.uint8))
    keep_bytes[[3, 11], 0] = 0  # holes in the query mask
    keep_bytes[[5, 16], 1] = 0  # and in the key mask
    q_keep, k_keep = (keep_bytes[:, i:i + 1].view(torch.bool).t() for i in (0, 1))  # [B, S], position stride 2 * BIG

    def run(q, k, v, dout, q_keep, k_keep):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out, lse = coreattn.padded_attn(q, k, v, layout="sbhd", q_keep_mask=q_keep, k_keep_mask=k_keep, causal=True,
                                        return_lse=True, backend="triton")
        return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))

    got = run(q, k, v, dout, q_keep, k_keep)
    assert lanes == {name: {True} for name in ("_varlen_attn_fwd_kernel", "_attn_bwd_preprocess_kernel",
                                               "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel")}
    ref = run(*(x.contiguous() for x in (q, k, v, dout, q_keep, k_keep)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        assert torch.equal(a, b), name


def test_the_variant_follows_strides_not_lengths(lanes):
    """Ordinary layouts take the int32 variant whatever the batch; only a stride decides (an sbhd
    token stride is B*H*D: past the bound at 16 rows for BIG, the interpreter's tiles)."""
    gen = torch.Generator().manual_seed(1)
    for lens in ((5, 11), (1, 2, 3, 30), (64,)):
        total = sum(lens)
        q, k, v = (torch.randn(total, h, D, generator=gen, dtype=torch.float16) for h in (H, HKV, HKV))
        cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        coreattn.varlen_attn(q, k, v, cu, cu, max(lens), max(lens), causal=True, backend="triton")
    assert lanes == {"_varlen_attn_fwd_kernel": {False}}
    batch = BIG // (H * D) + 1  # sbhd [S, B, H, D]: the token stride B*H*D passes BIG
    x = torch.empty(2, batch, H, D, dtype=torch.float16)  # virtual
    pack = Packing("sbhd", torch.zeros(batch, dtype=torch.int32), torch.full((batch,), 2, dtype=torch.int32))
    assert attn_fwd.lane_flags(16, D, ((pack, (x,)),))["INT64_LANES"]
    assert not attn_fwd.lane_flags(1, D, ((pack, (x,)),))["INT64_LANES"]  # one-row tiles: no lane offset
    small = pack._replace(seq=pack.seq[:8], lens=pack.lens[:8])
    assert not attn_fwd.lane_flags(16, D, ((small, (x[:, :8].contiguous(),)),))["INT64_LANES"]  # B = 8
    keep = torch.empty(2, BIG, dtype=torch.bool).t()  # [B, S] over [S, B] storage: position stride B = BIG
    assert attn_fwd.lane_flags(16, D, ((pack._replace(keep=keep), ()),))["INT64_LANES"]
    assert not attn_fwd.lane_flags(16, D, ((pack._replace(keep=keep[:8].contiguous()), ()),))["INT64_LANES"]


def test_persistent_task_counters_stay_in_int32():
    """Ascend's persistent kernels step an int32 task counter by the grid past the last task: the
    launch grid refuses a task count that would carry it past 2**31 - 1 (the interpreter's stand-in
    core counts: 4 programs for the attention kernels)."""
    cpu = torch.device("cpu")
    fits = INT32_MAX - 3  # the counter's last value: fits - 1 + 4 = INT32_MAX
    assert attn_fwd.launch_grid(cpu, "ascend", fits, 1) == ((4,), True)
    with pytest.raises(ValueError, match="int32 task counter"):
        attn_fwd.launch_grid(cpu, "ascend", fits + 1, 1)
    assert attn_fwd.launch_grid(cpu, "sm90", fits + 1, 1) == ((fits + 1,), False)  # one program per task


def test_the_int64_variant_takes_its_own_tile_where_it_has_one():
    """sm90's dropout dQ at 64 spilled 4 B on the table's 128 x 64 in the INT64_LANES variant: that
    variant takes 128 x 32 there (configs/dense.py ``_DQ_DROPOUT_INT64``); nothing else changes."""
    from coreattn.kernels.configs.dense import shipped_config

    assert shipped_config("sm90", "dq", 64, 64, 2, True, int64_lanes=True)[:4] == (128, 32, 8, 2)
    assert shipped_config("sm90", "dq", 64, 64, 2, True)[:4] == (128, 64, 8, 2)
    for args in (("sm90", "dq", 128, 128, 2, True), ("sm90", "dq", 64, 64, 2, False), ("sm90", "fwd", 64, 64, 2, True),
                 ("sm100", "dq", 64, 64, 2, True), ("sm90", "dq", 64, 64, 4, True)):
        assert shipped_config(*args, int64_lanes=True) == shipped_config(*args)
