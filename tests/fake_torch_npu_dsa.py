"""A CPU stand-in for torch_npu's DeepSeek Sparse Attention operators, next to tests/fake_torch_npu.py.

``FakeDsaOps(fake)`` adds to a ``FakeTorchNpu``'s module ``npu_sparse_flash_attention`` (+ ``_grad``),
``npu_lightning_indexer`` and ``npu_sparse_lightning_indexer_grad_kl_loss``. Each rejects what its
documentation rejects (argument names, BSND layouts, dtypes, shapes, contiguity, sizes, the only
supported modes) and computes what its kernel computes, reading the index rows as the kernel reads
them, in float64; every call is recorded in ``calls`` as ``dict(op=name, **arguments)``. Options:
``ops`` leaves an operator out (a torch_npu without it); ``unsupported`` makes an operator raise what
torch_npu raises when the installed CANN has no kernel for it; ``errors`` makes one raise another
RuntimeError (a real error); ``soc`` is the chip ``torch_npu.npu.get_device_name`` reports (an
operator called on a chip its kernel is not built for raises as its tiling does). ``install`` puts
it in place of torch_npu with the DSA ops' backend choice asked for a stand-in npu device.

Sources (docs/ascend.md links each): OPS = cann ops-transformer, read at its public mirror
github.com/yuanfang-chen/ops-transformer at the commit named; PAGES = torch_npu's pages in
Ascend/op-plugin (docs/zh/custom_APIs/torch_npu/) and the aclnn pages in OPS.

- ``npu_sparse_flash_attention`` (page; kernel OPS attention/sparse_flash_attention/op_kernel/
  sparse_flash_attention_service_vector_mla.h @ 0c29b4ee): absorbed MLA (``attention_mode=2``):
  q = [query, query_rope], k = [key, key_rope], V = value (= key's data), one key head, D 512 + 64,
  1..128 query heads (powers of two); a row's entries are gathered up to its first -1 and the slots
  not filled get no weight (ElewiseCompute: -inf past the gathered count); ``sparse_mode`` 3 also
  hides keys past the bottom-right diagonal, 0 nothing more; ``scale_value`` multiplies q.k before
  the softmax, so softmax_max / softmax_sum ``[B, 1, S1, N1]`` float32 are the row's largest scaled
  logit and the sum of exp(logit - max); a row with no key gets max -2e38 and sum 0
  (CopyFALseToGm). Its output there is not documented: NaN here.
- ``npu_sparse_flash_attention_grad`` (page: aclnnSparseFlashAttentionGrad.md @ 3f69a4f6: B
  1..256, S1 and S2 1..128K, K 2048, N1 powers of two up to 128; kernel OPS attention/
  sparse_flash_attention_grad/op_kernel/arch32/sparse_flash_attention_grad_bs1_basic.h @ 2e37897b
  GetActualSelCount, basic_modules/vec_op.h @ 044e88c5 GatherKV and CalSoftmax): row s reads
  ``min(K, S2)`` slots (sparse_mode 0) or ``min(K, max(S2 - S1 + s + 1, 0))`` (3) whatever they
  hold: each slot's index is added to the sample's first key row unchecked (a -1 gathers the row
  before the sample: another sample's key, or outside the tensor: NaN here), and the softmax over
  those slots uses the softmax_max / softmax_sum handed in (block size 1 masks nothing); dk and dv
  are scattered to the slots' indices where they are >= 0. (An older kernel, vec_op.h @ 3b632b4f,
  stopped at the first -1.)
- ``npu_lightning_indexer`` (pages; OPS attention/lightning_indexer/op_host/lightning_indexer_def.cpp
  @ 23d403a4, lightning_indexer_tiling.cpp @ 0307b980): score[s, j] = sum_h w[s, h] ReLU(q[s, h] . k[j]),
  keys past the bottom-right diagonal at -inf with ``sparse_mode`` 3; 1..64 heads of 128,
  ``sparse_count`` 1..2048 or a multiple of 1024 up to 8192, weights of the query's dtype; the
  ``sparse_count`` best, score descending (the public reference's torch.sort: masked keys are sorted
  in at -inf), -1 past the keys; ``sparse_values`` in the query's dtype. Chosen here where the
  reference leaves it open: equal scores in descending position (the opposite of coreattn's rule,
  so the conversion shows).
- ``npu_sparse_lightning_indexer_grad_kl_loss`` (page; kernel OPS attention/
  sparse_lightning_indexer_grad_kl_loss/op_kernel/arch32/sparse_lightning_indexer_grad_kl_loss_base.h
  @ 2d3c2212 GetRunInfo, ..._vector.h @ b1498789 MergeKv, VectorP, VectorSy, VectorLoss,
  VectorDwDqDk): row s of each BSND sample reads ``n = min(K, max(S2 - S1 + s + 1, 0))`` slots (0
  in any mode but 3). Its gather fills them in order with the row's entries below that count,
  skipping larger ones and stopping at the first negative one; the slots it leaves unfilled keep
  stale workspace (here: the keys at positions 0, 1, ... of the sample, key and index key alike),
  and every one of the n slots enters the loss and the gradients. Target P = the mean over the
  attention heads of exp(scale * q.k - softmax_max) / softmax_sum as handed in; indexer y = softmax
  over the slots of sum_h w_h ReLU(q_index[h] . k_index); loss = sum over rows and slots of
  max(P, 1e-8) (log max(P, 1e-8) - log max(y, 1e-8)); the gradients come from y - P (unclamped), dk
  scattered to the slot's own index where that is in [0, n). Its size table: 32, 64 or 128
  attention heads, 8 to 64 index heads, K one of 1,024, 2,048, 3,072 (the table's "3081"), 4,096,
  ..., 8,192, B <= 256, S1 <= 8K, S2 <= 128K.
- Chips (op definitions and tilings above): the four as coreattn calls them run on Atlas A2
  ("Ascend910B...") and A3 ("Ascend910_93..."); elsewhere a call raises the tiling's "SOC
  Version[N] is not support."
"""

from __future__ import annotations

import sys
import types
from typing import NamedTuple

import torch

UNLIMITED = 2**63 - 1
DIM, ROPE, INDEX_HEADS, INDEX_DIM = 512, 64, 64, 128
QUERY_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
LOSS_HEADS, LOSS_INDEX_HEADS = (32, 64, 128), (8, 16, 32, 64)
LOSS_TOPK = (1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192)
GRAD_TOPK, GRAD_MAX_BATCH, GRAD_MAX_SEQLEN = 2048, 256, 128 * 1024
DTYPES = (torch.float16, torch.bfloat16)
OPS = ("npu_sparse_flash_attention", "npu_sparse_flash_attention_grad", "npu_lightning_indexer",
       "npu_sparse_lightning_indexer_grad_kl_loss")
ACLNN = {"npu_sparse_flash_attention": "aclnnSparseFlashAttention",
         "npu_sparse_flash_attention_grad": "aclnnSparseFlashAttentionGrad",
         "npu_lightning_indexer": "aclnnLightningIndexer",
         "npu_sparse_lightning_indexer_grad_kl_loss": "aclnnSparseLightningIndexerGradKLLoss"}
CHIPS = ("ascend910b", "ascend910_93")  # the SoC families every operator here is built for, as coreattn calls it
SOFTMAX_MIN = -2e38  # the forward's softmax_max of a row with no key
CLAMP = 1e-8  # the loss kernel's floor on both distributions


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _tensor(name: str, t, shape: tuple, dtypes) -> None:
    _require(isinstance(t, torch.Tensor), f"{name} must be a tensor")
    _require(t.dtype in dtypes, f"{name} has dtype {t.dtype}, expected one of {dtypes}")
    _require(tuple(t.shape) == tuple(shape), f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    _require(t.is_contiguous(), f"{name} must be contiguous (the operators take no strided input)")


def _valid_first(idx: torch.Tensor, seqlen_k: int) -> list[list[int]]:
    """The forward's rows: valid entries first, -1 only after them (its page), all < seqlen_k; each row's
    entries up to its first -1 (what its kernel gathers)."""
    rows = []
    for row in idx.reshape(-1, idx.shape[-1]).tolist():
        valid = [j for j in row if j != -1]
        _require(row[:len(valid)] == valid and all(j == -1 for j in row[len(valid):]),
                 f"sparse_indices row {row}: valid entries first, then -1")
        _require(all(0 <= j < seqlen_k for j in valid), f"sparse_indices row {row}: entries in [0, {seqlen_k})")
        rows.append(valid)
    return rows


def _causal_count(s: int, seqlen_q: int, seqlen_k: int) -> int:
    """RightDown mode's key count of row s of a sample: max(S2 - S1 + s + 1, 0)."""
    return max(seqlen_k - seqlen_q + s + 1, 0)


class Device(NamedTuple):
    """Stands in for torch.device("npu"), which needs torch_npu to exist."""

    type: str
    index: int | None = 0


NPU = Device("npu")


class FakeDsaOps:
    def __init__(self, fake, ops=OPS, *, unsupported=(), errors=None, soc: str = "Ascend910B3"):
        self.calls: list[dict] = []
        self.unsupported = set(unsupported)
        self.errors = dict(errors or {})
        self.soc = soc
        fake.module.npu = types.SimpleNamespace(get_device_name=lambda index=0: self.soc, current_device=lambda: 0)
        for name in ops:
            setattr(fake.module, name, getattr(self, name))

    def _record(self, op: str, **args) -> None:
        self.calls.append(dict(op=op, **args))
        if op in self.unsupported:  # op-plugin's EXEC_NPU_CMD when libopapi.so has no such aclnn symbol
            raise RuntimeError(f"{ACLNN[op]} or {ACLNN[op]}GetWorkspaceSize not in libopapi.so, or libopapi.so"
                               "not found.")
        if op in self.errors:
            raise RuntimeError(self.errors[op])
        if not self.soc.lower().startswith(CHIPS):
            raise RuntimeError(f"call {ACLNN[op]} failed, detail: E89999: SOC Version[2] is not support.")

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
        q = torch.cat([query, query_rope], -1).double()  # [B, S1, N1, 576]
        k = torch.cat([key, key_rope], -1)[:, :, 0].double()  # [B, S2, 576]
        return q, k

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
        q, k = self._check_sfa(query, key, value, sparse_indices, query_rope, key_rope, layout_query, layout_kv,
                               sparse_block_size, sparse_mode, pre_tokens, next_tokens, attention_mode,
                               (actual_seq_lengths_query, actual_seq_lengths_kv))
        batch, seqlen_q, heads = query.shape[:3]
        seqlen_k = key.shape[1]
        rows = _valid_first(sparse_indices, seqlen_k)
        out = torch.full((batch, seqlen_q, heads, DIM), float("nan"), dtype=torch.float64)
        smax = torch.full((batch, seqlen_q, heads), SOFTMAX_MIN, dtype=torch.float64)
        ssum = torch.zeros_like(smax)
        for n, row in enumerate(rows):
            b, s = divmod(n, seqlen_q)
            keys = sorted({j for j in row if sparse_mode != 3 or j < _causal_count(s, seqlen_q, seqlen_k)})
            if not keys:
                continue
            logits = q[b, s] @ k[b, keys].t() * scale_value  # [N1, E]
            smax[b, s] = logits.amax(-1)
            e = torch.exp(logits - smax[b, s, :, None])
            ssum[b, s] = e.sum(-1)
            out[b, s] = (e / ssum[b, s, :, None]) @ k[b, keys, :DIM]
        out = out.to(query.dtype)
        if not return_softmax_lse:
            return out, query.new_empty(0, dtype=torch.float32), query.new_empty(0, dtype=torch.float32)
        return out, smax.float()[:, None].contiguous(), ssum.float()[:, None].contiguous()

    def npu_sparse_flash_attention_grad(self, query, key, value, sparse_indices, d_out, out, softmax_max, softmax_sum,
                                        scale_value, sparse_block_size, query_rope=None, key_rope=None,
                                        actual_seq_qlen=None, actual_seq_kvlen=None, layout="BSND", sparse_mode=3,
                                        pre_tokens=UNLIMITED, next_tokens=UNLIMITED, attention_mode=0):
        self._record("npu_sparse_flash_attention_grad", sparse_indices=sparse_indices, layout=layout,
                     sparse_mode=sparse_mode, attention_mode=attention_mode, scale_value=scale_value,
                     softmax_max=softmax_max, softmax_sum=softmax_sum, key=key, d_out=d_out, out=out)
        q, k = self._check_sfa(query, key, value, sparse_indices, query_rope, key_rope, layout, layout,
                               sparse_block_size, sparse_mode, pre_tokens, next_tokens, attention_mode,
                               (actual_seq_qlen, actual_seq_kvlen))
        batch, seqlen_q, heads = query.shape[:3]
        seqlen_k, width = key.shape[1], sparse_indices.shape[-1]
        _require(batch <= GRAD_MAX_BATCH, f"B = {batch}: 1..{GRAD_MAX_BATCH}")
        _require(seqlen_q <= GRAD_MAX_SEQLEN and seqlen_k <= GRAD_MAX_SEQLEN, "S1, S2: 1..128K")
        _require(width == GRAD_TOPK, f"sparse_indices K = {width}: {GRAD_TOPK}")
        _tensor("d_out", d_out, query.shape, (query.dtype,))
        _tensor("out", out, query.shape, (query.dtype,))
        for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
            _tensor(name, t, (batch, 1, seqlen_q, heads), (torch.float32,))
        lse = (softmax_max.double() + torch.log(softmax_sum.double()))[:, 0]  # [B, S1, N1]
        flat_k = k.reshape(batch * seqlen_k, -1)
        idx = sparse_indices.reshape(batch, seqlen_q, width).tolist()
        do, o = d_out.double(), out.double()
        dq = torch.zeros_like(q)
        dk = torch.zeros(batch, seqlen_k, DIM + ROPE, dtype=torch.float64)
        dv = torch.zeros(batch, seqlen_k, DIM, dtype=torch.float64)
        for b in range(batch):
            for s in range(seqlen_q):
                n = min(width, seqlen_k if sparse_mode == 0 else _causal_count(s, seqlen_q, seqlen_k))
                if n == 0:
                    continue
                slots = idx[b][s][:n]
                rows = [b * seqlen_k + j for j in slots]  # unchecked: the sample's first key row plus the index
                ks = torch.stack([flat_k[r] if 0 <= r < flat_k.shape[0] else torch.full_like(flat_k[0], float("nan"))
                                  for r in rows])  # [n, 576]
                p = torch.exp(q[b, s] @ ks.t() * scale_value - lse[b, s, :, None])  # [N1, n]
                dp = do[b, s] @ ks[:, :DIM].t()
                ds = p * (dp - (do[b, s] * o[b, s]).sum(-1, keepdim=True))
                dq[b, s] = ds @ ks * scale_value
                for t, j in enumerate(slots):
                    if j >= 0 and b * seqlen_k + j < batch * seqlen_k:
                        bb, jj = divmod(b * seqlen_k + j, seqlen_k)
                        dk[bb, jj] += ds[:, t] @ q[b, s] * scale_value
                        dv[bb, jj] += p[:, t] @ do[b, s]
        dtype = query.dtype
        return (dq[..., :DIM].to(dtype), dk[:, :, None, :DIM].to(dtype), dv[:, :, None].to(dtype),
                dq[..., DIM:].to(dtype), dk[:, :, None, DIM:].to(dtype))

    # ---- lightning indexer ---------------------------------------------------------------------

    @staticmethod
    def _check_index_side(query, key, weights, heads=tuple(range(1, INDEX_HEADS + 1))):
        _require(query.dim() == 4 and query.shape[2] in heads, f"BSND query of {heads[0]}..{heads[-1]} heads")
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
        _require(isinstance(sparse_count, int) and (1 <= sparse_count <= 2048 or (
            sparse_count <= 8192 and sparse_count % 1024 == 0)),
            f"sparse_count {sparse_count}: 1..2048, or a multiple of 1024 up to 8192")
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
        values = torch.full(idx.shape, float("-inf"), dtype=torch.float64)
        idx[..., :take] = order[..., :take].to(torch.int32)
        values[..., :take] = scores.gather(-1, order[..., :take])
        return idx[:, :, None], (values.to(query.dtype)[:, :, None] if return_value else values.new_empty(0))

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
        q, k = self._check_sfa(query, key, key, sparse_indices, query_rope, key_rope, layout, layout, 1, sparse_mode,
                               pre_tokens, next_tokens, 2, (actual_seq_qlen, actual_seq_klen))
        self._check_index_side(query_index, key_index, weights, LOSS_INDEX_HEADS)
        _require(query_index.shape[:2] == query.shape[:2] and key_index.shape[:2] == key.shape[:2],
                 "index side and attention side cover the same tokens")
        batch, seqlen_q, heads = query.shape[:3]
        seqlen_k, width = key.shape[1], sparse_indices.shape[-1]
        _require(heads in LOSS_HEADS, f"N1 = {heads}: one of {LOSS_HEADS}")
        _require(width in LOSS_TOPK, f"K = {width}: one of {LOSS_TOPK}")
        _require(batch <= 256 and seqlen_q <= 8 * 1024 and seqlen_k <= 128 * 1024, "B <= 256, S1 <= 8K, S2 <= 128K")
        for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
            _tensor(name, t, (batch, 1, seqlen_q, heads), (torch.float32,))
        smax, ssum = softmax_max[:, 0].double(), softmax_sum[:, 0].double()  # [B, S1, N1]
        qi, ki, w = query_index.double(), key_index[:, :, 0].double(), weights.double()
        idx = sparse_indices.reshape(batch, seqlen_q, width).tolist()
        loss = torch.zeros((), dtype=torch.float64)
        dqi, dki, dw = torch.zeros_like(qi), torch.zeros_like(ki), torch.zeros_like(w)
        for b in range(batch):
            for s in range(seqlen_q):
                count = _causal_count(s, seqlen_q, seqlen_k)  # GetS2SparseLen, RightDown
                n = min(width, count)
                if n == 0:
                    continue
                row = idx[b][s][:n]
                gathered = []
                for j in row:  # MergeKv: stop at a negative entry, skip entries >= count
                    if j < 0:
                        break
                    if j < count:
                        gathered.append(j)
                keys = gathered + list(range(n - len(gathered)))  # unfilled slots: stale workspace
                logits = q[b, s] @ k[b, keys].t() * scale_value  # [N1, n]
                target = (torch.exp(logits - smax[b, s, :, None]) / ssum[b, s, :, None]).mean(0)  # VectorP
                x = ki[b, keys] @ qi[b, s].t()  # [n, H_I]
                y = torch.softmax((x.clamp_min(0) * w[b, s]).sum(-1), 0)  # VectorSy
                tc, yc = target.clamp_min(CLAMP), y.clamp_min(CLAMP)
                loss = loss + (tc * (torch.log(tc) - torch.log(yc))).sum()  # VectorLoss
                dz = y - target  # VectorDwDqDk: Sub(y, P), no clamp
                gate = dz[:, None] * w[b, s] * (x > 0)  # [n, H_I]
                dw[b, s] = (dz[:, None] * x.clamp_min(0)).sum(0)
                dqi[b, s] = gate.t() @ ki[b, keys]
                for t, j in enumerate(row):  # ScatterAdd: by the slot's own index, where it is in [0, count)
                    if 0 <= j < count:
                        dki[b, j] += gate[t] @ qi[b, s]
        dtype = query_index.dtype
        return dqi.to(dtype), dki[:, :, None].to(dtype), dw.to(weights.dtype), loss.float().reshape(1)


def install(monkeypatch, ops=OPS, **options) -> FakeDsaOps:
    """A stand-in torch_npu (tests/fake_torch_npu.py's, with ``ops`` and FakeDsaOps' ``options``) as
    ``torch_npu``, and the DSA ops' backend choice (sparse attention, the indexer's steps) asked for an
    npu device, so CPU tensors stand in for npu ones; the choices are logged afresh. Callers clear
    ``coreattn.kernels.npu``'s cache when done."""
    from coreattn.kernels import npu
    from coreattn.layers import backends
    from coreattn.layers.dsa import sparse_function
    from coreattn.layers.dsa.indexer import function, ops as indexer_ops
    from fake_torch_npu import FakeTorchNpu

    fake = FakeTorchNpu()
    dsa = FakeDsaOps(fake, ops, **options)
    monkeypatch.setitem(sys.modules, "torch_npu", fake.module)
    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    monkeypatch.setattr(backends, "_logged", set())  # each test sees its choices logged
    npu.cache_clear()
    monkeypatch.setattr(sparse_function, "select_sparse_backend",
                        lambda device, override=None, unfit=None, **kw: backends.select_sparse_backend(NPU, override,
                                                                                                      unfit, **kw))
    monkeypatch.setattr(indexer_ops, "indexer_backend",
                        lambda device, override=None, **kw: function.indexer_backend(NPU, override, **kw))
    return dsa
