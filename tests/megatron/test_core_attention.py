"""CoreAttention (the Megatron core_attention module) against the float64 oracle, layer by layer.

Every Megatron mask type in sbhd, bshd and thd (with and without cu_seqlens_*_padded gaps), on
the Triton kernels (interpreter on CPU, fp32) and the torch backend, forward and backward.
"""

import math

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from attn_cases import KERNEL_DEVICE, assert_flash_criterion  # noqa: E402
from coreattn.layers import CoreAttention  # noqa: E402
from oracle import _one_sequence, attention_ref, visible  # noqa: E402

B, HQ, HKV, DK, DV = 3, 4, 2, 24, 16
BACKENDS = ["triton", "torch"]


def make_config(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=HQ, num_query_groups=HKV, kv_channels=DK,
                attention_dropout=0.0, hidden_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def make_layer(mask_type=AttnMaskType.causal, backend="torch", layer_number=1, **cfg):
    return CoreAttention(make_config(**cfg), layer_number, mask_type, "self", v_channels=DV, backend=backend)


def sbhd_inputs(sq, sk, dtype=torch.float32, device=KERNEL_DEVICE, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(s, h, d):
        return torch.randn(s, B, h, d, generator=gen).to(dtype).to(device).requires_grad_()

    return rand(sq, HQ, DK), rand(sk, HKV, DK), rand(sk, HKV, DV)


def dense_ref(q, k, v, allowed, upcast=True):
    """sbhd q/k/v with allowed [B, Sq, Sk] (True = attend) -> out [Sq, B, Hq*Dv] via the oracle core."""
    work = torch.float64 if upcast else torch.float32
    group = HQ // HKV
    outs = []
    for b in range(q.shape[1]):
        qs = q[:, b].to(work)
        ks = k[:, b].to(work).repeat_interleave(group, dim=1)
        vs = v[:, b].to(work).repeat_interleave(group, dim=1)
        outs.append(_one_sequence(qs, ks, vs, allowed[b], 1 / math.sqrt(DK), q.dtype, upcast)[0])
    out = torch.stack(outs, dim=1)  # [Sq, B, Hq, Dv]
    return (out if upcast else out.to(q.dtype)).reshape(q.shape[0], q.shape[1], -1)


def band(sq, sk, causal, window, bottom_right):
    rows = [[visible(i, j, sq, sk, causal, window, bottom_right) for j in range(sk)] for i in range(sq)]
    return torch.tensor(rows, dtype=torch.bool).reshape(sq, sk)


def check_against_oracle(name, out, q, k, v, allowed):
    """Forward and q/k/v gradients with the flash criterion (fp32 naive baseline)."""
    ref = dense_ref(q, k, v, allowed)
    naive = dense_ref(q, k, v, allowed, upcast=False)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert_flash_criterion(name, out, naive, ref)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g.double())
    base = torch.autograd.grad(naive, (q, k, v), g)
    for gname, a, w, n in zip("qkv", got, want, base):
        assert_flash_criterion(f"{name} d{gname}", a, n, w)


# Right padding, left padding and a hole, as a Megatron [b, 1, 1, s] mask (True = masked out).
def padding_mask(s, device):
    keep = torch.ones(B, s, dtype=torch.bool)
    keep[0, s - 5:] = False
    keep[1, :4] = False
    keep[2, 3:6] = False
    return ~keep[:, None, None, :].to(device), keep


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_type,sq,sk", [
    (AttnMaskType.no_mask, 19, 19),
    (AttnMaskType.causal, 19, 19),
    (AttnMaskType.causal, 7, 19),  # top-left: query i sees keys j <= i
    (AttnMaskType.causal_bottom_right, 7, 19),  # bottom-right: j <= i + 12
], ids=["no_mask", "causal", "causal-cross-top-left", "causal-bottom-right"])
def test_sbhd_mask_types(mask_type, sq, sk, backend):
    q, k, v = sbhd_inputs(sq, sk)
    layer = make_layer(mask_type, backend)
    junk = torch.ones(B, 1, sq, sk, dtype=torch.bool, device=q.device)  # ignored for these types, as TE does
    out = layer(q, k, v, junk)
    causal = mask_type != AttnMaskType.no_mask
    allowed = band(sq, sk, causal, (-1, -1), mask_type == AttnMaskType.causal_bottom_right).expand(B, sq, sk)
    check_against_oracle(mask_type.name, out, q, k, v, allowed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_type", [AttnMaskType.padding, AttnMaskType.padding_causal])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int32])
def test_sbhd_padding_mask(mask_type, mask_dtype, backend):
    s = 17
    q, k, v = sbhd_inputs(s, s)
    masked, keep = padding_mask(s, q.device)
    out = make_layer(mask_type, backend)(q, k, v, masked.to(mask_dtype))
    allowed = band(s, s, mask_type == AttnMaskType.padding_causal, (-1, -1), False)
    allowed = allowed & keep[:, :, None] & keep[:, None, :]  # dropped query rows output zeros
    check_against_oracle(mask_type.name, out, q, k, v, allowed)
    assert not out.transpose(0, 1)[~keep.to(out.device)].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bshd_padding_mask(backend):
    s = 13
    q, k, v = sbhd_inputs(s, s)
    masked, keep = padding_mask(s, q.device)
    qb, kb, vb = (t.transpose(0, 1) for t in (q, k, v))  # [b, s, h, d] views
    params = PackedSeqParams(qkv_format="bshd")
    out = make_layer(AttnMaskType.padding_causal, backend)(qb, kb, vb, masked, packed_seq_params=params)
    allowed = band(s, s, True, (-1, -1), False) & keep[:, :, None] & keep[:, None, :]
    check_against_oracle("bshd padding_causal", out.transpose(0, 1), q, k, v, allowed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_attention_padding_masks_only_keys(backend):
    """attention_type "cross" with sq == sk: a [b, 1, 1, sk] mask pads the encoder's keys, not the
    decoder's queries."""
    s = 12
    q, k, v = sbhd_inputs(s, s)
    masked, keep = padding_mask(s, q.device)
    layer = CoreAttention(make_config(), 1, AttnMaskType.padding, "cross", v_channels=DV, backend=backend)
    out = layer(q, k, v, masked)
    check_against_oracle("cross padding", out, q, k, v, keep[:, None, :].expand(B, s, s))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_attention_tuple_padding_mask(backend):
    """Megatron's cross-attention padding as (q mask [b,1,1,sq], kv mask [b,1,1,skv])."""
    sq, sk = 9, 14
    q, k, v = sbhd_inputs(sq, sk)
    q_masked, q_keep = padding_mask(sq, q.device)
    k_masked, k_keep = padding_mask(sk, q.device)
    layer = CoreAttention(make_config(), 1, AttnMaskType.padding, "cross", v_channels=DV, backend=backend)
    out = layer(q, k, v, (q_masked, k_masked))
    check_against_oracle("cross tuple padding", out, q, k, v, q_keep[:, :, None] & k_keep[:, None, :])
    with pytest.raises(ValueError, match=r"attention_mask\[1\] must be a \[b, 1, 1, s\]"):
        layer(q, k, v, (q_masked, k_masked[:, 0]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dense", [False, True], ids=["no-mask", "dense-mask"])
def test_sbhd_padding_from_cu_seqlens(dense, backend):
    """Padding types on sbhd may give the per-sample lengths as cu_seqlens (right padding), as with TE."""
    s, lens = 11, [11, 4, 0]
    q, k, v = sbhd_inputs(s, s)
    cu = torch.tensor([0, 11, 15, 15], dtype=torch.int32, device=q.device)
    params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    keep = torch.arange(s)[None, :] < torch.tensor(lens)[:, None]
    allowed = band(s, s, True, (-1, -1), False) & keep[:, :, None] & keep[:, None, :]
    mask = None
    if dense:  # a dense mask that hides one more key from everyone: both apply
        mask = torch.zeros(B, 1, s, s, dtype=torch.bool, device=q.device)
        mask[..., 2] = True
        allowed = allowed & (torch.arange(s) != 2)[None, None, :]
    out = make_layer(AttnMaskType.padding_causal, backend)(q, k, v, mask, packed_seq_params=params)
    check_against_oracle("sbhd cu_seqlens padding", out, q, k, v, allowed)
    bad = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu[:-1], cu_seqlens_kv=cu)
    with pytest.raises(ValueError, match=r"packed_seq_params.cu_seqlens_q must be a \[b\+1\] = \[4\]"):
        make_layer(AttnMaskType.padding_causal, backend)(q, k, v, mask, packed_seq_params=bad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_type", [AttnMaskType.arbitrary, AttnMaskType.padding])
def test_sbhd_dense_mask(mask_type, backend):
    sq, sk = 11, 14
    q, k, v = sbhd_inputs(sq, sk)
    masked = torch.rand(B, 1, sq, sk, generator=torch.Generator().manual_seed(3)) < 0.4
    masked[1, 0, 4] = True  # a row that sees nothing: zeros, no NaN
    out = make_layer(mask_type, backend)(q, k, v, masked.to(q.device))
    check_against_oracle(mask_type.name, out, q, k, v, ~masked[:, 0])
    assert not out[4, 1].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_arbitrary_key_mask_runs_in_kernels(backend):
    sq, sk = 9, 14
    q, k, v = sbhd_inputs(sq, sk)
    masked = torch.zeros(B, 1, 1, sk, dtype=torch.bool)
    masked[0, ..., :3] = True
    out = make_layer(AttnMaskType.arbitrary, backend)(q, k, v, masked.to(q.device))
    check_against_oracle("arbitrary key mask", out, q, k, v, (~masked[:, 0]).expand(B, sq, sk))


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_from_config(backend):
    s = 21
    q, k, v = sbhd_inputs(s, s)
    out = make_layer(AttnMaskType.causal, backend, window_size=(5, 0))(q, k, v, None)
    check_against_oracle("window", out, q, k, v, band(s, s, True, (5, -1), False).expand(B, s, s))
    # window_attn_skip_freq=2: layer 2 is a full-attention layer
    out2 = make_layer(AttnMaskType.causal, backend, layer_number=2, window_size=(5, 0), window_attn_skip_freq=2)(
        q, k, v, None)
    check_against_oracle("window skipped", out2, q, k, v, band(s, s, True, (-1, -1), False).expand(B, s, s))


LENS = (5, 0, 11, 1)
PADDED = (8, 0, 12, 4)  # slots with gaps, as cu_seqlens_*_padded describes them


def _cu(lens, device):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.no_mask, AttnMaskType.padding_causal])
@pytest.mark.parametrize("gaps", [False, True], ids=["dense", "padded"])
def test_thd(mask_type, gaps, backend):
    device = KERNEL_DEVICE
    slots = PADDED if gaps else LENS
    total = sum(slots)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, h, d, generator=gen).to(device).requires_grad_()
               for h, d in ((HQ, DK), (HKV, DK), (HKV, DV)))
    cu, cu_pad = _cu(LENS, device), _cu(slots, device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(LENS),
                             max_seqlen_kv=max(LENS))
    if gaps:
        params.cu_seqlens_q_padded = cu_pad
        params.cu_seqlens_kv_padded = cu_pad
    out = make_layer(mask_type, backend)(q, k, v, None, packed_seq_params=params)
    assert out.shape == (total, HQ * DV)
    real = torch.cat([torch.arange(s, s + n) for s, n in zip(cu_pad[:-1].tolist(), LENS)])
    gap = torch.ones(total, dtype=torch.bool)
    gap[real] = False
    causal = mask_type != AttnMaskType.no_mask
    qr, kr, vr = (t[real.to(device)] for t in (q, k, v))
    ref, _ = attention_ref(qr, kr, vr, cu, cu, causal=causal)
    naive, _ = attention_ref(qr, kr, vr, cu, cu, causal=causal, upcast=False)
    got = out.view(total, HQ, DV)
    assert_flash_criterion("thd out", got[real.to(device)], naive, ref)
    assert not got[gap.to(device)].any(), "gap tokens must output zeros"
    g = torch.randn(ref.shape, generator=gen).to(device)
    grads = torch.autograd.grad(got[real.to(device)], (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g.double(), retain_graph=True)
    base = torch.autograd.grad(naive, (q, k, v), g)
    for name, a, w, n in zip("qkv", grads, want, base):
        assert_flash_criterion(f"thd d{name}", a, n, w)
        assert not a[gap.to(device)].any(), "gap tokens get no gradient"


def test_mla_dims_and_scale():
    cfg = make_config(kv_channels=None, num_query_groups=None)
    layer = CoreAttention(cfg, 1, AttnMaskType.causal, "self", softmax_scale=0.3, k_channels=192, v_channels=128,
                          num_splits=1, cp_comm_type="p2p", model_comm_pgs=None, backend="torch")
    assert (layer.hidden_size_per_attention_head_k, layer.hidden_size_per_attention_head_v) == (192, 128)
    assert layer.softmax_scale == 0.3
    assert layer.hidden_size_per_partition == HQ * 128
    default = CoreAttention(make_config(), 1, AttnMaskType.causal, "self")
    assert default.softmax_scale == pytest.approx(1 / math.sqrt(DK))
    assert default.hidden_size_per_attention_head_v == DK


def test_padded_value_is_correct_too():
    """megatron-core >= 0.18 zero-pads MLA's V to Dqk on thd: CoreAttention's output is then the
    unpadded result followed by zeros, which Megatron slices off."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(16, HQ, DK, generator=gen), torch.randn(16, HKV, DK, generator=gen)
    v = torch.randn(16, HKV, DV, generator=gen)
    v_pad = torch.nn.functional.pad(v, (0, DK - DV))
    cu = _cu((7, 9), "cpu")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    layer = make_layer(AttnMaskType.causal, "torch")
    out = layer(q, k, v, None, packed_seq_params=params).view(16, HQ, DV)
    out_pad = layer(q, k, v_pad, None, packed_seq_params=params).view(16, HQ, DK)
    torch.testing.assert_close(out_pad[..., :DV], out, rtol=0, atol=1e-6)
    assert not out_pad[..., DV:].any()


def test_backend_override_precedence(monkeypatch):
    monkeypatch.setenv("COREATTN_BACKEND", "torch")
    cfg = make_config()
    cfg.coreattn_backend = "torch"
    assert CoreAttention(cfg, 1, AttnMaskType.causal, "self").backend.value == "torch"
    assert CoreAttention(cfg, 1, AttnMaskType.causal, "self", backend="triton").backend.value == "triton"
    cfg.coreattn_backend = "cuda-magic"
    with pytest.raises(ValueError, match="config.coreattn_backend"):
        CoreAttention(cfg, 1, AttnMaskType.causal, "self")


def test_unusable_override_raises(monkeypatch):
    from coreattn.layers import backends

    monkeypatch.setitem(backends._REGISTRY, backends.Backend.TRITON,
                        lambda device: backends.Availability(False, "test: pretend Triton is missing"))
    q, k, v = sbhd_inputs(5, 5, device="cpu")
    with pytest.raises(RuntimeError, match="pretend Triton is missing"):
        make_layer(AttnMaskType.causal, backend="triton")(q, k, v, None)


def _cp_layer(cp_size=2, layer_number=1, given=None, **cfg):
    """A CoreAttention built as Megatron builds it under context parallelism (a stand-in cp group)."""
    group = type("Group", (), {"size": lambda self, n=cp_size: n})()
    pgs = type("PGs", (), {"cp": group, "tp": type("Group", (), {"size": lambda self: 1})()})()
    config = make_config(context_parallel_size=cp_size, **cfg)
    return CoreAttention(config, layer_number, AttnMaskType.causal, "self", cp_comm_type=given,
                         pg_collection=pgs, backend="torch")


@pytest.mark.parametrize("given,config_value,layer_number,expected", [
    ("a2a", None, 1, "a2a"),  # what Megatron passes (the layer's own value)
    ("all_gather", "p2p", 2, "all_gather"),  # the argument wins over the config
    (None, None, 1, "p2p"),  # Megatron's default, run as p2p like its Transformer Engine wrapper
    (None, "a2a", 1, "a2a"),
    (None, ["a2a", "all_gather"], 2, "all_gather"),  # built without the argument: the layer's entry
    (None, ["p2p", "a2a+p2p"], 2, "a2a+p2p"),
])
def test_cp_comm_type_per_layer(given, config_value, layer_number, expected):
    layer = _cp_layer(layer_number=layer_number, given=given, cp_comm_type=config_value,
                      hierarchical_context_parallel_sizes=[2, 1])
    assert layer.cp_comm_type == expected


class TestBadInput:
    def test_cp_comm_type_unknown(self):
        with pytest.raises(ValueError, match=r"comm must be one of \('p2p', 'all_gather', 'a2a', 'a2a\+p2p'\), got 'ring'"):
            _cp_layer(given="ring")

    def test_cp_comm_type_hierarchical(self):
        """a2a+p2p: hierarchical_context_parallel_sizes must multiply to the cp size and split the heads;
        checked when the layer is built (the groups are looked up when it first runs)."""
        for sizes in ([2, 2], [4, 1], [1, 4]):
            layer = _cp_layer(cp_size=4, given="a2a+p2p", hierarchical_context_parallel_sizes=sizes)
            assert layer.cp_comm_type == "a2a+p2p"
        assert _cp_layer(cp_size=1, given="a2a+p2p").cp_comm_type == "a2a+p2p"  # no CP: never used
        with pytest.raises(ValueError, match=r"needs config.hierarchical_context_parallel_sizes = \[a2a size, p2p "
                                             r"size\].*got None"):
            _cp_layer(cp_size=4, given="a2a+p2p")
        with pytest.raises(ValueError, match=r"hierarchical_context_parallel_sizes = \[2, 4\] multiply to 8, not "
                                             r"context_parallel_size = 4"):
            _cp_layer(cp_size=4, given="a2a+p2p", hierarchical_context_parallel_sizes=[2, 4])
        with pytest.raises(ValueError, match=r"num_attention_heads / tensor parallel size = 4 is not divisible by "
                                             r"hierarchical_context_parallel_sizes\[0\] = 3"):
            _cp_layer(cp_size=6, given="a2a+p2p", hierarchical_context_parallel_sizes=[3, 2])
        with pytest.raises(ValueError, match=r"num_query_groups / tensor parallel size = 3 and "
                                             r"hierarchical_context_parallel_sizes\[0\] = 2 must divide"):
            _cp_layer(cp_size=4, given="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2], num_attention_heads=6,
                      num_query_groups=3)

    def test_attention_bias(self):
        q, k, v = sbhd_inputs(5, 5, device="cpu")
        with pytest.raises(NotImplementedError, match="attention_bias"):
            make_layer()(q, k, v, None, attention_bias=torch.zeros(1))

    def test_context_parallel_group_size_mismatch(self):
        one_rank = type("Group", (), {"size": lambda self: 1})()
        pgs = type("PGs", (), {"cp": one_rank, "tp": one_rank})()
        with pytest.raises(ValueError, match="context_parallel_size=2 but the context-parallel group has 1"):
            CoreAttention(make_config(context_parallel_size=2), 1, AttnMaskType.causal, "self", pg_collection=pgs)

    @pytest.mark.parametrize("mask_type", [AttnMaskType.padding, AttnMaskType.arbitrary])
    def test_masks_under_context_parallelism(self, mask_type):
        two_ranks = type("Group", (), {"size": lambda self: 2})()
        pgs = type("PGs", (), {"cp": two_ranks, "tp": type("Group", (), {"size": lambda self: 1})()})()
        layer = CoreAttention(make_config(context_parallel_size=2), 1, mask_type, "self", v_channels=DV,
                              pg_collection=pgs, backend="torch")
        q, k, v = sbhd_inputs(6, 6, device="cpu")
        with pytest.raises(NotImplementedError, match="not supported under context parallelism"):
            layer(q, k, v, torch.zeros(B, 1, 1, 6, dtype=torch.bool))

    def test_float_mask(self):
        q, k, v = sbhd_inputs(5, 5, device="cpu")
        with pytest.raises(TypeError, match="additive"):
            make_layer(AttnMaskType.padding)(q, k, v, torch.zeros(B, 1, 1, 5))

    def test_mask_rank(self):
        q, k, v = sbhd_inputs(5, 5, device="cpu")
        with pytest.raises(ValueError, match=r"\[b, 1, sq, sk\]"):
            make_layer(AttnMaskType.padding)(q, k, v, torch.zeros(B, 5, dtype=torch.bool))

    def test_arbitrary_thd(self):
        q, k, v = torch.randn(6, HQ, DK), torch.randn(6, HKV, DK), torch.randn(6, HKV, DV)
        cu = _cu((6,), "cpu")
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
        with pytest.raises(NotImplementedError, match="thd"):
            make_layer(AttnMaskType.arbitrary)(q, k, v, torch.zeros(1, 1, 6, 6, dtype=torch.bool),
                                               packed_seq_params=params)

    def test_unknown_format(self):
        q, k, v = sbhd_inputs(5, 5, device="cpu")
        with pytest.raises(ValueError, match="qkv_format"):
            make_layer()(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="bhsd"))
