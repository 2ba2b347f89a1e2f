"""A CPU stand-in for torch_npu's DeepSeek Sparse Attention operators, next to tests/fake_torch_npu.py.

``FakeDsaOps(fake)`` adds to a ``FakeTorchNpu``'s module ``npu_sparse_flash_attention`` (+ ``_grad``),
``npu_lightning_indexer`` and ``npu_sparse_lightning_indexer_grad_kl_loss``, each checking the
arguments as torch_npu documents them (names, BSND layouts, dtypes, shapes, contiguity, the index
rows' valid-then-invalid order, the only supported attention_mode / pre_tokens / next_tokens) and
computing its documented result with the float64 oracles (tests/sparse_oracle.py,
tests/indexer_oracle.py); every call is recorded in ``calls`` as ``dict(op=name, **arguments)``.
A flag per operator (``ops``) leaves it out, as a torch_npu without it. ``install`` puts it in
place of torch_npu with the DSA ops' backend choice asked for a stand-in npu device.

The contracts (docs/ascend.md cites each source):
- ``npu_sparse_flash_attention``: absorbed MLA (``attention_mode=2``): q = [query, query_rope],
  k = [key, key_rope], V = value (= key's data), one key head, D 512 + 64, 1..128 query heads
  (powers of two); each query row attends to the keys its index row names up to its first -1
  (token-wise, ``sparse_block_size=1``), ``sparse_mode`` 3 also hides keys past the bottom-right
  diagonal, 0 nothing more; ``scale_value`` multiplies q.k. ``return_softmax_lse`` gives
  softmax_max / softmax_sum ``[B, 1, S1, N1]`` float32: the row's largest scaled logit and the sum
  of exp(logit - max), so lse = max + log(sum) (the unit of the statistics the dense KL loss's
  public reference uses).
- ``npu_sparse_flash_attention_grad``: (dq, dk, dv, dq_rope, dk_rope) of that attention; it checks
  that the statistics and out it is handed are this call's.
- ``npu_lightning_indexer``: score[s, j] = sum_h w[s, h] ReLU(q[s, h] . k[j]), keys past the
  bottom-right diagonal at -inf with ``sparse_mode`` 3; the ``sparse_count`` best, score descending
  (the public reference's torch.sort: masked keys are sorted in at -inf), -1 past the keys.
  Chosen here where the reference leaves it open: equal scores in descending position (the
  opposite of coreattn's rule, so the conversion shows). ``sparse_values`` (documented int32; the
  reference's sorted scores) come back float32.
- ``npu_sparse_lightning_indexer_grad_kl_loss``: sum over rows of KL(target || softmax of the index
  scores) over the keys of the row's index list (up to its first -1, causal mode 3), the target
  being the attention probabilities from the given softmax_max/softmax_sum summed over heads and
  normalized; it checks those statistics against the attention; returns the loss's gradients for
  query_index, key_index, weights and the loss ``[1]`` float32. Its size table: 32, 64 or 128
  attention heads, 8 to 64 index heads, K one of 1,024, 2,048, 3,072 (the table's "3081"), 4,096,
  ..., 8,192, B <= 256, S1 <= 8K, S2 <= 128K.
Not documented, chosen here: an index row with no valid entry gives NaN output, statistics and
query gradients (the caller must not rely on them) and adds nothing to the loss.
"""

from __future__ import annotations

import concurrent.futures
import sys
from typing import NamedTuple

import torch

from indexer_oracle import loss_ref
from sparse_oracle import sparse_attention_ref

UNLIMITED = 2**63 - 1
DIM, ROPE, INDEX_HEADS, INDEX_DIM = 512, 64, 64, 128
QUERY_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
LOSS_HEADS, LOSS_INDEX_HEADS = (32, 64, 128), (8, 16, 32, 64)
LOSS_TOPK = (1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192)
DTYPES = (torch.float16, torch.bfloat16)
OPS = ("npu_sparse_flash_attention", "npu_sparse_flash_attention_grad", "npu_lightning_indexer",
       "npu_sparse_lightning_indexer_grad_kl_loss")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _tensor(name: str, t, shape: tuple, dtypes) -> None:
    _require(isinstance(t, torch.Tensor), f"{name} must be a tensor")
    _require(t.dtype in dtypes, f"{name} has dtype {t.dtype}, expected one of {dtypes}")
    _require(tuple(t.shape) == tuple(shape), f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    _require(t.is_contiguous(), f"{name} must be contiguous (the operators take no strided input)")


def _index_rows(idx: torch.Tensor, seqlen_k: int) -> list[list[int]]:
    """Each row's entries up to its first -1; valid ones first, -1 only after them, all < seqlen_k."""
    rows = []
    for row in idx.reshape(-1, idx.shape[-1]).tolist():
        valid = [j for j in row if j != -1]
        _require(row[:len(valid)] == valid and all(j == -1 for j in row[len(valid):]),
                 f"sparse_indices row {row}: valid entries first, then -1")
        _require(all(0 <= j < seqlen_k for j in valid), f"sparse_indices row {row}: entries in [0, {seqlen_k})")
        rows.append(valid)
    return rows


def _sets(rows: list[list[int]], seqlen_q: int, seqlen_k: int, sparse_mode: int) -> list[list[set]]:
    """Per flat token (b * S1 + s) one key set; mode 3 keeps j <= s + S2 - S1."""
    sets = []
    for n, row in enumerate(rows):
        s = n % seqlen_q
        sets.append([{j for j in row if sparse_mode != 3 or j <= s + seqlen_k - seqlen_q}])
    return sets


def _stats(q: torch.Tensor, k: torch.Tensor, sets, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, lse) float64 ``[N, Hq]`` of scale * q.k over each token's set (NaN for an empty set)."""
    batch, seqlen_k = k.shape[:2]
    seqlen_q = q.shape[0] // batch
    maxes, lses = [], []
    for n, (keys,) in enumerate(sets):
        if not keys:
            maxes.append(q.new_full((q.shape[1],), float("nan"), dtype=torch.float64))
            lses.append(maxes[-1])
            continue
        sel = k[n // seqlen_q, sorted(keys), 0].double()  # [E, D]
        logits = q[n].double() @ sel.t() * scale  # [Hq, E]
        maxes.append(logits.amax(-1))
        lses.append(torch.logsumexp(logits, -1))
    return torch.stack(maxes), torch.stack(lses)


def _check_stats(q, k, sets, scale, softmax_max, softmax_sum, shape) -> list[bool]:
    """The statistics handed in are this attention's (max + log(sum) = its lse where a row has keys);
    returns which rows have keys."""
    for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        _tensor(name, t, shape, (torch.float32,))
    full = [bool(s[0]) for s in sets]
    _, lse = _stats(q, k, sets, scale)
    given = (softmax_max.double() + torch.log(softmax_sum.double())).view(-1, shape[-1])
    mask = torch.tensor(full)
    _require(torch.allclose(given[mask], lse[mask], rtol=1e-5, atol=1e-5),
             "softmax_max/softmax_sum are not this attention's softmax statistics over these indices")
    return full


def _with_autograd(fn):
    """``fn()`` on a fresh thread: a custom op's kernel runs below autograd (thread-local dispatch
    state), so the oracle's gradients are taken where autograd records."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


class FakeDsaOps:
    def __init__(self, fake, ops=OPS):
        self.calls: list[dict] = []
        for name in ops:
            setattr(fake.module, name, getattr(self, name))

    def _record(self, op: str, **args) -> None:
        self.calls.append(dict(op=op, **args))

    def of(self, op: str) -> list[dict]:
        return [c for c in self.calls if c["op"] == op]

    # ---- sparse flash attention ----------------------------------------------------------------

    @staticmethod
    def _check_sfa(query, key, value, sparse_indices, query_rope, key_rope, layout_q, layout_kv, sparse_block_size,
                   sparse_mode, pre_tokens, next_tokens, attention_mode, lengths):
        if layout_q != "BSND" or layout_kv != "BSND":
            raise NotImplementedError(f"the fake implements BSND, not {layout_q}/{layout_kv}")
        _require(attention_mode == 2, f"attention_mode {attention_mode}: only 2 (MLA-absorb) is supported")
        _require(query_rope is not None and key_rope is not None, "attention_mode 2 needs query_rope and key_rope")
        _require(sparse_block_size == 1, "the fake implements sparse_block_size 1 (token-wise)")
        _require(sparse_mode in (0, 3), f"sparse_mode {sparse_mode}: 0 or 3")
        _require(pre_tokens == UNLIMITED and next_tokens == UNLIMITED, "pre_tokens/next_tokens: defaults only")
        if any(x is not None for x in lengths):
            raise NotImplementedError("the fake implements actual_seq_lengths None (the whole S)")
        _require(query.dim() == 4 and key.dim() == 4, "BSND query and key")
        batch, seqlen_q, heads = query.shape[:3]
        seqlen_k = key.shape[1]
        _require(heads in QUERY_HEADS, f"N1 = {heads}: one of {QUERY_HEADS}")
        _tensor("query", query, (batch, seqlen_q, heads, DIM), DTYPES)
        _tensor("key", key, (batch, seqlen_k, 1, DIM), (query.dtype,))
        _tensor("value", value, key.shape, (query.dtype,))
        _require(value.data_ptr() == key.data_ptr(), "attention_mode 2: key and value share one tensor's data")
        _tensor("query_rope", query_rope, (batch, seqlen_q, heads, ROPE), (query.dtype,))
        _tensor("key_rope", key_rope, (batch, seqlen_k, 1, ROPE), (query.dtype,))
        _require(sparse_indices.dim() == 4 and sparse_indices.shape[-1] > 0, "sparse_indices [B, S1, 1, K], K > 0")
        _tensor("sparse_indices", sparse_indices, (batch, seqlen_q, 1, sparse_indices.shape[-1]), (torch.int32,))
        rows = _index_rows(sparse_indices, seqlen_k)
        q = torch.cat([query, query_rope], -1).reshape(batch * seqlen_q, heads, DIM + ROPE)
        k = torch.cat([key, key_rope], -1)  # [B, S2, 1, 576]
        sample = [n // seqlen_q for n in range(batch * seqlen_q)]
        return q, k, _sets(rows, seqlen_q, seqlen_k, sparse_mode), sample

    def npu_sparse_flash_attention(self, query, key, value, sparse_indices, scale_value, *, block_table=None,
                                   actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                                   key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                                   sparse_mode=3, pre_tokens=UNLIMITED, next_tokens=UNLIMITED, attention_mode=0,
                                   return_softmax_lse=False):
        self._record("npu_sparse_flash_attention", query=query, key=key, value=value, sparse_indices=sparse_indices,
                     scale_value=scale_value, layout_query=layout_query, layout_kv=layout_kv, sparse_mode=sparse_mode,
                     attention_mode=attention_mode, return_softmax_lse=return_softmax_lse,
                     actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_kv=actual_seq_lengths_kv)
        _require(block_table is None, "the fake implements no PageAttention (block_table)")
        q, k, sets, sample = self._check_sfa(query, key, value, sparse_indices, query_rope, key_rope, layout_query,
                                             layout_kv, sparse_block_size, sparse_mode, pre_tokens, next_tokens,
                                             attention_mode, (actual_seq_lengths_query, actual_seq_lengths_kv))
        out, lse = sparse_attention_ref(q, k, None, sets, sample, v_head_dim=DIM, softmax_scale=scale_value)
        empty = torch.tensor([not s[0] for s in sets])
        out = out.masked_fill(empty[:, None, None], float("nan")).to(query.dtype).view(*query.shape)
        if not return_softmax_lse:
            return out, query.new_empty(0, dtype=torch.float32), query.new_empty(0, dtype=torch.float32)
        smax, lse = _stats(q, k, sets, scale_value)
        batch, seqlen_q, heads = query.shape[:3]
        shape = (batch, 1, seqlen_q, heads)
        return out, smax.float().view(shape), torch.exp(lse - smax).float().view(shape)

    def npu_sparse_flash_attention_grad(self, query, key, value, sparse_indices, d_out, out, softmax_max, softmax_sum,
                                        scale_value, sparse_block_size, query_rope=None, key_rope=None,
                                        actual_seq_qlen=None, actual_seq_kvlen=None, layout="BSND", sparse_mode=3,
                                        pre_tokens=UNLIMITED, next_tokens=UNLIMITED, attention_mode=0):
        self._record("npu_sparse_flash_attention_grad", sparse_indices=sparse_indices, layout=layout,
                     sparse_mode=sparse_mode, attention_mode=attention_mode, scale_value=scale_value,
                     softmax_max=softmax_max, softmax_sum=softmax_sum)
        q, k, sets, sample = self._check_sfa(query, key, value, sparse_indices, query_rope, key_rope, layout, layout,
                                             sparse_block_size, sparse_mode, pre_tokens, next_tokens, attention_mode,
                                             (actual_seq_qlen, actual_seq_kvlen))
        batch, seqlen_q, heads = query.shape[:3]
        _tensor("d_out", d_out, query.shape, (query.dtype,))
        _tensor("out", out, query.shape, (query.dtype,))
        full = _check_stats(q, k, sets, scale_value, softmax_max, softmax_sum, (batch, 1, seqlen_q, heads))
        def oracle_grads():
            leaves = [t.detach().double().requires_grad_() for t in (query, key, value, query_rope, key_rope)]
            qn, kn, v, qr, kr = leaves
            ref, _ = sparse_attention_ref(torch.cat([qn, qr], -1).view(-1, heads, DIM + ROPE),
                                          torch.cat([kn, kr], -1), v, sets, sample, softmax_scale=scale_value)
            ref = ref.view(query.shape)
            grads = torch.autograd.grad(ref, leaves, d_out.double(), allow_unused=True)
            return ref.detach(), [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]

        ref_out, grads = _with_autograd(oracle_grads)
        rows = torch.tensor(full).view(batch, seqlen_q)
        _require(torch.allclose(out.double()[rows], ref_out[rows], rtol=2e-2, atol=2e-2),
                 "out is not this call's attention output")
        poison = ~rows[..., None, None]
        dq, dk, dv, dq_rope, dk_rope = grads
        return (dq.masked_fill(poison, float("nan")).to(query.dtype), dk.to(key.dtype), dv.to(key.dtype),
                dq_rope.masked_fill(poison, float("nan")).to(query.dtype), dk_rope.to(key.dtype))

    # ---- lightning indexer ---------------------------------------------------------------------

    @staticmethod
    def _check_index_side(query, key, weights, heads=(INDEX_HEADS,)):
        _require(query.dim() == 4 and query.shape[2] in heads, f"BSND query of {heads} heads")
        batch, seqlen_q, n_heads = query.shape[:3]
        _tensor("query", query, (batch, seqlen_q, n_heads, INDEX_DIM), DTYPES)
        _require(key.dim() == 4, "BSND key")
        _tensor("key", key, (batch, key.shape[1], 1, INDEX_DIM), (query.dtype,))
        _tensor("weights", weights, (batch, seqlen_q, n_heads), (query.dtype,))

    def npu_lightning_indexer(self, query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                              block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048,
                              sparse_mode=3, pre_tokens=UNLIMITED, next_tokens=UNLIMITED, return_value=False):
        self._record("npu_lightning_indexer", query=query, key=key, weights=weights, layout_query=layout_query,
                     layout_key=layout_key, sparse_count=sparse_count, sparse_mode=sparse_mode,
                     return_value=return_value, actual_seq_lengths_query=actual_seq_lengths_query,
                     actual_seq_lengths_key=actual_seq_lengths_key)
        if layout_query != "BSND" or layout_key != "BSND":
            raise NotImplementedError(f"the fake implements BSND, not {layout_query}/{layout_key}")
        if actual_seq_lengths_query is not None or actual_seq_lengths_key is not None or block_table is not None:
            raise NotImplementedError("the fake implements whole rows (no lengths, no PageAttention)")
        self._check_index_side(query, key, weights)
        _require(isinstance(sparse_count, int) and 1 <= sparse_count <= 2048, f"sparse_count {sparse_count}: 1..2048")
        _require(sparse_mode in (0, 3), f"sparse_mode {sparse_mode}: 0 or 3")
        _require(pre_tokens == UNLIMITED and next_tokens == UNLIMITED, "pre_tokens/next_tokens: defaults only")
        from indexer_oracle import index_scores

        scores = index_scores(query, key[:, :, 0], weights, relu=True)  # [B, S1, S2] float64
        seqlen_q, seqlen_k = scores.shape[1:]
        if sparse_mode == 3:
            s = torch.arange(seqlen_q)[:, None]
            scores = scores.masked_fill(torch.arange(seqlen_k)[None, :] > s + seqlen_k - seqlen_q, float("-inf"))
        # score descending, equal scores by descending position (left open by the reference)
        order = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices
        order = seqlen_k - 1 - order
        take = min(sparse_count, seqlen_k)
        idx = torch.full(scores.shape[:2] + (sparse_count,), -1, dtype=torch.int32)
        values = torch.full(idx.shape, float("-inf"), dtype=torch.float32)
        idx[..., :take] = order[..., :take].to(torch.int32)
        values[..., :take] = scores.gather(-1, order[..., :take]).float()
        return idx[:, :, None], (values[:, :, None] if return_value else values.new_empty(0))

    # ---- sparse indexer loss -------------------------------------------------------------------

    def npu_sparse_lightning_indexer_grad_kl_loss(self, query, key, query_index, key_index, weights, sparse_indices,
                                                  softmax_max, softmax_sum, scale_value, *, query_rope=None,
                                                  key_rope=None, actual_seq_qlen=None, actual_seq_klen=None,
                                                  layout="BSND", sparse_mode=3, pre_tokens=UNLIMITED,
                                                  next_tokens=UNLIMITED):
        self._record("npu_sparse_lightning_indexer_grad_kl_loss", query=query, key=key, query_index=query_index,
                     key_index=key_index, weights=weights, sparse_indices=sparse_indices, scale_value=scale_value,
                     layout=layout, sparse_mode=sparse_mode, actual_seq_qlen=actual_seq_qlen,
                     actual_seq_klen=actual_seq_klen)
        _require(sparse_mode == 3, f"sparse_mode {sparse_mode}: the documented 3")
        q, k, sets, sample = self._check_sfa(query, key, key, sparse_indices, query_rope, key_rope, layout, layout, 1,
                                             sparse_mode, pre_tokens, next_tokens, 2,
                                             (actual_seq_qlen, actual_seq_klen))
        self._check_index_side(query_index, key_index, weights, LOSS_INDEX_HEADS)
        _require(query_index.shape[:2] == query.shape[:2] and key_index.shape[:2] == key.shape[:2],
                 "index side and attention side cover the same tokens")
        batch, seqlen_q, heads = query.shape[:3]
        seqlen_k = key.shape[1]
        _require(heads in LOSS_HEADS, f"N1 = {heads}: one of {LOSS_HEADS}")
        _require(sparse_indices.shape[-1] in LOSS_TOPK, f"K = {sparse_indices.shape[-1]}: one of {LOSS_TOPK}")
        _require(batch <= 256 and seqlen_q <= 8 * 1024 and seqlen_k <= 128 * 1024, "B <= 256, S1 <= 8K, S2 <= 128K")
        _check_stats(q, k, sets, scale_value, softmax_max, softmax_sum, (batch, 1, seqlen_q, heads))
        lo = [[0] * seqlen_q for _ in range(batch)]
        hi = [[max(0, min(seqlen_k, s + 1 + seqlen_k - seqlen_q)) for s in range(seqlen_q)] for _ in range(batch)]
        chosen = torch.tensor([sorted(s[0]) + [-1] * (sparse_indices.shape[-1] - len(s[0])) for s in sets])

        def oracle_grads():
            leaves = [t.detach().double().requires_grad_() for t in (query_index, key_index[:, :, 0], weights)]
            loss = loss_ref(*leaves, torch.cat([query, query_rope], -1), torch.cat([key, key_rope], -1), lo, hi,
                            scale_value, 1.0, sparse=True, topk_indices=chosen.view(batch, seqlen_q, -1), relu=True,
                            per_token=True)
            grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else (None,) * 3
            return loss.detach(), [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]

        loss, (dq, dk, dw) = _with_autograd(oracle_grads)
        dtype = query_index.dtype
        return dq.to(dtype), dk[:, :, None].to(dtype), dw.to(dtype), loss.float().reshape(1)


class Device(NamedTuple):
    """Stands in for torch.device("npu"), which needs torch_npu to exist."""

    type: str
    index: int | None = 0


NPU = Device("npu")


def install(monkeypatch, ops=OPS) -> FakeDsaOps:
    """A stand-in torch_npu (tests/fake_torch_npu.py's, with ``ops``) as ``torch_npu``, and the DSA ops'
    backend choice (sparse attention, the indexer's steps) asked for an npu device, so CPU tensors
    stand in for npu ones. Callers clear ``coreattn.kernels.npu``'s cache when done."""
    from coreattn.kernels import npu
    from coreattn.layers import backends
    from coreattn.layers.dsa import sparse_function
    from coreattn.layers.dsa.indexer import function, ops as indexer_ops
    from fake_torch_npu import FakeTorchNpu

    fake = FakeTorchNpu()
    dsa = FakeDsaOps(fake, ops)
    monkeypatch.setitem(sys.modules, "torch_npu", fake.module)
    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    npu.cache_clear()
    monkeypatch.setattr(sparse_function, "select_sparse_backend",
                        lambda device, override=None, unfit=None, triton_unfit=None:
                        backends.select_sparse_backend(NPU, override, unfit, triton_unfit))
    monkeypatch.setattr(indexer_ops, "indexer_backend",
                        lambda device, override=None, **kw: function.indexer_backend(NPU, override, **kw))
    return dsa
