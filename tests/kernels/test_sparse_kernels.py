"""The sparse (top-k) attention kernels (coreattn/kernels/sparse_fwd.py, sparse_bwd.py; the interpreter
without a GPU) against an independent float64 reference: a dense softmax over each query token's
named key set, masked in a [tokens, heads, keys] tensor built with Python loops from the raw indices
and bounds (written from the op's definition in the module docstrings, not from the kernels).

Each batch mixes what the kernels must mask: -1 and other negative entries, duplicates (set
semantics), entries outside the token's sequence, past causality or past the tensor, a row without
any valid entry, sequences shorter than K, empty sequences, padded positions without keys. Per
output and gradient the flash criterion (err <= 2 * err of the same computation in the input dtype
+ eps). Outputs preallocated with NaN must come back without one; tokens without a visible key get
out 0, lse -inf and zero gradients. The backward is bitwise deterministic, does not depend on how
its query tokens are chunked, its two deterministic dK/dV schedules (token-centric partials,
key-centric) and its atomic variant agree within rounding.

Interpreter time is the budget (tests/conftest.py; about 60 s for this file on one core): tokens
<= 24, K <= 40 (the interpreter's slot blocks are 32), heads <= 20, one 576/512 case with few tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from attn_cases import KERNEL_DEVICE, assert_flash_criterion, assert_lse_criterion
from coreattn.kernels.sparse_bwd import ENV_PARTIAL_BUDGET, KEYS_MAX_GROUP, SCHEDULES, dkv_schedule, sparse_attn_bwd
from coreattn.kernels.sparse_fwd import sparse_attn_fwd
from coreattn.kernels.sparse_index import prepare_topk


@dataclass(frozen=True)
class SparseCase:
    fmt: str = "thd"
    lens: tuple = (5, 0, 12, 3)  # tokens per sequence (thd) or sample (padded: S = max + 1)
    heads_q: int = 4
    heads_kv: int = 2
    dim_qk: int = 40
    dim_v: int = 24
    absorbed: bool = False  # v None: V = k's first dim_v columns
    n_slots: int = 36
    per_head: bool = False  # indices [.., Hkv, K] (else one set for every head)
    causal: bool = True
    topk_length: bool = False
    # index rows: "random" (half visible keys, half what must be masked), "full" (every row names its whole
    # visible range, shuffled, among -1, a repeat and keys outside it: the kernels' range mode), "mixed" (the
    # whole range where it fits in K, else K keys spread over it; with per_head, the second index head's
    # rows leave out one key: a token full for one kv head and not for the other)
    rows: str = "random"
    window: int = 0  # key bounds narrower than the sequence: lo = max(start, position + 1 - window)

    @property
    def id(self) -> str:
        parts = [self.fmt, f"hdim{self.dim_qk}x{self.dim_v}",
                 "absorbed" if self.absorbed else f"gqa{self.heads_q // self.heads_kv}",
                 f"h{self.heads_q}", f"k{self.n_slots}"]
        parts += ["per-head-idx"] if self.per_head else []
        parts += ["causal"] if self.causal else ["full"]
        parts += ["topk-length"] if self.topk_length else []
        parts += [f"{self.rows}-rows"] if self.rows != "random" else []
        parts += [f"bounds-window{self.window}"] if self.window else []
        return "-".join(parts)


def _token_layout(case: SparseCase):
    """(batch, S, key rows per sample, [(sample, position, start, length)] per token n)."""
    if case.fmt == "thd":
        tokens, start = [], 0
        for length in case.lens:
            tokens += [(0, start + i, start, length) for i in range(length)]
            start += length
        return 1, start, start, tokens
    seqlen = max(case.lens) + 1  # a padded position in every sample
    tokens = [(b, s, 0, length) for b, length in enumerate(case.lens) for s in range(seqlen)]
    return len(case.lens), seqlen, seqlen, tokens


def _bounds(case: SparseCase, tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """key_lo/key_hi [N] in positions of the sample: the token's sequence, causal or not; a padded
    position past its sample's length sees nothing."""
    lo, hi = [], []
    for _, pos, start, length in tokens:
        if case.fmt != "thd" and pos >= length:
            lo.append(0)
            hi.append(0)
            continue
        lo.append(max(start, pos + 1 - case.window) if case.window else start)
        hi.append(pos + 1 if case.causal else start + length)
    return torch.tensor(lo, dtype=torch.int32), torch.tensor(hi, dtype=torch.int32)


def _whole_rows(case: SparseCase, lo, hi, rows, gen) -> torch.Tensor:
    """[N, Hidx, K] int64 for ``rows`` "full" and "mixed" (SparseCase.rows): each row's keys, then a
    repeat, a -1, a key of the next row (outside the range: past causality or another sequence) and
    -1 up to K, shuffled."""
    n_idx = case.heads_kv if case.per_head else 1
    raw = torch.full((len(lo), n_idx, case.n_slots), -1, dtype=torch.int64)
    for t in range(len(lo)):
        visible = list(range(int(lo[t]), int(hi[t])))
        for h in range(n_idx):
            keys = visible
            if len(keys) > case.n_slots:  # mixed: K keys spread over the range
                keys = [visible[(j * len(visible)) // case.n_slots] for j in range(case.n_slots)]
            if h == 1 and len(keys) > 1:
                keys = keys[1:]
            extra = [keys[0], -1, int(hi[t]) % rows] if keys else [-1, int(hi[t]) % rows]
            row = (keys + extra)[:case.n_slots]
            raw[t, h, :len(row)] = torch.tensor(row)
            raw[t, h] = raw[t, h, torch.randperm(case.n_slots, generator=gen)]
    return raw


def _raw_indices(case: SparseCase, tokens, lo, hi, rows, gen) -> torch.Tensor:
    """[N, Hidx, K] int64: half of each row drawn from the token's visible range, the rest from a
    wider one (negatives, other sequences, past causality, past the tensor), then edits: duplicates,
    a row of -1, a row past causality only."""
    n_idx = case.heads_kv if case.per_head else 1
    n = len(tokens)
    wide = torch.randint(-3, rows + 3, (n, n_idx, case.n_slots), generator=gen)
    raw = wide.clone()
    for t in range(n):
        if hi[t] > lo[t]:
            near = torch.randint(int(lo[t]), int(hi[t]), (n_idx, case.n_slots // 2), generator=gen)
            raw[t, :, :case.n_slots // 2] = near
    perm = torch.randperm(case.n_slots, generator=gen)
    raw = raw[..., perm]  # unsorted rows
    raw[::3, :, 1] = raw[::3, :, 0]  # duplicates
    raw[::4, :, 2] = raw[::4, :, 5]
    if n > 2:
        raw[1] = -1  # nothing named
        raw[2] = int(hi[2]) + torch.arange(case.n_slots) % 3  # past causality (or past the tensor)
    return raw


def _token_dims(x: torch.Tensor, case: SparseCase, batch: int, seqlen: int) -> torch.Tensor:
    """[N, ...] -> the layout's token dims (thd [T, ...]; bshd [B, S, ...]; sbhd [S, B, ...])."""
    if case.fmt == "thd":
        return x
    x = x.reshape(batch, seqlen, *x.shape[1:])
    return x.transpose(0, 1).contiguous() if case.fmt == "sbhd" else x


def _named_mask(case: SparseCase, raw, lengths, lo, hi, seqlen_k) -> torch.Tensor:
    """bool [N, Hq, Sk]: key j is in token n's set for q head h (python loops, from the definition)."""
    n, group = raw.shape[0], case.heads_q // case.heads_kv
    mask = torch.zeros(n, case.heads_q, seqlen_k, dtype=torch.bool)
    for t in range(n):
        for h in range(case.heads_q):
            row = raw[t, h // group if case.per_head else 0].tolist()
            if lengths is not None:
                row = row[:int(lengths[t])]
            for j in row:
                if 0 <= j < seqlen_k and lo[t] <= j < hi[t]:
                    mask[t, h, j] = True
    return mask


def _bshd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return x.unsqueeze(0) if fmt == "thd" else x.transpose(0, 1) if fmt == "sbhd" else x


def _from_bshd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return x[0] if fmt == "thd" else x.transpose(0, 1) if fmt == "sbhd" else x


def sparse_reference(q, k, v, mask, case: SparseCase, scale, upcast=True):
    """out (q's layout) and lse ([Hq, T] or [B, Hq, S]): float64 when upcast, else the naive same-dtype
    computation (fp32 scores from input-dtype values, P rounded to the input dtype, out rounded).
    ``mask`` [N, Hq, Sk]; v None: V = k's first dim_v columns. Differentiable."""
    dtype = q.dtype
    work = torch.float64 if upcast else torch.float32
    if v is None:
        v = k[..., :case.dim_v]
    qb, kb, vb = (_bshd(x, case.fmt).to(work) for x in (q, k, v))  # [B, S, H, D]
    group = case.heads_q // case.heads_kv
    kb, vb = kb.repeat_interleave(group, dim=2), vb.repeat_interleave(group, dim=2)
    batch, seqlen = qb.shape[:2]
    m = mask.reshape(batch, seqlen, case.heads_q, -1).transpose(1, 2)  # [B, Hq, S, Sk]
    s = torch.einsum("bihd,bjhd->bhij", qb, kb) * scale
    s = s.masked_fill(~m, float("-inf"))
    row_max = s.amax(-1, keepdim=True) if s.shape[-1] else s.new_full((*s.shape[:-1], 1), float("-inf"))
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    e = torch.exp(s - row_max)
    denom = e.sum(-1, keepdim=True)
    p = e / torch.where(denom == 0, torch.ones_like(denom), denom)
    if not upcast:
        p = p.to(dtype).to(work)
    out = _from_bshd(torch.einsum("bhij,bjhd->bihd", p, vb), case.fmt)
    lse = (row_max + torch.log(denom)).squeeze(-1)  # [B, Hq, S]
    lse = lse[0] if case.fmt == "thd" else lse
    return (out if upcast else out.to(dtype)), lse


class Batch:
    def __init__(self, case: SparseCase, dtype: torch.dtype, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.case, self.dtype = case, dtype
        batch, seqlen, seqlen_k, tokens = _token_layout(case)
        self.lo, self.hi = _bounds(case, tokens)
        if case.rows == "random":
            raw = _raw_indices(case, tokens, self.lo, self.hi, seqlen_k, gen)
        else:
            raw = _whole_rows(case, self.lo, self.hi, seqlen_k, gen)
        lengths = None
        if case.topk_length:
            lengths = torch.randint(0, case.n_slots + 3, (len(tokens),), generator=gen)
        self.mask = _named_mask(case, raw, lengths, self.lo, self.hi, seqlen_k)
        self.indices = _token_dims(raw if case.per_head else raw[:, 0], case, batch, seqlen).to(KERNEL_DEVICE)
        self.topk_length = None if lengths is None else _token_dims(lengths, case, batch, seqlen).to(KERNEL_DEVICE)
        self.lo, self.hi = self.lo.to(KERNEL_DEVICE), self.hi.to(KERNEL_DEVICE)
        token_shape = {"thd": (seqlen,), "bshd": (batch, seqlen), "sbhd": (seqlen, batch)}[case.fmt]

        def rand(heads, dim):
            return torch.randn(*token_shape, heads, dim, generator=gen).to(dtype).to(KERNEL_DEVICE)

        self.q = rand(case.heads_q, case.dim_qk)
        self.k = rand(case.heads_kv, case.dim_qk)
        self.v = None if case.absorbed else rand(case.heads_kv, case.dim_v)
        self.dout = rand(case.heads_q, case.dim_v)
        self.scale = case.dim_qk ** -0.5
        self.topk = prepare_topk(self.indices, case.fmt, self.topk_length)

    @property
    def kw(self) -> dict:
        return dict(v_dim=self.case.dim_v if self.case.absorbed else None)

    def forward(self, **kw):
        return sparse_attn_fwd(self.q, self.k, self.v, self.topk, self.lo, self.hi, self.case.fmt, self.scale,
                               **self.kw, **kw)

    def backward(self, out, lse, atomic=False, schedule=None):
        return sparse_attn_bwd(self.dout, self.q, self.k, self.v, out, lse, self.topk, self.lo, self.hi,
                               self.case.fmt, self.scale, **self.kw, atomic=atomic, schedule=schedule)

    def leaves(self, dtype=None):
        return [x.detach().cpu().to(dtype or x.dtype).requires_grad_() for x in (self.q, self.k, self.v)
                if x is not None]

    def check_forward(self, out, lse):
        qkv = self._qkv([x.detach() for x in self.leaves()])
        ref, ref_lse = sparse_reference(*qkv, self.mask, self.case, self.scale)
        naive, naive_lse = sparse_reference(*qkv, self.mask, self.case, self.scale, upcast=False)
        out, lse = out.cpu(), lse.cpu()
        assert out.dtype == self.dtype and out.shape == ref.shape
        assert_flash_criterion("out", out, naive, ref)
        assert_lse_criterion(lse, naive_lse, ref_lse)
        seen = self.mask.any(-1)  # [N, Hq]: the token sees a key
        flat = _bshd(out, self.case.fmt).reshape(seen.shape + (-1,))
        assert (flat[~seen] == 0).all(), "a token without a visible key must output 0"

    def check_backward(self, grads):
        ref_leaves, naive_leaves = self.leaves(torch.float64), self.leaves()
        ref, _ = sparse_reference(*self._qkv(ref_leaves), self.mask, self.case, self.scale)
        naive, _ = sparse_reference(*self._qkv(naive_leaves), self.mask, self.case, self.scale, upcast=False)
        refs = torch.autograd.grad(ref, ref_leaves, self.dout.cpu().double())
        naives = torch.autograd.grad(naive, naive_leaves, self.dout.cpu())
        grads = [None if g is None else g.cpu() for g in grads]
        names = ("dq", "dk") if self.case.absorbed else ("dq", "dk", "dv")
        assert len(grads) == 3 and (grads[2] is None) == self.case.absorbed
        for name, got, r, n in zip(names, grads, refs, naives):
            assert got.dtype == self.dtype and got.shape == r.shape, name
            assert_flash_criterion(name, got, n, r)
        seen = self.mask.any(-1)
        dq = _bshd(grads[0], self.case.fmt).reshape(seen.shape + (-1,))
        assert (dq[~seen] == 0).all(), "a token without a visible key must get dq 0"

    def _qkv(self, leaves):
        return (leaves[0], leaves[1], None) if self.case.absorbed else tuple(leaves)


def _nan_outputs(batch: Batch):
    out = torch.full((*batch.q.shape[:-1], batch.case.dim_v), float("nan"), dtype=batch.dtype, device=KERNEL_DEVICE)
    n_tokens = batch.mask.shape[0]
    lse_shape = (batch.case.heads_q, n_tokens) if batch.case.fmt == "thd" else \
        (len(batch.case.lens), batch.case.heads_q, n_tokens // len(batch.case.lens))
    return out, torch.full(lse_shape, float("nan"), device=KERNEL_DEVICE)


CASES = [
    # GQA 2 with per-kv-head indices, split q/k dims (32 + 16 -> 40) and a separate V of 24 (fp32: the sbhd
    # case below and the backward's determinism, chunking and atomic tests)
    (SparseCase(per_head=True), torch.float16),
    # absorbed MQA: 20 q heads on one key head (two head blocks), V = the key block's first 32 columns
    (SparseCase(lens=(9, 0, 7), heads_q=20, heads_kv=1, dim_qk=48, dim_v=32, absorbed=True, n_slots=20),
     torch.float16),
    # sbhd, indices shared by both kv heads, topk_length, not causal, K past every sequence's length
    (SparseCase(fmt="sbhd", lens=(6, 3), heads_q=4, heads_kv=2, dim_qk=32, dim_v=48, n_slots=40, causal=False,
                topk_length=True), torch.float32),
    # bshd absorbed where v's block is not k's first (24 -> 32, v 16): V read again, dV folded at the end; bf16
    (SparseCase(fmt="bshd", lens=(7, 4), heads_q=4, heads_kv=1, dim_qk=24, dim_v=16, absorbed=True, n_slots=12),
     torch.bfloat16),
    # DeepSeek-V3.2 / GLM-5's absorbed MLA: 576 = 512 + 64, V = the 512 block, few tokens
    (SparseCase(lens=(4, 2), heads_q=16, heads_kv=1, dim_qk=576, dim_v=512, absorbed=True, n_slots=20),
     torch.bfloat16),
    # every row full (top-k longer than every sequence): the range mode alone, its 16-row tiles 8 tokens of
    # GQA 2 across sequence boundaries, 16-key blocks across the 12-token sequence
    (SparseCase(rows="full", n_slots=16), torch.float16),
    # bshd, one sample longer than K: its first 6 tokens full, the rest sparse, and per kv head (the second's
    # rows one key short: slot mode), so token blocks, key blocks and dK/dV rows take both modes at once
    (SparseCase(fmt="bshd", lens=(14, 9), heads_kv=2, per_head=True, rows="mixed", n_slots=6), torch.float32),
    # key bounds narrower than causality (a window of 4): a row naming its 4 keys is full, its range does not
    # start at the sequence's; absorbed V from the key block
    (SparseCase(lens=(11, 6), heads_q=2, heads_kv=1, dim_qk=32, dim_v=32, absorbed=True, rows="full", window=4,
                n_slots=8), torch.float32),
]


@pytest.mark.parametrize("case, dtype", [pytest.param(c, d, id=f"{c.id}-{str(d).split('.')[-1]}") for c, d in CASES])
def test_forward_and_backward_match_the_reference(case, dtype):
    batch = Batch(case, dtype)
    out, lse = _nan_outputs(batch)
    got_out, got_lse = batch.forward(out=out, lse=lse)
    assert got_out is out and got_lse is lse
    assert not out.isnan().any() and not lse.isnan().any()
    batch.check_forward(out, lse)
    batch.check_backward(batch.backward(out, lse))


SMALL = SparseCase(lens=(3, 6, 0, 5), heads_q=4, heads_kv=1, dim_qk=32, dim_v=32, n_slots=10)


@pytest.fixture(scope="module")
def small():
    """A small fp32 batch and its forward, shared by the backward's determinism tests."""
    batch = Batch(SMALL, torch.float32, seed=1)
    return batch, *batch.forward()


def test_backward_is_bitwise_deterministic_and_needs_no_written_buffer(small, monkeypatch):
    """Two runs bitwise equal; the second with every fresh float allocation NaN-filled, so an element
    the kernels forget to write shows."""
    batch, out, lse = small
    first = batch.backward(out, lse)
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(real):
        def make(*args, **kwargs):
            x = real(*args, **kwargs)
            return x.fill_(float("nan")) if x.is_floating_point() else x
        return make

    monkeypatch.setattr(torch, "empty", poisoned(real_empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(real_empty_like))
    second = batch.backward(out, lse)
    monkeypatch.undo()
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    batch.check_backward(first)


def test_chunked_reduce_equals_one_chunk_bitwise(small, monkeypatch):
    """A 1-byte budget: one query token per chunk (14 chunks, each key's entries split over many)."""
    batch, out, lse = small
    whole = batch.backward(out, lse)
    monkeypatch.setenv(ENV_PARTIAL_BUDGET, "1")
    chunked = batch.backward(out, lse)
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)


def test_atomic_variant_agrees_within_rounding(small):
    batch, out, lse = small
    exact = batch.backward(out, lse)
    atomic = batch.backward(out, lse, atomic=True)
    assert torch.equal(atomic[0], exact[0])  # dQ does not depend on the variant
    for a, b in zip(atomic[1:], exact[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    batch.check_backward(atomic)


@pytest.mark.parametrize("case", [SparseCase(fmt="bshd", lens=(9, 5), heads_kv=2, per_head=True, rows="mixed",
                                             n_slots=6),
                                  SparseCase(lens=(9, 0, 7), heads_q=2, heads_kv=1, dim_qk=48, dim_v=32, absorbed=True,
                                             n_slots=12)], ids=["bshd-gqa2-per-head-idx-mixed", "thd-absorbed-gqa2"])
def test_both_dkv_schedules_match_the_reference_and_each_other(case):
    """The slot mode's dK/dV token-centric ("partials": partial rows and the reduce) and key-centric ("keys": a
    program per (key row, kv head) over the tokens naming the key): each within the flash criterion and
    bitwise repeatable, dQ bitwise equal, dK/dV within rounding of each other (they sum in other orders)."""
    batch = Batch(case, torch.float32, seed=3)
    out, lse = batch.forward()
    runs = {schedule: batch.backward(out, lse, schedule=schedule) for schedule in SCHEDULES}
    for schedule, grads in runs.items():
        batch.check_backward(grads)
        again = batch.backward(out, lse, schedule=schedule)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads, again)), schedule
    partials, keys = runs["partials"], runs["keys"]
    assert torch.equal(partials[0], keys[0])
    for a, b in zip(partials[1:], keys[1:]):
        assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_schedule_choice():
    """Fewer bytes per (token, kv head, slot): per-head K/V with small groups key-centric, absorbed MLA's
    wide groups token-centric; COREATTN_SPARSE_DKV and the argument override, atomic first."""
    from coreattn.kernels.sparse_fwd import sparse_problem

    def problem(heads_q, heads_kv, dim_qk, dim_v, absorbed):
        q, k = torch.empty(1, heads_q, dim_qk, device="meta"), torch.empty(1, heads_kv, dim_qk, device="meta")
        v = None if absorbed else torch.empty(1, heads_kv, dim_v, device="meta")
        return sparse_problem(q, k, v, "thd", dim_v if absorbed else None)

    per_head, gqa16, absorbed = problem(128, 128, 192, 128, False), problem(128, 8, 192, 128, False), \
        problem(128, 1, 576, 512, True)
    assert dkv_schedule(per_head, 2, 192 + 128) == "keys"
    assert dkv_schedule(problem(128, 32, 192, 128, False), 2, 320) == "keys"  # 4 heads a group
    assert dkv_schedule(gqa16, 2, 320) == "partials"
    assert dkv_schedule(absorbed, 2, 576) == "partials"
    assert dkv_schedule(per_head, 2, 320, schedule="partials") == "partials"
    assert dkv_schedule(per_head, 2, 320, atomic=True, schedule="partials") == "atomic"
    with pytest.raises(ValueError, match="COREATTN_SPARSE_DKV"):
        dkv_schedule(per_head, 2, 320, schedule="rows")
    for group in range(1, 17):  # the byte rule picks the key-centric schedule up to KEYS_MAX_GROUP heads a group only
        for elem in (2, 4):
            prob = problem(8 * group, 8, 192, 128, False)
            assert (dkv_schedule(prob, elem, 320) == "keys") <= (group <= KEYS_MAX_GROUP), (group, elem)


class _LoadCalls:
    """Counts the interpreter's load calls that read each of some tensors (any lane's address in its
    storage): the kernels' algorithmic cost in gathers, independent of the machine's speed."""

    def __init__(self, monkeypatch, **tensors):
        from triton.runtime import interpreter

        storages = {name: t.untyped_storage() for name, t in tensors.items()}
        self.ranges = {name: (s.data_ptr(), s.data_ptr() + s.nbytes()) for name, s in storages.items()}
        self.calls = dict.fromkeys(tensors, 0)
        real = interpreter.InterpreterBuilder.create_masked_load

        def counted(builder, ptrs, mask, *args, **kwargs):
            addr = ptrs.data.astype("uint64")
            for name, (lo, hi) in self.ranges.items():
                self.calls[name] += bool(((addr >= lo) & (addr < hi)).any())
            return real(builder, ptrs, mask, *args, **kwargs)

        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", counted)


def _widened(topk: torch.Tensor, n_slots: int) -> torch.Tensor:
    """The same prepared rows in ``n_slots`` slots (-1 before them, prepared again)."""
    pad = torch.full((*topk.shape[:-1], n_slots - topk.shape[-1]), -1, dtype=topk.dtype, device=topk.device)
    return prepare_topk(torch.cat([pad, topk], -1), "thd")


@pytest.mark.interpreter_only("counts the kernels' loads under the interpreter")
def test_unused_slots_and_full_rows_cost_no_loads(monkeypatch):
    """The same valid entries in K = 10 and in K = 200 slots (190 more -1) take as many key loads in
    every kernel, forward and backward, with bitwise equal results: each row's loop runs from its
    first valid slot to its last, and slot blocks past it do nothing. Full rows (the range mode) read
    no index entry at all."""
    batch = Batch(SMALL, torch.float32, seed=2)
    runs = []
    for n_slots in (SMALL.n_slots, 200):
        topk = _widened(batch.topk, n_slots)
        calls = _LoadCalls(monkeypatch, k=batch.k, topk=topk)
        out, lse = sparse_attn_fwd(batch.q, batch.k, batch.v, topk, batch.lo, batch.hi, "thd", batch.scale)
        grads = sparse_attn_bwd(batch.dout, batch.q, batch.k, batch.v, out, lse, topk, batch.lo, batch.hi, "thd",
                                batch.scale)
        monkeypatch.undo()
        runs.append((calls.calls, out, lse, grads))
    (few, *first), (many, *second) = runs
    assert few["k"] > 0 and few == many, (few, many)
    for a, b in zip([first[0], first[1], *first[2]], [second[0], second[1], *second[2]]):
        assert (a is None and b is None) or torch.equal(a, b)
    batch.check_forward(first[0], first[1])

    full = Batch(SparseCase(lens=(5, 0, 9), heads_q=4, heads_kv=1, rows="full", n_slots=12), torch.float32)
    calls = _LoadCalls(monkeypatch, k=full.k, topk=full.topk)
    out, lse = full.forward()
    full.backward(out, lse)
    monkeypatch.undo()
    assert calls.calls["k"] > 0 and calls.calls["topk"] == 0, calls.calls


@pytest.mark.parametrize("what", ["no-tokens", "no-slots", "no-keys"])
def test_empty_inputs(what):
    """No query token (N = 0), K = 0, or no key rows at all: outputs of the right shapes, out 0,
    lse -inf, zero gradients, no launch reads past a tensor (the interpreter memcheck)."""
    gen = torch.Generator().manual_seed(0)
    tq, tk, n_slots = (0, 4, 5) if what == "no-tokens" else (3, 4, 0) if what == "no-slots" else (3, 0, 5)
    q, k, v = (torch.randn(t, h, d, generator=gen).to(KERNEL_DEVICE)
               for t, h, d in ((tq, 2, 16), (tk, 1, 16), (tk, 1, 8)))
    topk = prepare_topk(torch.randint(0, 4, (tq, n_slots), generator=gen).to(KERNEL_DEVICE), "thd")
    lo = torch.zeros(tq, dtype=torch.int32, device=KERNEL_DEVICE)
    hi = torch.full((tq,), 4, dtype=torch.int32, device=KERNEL_DEVICE)
    out, lse = sparse_attn_fwd(q, k, v, topk, lo, hi, "thd", 0.25)
    assert out.shape == (tq, 2, 8) and lse.shape == (2, tq)
    assert (out == 0).all() and torch.isneginf(lse).all()
    dq, dk, dv = sparse_attn_bwd(torch.randn_like(out), q, k, v, out, lse, topk, lo, hi, "thd", 0.25)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert not dq.any() and not dk.any() and not dv.any()

