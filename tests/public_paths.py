"""Every public attention path, forward and backward on the Triton backend, as one function per path
(``PATHS``): what tests/test_no_host_sync.py runs under the CPU host-read detector and
tests/test_gpu.py under ``torch.cuda.set_sync_debug_mode("error")``. Each takes the device and a
context-parallel group (a one-rank group on CPU; None on a GPU, cp_attn's no-CP path).
"""

from __future__ import annotations

import pytest
import torch

import coreattn
from coreattn import masks
from coreattn.kernels.packing import Packing
from coreattn.layers import function
from coreattn.layers.checks import VarlenParams

HQ, HKV, D = 2, 1, 16


def _cu(device):
    return torch.tensor([0, 5, 5, 12, 19], dtype=torch.int32, device=device)


def _qkv(device, tokens=19, lead=(), dtype=None):
    dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    gen = torch.Generator().manual_seed(0)
    shapes = ((*lead, tokens, HQ, D), (*lead, tokens, HKV, D), (*lead, tokens, HKV, D))
    return tuple(torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_() for s in shapes)


def _backward(out, *leaves):
    torch.autograd.grad(out.float().square().sum(), [x for x in leaves if x.requires_grad])


def _sbhd(x):
    return x.detach().transpose(0, 1).requires_grad_()


def varlen_plain(device, group):
    q, k, v = _qkv(device)
    max_len = torch.tensor(7, device=device)  # a 0-dim tensor: never read
    out = coreattn.varlen_attn(q, k, v, _cu(device), _cu(device), max_len, max_len, causal=True, backend="triton")
    _backward(out, q, k, v)
    out = coreattn.flash_attn_varlen_func(q, k, v, _cu(device), _cu(device), max_len, max_len, causal=True)
    _backward(out, q, k, v)


def varlen_seqused_dropout(device, group):
    q, k, v = _qkv(device)
    used = dict(seqused_q=torch.tensor([4, 0, 6, 7], dtype=torch.int32, device=device),
                seqused_k=torch.tensor([5, 0, 7, 5], dtype=torch.int32, device=device))
    out = coreattn.varlen_attn(q, k, v, _cu(device), _cu(device), 7, 7, causal=True, dropout_p=0.25,
                               backend="triton", **used)
    _backward(out, q, k, v)


def varlen_sink_maxlogit_window(device, group):
    q, k, v = _qkv(device)
    sink = torch.zeros(HQ, device=device, requires_grad=True)
    out, _, _ = coreattn.varlen_attn(q, k, v, _cu(device), _cu(device), 7, 7, causal=True, window_size=(3, 0),
                                     softmax_offset=sink, return_max_logit=True, return_lse=True, backend="triton")
    _backward(out, q, k, v, sink)


def _padded(device, layout, **spans):
    q, k, v = _qkv(device, 9, (2,))
    if layout == "sbhd":
        q, k, v = (_sbhd(x) for x in (q, k, v))
    out = coreattn.padded_attn(q, k, v, layout=layout, causal=True, backend="triton", **spans)
    _backward(out, q, k, v)


def _keep(device):
    keep = torch.ones(2, 9, dtype=torch.bool, device=device)
    keep[1, 6:] = False
    keep[0, 2] = False  # a hole
    return keep


def padded_keep_masks(device, group):
    for layout in ("bshd", "sbhd"):
        _padded(device, layout, q_keep_mask=_keep(device), k_keep_mask=_keep(device))


def padded_spans(device, group):
    start = torch.tensor([0, 2], dtype=torch.int32, device=device)
    length = torch.tensor([9, 5], dtype=torch.int32, device=device)
    for layout in ("bshd", "sbhd"):
        _padded(device, layout, q_start=start, q_len=length, k_start=start, k_len=length)
        _padded(device, layout)


POSITION_ROWS = [[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0, 1, 2]]


def position_ids(device, group):
    q, k, v = _qkv(device, 18)
    pack = Packing(function.POSITION_IDS, torch.tensor(POSITION_ROWS, device=device))
    out, _, _ = function.attention(q, k, v, pack, pack, 18, 18, VarlenParams(D ** -0.5, -1, 0, True), "triton")
    _backward(out, q, k, v)


def transformers_attention(device, group):
    pytest.importorskip("transformers")
    from coreattn.adapters import transformers as hf

    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (x.detach().reshape(2, 9, x.shape[1], D).transpose(1, 2).requires_grad_() for x in _qkv(device, 18))
    cu = torch.tensor([0, 9, 18], dtype=torch.int32, device=device)
    pos = torch.arange(9, device=device).expand(2, 9)
    for kwargs in (dict(attention_mask=_keep(device)), dict(attention_mask=None, position_ids=pos),
                   dict(attention_mask=None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)):
        out, _ = hf.attention_forward(module, q, k, v, backend="triton", **kwargs)
        _backward(out, q, k, v)


def cp_attention(device, group):
    q, k, v = _qkv(device, 20)
    out = coreattn.cp_attn(q, k, v, cp_group=group, layout="thd", causal=True, backend="triton",
                           cu_seqlens_q=torch.tensor([0, 8, 12, 20], dtype=torch.int32, device=device))
    _backward(out, q, k, v)
    q, k, v = (_sbhd(x) for x in _qkv(device, 8, (2,)))
    out = coreattn.cp_attn(q, k, v, cp_group=group, layout="sbhd", causal=True, backend="triton")
    _backward(out, q, k, v)


def megatron_core_attention(device, group):
    pytest.importorskip("megatron.core")
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from coreattn.layers import CoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=HQ * D, num_attention_heads=HQ, num_query_groups=HKV,
                               kv_channels=D, attention_dropout=0.0, hidden_dropout=0.0)
    layer = CoreAttention(config, 1, AttnMaskType.causal, "self", backend="triton")
    q, k, v = (_sbhd(x) for x in _qkv(device, 8, (2,)))
    out = layer(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    _backward(out, q, k, v)
    q, k, v = _qkv(device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu(device), cu_seqlens_kv=_cu(device), max_seqlen_q=7,
                             max_seqlen_kv=7)
    out = layer(q, k, v, None, attn_mask_type=AttnMaskType.padding_causal, packed_seq_params=params)
    _backward(out, q, k, v)


def mask_utilities(device, group):
    """The mask utilities with the arguments that make them sync-free (docs/masks.md)."""
    lens = torch.tensor([3, 0, 5], dtype=torch.int32, device=device)
    x = torch.randn(3, 6, 2, 4, device=device)
    keep = masks.padding_mask_from_seqlens(lens, 6)
    cu = masks.cu_seqlens_from_seqlens(lens)
    masks.seqlens_from_cu_seqlens(cu)
    masks.seqlens_from_padding_mask(keep)
    masks.spans_from_keep_mask(keep)
    packed = masks.unpad(x, keep, total=8, max_seqlen=5)
    masks.pad(packed.x_packed, packed.indices, 3, 6)
    masks.position_ids_from_cu_seqlens(cu, total=8)
    masks.sequence_ids_from_cu_seqlens(cu, total=8)
    masks.keep_mask_from_4d(~keep[:, None, None, :], "megatron")
    masks.cp_partition_indices_sbhd(8, 2, 1)


def _topk(device, *token_dims, topk=4, heads=()):
    gen = torch.Generator().manual_seed(1)
    return torch.randint(-1, 9, (*token_dims, *heads, topk), generator=gen).to(device)


def sparse_varlen(device, group):
    """Top-k sparse attention, packed: indices with -1, key bounds and topk_length derived and given on
    the device; absorbed MLA (v None) and per-kv-head indices."""
    q, k, v = _qkv(device)
    lengths = torch.full((19,), 3, dtype=torch.int32, device=device)
    bounds = (torch.zeros(19, dtype=torch.int64, device=device), torch.full((19,), 12, device=device))
    out = coreattn.sparse_varlen_attn(q, k, v, _topk(device, 19, heads=(HKV,)), _cu(device), _cu(device),
                                      topk_length=lengths, key_bounds=bounds, backend="triton")
    _backward(out, q, k, v)
    out = coreattn.sparse_varlen_attn(q, k, None, _topk(device, 19), _cu(device), _cu(device), v_head_dim=D // 2,
                                      causal_alignment="top_left", backend="triton")
    _backward(out, q, k)


def sparse_padded(device, group):
    """Top-k sparse attention on padded batches: bshd with spans, sbhd with Megatron's [b, s, K] indices
    as their transposed view."""
    q, k, v = _qkv(device, 9, (2,))
    span = dict(q_start=torch.tensor([0, 2], dtype=torch.int32, device=device),
                q_len=torch.tensor([9, 5], dtype=torch.int32, device=device))
    out = coreattn.sparse_padded_attn(q, k, v, _topk(device, 2, 9), backend="triton", **span)
    _backward(out, q, k, v)
    q, k = _sbhd(q), _sbhd(k)
    out = coreattn.sparse_padded_attn(q, k, None, _topk(device, 2, 9).transpose(0, 1), layout="sbhd",
                                      v_head_dim=D, backend="triton")
    _backward(out, q, k)


def block_sparse(device, group):
    """The block mode (MiniMax-M3's block-sparse attention): packed and padded rows of block ids, forward and
    backward on the kernels (the dK/dV's block table and CSR built on the device), and the indexer's
    block-max top-k (the kernel's scores, torch's selection)."""
    q, k, v = _qkv(device)
    blocks = _topk(device, 19, heads=(HKV,), topk=3).clamp(max=4)
    out = coreattn.sparse_varlen_attn(q, k, v, blocks, _cu(device), _cu(device), block_size=4, backend="triton")
    _backward(out, q, k, v)
    q, k, v = _qkv(device, 9, (2,))
    out = coreattn.sparse_padded_attn(q, k, v, _topk(device, 2, 9, topk=2).clamp(max=2), block_size=4,
                                      backend="triton")
    _backward(out, q, k, v)
    coreattn.indexer_topk(q.detach(), k[..., 0, :].detach(), None, 2, layout="bshd", block_size=4, relu=False,
                          backend="triton")


def dsa_indexer(device, group):
    """The DSA indexer ops: the kernel's top-k, top-k + dense and sparse loss (the loss in torch ops,
    on host-known key ranges where values are not read) and their backward, the rotation."""
    gen = torch.Generator().manual_seed(1)
    q, k, w = (torch.randn(s, generator=gen).to(device).requires_grad_() for s in ((19, 2, D), (19, D), (19, 2)))
    query, key = torch.randn(19, HQ, D, generator=gen).to(device), torch.randn(19, HKV, D, generator=gen).to(device)
    kw = dict(layout="thd", cu_seqlens=_cu(device), max_seqlen=7)
    coreattn.indexer_topk(q, k, w, 4, backend="triton", **kw)
    for sparse in (False, True):
        _, loss = coreattn.indexer_topk_and_loss(q, k, w, query, key, 4, 0.25, 0.1, sparse=sparse, backend="triton",
                                                 **kw)
        _backward(loss, q, k, w)
    _backward(coreattn.rotate_activation(q, backend="triton"), q)


PATHS = {fn.__name__: fn for fn in (varlen_plain, varlen_seqused_dropout, varlen_sink_maxlogit_window,
                                    padded_keep_masks, padded_spans, position_ids, transformers_attention,
                                    cp_attention, megatron_core_attention, mask_utilities, sparse_varlen,
                                    sparse_padded, block_sparse, dsa_indexer)}
