"""coreattn's DSA indexer ops against Megatron-Core 0.19's own functions (``dsa.py``): the top-k of
``fused_qk_topk_naive``, the loss of ``compute_dsa_indexer_loss`` and the gradients of
``FusedDSAIndexerLoss`` (its naive backward), dense and sparse, ReLU and identity scoring, sbhd and thd
(Megatron's thd indexer tensors are sbhd with b = 1 and packed-stream bounds), with and without the
Hadamard rotation. Both coreattn backends (Triton under the interpreter on CPU).

Megatron ranks ties by ``torch.topk``'s order, coreattn by the lower key position: sets are compared
up to keys whose score ties the boundary. The sparse loss gets Megatron's own indices where ReLU
ties are likely, so both sides sum over the same keys.
"""

import types

import pytest
import torch

pytest.importorskip("megatron.core")

import megatron.core  # noqa: E402

try:
    from megatron.core.transformer.experimental_attention_variant import dsa
except ImportError:  # releases before the experimental attention variants
    dsa = None
pytestmark = pytest.mark.skipif(dsa is None or not hasattr(dsa, "FusedDSAIndexerLoss"),
                                reason=f"megatron-core {megatron.core.__version__} has no DSA indexer loss "
                                       "(FusedDSAIndexerLoss came with the experimental DSA of 0.17+)")

import indexer_oracle as oracle  # noqa: E402
from coreattn.layers.dsa import indexer as ix  # noqa: E402
from megatron_env import CPU_BACKENDS  # noqa: E402

PG = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))  # one tensor-parallel rank
CU = [0, 9, 9, 13, 30, 36]  # an empty sequence and one shorter than the top-k
S, B, H, D, NP, DQ, TOPK, SCALE, COEFF = 36, 2, 4, 16, 4, 32, 6, 0.3, 0.7


def inputs(batch, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, batch, H, D, generator=g)
    k = torch.randn(S, batch, D, generator=g)
    w = torch.rand(S, batch, H, generator=g) - 0.3
    query = torch.randn(S, batch, NP, DQ, generator=g)
    key = torch.randn(S, batch, 1, DQ, generator=g)  # the absorbed MLA key: one latent head
    return q, k, w, query, key


def bounds(thd: bool):
    """Megatron's varlen starts/ends ([S]: thd from cu_seqlens on the packed stream, sbhd causal)."""
    if thd:
        return dsa.dsa_masking.generate_varlen_mask_params(torch.tensor(CU))
    return torch.zeros(S, dtype=torch.int64), torch.arange(1, S + 1)


def ours(thd: bool):
    """coreattn's layout and bounds arguments for the same keys."""
    if thd:
        return dict(layout="thd", cu_seqlens=torch.tensor(CU, dtype=torch.int32))
    return dict(layout="sbhd")


def squeeze(x, thd):  # Megatron's [S, 1, ...] thd tensors as coreattn's [T, ...]
    return x[:, 0] if thd else x


def assert_same_topk(idx, ref, scores):
    """Row by row the same selected set, up to keys whose (Megatron) score ties the boundary's."""
    for row, (mine, theirs, sc) in enumerate(zip(idx.reshape(-1, idx.shape[-1]), ref.reshape(-1, ref.shape[-1]),
                                                 scores.reshape(-1, scores.shape[-1]))):
        a, b = {j for j in mine.tolist() if j >= 0}, {j for j in theirs.tolist() if j >= 0}
        assert len(a) == len(b), row
        if a != b:
            kth = min(sc[j].item() for j in b)
            tol = 1e-5 * max(1.0, abs(kth))
            assert all(abs(sc[j].item() - kth) <= tol for j in a ^ b), (row, a, b)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("relu", [True, False], ids=["relu", "identity"])
@pytest.mark.parametrize("thd", [False, True], ids=["sbhd", "thd"])
def test_topk_matches_megatron(thd, relu, backend):
    batch = 1 if thd else B
    q, k, w, _, _ = inputs(batch, seed=1)
    starts, ends = bounds(thd)
    scores, ref = dsa.fused_qk_topk_naive(q, k, w, TOPK, varlen_starts=starts, varlen_ends=ends, use_relu=relu)
    got = ix.indexer_topk(squeeze(q, thd), squeeze(k, thd), squeeze(w, thd), TOPK, relu=relu, backend=backend,
                          **ours(thd))
    idx = got.indices[None] if thd else got.indices.transpose(0, 1)  # Megatron's [b, s, K]
    assert idx.shape == ref.shape and idx.dtype == ref.dtype == torch.int64
    assert_same_topk(idx, ref, scores)
    if not thd and backend == "torch":  # the Megatron-style [S] bounds give the same as the derived causal ones
        given = ix.indexer_topk(q, k, w, TOPK, relu=relu, backend=backend, layout="sbhd", key_bounds=(starts, ends))
        assert torch.equal(given.indices, got.indices)


def megatron_loss(q, k, w, query, key, sparse, relu, thd, rows=None, per_token=False):
    """FusedDSAIndexerLoss forward and backward: (topk_indices, loss, dq, dk, dw)."""
    starts, ends = bounds(thd)
    leaves = [t.clone().requires_grad_() for t in (q, k, w)]
    idx, loss = dsa.FusedDSAIndexerLoss.apply(leaves[0], leaves[2], leaves[1], query, key.expand(-1, -1, NP, -1),
                                              SCALE, TOPK, COEFF, None, sparse, PG, starts, ends, None, rows, per_token,
                                              relu)
    loss.backward()
    return idx, loss.detach(), *(t.grad for t in leaves)


def truth(q, k, w, query, key, idx_m, sparse, relu, thd, rows=None, per_token=False):
    """The float64 oracle's loss and gradients on Megatron's indices (bshd form inside)."""
    starts, ends = bounds(thd)
    batch = q.shape[1]
    lo, hi = [starts.tolist()] * batch, [ends.tolist()] * batch
    leaves = [t.transpose(0, 1).double().requires_grad_() for t in (q, k, w)]
    loss = oracle.loss_ref(*leaves, query.transpose(0, 1), key.transpose(0, 1), lo, hi, SCALE, COEFF, sparse=sparse,
                           topk_indices=idx_m, relu=relu, query_valid_rows=rows, per_token=per_token)
    loss.backward()
    return loss, *(t.grad.transpose(0, 1) for t in leaves)


def assert_like_megatron(mine, megatron, exact):
    """Each of loss, dq, dk, dw at most twice as far from the float64 oracle as Megatron's own (float32)
    result, plus four float32 roundings (ulps) of its largest entry: the same value within float32
    rounding. (The eps is for the cases where Megatron's sum happens to land next to the exact value:
    both sum the same terms in different orders, coreattn over a row's gathered top-k entries,
    Megatron over the whole masked row, and a sum over rows and keys rounds a few times.)"""
    for name, a, m, t in zip(("loss", "dq", "dk", "dw"), mine, megatron, exact):
        err, err_megatron = (a.double() - t).abs().max(), (m.double() - t).abs().max()
        assert err <= 2 * err_megatron + 2**-22 * t.abs().max(), f"{name}: {err:.3e} vs Megatron's {err_megatron:.3e}"


CASES = [(thd, sparse, relu) for thd in (False, True) for sparse in (False, True) for relu in (True, False)]


@pytest.mark.parametrize("thd,sparse,relu", CASES, ids=[f"{'thd' if t else 'sbhd'}-{'sparse' if s else 'dense'}-"
                                                          f"{'relu' if r else 'identity'}" for t, s, r in CASES])
def test_loss_matches_megatron(thd, sparse, relu):
    """Loss and gradients on the same top-k indices as Megatron's (torch backend: the loss always runs in torch)."""
    batch = 1 if thd else B
    q, k, w, query, key = inputs(batch, seed=2)
    idx_m, loss_m, *grads_m = megatron_loss(q, k, w, query, key, sparse, relu, thd)
    value = dsa.compute_dsa_indexer_loss(dsa._compute_index_scores(q, w, k, relu), idx_m, query,
                                         key.expand(-1, -1, NP, -1), SCALE, COEFF, sparse, PG,
                                         varlen_starts=bounds(thd)[0], varlen_ends=bounds(thd)[1])
    assert torch.equal(value, loss_m)
    leaves = [t.clone().requires_grad_() for t in (q, k, w)]
    given = idx_m[0] if thd else idx_m.transpose(0, 1)
    loss = ix.indexer_loss(*(squeeze(t, thd) for t in (*leaves, query, key)), SCALE, COEFF, topk_indices=given,
                           sparse=sparse, relu=relu, backend="torch", **ours(thd))
    loss.backward()
    assert_like_megatron((loss, *(t.grad for t in leaves)), (loss_m, *grads_m),
                         truth(q, k, w, query, key, idx_m, sparse, relu, thd))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("thd", [False, True], ids=["sbhd", "thd"])
def test_fused_topk_and_loss_match_megatron(thd, backend):
    """indexer_topk_and_loss against FusedDSAIndexerLoss end to end (sparse, identity scoring: float scores
    without ties), with query_valid_rows and the per-token sum on sbhd."""
    batch = 1 if thd else B
    q, k, w, query, key = inputs(batch, seed=3)
    rows = per_token = None
    if not thd:
        rows = torch.ones(batch, S, dtype=torch.bool)
        rows[1, 4:11] = False
        per_token = True
    idx_m, loss_m, *grads_m = megatron_loss(q, k, w, query, key, True, False, thd, rows, bool(per_token))
    leaves = [t.clone().requires_grad_() for t in (q, k, w)]
    idx, loss = ix.indexer_topk_and_loss(*(squeeze(t, thd) for t in (*leaves, query, key)), TOPK, SCALE, COEFF,
                                         sparse=True, relu=False, backend=backend,
                                         query_valid_rows=None if rows is None else rows.t(),
                                         calculate_per_token_loss=bool(per_token), **ours(thd))
    loss.backward()
    assert torch.equal(idx[None] if thd else idx.transpose(0, 1), idx_m)
    assert_like_megatron((loss, *(t.grad for t in leaves)), (loss_m, *grads_m),
                         truth(q, k, w, query, key, idx_m, True, False, thd, rows, bool(per_token)))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_rotation_matches_megatron(backend, monkeypatch):
    """dsa_indexer_rotate_activation: coreattn's rotate_activation is fast_hadamard_transform's definition
    (checked in tests/test_indexer.py); with it standing in for the CUDA library in Megatron's
    rotate_activation (bf16 only there), the loss and the gradients to the unrotated q and k match."""
    q, k, w, query, key = inputs(B, seed=4)
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    monkeypatch.setattr(dsa, "hadamard_transform", lambda x, scale: ix.hadamard_transform(x, scale, backend=backend))
    results = []
    for rotate in (dsa.rotate_activation, lambda x: ix.rotate_activation(x, backend=backend)):
        leaves = [t.clone().requires_grad_() for t in (q, k, w)]
        qr, kr = rotate(leaves[0]), rotate(leaves[1])
        if rotate is dsa.rotate_activation:
            starts, ends = bounds(False)
            _, loss = dsa.FusedDSAIndexerLoss.apply(qr, leaves[2], kr, query, key.expand(-1, -1, NP, -1), SCALE, TOPK,
                                                    COEFF, None, False, PG, starts, ends, None, None, False, True)
        else:
            loss = ix.indexer_loss(qr, kr, leaves[2], query, key, SCALE, COEFF, layout="sbhd", backend=backend)
        loss.backward()
        results.append((loss.detach(), *(t.grad for t in leaves)))
    (loss_m, *grads_m), (loss, *grads) = results
    assert torch.allclose(loss, loss_m, rtol=1e-6, atol=1e-7)
    for name, mine, theirs in zip(("dq", "dk", "dw"), grads, grads_m):
        ulp = 2 ** -7 * theirs.abs().max().float()  # bf16 gradients: one rounding may differ
        assert (mine.float() - theirs.float()).abs().max() <= ulp, name
