"""Block-sparse cases of the sparse op (``block_size``): inputs whose index rows name blocks, and their oracle.

Written from the op's definition (docs/dsa.md, the block mode), not from the code under test: entry c
of a token's row stands for the keys ``origin + c * B .. origin + c * B + B - 1`` (origin: the token's
sequence's first key row, thd; position 0 of the sample, padded), which a Python loop writes out as
token entries (-1 for a negative entry, the first ``topk_length`` entries only); the token oracle
(tests/sparse_oracle.py) then applies the sequence, causality and bounds, with set semantics.

Rows mix what the op must handle: the token's own block (causal inside), blocks at the sequence's start
and end (its last block partial: lengths are not multiples of B), earlier blocks, blocks past causality
and past the sequence (the next sequence's keys in thd, past the sample padded), -1 and other negative
entries, a block named twice, entries whose keys pass int32, and rows naming nothing visible.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from sparse_cases import SparseCase, SparseInputs
from sparse_oracle import sparse_sets


@dataclass(frozen=True)
class BlockCase(SparseCase):
    block_size: int = 4
    n_blocks: int = 3  # entries per row
    own_block: bool = True  # every row names its own block (MiniMax-M3's indexer always keeps it)

    @property
    def id(self) -> str:
        parts = super().id.split("-")
        parts[parts.index(next(p for p in parts if p.startswith("k") and p[1:].isdigit()))] = \
            f"b{self.block_size}x{self.n_blocks}"
        return "-".join(parts) + ("" if self.own_block else "-no-own")


class BlockInputs(SparseInputs):
    """A ``SparseInputs`` (q, k, v, layout, bounds) whose index rows are block entries (``block_size``)."""

    def __init__(self, case: BlockCase, dtype: torch.dtype, seed: int = 0):
        super().__init__(SparseCase(**{f: getattr(case, f) for f in SparseCase.__dataclass_fields__}
                                    | dict(topk_length=False, bounds=False, key_window=None, topk=1)), dtype, seed)
        self.case = case
        rng = random.Random(seed + 100)
        lens_q = case.lens_q
        lens_k = case.lens_k if case.lens_k is not None else lens_q
        padded = case.layout != "thd"
        batch = len(lens_q)
        bsz = case.block_size
        if padded:
            sq, sk = self.by_sample(self.q).shape[1], self.by_sample(self.k).shape[1]
            spans = "q_start" in self.kwargs
            q_start = self.kwargs["q_start"].tolist() if spans else [0] * batch
            k_start = self.kwargs["k_start"].tolist() if spans else [0] * batch
            tokens = [(b, s) for b in range(batch) for s in range(sq)]
            token_seq = [b if q_start[b] <= s < q_start[b] + lens_q[b] else None for b, s in tokens]
            token_pos = [s - q_start[b] for b, s in tokens]
            origin = [0] * len(tokens)
        else:
            sk = sum(lens_k)
            cu_q, cu_k = self.cu_q.tolist(), self.cu_k.tolist()
            k_start = cu_k[:-1]
            token_seq = [next(b for b in range(batch) if cu_q[b] <= n < cu_q[b + 1]) for n in range(cu_q[-1])]
            token_pos = [n - cu_q[b] for n, b in enumerate(token_seq)]
            origin = [cu_k[b] for b in token_seq]
        hidx = case.hkv if case.per_head else 1
        rows = []
        for n, b in enumerate(token_seq):
            heads = []
            for _ in range(hidx):
                row = []
                if b is not None and n % 7 != 3:
                    shift = lens_k[b] - lens_q[b] if case.bottom_right else 0
                    col = token_pos[n] + shift  # the query among its sequence's keys
                    # padded: blocks count from position 0 of the sample, the sequence from k_start
                    rel0 = k_start[b] - origin[n] if padded else 0
                    first, last = rel0 // bsz, (rel0 + max(lens_k[b], 1) - 1) // bsz
                    own = (rel0 + col) // bsz if 0 <= col < lens_k[b] else first
                    if case.own_block:
                        row.append(own)
                    while len(row) < case.n_blocks:
                        r = rng.random()
                        if r < 0.35:
                            row.append(rng.randrange(first, last + 1))  # a block of the sequence (start, end too)
                        elif r < 0.45:
                            row.append(rng.choice([first, last]))
                        elif r < 0.55:
                            row.append(-1 if r < 0.5 else -3)
                        elif r < 0.65 and row:
                            row.append(rng.choice(row))  # a block named twice
                        elif r < 0.75:
                            row.append(last + 1 + rng.randrange(2))  # past the sequence (or the sample)
                        elif r < 0.8 and case.index_dtype == torch.int64:
                            row.append(2**31 // bsz + rng.randrange(3))  # its keys pass int32
                        else:
                            row.append(own + 1)  # past causality (or the next block)
                    rng.shuffle(row)
                else:  # nothing visible: unused entries and blocks past every key
                    row = [rng.choice([-1, -2, (sk + bsz) // bsz + 1]) for _ in range(case.n_blocks)]
                heads.append(row)
            rows.append(heads)
        self.block_rows = rows
        length = [rng.randrange(case.n_blocks + 2) - 1 for _ in rows] if case.topk_length else None
        bounds = None
        if case.bounds:
            lo = [k_start[b] + rng.randrange(3) - 1 if b is not None else 0 for b in token_seq]
            hi = [k_start[b] + lens_k[b] - rng.randrange(3) + 1 if b is not None else 0 for b in token_seq]
            bounds = (lo, hi)
        # the oracle: each block entry written out as its keys, then the token sets
        token_rows = []
        for n, heads in enumerate(rows):
            cut = [row if length is None else row[:max(0, length[n])] for row in heads]
            token_rows.append([[origin[n] + c * bsz + i if c >= 0 else -1 for c in row for i in range(bsz)]
                               for row in cut])
        width = max((len(r) for heads in token_rows for r in heads), default=0)
        token_rows = [[r + [-1] * (width - len(r)) for r in heads] for heads in token_rows]
        self.sets = sparse_sets(token_rows, token_seq, token_pos, lens_q, list(k_start), list(lens_k),
                                causal=case.causal, bottom_right=case.bottom_right, bounds=bounds)

        def token_shaped(flat: torch.Tensor) -> torch.Tensor:
            if not padded:
                return flat
            x = flat.reshape(batch, -1, *flat.shape[1:])
            return x.transpose(0, 1) if case.layout == "sbhd" else x

        idx = torch.tensor(rows, dtype=case.index_dtype)  # [N, Hidx, nblocks]
        self.topk_indices = token_shaped(idx if case.per_head else idx[:, 0])
        self.kwargs.pop("topk_length", None)
        self.kwargs.pop("key_bounds", None)
        if length is not None:
            self.kwargs["topk_length"] = token_shaped(torch.tensor(length, dtype=torch.int32))
        if bounds is not None:
            self.kwargs["key_bounds"] = tuple(token_shaped(torch.tensor(x, dtype=torch.int64)) for x in bounds)
        self.kwargs["block_size"] = bsz
