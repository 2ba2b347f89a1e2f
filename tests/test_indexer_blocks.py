"""``indexer_topk``'s block mode (``block_size``: MiniMax-M3's block-max scoring) against a reference written
from its definition, on the torch backend and the Triton block-score kernel (the interpreter on CPU).

The reference loops per row and head: block c (keys ``origin + c * B ..``, origin the row's first
visible key in thd, 0 padded) scores the largest ``act(q . k)`` over its visible keys, the
``local_blocks`` blocks ending at the row's last visible key's block score +inf, and the row keeps the
top K = min(topk, blocks) by score, then lower block first. Integer-valued q and k make every score exact
whatever the summation order, so the tie rule is checked exactly (ties are frequent there); float data
is checked too. Then the MiniMax-M3 model's own scorer on the same inputs, and the argument checks.
"""

from __future__ import annotations

import pytest
import torch

from coreattn.layers.dsa import indexer as ix

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.interpreter_only(
    "the Triton indexer kernels on CPU tensors"))]
CU = [0, 7, 7, 10, 26, 31]  # an empty sequence, sequences shorter than a block, partial last blocks


def reference(q, k, lo, hi, origin, block, topk, local, relu):
    """(block ids [B, S, H, K] int64, their float64 scores) by the definition (module docstring)."""
    batch, seqlen, heads, _ = q.shape
    n_blocks = -(-k.shape[1] // block)
    width = min(topk, n_blocks)
    ids = torch.full((batch, seqlen, heads, width), -1, dtype=torch.int64)
    vals = torch.full((batch, seqlen, heads, width), float("-inf"), dtype=torch.float64)
    x = torch.einsum("bshd,btd->bsht", q.double(), k.double())
    if relu:
        x = x.clamp_min(0)
    for b in range(batch):
        for s in range(seqlen):
            lo_, hi_, o = lo[b][s], hi[b][s], origin[b][s]
            for h in range(heads):
                score = [float("-inf")] * n_blocks
                for j in range(lo_, hi_):
                    c = (j - o) // block
                    score[c] = max(score[c], float(x[b, s, h, j]))
                if hi_ > lo_:
                    own = (hi_ - 1 - o) // block
                    for i in range(local):
                        score[max(own - i, 0)] = float("inf")
                order = sorted((c for c in range(n_blocks) if score[c] > float("-inf")), key=lambda c: (-score[c], c))
                for slot, c in enumerate(order[:width]):
                    ids[b, s, h, slot], vals[b, s, h, slot] = c, score[c]
    return ids, vals


def _inputs(batch, seqlen, seqlen_k, heads, dim, integer, seed=0):
    g = torch.Generator().manual_seed(seed)
    if integer:
        return (torch.randint(-2, 3, (batch, seqlen, heads, dim), generator=g).float(),
                torch.randint(-2, 3, (batch, seqlen_k, dim), generator=g).float())
    return torch.randn(batch, seqlen, heads, dim, generator=g), torch.randn(batch, seqlen_k, dim, generator=g)


CASES = [  # layout, batch, S, Sk, heads, block, topk, local blocks, relu, integer data
    ("bshd", 2, 21, 21, 3, 4, 3, 1, False, True),
    ("bshd", 1, 13, 19, 2, 3, 4, 2, True, True),  # keys past the queries: bottom-right causality
    ("sbhd", 2, 17, 17, 4, 5, 2, 0, False, False),
    ("thd", 1, 31, 31, 2, 4, 3, 1, False, True),  # blocks from each sequence's start
    ("bshd", 1, 9, 9, 2, 4, 8, 1, False, False),  # top-k wider than the blocks: K = blocks
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout,batch,seqlen,seqlen_k,heads,block,topk,local,relu,integer", CASES,
                         ids=lambda v: str(v))
def test_block_topk_matches_reference(backend, layout, batch, seqlen, seqlen_k, heads, block, topk, local, relu,
                                      integer):
    q, k = _inputs(batch, seqlen, seqlen_k, heads, 16, integer)
    if layout == "thd":
        seq = [next(i for i in range(len(CU) - 1) if CU[i] <= s < CU[i + 1]) for s in range(seqlen)]
        lo = [[CU[i] for i in seq]]
        hi = [[s + 1 for s in range(seqlen)]]
        origin = lo
        kw = dict(cu_seqlens=torch.tensor(CU, dtype=torch.int32))
        qa, ka = q[0], k[0]
    else:
        shift = seqlen_k - seqlen
        lo = [[0] * seqlen] * batch
        hi = [[min(s + 1 + shift, seqlen_k) for s in range(seqlen)]] * batch
        origin = lo
        kw = {}
        qa, ka = (q.transpose(0, 1), k.transpose(0, 1)) if layout == "sbhd" else (q, k)
    want_ids, want_vals = reference(q, k, lo, hi, origin, block, topk, local, relu)
    got = ix.indexer_topk(qa, ka, None, topk, layout=layout, relu=relu, block_size=block, local_blocks=local,
                          return_scores=True, backend=backend, **kw)
    ids, vals = got.indices, got.scores
    if layout == "thd":
        ids, vals = ids[None], vals[None]
    elif layout == "sbhd":
        ids, vals = ids.transpose(0, 1), vals.transpose(0, 1)
    if integer:  # exact scores: the same blocks in the same order
        assert torch.equal(ids, want_ids)
        assert torch.equal(vals.double(), want_vals)
    else:  # float scores: the same sets, scores to rounding
        assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
        torch.testing.assert_close(vals.double(), want_vals, rtol=1e-5, atol=1e-5)


def test_matches_the_models_own_scorer():
    """MiniMax-M3's ``MiniMaxM3VLIndexer.forward`` scoring (transformers' code, with its RoPE and norms) and
    the op on the same projected q and k: the same block sets."""
    mm = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
    from transformers import MiniMaxM3VLTextConfig

    config = MiniMaxM3VLTextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   index_n_heads=2, index_head_dim=32, index_block_size=4, index_topk_blocks=3,
                                   index_local_blocks=2, num_hidden_layers=1, layer_types=["minimax_m3_sparse"])
    torch.manual_seed(0)
    indexer = mm.MiniMaxM3VLIndexer(config, 0)
    for p in indexer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    rope = mm.MiniMaxM3VLRotaryEmbedding(config)
    hidden = torch.randn(2, 23, 32)
    positions = torch.arange(23)[None].expand(2, -1)
    emb = rope(hidden, positions)
    forward = getattr(mm.MiniMaxM3VLIndexer.forward, "coreattn_wrapped", mm.MiniMaxM3VLIndexer.forward)
    want = forward(indexer, hidden, emb, None, positions)  # [B, H, S, K]
    q = indexer.q_norm(indexer.q_proj(hidden).view(2, 23, 2, 32))
    k = indexer.k_norm(indexer.k_proj(hidden).view(2, 23, 1, 32))
    q, k = mm.apply_rotary_pos_emb(q, k, emb[0][..., :32], emb[1][..., :32], unsqueeze_dim=2)
    got = ix.indexer_topk(q, k[:, :, 0], None, 3, layout="bshd", relu=False, block_size=4, local_blocks=2,
                          backend="torch").indices.permute(0, 2, 1, 3)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(weights=torch.ones(5, 2)), ValueError, "weights must be None with block_size"),
    (dict(block_size=0), ValueError, "block_size must be >= 1"),
    (dict(local_blocks=-1), ValueError, "local_blocks must be >= 0"),
    (dict(local_blocks=1.5), TypeError, "local_blocks must be an int"),
    (dict(backend="npu_fused"), (RuntimeError, ValueError, NotImplementedError), "npu"),
])
def test_bad_block_arguments_raise_naming_them(kwargs, error, match):
    args = dict(weights=None, block_size=2, local_blocks=1) | kwargs
    with pytest.raises(error, match=match):
        ix.indexer_topk(torch.randn(5, 2, 8), torch.randn(5, 8), args.pop("weights"), 2, **args)
