"""Shared builders for the sparse-attention tests: cases, inputs with every kind of index, and the checks.

Each query row of ``topk_indices`` mixes visible keys with what must be masked: -1 and other
negative entries, repeats of a key (set semantics: counted once), keys of another sequence (thd) or
past the sample's keys (padded, also beyond the tensor), keys past causality, and (int64 indices)
values beyond int32; some rows hold no visible key at all. Sequences shorter than top-k and empty
ones are in the default lengths.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from attn_cases import assert_flash_criterion
from sparse_oracle import sparse_attention_ref, sparse_sets

EPS = 1e-5


@dataclass(frozen=True)
class SparseCase:
    layout: str = "thd"  # thd | bshd | sbhd
    dqk: int = 32
    dv: int = 16
    hq: int = 4
    hkv: int = 2
    absorbed: bool = False  # v None: V = k[..., :dv]
    per_head: bool = False  # topk_indices [.., Hkv, K]
    topk: int = 8
    lens_q: tuple[int, ...] = (5, 0, 13, 1, 9)
    lens_k: tuple[int, ...] | None = None  # None: lens_q
    causal: bool = True
    bottom_right: bool = True
    topk_length: bool = False
    bounds: bool = False
    left_pad: bool = False  # padded layouts: spans end at S (q_start = S - len)
    index_dtype: torch.dtype = torch.int64
    noncontig: bool = False
    softmax_scale: float | None = None
    full_rows: float = 0.0  # this share of the rows name every key of their causal range (and masked extras)
    key_window: tuple[int, int] | None = None  # keys added around each token (DeepSeek-V4's sliding window)
    sinks: bool = False  # a softmax offset per q head (differentiable)
    token_sinks: bool = False  # with sinks: one per token and head instead (thd [T, Hq], padded [B, Hq, S])
    # "random": every row mixes visible keys with everything that must be masked; "mixed": runs of
    # rows of one kind each (mixed_row): whole causal ranges, windows, random subsets, a key or two
    rows: str = "random"

    @property
    def id(self) -> str:
        parts = [self.layout, f"hdim{self.dqk}x{self.dv}" + ("-absorbed" if self.absorbed else "")]
        parts.append("mqa" if self.hkv == 1 else f"gqa{self.hq // self.hkv}" if self.hq != self.hkv else "mha")
        parts.append(f"k{self.topk}" + ("-perhead" if self.per_head else ""))
        if self.causal:
            parts.append("causal" + ("" if self.bottom_right else "-topleft"))
        parts += [name for name, on in (("qk-lens-differ", self.lens_k is not None), ("topk-length", self.topk_length),
                                        ("bounds", self.bounds), ("left-pad", self.left_pad),
                                        ("strided", self.noncontig), ("mixed-rows", self.rows == "mixed")) if on]
        if self.key_window is not None:
            parts.append(f"window{self.key_window[0]}-{self.key_window[1]}")
        if self.sinks:
            parts.append("token-sinks" if self.token_sinks else "sinks")
        if self.full_rows:
            parts.append("all-rows-full" if self.full_rows >= 1 else f"full-rows{int(self.full_rows * 100)}")
        return "-".join(parts)


MIXED_KINDS = ("full", "window", "subset", "few")


def mixed_row(rng: random.Random, n: int, topk: int, k0: int, vis_hi: int, k_rows: int) -> list[int]:
    """A row of kind ``MIXED_KINDS[(n // 3) % 4]`` (runs of three tokens per kind), shuffled, padded
    with -1 and a repeat: every causal key (a token seeing its whole range, when K allows), the last
    few of them (a window), a random subset of them with keys past causality and out of range, or
    one or two keys and -1 (a row the backend compacts); every 11th row names nothing."""
    if n % 11 == 5:
        return [-1] * topk
    kind = MIXED_KINDS[(n // 3) % len(MIXED_KINDS)]
    visible = list(range(k0, k0 + vis_hi))
    if kind == "full":
        keys = visible[:topk]
    elif kind == "window":
        keys = visible[-max(1, vis_hi // 2):] if visible else []
    elif kind == "subset":
        keys = [j for j in visible if rng.random() < 0.5] + [k0 + vis_hi + 1, k_rows + 3, -5]
    else:
        keys = rng.sample(visible, min(2, len(visible)))
    keys = keys[:topk]
    if keys and len(keys) < topk:
        keys.append(keys[0])  # a repeat
    keys += [-1] * (topk - len(keys))
    rng.shuffle(keys)
    return keys


class SparseInputs:
    """Inputs of a case (``q, k, v`` leaves requiring grad) and the call's keyword arguments."""

    def __init__(self, case: SparseCase, dtype: torch.dtype, seed: int = 0):
        self.case = case
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        lens_q = case.lens_q
        lens_k = case.lens_k if case.lens_k is not None else lens_q
        padded = case.layout != "thd"
        batch = len(lens_q)
        # padded: spans unless every sample is full (equal lengths, no left padding)
        spans = padded and (len(set(lens_q)) > 1 or len(set(lens_k)) > 1 or case.left_pad)
        sq, sk = (max(lens_q) + 2 * spans, max(lens_k) + spans) if padded else (sum(lens_q), sum(lens_k))

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(dtype)

        def side(seqlen, heads, dim, extra=0):
            shape = (seqlen, heads, dim + extra) if not padded else (batch, seqlen, heads, dim + extra)
            x = rand(*shape)
            if case.layout == "sbhd":  # [S, B, ...]: contiguous, or a strided view with noncontig
                x = x.transpose(0, 1) if case.noncontig else x.transpose(0, 1).contiguous()
            return x[..., extra:] if extra else x

        pad = 3 if case.noncontig else 0
        self.q = side(sq, case.hq, case.dqk, pad).detach().requires_grad_()
        self.k = side(sk, case.hkv, case.dqk, pad).detach().requires_grad_()
        self.v = None if case.absorbed else side(sk, case.hkv, case.dv, pad).detach().requires_grad_()

        # per query token: its sequence (None outside), position in it; per sequence: spans
        if padded:
            q_start = [sq - n if case.left_pad else 0 for n in lens_q]
            k_start = [sk - n if case.left_pad else 0 for n in lens_k]
            tokens = [(b, s) for b in range(batch) for s in range(sq)]
            token_seq = [b if q_start[b] <= s < q_start[b] + lens_q[b] else None for b, s in tokens]
            token_pos = [s - q_start[b] for b, s in tokens]
            token_sample = [b for b, _ in tokens]
            k_rows = sk
        else:
            cu_q = [0] + list(torch.tensor(lens_q).cumsum(0).tolist())
            cu_k = [0] + list(torch.tensor(lens_k).cumsum(0).tolist())
            q_start, k_start = cu_q[:-1], cu_k[:-1]
            token_seq = [next(b for b in range(batch) if cu_q[b] <= n < cu_q[b + 1]) for n in range(sq)]
            token_pos = [n - cu_q[b] for n, b in enumerate(token_seq)]
            token_sample = [0] * sq
            k_rows = sk
        self.token_sample = token_sample

        hidx = case.hkv if case.per_head else 1
        big = 2**31 + 5 if case.index_dtype == torch.int64 else k_rows + 7
        rows = []
        for n, b in enumerate(token_seq):
            heads = []
            for _ in range(hidx):
                row = []
                if b is not None:
                    k0, lk = k_start[b], lens_k[b]
                    shift = lk - lens_q[b] if case.bottom_right else 0
                    vis_hi = min(lk, token_pos[n] + 1 + shift) if case.causal else lk
                    if 0 < vis_hi <= case.topk and n % 7 != 3 and rng.random() < case.full_rows:
                        # a full row: every visible key, shuffled, then masked extras (-1, repeats, the future)
                        row = [k0 + j for j in range(vis_hi)]
                        row += [rng.choice([-1, row[0], k0 + lk]) for _ in range(case.topk - vis_hi)]
                        rng.shuffle(row)
                        heads.append(row)
                        continue
                if case.rows == "mixed" and b is not None:
                    heads.append(mixed_row(rng, n, case.topk, k0, vis_hi, k_rows))
                    continue
                for slot in range(case.topk):
                    r = rng.random()
                    if b is None or n % 7 == 3:  # a row with no visible key
                        row.append(rng.choice([-1, -3, big, k_rows]))
                    elif r < 0.45 and vis_hi > 0:
                        row.append(k0 + rng.randrange(vis_hi))
                    elif r < 0.55 and row:
                        row.append(rng.choice(row))  # a repeat
                    elif r < 0.65:
                        row.append(-1)
                    elif r < 0.75 and vis_hi < lk:
                        row.append(k0 + rng.randrange(vis_hi, lk))  # past causality
                    elif r < 0.85:
                        row.append(rng.choice([rng.randrange(k_rows), k_rows, k_rows + 2, big, -2]))
                    else:
                        row.append(k0 + rng.randrange(max(lk, 1)))
                heads.append(row)
            rows.append(heads)
        self.rows = rows
        topk = torch.tensor(rows, dtype=case.index_dtype)  # [N, Hidx, K]
        length = [rng.randrange(case.topk + 2) - 1 for _ in rows] if case.topk_length else None
        bounds = None
        if case.bounds:  # narrower than the sequence for some tokens, wider for others
            lo = [k_start[b] + rng.randrange(3) - 1 if b is not None else 0 for b in token_seq]
            hi = [k_start[b] + lens_k[b] - rng.randrange(3) + 1 if b is not None else 0 for b in token_seq]
            bounds = (lo, hi)
        self.sets = sparse_sets(rows, token_seq, token_pos, lens_q,
                                [k_start[b] for b in range(batch)], list(lens_k), causal=case.causal,
                                bottom_right=case.bottom_right, topk_length=length, bounds=bounds,
                                window=case.key_window)

        def token_shaped(flat: torch.Tensor) -> torch.Tensor:
            if not padded:
                return flat
            x = flat.reshape(batch, sq, *flat.shape[1:])
            return x.transpose(0, 1) if case.layout == "sbhd" else x

        self.kwargs = dict(causal=case.causal, causal_alignment="bottom_right" if case.bottom_right else "top_left")
        if case.softmax_scale is not None:
            self.kwargs["softmax_scale"] = case.softmax_scale
        idx = topk if case.per_head else topk[:, 0]
        self.topk_indices = token_shaped(idx)
        if length is not None:
            self.kwargs["topk_length"] = token_shaped(torch.tensor(length, dtype=torch.int32))
        if bounds is not None:
            self.kwargs["key_bounds"] = tuple(token_shaped(torch.tensor(x, dtype=torch.int64)) for x in bounds)
        if case.absorbed:
            self.kwargs["v_head_dim"] = case.dv
        if case.key_window is not None:
            self.kwargs["key_window"] = case.key_window
        self.sinks = None
        if case.sinks:
            work = torch.float64 if dtype == torch.float64 else torch.float32
            if case.token_sinks:
                self.sinks = torch.randn(len(rows), case.hq, generator=gen).to(work)  # [N, Hq]
                if padded:  # [B, Hq, S]
                    self.sinks = self.sinks.view(batch, sq, case.hq).transpose(1, 2).contiguous()
            else:
                self.sinks = torch.randn(case.hq, generator=gen).to(work)
            self.sinks.requires_grad_()
            self.kwargs["softmax_offset"] = self.sinks
        if padded:
            self.kwargs["layout"] = case.layout
            if spans:
                i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
                self.kwargs.update(q_start=i32(q_start), q_len=i32(list(lens_q)), k_start=i32(k_start),
                                   k_len=i32(list(lens_k)))
        else:
            i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
            self.cu_q, self.cu_k = i32(cu_q), i32(cu_k)

    def on(self, device) -> "SparseInputs":
        """A copy of these inputs on ``device`` (new leaves; the oracle stays with the CPU ones)."""
        if str(device) == "cpu":
            return self
        other = object.__new__(SparseInputs)
        other.__dict__.update(self.__dict__)
        move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
        for name in ("q", "k", "v", "sinks"):
            x = getattr(self, name)
            setattr(other, name, None if x is None else x.detach().to(device).requires_grad_())
        if other.sinks is not None:
            other.kwargs = dict(self.kwargs, softmax_offset=other.sinks)
        other.topk_indices = move(self.topk_indices)
        other.kwargs = {n: tuple(map(move, x)) if isinstance(x, tuple) else move(x) for n, x in other.kwargs.items()}
        if self.case.layout == "thd":
            other.cu_q, other.cu_k = move(self.cu_q), move(self.cu_k)
        return other

    def call(self, fn=None, **over):
        """Runs the public function of the layout: (out, lse)."""
        import coreattn

        kw = dict(self.kwargs, return_lse=True, **over)
        if self.case.layout == "thd":
            fn = fn or coreattn.sparse_varlen_attn
            return fn(self.q, self.k, self.v, self.topk_indices, self.cu_q, self.cu_k, **kw)
        fn = fn or coreattn.sparse_padded_attn
        return fn(self.q, self.k, self.v, self.topk_indices, **kw)

    # token-major views: [N, H, D] rows in token order n = b * S + s
    def flat(self, x: torch.Tensor) -> torch.Tensor:
        if self.case.layout == "thd":
            return x
        x = x.transpose(0, 1) if self.case.layout == "sbhd" else x
        return x.reshape(-1, *x.shape[2:])

    def flat_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """lse as ``[N, Hq]``."""
        return lse.t() if self.case.layout == "thd" else lse.transpose(1, 2).reshape(-1, lse.shape[1])

    def by_sample(self, x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        if self.case.layout == "thd":
            return x.unsqueeze(0)
        return x.transpose(0, 1) if self.case.layout == "sbhd" else x

    def reference(self, upcast: bool = True):
        """(out [N, Hq, Dv], lse [N, Hq]) of the oracle (upcast) or the naive same-dtype baseline."""
        return sparse_attention_ref(self.flat(self.q), self.by_sample(self.k), self.by_sample(self.v), self.sets,
                                    self.token_sample, v_head_dim=self.case.dv, upcast=upcast,
                                    softmax_scale=self.kwargs.get("softmax_scale"), sinks=self.flat_sinks())

    def flat_sinks(self) -> torch.Tensor | None:
        """The sinks as the oracle takes them: ``[Hq]``, or ``[N, Hq]`` per token."""
        if self.sinks is None or self.sinks.dim() < 2 or self.case.layout == "thd":
            return self.sinks
        return self.sinks.transpose(1, 2).reshape(-1, self.sinks.shape[1])

    def leaves(self):
        return [t for t in (self.q, self.k, self.v, self.sinks) if t is not None]

    def leaf_names(self):
        return [n for n, t in (("dq", self.q), ("dk", self.k), ("dv", self.v), ("dsinks", self.sinks)) if t is not None]


def incoming_grad(out: torch.Tensor, seed: int = 3) -> torch.Tensor:
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)


def assert_sparse_matches_oracle(inp: SparseInputs, out: torch.Tensor, lse: torch.Tensor, grads: bool = True,
                                 run: SparseInputs | None = None):
    """out, lse and (``grads``) dq/dk/dv of a call against the float64 oracle: the flash criterion
    (err <= 2 * err of the naive same-dtype computation + eps) in 16/32-bit, 1e-10 in float64; lse
    -inf exactly where the oracle's is; no NaN. ``run``: the inputs the call ran on (``inp.on(device)``),
    if not ``inp``."""
    run = run or inp
    out_flat, lse_flat = run.flat(out), run.flat_lse(lse).cpu()
    ref, ref_lse = inp.reference(upcast=True)
    naive, naive_lse = inp.reference(upcast=False)
    assert out.dtype == inp.q.dtype
    assert lse.dtype == (torch.float64 if inp.q.dtype == torch.float64 else torch.float32)
    assert torch.equal(torch.isneginf(lse_flat), torch.isneginf(ref_lse)), "lse: rows without keys differ"
    fin = torch.isfinite(ref_lse)
    g = incoming_grad(out_flat)
    leaves = inp.leaves()
    got = [out_flat.cpu(), lse_flat[fin]]
    want = [ref, ref_lse[fin]]
    base = [naive, naive_lse[fin]]
    names = ["out", "lse"]
    if grads:
        got += [x.cpu() for x in torch.autograd.grad(out_flat, run.leaves(), g.to(out_flat.device),
                                                     retain_graph=True)]
        want += list(torch.autograd.grad(ref, leaves, g.double()))
        base += list(torch.autograd.grad(naive, leaves, g.to(naive.dtype)))
        names += inp.leaf_names()
    for name, x, r, n in zip(names, got, want, base):
        x = x.detach()
        if inp.q.dtype == torch.float64:
            assert not torch.isnan(x).any(), f"{name}: NaN"
            torch.testing.assert_close(x, r.detach(), rtol=1e-10, atol=1e-10, msg=name)
        else:
            assert_flash_criterion(name, x, n.detach(), r.detach(), EPS)
