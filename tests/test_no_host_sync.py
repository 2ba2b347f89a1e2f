"""No host read of a device tensor on an attention path (tests/sync_detector.py).

Every public path runs here on the Triton kernels (the interpreter) with ``COREATTN_VALIDATE=0``,
which makes coreattn read on CPU what it reads on a device, and with every host-read entry point
raising when coreattn's code calls it: forward and backward of ``varlen_attn`` /
``flash_attn_varlen_func`` (seqused, max_seqlen as 0-dim tensors, dropout, sinks, max logits,
windows), ``padded_attn`` (spans, keep masks, sbhd), the position-ids layout, the transformers
attention function, Megatron's ``CoreAttention`` (sbhd and thd), ``cp_attn`` on a one-rank group and
the mask utilities given their sync-free arguments. The GPU side is
``torch.cuda.set_sync_debug_mode("error")`` over the same paths (tests/test_gpu.py).
"""

import os
import tempfile

import pytest
import torch

import coreattn
from coreattn import masks
from coreattn.kernels.packing import Packing
from coreattn.layers import function
from coreattn.layers.checks import VarlenParams

from attn_cases import KERNEL_DEVICE
from sync_detector import HostRead, no_host_reads

pytestmark = pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="the CPU detector; tests/test_gpu.py checks a GPU")

CU = torch.tensor([0, 5, 5, 12, 19], dtype=torch.int32)
HQ, HKV, D = 2, 1, 16


def _qkv(tokens=19, lead=(), dv=D, requires_grad=True):
    gen = torch.Generator().manual_seed(0)
    shapes = ((*lead, tokens, HQ, D), (*lead, tokens, HKV, D), (*lead, tokens, HKV, dv))
    return tuple(torch.randn(s, generator=gen).requires_grad_(requires_grad) for s in shapes)


def _backward(out, *leaves):
    torch.autograd.grad(out.float().square().sum(), [x for x in leaves if x.requires_grad])


def test_the_detector_catches_a_read(monkeypatch):
    """The detector itself: a coreattn frame that reads a value raises; torch's own reads do not."""
    from coreattn.layers import checks

    with no_host_reads(monkeypatch):
        with pytest.raises(HostRead, match="Tensor.tolist called by coreattn.layers.checks"):
            checks.check_cu_seqlens_values("cu_seqlens_q", CU, 19, "max_seqlen_q", 7)
        assert CU.tolist()[-1] == 19  # the test's own read
        assert not checks.reads_values(CU)


@pytest.mark.parametrize("features", ["plain", "seqused-dropout", "sink-maxlogit-window"])
def test_varlen_attn(monkeypatch, features):
    q, k, v = _qkv()
    kw = dict(causal=True)
    if features == "seqused-dropout":
        kw.update(seqused_q=torch.tensor([4, 0, 6, 7], dtype=torch.int32),
                  seqused_k=torch.tensor([5, 0, 7, 5], dtype=torch.int32), dropout_p=0.25)
    if features == "sink-maxlogit-window":
        kw.update(softmax_offset=torch.zeros(HQ, requires_grad=True), return_max_logit=True, return_lse=True,
                  window_size=(3, 0))
    max_len = torch.tensor(7)  # a 0-dim tensor: never read
    with no_host_reads(monkeypatch):
        res = coreattn.varlen_attn(q, k, v, CU, CU, max_len, max_len, backend="triton", **kw)
        out = res[0] if isinstance(res, tuple) else res
        _backward(out, q, k, v, *([kw["softmax_offset"]] if "softmax_offset" in kw else []))
        out = coreattn.flash_attn_varlen_func(q, k, v, CU, CU, max_len, max_len, causal=True)  # the default: triton
        _backward(out, q, k, v)


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_padded_attn(monkeypatch, layout):
    lead = (2,)
    q, k, v = _qkv(9, lead)
    if layout == "sbhd":
        q, k, v = (x.detach().transpose(0, 1).requires_grad_() for x in (q, k, v))
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, 6:] = False
    keep[0, 2] = False  # a hole
    start, length = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([9, 5], dtype=torch.int32)
    with no_host_reads(monkeypatch):
        for spans in (dict(q_keep_mask=keep, k_keep_mask=keep),
                      dict(q_start=start, q_len=length, k_start=start, k_len=length), {}):
            out = coreattn.padded_attn(q, k, v, layout=layout, causal=True, backend="triton", **spans)
            _backward(out, q, k, v)


def test_position_ids_layout(monkeypatch):
    q, k, v = _qkv(18)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0, 1, 2]])
    pack = Packing(function.POSITION_IDS, pos)
    with no_host_reads(monkeypatch):
        out, _, _ = function.attention(q, k, v, pack, pack, 18, 18, VarlenParams(D ** -0.5, -1, 0, True), "triton")
        _backward(out, q, k, v)


def test_transformers_attention(monkeypatch):
    pytest.importorskip("transformers")
    from coreattn.adapters import transformers as hf

    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (x.detach().reshape(2, 9, x.shape[1], D).transpose(1, 2).requires_grad_()
               for x in _qkv(18))  # [B, H, S, D] as transformers hands them
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[0, 7:] = False
    pos = torch.arange(9).expand(2, 9)
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)
    with no_host_reads(monkeypatch):
        for kwargs in (dict(attention_mask=keep), dict(attention_mask=None, position_ids=pos),
                       dict(attention_mask=None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)):
            out, _ = hf.attention_forward(module, q, k, v, backend="triton", **kwargs)
            _backward(out, q, k, v)


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        fd, path = tempfile.mkstemp(prefix="coreattn-gloo-")
        os.close(fd)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()
        os.unlink(path)


@pytest.mark.parametrize("layout", ["thd", "sbhd"])
def test_cp_attn_one_rank(monkeypatch, one_rank_group, layout):
    if layout == "thd":
        q, k, v = _qkv(20)
        kw = dict(cu_seqlens_q=torch.tensor([0, 8, 12, 20], dtype=torch.int32))
    else:
        q, k, v = (x.detach().transpose(0, 1).requires_grad_() for x in _qkv(8, (2,)))
        kw = {}
    with no_host_reads(monkeypatch):
        out = coreattn.cp_attn(q, k, v, cp_group=one_rank_group, layout=layout, causal=True, backend="triton", **kw)
        _backward(out, q, k, v)


def test_megatron_core_attention(monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from coreattn.layers import CoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=HQ * D, num_attention_heads=HQ, num_query_groups=HKV,
                               kv_channels=D, attention_dropout=0.0, hidden_dropout=0.0)
    layer = CoreAttention(config, 1, AttnMaskType.causal, "self", backend="triton")
    q, k, v = (x.detach().transpose(0, 1).requires_grad_() for x in _qkv(8, (2,)))  # sbhd
    tq, tk, tv = _qkv()
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=CU, cu_seqlens_kv=CU, max_seqlen_q=7, max_seqlen_kv=7)
    with no_host_reads(monkeypatch):
        out = layer(q, k, v, None, attn_mask_type=AttnMaskType.causal)
        _backward(out, q, k, v)
        out = layer(tq, tk, tv, None, attn_mask_type=AttnMaskType.padding_causal, packed_seq_params=params)
        _backward(out, tq, tk, tv)


def test_mask_utilities(monkeypatch):
    """The mask utilities with the arguments that make them sync-free (docs/masks.md)."""
    lens = torch.tensor([3, 0, 5], dtype=torch.int32)
    x = torch.randn(3, 6, 2, 4)
    with no_host_reads(monkeypatch):
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
