"""CoreDSAttention (coreattn/layers/dsa/core_dsa_attention.py): Megatron-Core's DeepSeek Sparse Attention with
its sparse attention on coreattn, swapped in by ``use_coreattn``. On CPU, one-rank gloo group.

1. The seam alone. coreattn's replacement of Megatron's sparse-attention step, run in float64 on
   the torch backend, equals the float64 oracle (dsa_oracle.py, written from the definition) to
   float64 rounding, output and every input gradient; Megatron's own step, which computes in
   float32, is within float32 rounding of the same oracle (so the oracle is Megatron's definition).
   Cases: Megatron's causal bounds, packed thd bounds, local query rows against all keys (context
   parallelism), explicit key positions, additive 0/-inf masks, no mask, topk_length; -1 entries,
   duplicates, indices outside the bounds; absorbed MLA and per-head K/V (MQA and one head per head).
2. The hook: Megatron's functions are back after every forward (also one that raises), nested
   forwards, other threads' calls go to Megatron's function, a seam of another shape raises an
   ImportError naming the version, the fully fused DSA hook is declined.
3. Whole GPTModels (2 layers, hidden 64, 4 heads, kv_lora_rank 32 + rope 8, indexer top-8 over
   sequences of up to 16 tokens) built with Megatron's own DSA spec, and the same spec through
   use_coreattn, same weights: logits, the logged indexer loss of each layer and every parameter
   gradient, with the flash criterion err(coreattn) <= 2 * err(Megatron) + 1e-5, both measured from
   the same model whose sparse-attention step is the float64 oracle (its result rounded to float32,
   everything else as in the other two). Everything but that step is the same float32 computation
   in the three models, so the errors measure what each sparse attention adds, propagated through
   the model. The indexer picks the same keys in the three (checked first).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import threading
import types
from typing import NamedTuple

import pytest
import torch

pytest.importorskip("megatron.core")
dsa = pytest.importorskip("megatron.core.transformer.experimental_attention_variant.dsa")

import coreattn.layers.dsa.core_dsa_attention as dsa_attention  # noqa: E402
from attn_cases import assert_flash_criterion  # noqa: E402
from coreattn.adapters.megatron import use_coreattn  # noqa: E402
from coreattn.layers.dsa.core_dsa_attention import MEGATRON_VERSION, SEAM, CoreDSAttention, routed  # noqa: E402
from dsa_env import VOCAB, build, dsa_block_spec, dsa_config, install_shims, packed_params  # noqa: E402
from dsa_oracle import run_sparse_attention_ref, unfused_dsa_fn_ref  # noqa: E402
from megatron_env import megatron_cpu, megatron_cpu_shims  # noqa: E402,F401

V019 = SEAM.name == "_run_sparse_attention"
needs_019 = pytest.mark.skipif(not V019, reason=f"megatron-core {MEGATRON_VERSION} has the 0.16-0.18 DSAttention "
                                                "(unfused_dsa_fn), not 0.19's _run_sparse_attention")
needs_016 = pytest.mark.skipif(V019, reason=f"megatron-core {MEGATRON_VERSION} has 0.19's _run_sparse_attention, "
                                            "not the 0.16-0.18 unfused_dsa_fn")
F64 = dict(rtol=1e-9, atol=1e-11)
ORACLE_STEP = run_sparse_attention_ref if V019 else unfused_dsa_fn_ref  # Megatron's step from the definition
INIT_STD = 0.2  # weights large enough for peaked attention and indexer distributions


# ---------------------------------------------------------------- 1. the seam alone

def _indices(b, sq, sk, k, gen, row_has_self=False):
    """Random top-k rows [b, sq, k] over [0, sk) with duplicates, -1 entries and (past k // 2)
    indices beyond the key range's bounds for some rows."""
    idx = torch.randint(0, sk, (b, sq, k), generator=gen)
    idx[..., 1] = idx[..., 0]  # a duplicate in every row
    idx[:, ::3, -1] = -1
    if row_has_self:  # 0.16's Megatron step needs one visible key per row (else its softmax is NaN)
        idx[..., 0] = torch.arange(sq).clamp(max=sk - 1)
        idx[:, ::3, -1] = torch.randint(0, sk, (sq,), generator=gen)[::3]
    return idx


def _without_duplicates(idx):
    """The same sets with each repeated entry set to -1 (Megatron's own non-absorbed step counts a
    repeated index once per entry, its absorbed step once; its indexer never repeats one)."""
    repeated = torch.tril(idx[..., :, None] == idx[..., None, :], diagonal=-1).any(-1)
    return idx.masked_fill(repeated, -1)


def _seam_case(case: str, gen):
    """(b, sq, sk, visibility kwargs of _run_sparse_attention, topk_length or None)."""
    b, sq, sk = 2, 12, 12
    starts = ends = key_positions = mask = length = None
    if case in ("causal", "topk-length"):  # Megatron's plain causal bounds
        starts, ends = torch.zeros(sq, dtype=torch.int64), torch.arange(1, sq + 1)
        if case == "topk-length":
            length = torch.randint(0, 7, (b, sq), generator=gen, dtype=torch.int32)
    elif case == "thd":  # packed sequences of 5, 1 and 6 tokens
        b, cu = 1, torch.tensor([0, 5, 6, 12])
        rows = torch.arange(sq)
        starts, ends = cu[torch.searchsorted(cu[1:], rows, right=True)], rows + 1
    elif case == "cp-rows":  # this rank's zig-zag rows (0-2 and 9-11 of 12) against every key
        sq = 6
        rows = torch.tensor([0, 1, 2, 9, 10, 11])
        starts, ends = torch.zeros(sq, dtype=torch.int64), rows + 1
    elif case == "key-positions":  # keys in another order than their positions
        starts, ends = torch.zeros(sq, dtype=torch.int64), torch.arange(1, sq + 1)
        key_positions = torch.randperm(sk, generator=gen)
    elif case in ("mask", "mask-2d"):
        hidden = torch.rand(b, sq, sk, generator=gen) < 0.3
        hidden[1, 4] = True  # a row that sees nothing
        if case == "mask-2d":
            hidden = torch.triu(torch.ones(sq, sk, dtype=torch.bool), 1)
        mask = torch.zeros(hidden.shape).masked_fill(hidden, float("-inf"))
    else:
        assert case == "none"  # Megatron's default when neither is given: top-left causal
    vis = dict(mask=mask, varlen_starts=starts, varlen_ends=ends, key_positions=key_positions)
    return b, sq, sk, vis, length


def _seam_tensors(b, sq, sk, absorbed: bool, heads_kv: int, gen, dtype):
    h, rank, rope, d, dv = 4, 16, 8, 20, 12
    if absorbed:
        q = torch.randn(sq, b, h, rank + rope, generator=gen, dtype=dtype)
        k = torch.randn(sk, b, 1, rank + rope, generator=gen, dtype=dtype)
        v, up = None, torch.randn(h, dv, rank, generator=gen, dtype=dtype) * 0.3
    else:
        q = torch.randn(sq, b, h, d, generator=gen, dtype=dtype)
        k = torch.randn(sk, b, heads_kv, d, generator=gen, dtype=dtype)
        v, up = torch.randn(sk, b, heads_kv, dv, generator=gen, dtype=dtype), None
    config = types.SimpleNamespace(kv_lora_rank=rank, attention_backend="auto", dsa_kernel_backend="none")
    return dict(absorbed_mla=absorbed, query=q, key=k, value=v, up_v_weight=up, config=config,
                softmax_scale=(d if not absorbed else rank + rope) ** -0.5 * 1.3)


def _leaves(kw):
    return [kw[n] for n in ("query", "key", "value", "up_v_weight") if kw[n] is not None]


SEAM_CASES = ["causal", "thd", "cp-rows", "key-positions", "mask", "mask-2d", "none", "topk-length"]
SHAPES = {"absorbed": (True, 1), "mha": (False, 4), "mqa": (False, 1)}


@needs_019
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("case", SEAM_CASES)
def test_seam_matches_the_oracle(case, shape):
    gen = torch.Generator().manual_seed(SEAM_CASES.index(case))
    b, sq, sk, vis, length = _seam_case(case, gen)
    absorbed, heads_kv = SHAPES[shape]
    kw = _seam_tensors(b, sq, sk, absorbed, heads_kv, gen, torch.float64)
    kw.update(vis, topk_indices=_indices(b, sq, sk, 6, gen), topk_length=length)
    for t in _leaves(kw):
        t.requires_grad_(True)
    module = types.SimpleNamespace(backend="torch")
    got = SEAM.replacement(module, **kw)
    ref = run_sparse_attention_ref(**kw)
    torch.testing.assert_close(got, ref, **F64)
    grad = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    for name, g, r in zip(("query", "key", "value/up_v_weight"), torch.autograd.grad(got, _leaves(kw), grad),
                          torch.autograd.grad(ref, _leaves(kw), grad)):
        torch.testing.assert_close(g, r, **F64, msg=lambda m: f"d{name}: {m}")
    if length is None:  # Megatron's own (unfused) step ignores topk_length; its fused cuDNN step reads it
        fp32 = {n: (v.detach().float() if torch.is_tensor(v) and v.is_floating_point() and n != "mask" else v)
                for n, v in kw.items()}
        fp32["topk_indices"] = _without_duplicates(kw["topk_indices"])
        mega = dsa._run_sparse_attention(**fp32)
        torch.testing.assert_close(mega, ref.float(), msg=lambda m: f"Megatron's own step vs the oracle: {m}")


@needs_019
@pytest.mark.parametrize("validate", ["", "0"], ids=["cpu-checks", "as-on-a-device"])
def test_seam_refuses_a_mask_with_a_finite_bias(validate, monkeypatch):
    """A finite bias other than 0 at a selected key: ValueError where coreattn reads values (CPU), and
    where it does not (a device: COREATTN_VALIDATE=0 runs the CPU path so) a NaN output with no host
    read and no device-side assert (which would kill a CUDA context); a good mask is untouched."""
    monkeypatch.setenv("COREATTN_VALIDATE", validate)
    gen = torch.Generator().manual_seed(0)
    b, sq, sk, vis, _ = _seam_case("mask", gen)
    good = vis["mask"]
    vis["mask"] = good.masked_fill(good == 0, 0.5)
    kw = _seam_tensors(b, sq, sk, True, 1, gen, torch.float64)
    kw.update(vis, topk_indices=_indices(b, sq, sk, 6, gen))
    module = types.SimpleNamespace(backend="torch")
    if not validate:
        with pytest.raises(ValueError, match="0/-inf masks only"):
            SEAM.replacement(module, **kw)
        return
    assert SEAM.replacement(module, **kw).isnan().all()
    kw["mask"] = good
    assert not SEAM.replacement(module, **kw).isnan().any()


@needs_016
@pytest.mark.parametrize("heads_kv", [4])
def test_seam_matches_the_oracle_v016(heads_kv):
    gen = torch.Generator().manual_seed(0)
    b, sq, sk = 2, 12, 12
    kw = _seam_tensors(b, sq, sk, False, heads_kv, gen, torch.float64)
    q, k, v = kw["query"], kw["key"], kw["value"]
    idx = _indices(b, sq, sk, 6, gen, row_has_self=True)
    idx[idx < 0] = 0  # 0.16's step scatters every entry: no -1
    for t in (q, k, v):
        t.requires_grad_(True)
    got = SEAM.replacement(types.SimpleNamespace(backend="torch"), q, k, v, idx, kw["softmax_scale"])
    ref = unfused_dsa_fn_ref(q, k, v, idx, kw["softmax_scale"])
    torch.testing.assert_close(got, ref, **F64)
    grad = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    for g, r in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(g, r, **F64)
    mega = dsa.unfused_dsa_fn(q.detach().float(), k.detach().float(), v.detach().float(), idx, kw["softmax_scale"])
    torch.testing.assert_close(mega, ref.float())


# ---------------------------------------------------------------- 2. the hook

def _hooked():
    """Megatron's functions the dispatchers stand in for, as they are now."""
    return getattr(dsa, SEAM.name), getattr(getattr(dsa, "dsa_kernels", None), "run_fused_dsa_attention", None)


def test_megatron_functions_are_back_after_routing():
    before = _hooked()
    module = types.SimpleNamespace(backend="torch")
    with routed(module):
        assert getattr(dsa, SEAM.name) is not before[0]
        with routed(module):  # nested: still routed after the inner one ends
            pass
        assert getattr(dsa, SEAM.name) is not before[0]
    assert _hooked() == before and dsa_attention._users == 0
    with pytest.raises(ZeroDivisionError):
        with routed(module):
            1 / 0
    assert _hooked() == before and dsa_attention._users == 0


@needs_019
def test_only_calls_inside_a_coreattn_forward_are_routed(monkeypatch):
    """While one thread is inside a CoreDSAttention forward, another thread's DSAttention runs
    Megatron's own step; calls inside the forward run coreattn's."""
    gen = torch.Generator().manual_seed(0)
    b, sq, sk, vis, _ = _seam_case("causal", gen)
    kw = _seam_tensors(b, sq, sk, True, 1, gen, torch.float32)
    kw.update(vis, topk_indices=_indices(b, sq, sk, 6, gen))
    calls = []
    megatron_step = getattr(dsa, SEAM.name)
    monkeypatch.setattr(dsa, SEAM.name, lambda **k: calls.append("megatron") or megatron_step(**k))
    coreattn_step = SEAM.replacement
    monkeypatch.setattr(SEAM, "replacement", lambda m, **k: calls.append("coreattn") or coreattn_step(m, **k))
    with routed(types.SimpleNamespace(backend="torch")):
        other = threading.Thread(target=lambda: getattr(dsa, SEAM.name)(**kw))
        other.start()
        other.join()
        getattr(dsa, SEAM.name)(**kw)
    assert calls == ["megatron", "coreattn"]


def test_a_seam_of_another_shape_raises_naming_the_version(monkeypatch):
    original = getattr(dsa, SEAM.name)

    def widened(*args, attention_sink=None, **kwargs):  # a parameter coreattn does not read
        return original(*args, **kwargs)

    widened.__signature__ = inspect.Signature(
        list(inspect.signature(original).parameters.values())
        + [inspect.Parameter("attention_sink", inspect.Parameter.KEYWORD_ONLY, default=None)])
    monkeypatch.setattr(dsa, SEAM.name, widened)
    with pytest.raises(ImportError, match=f"megatron-core {MEGATRON_VERSION}.*{SEAM.name}"):
        dsa_attention._find_seam()
    monkeypatch.setattr(dsa, SEAM.name, original)
    monkeypatch.setattr(dsa.DSAttention, "forward", lambda self, *a, **k: None)
    with pytest.raises(ImportError, match=f"megatron-core {MEGATRON_VERSION}: DSAttention.forward calls neither"):
        dsa_attention._find_seam()


# ---------------------------------------------------------------- 3. whole models

@pytest.fixture
def dsa_cpu(megatron_cpu, megatron_cpu_shims, monkeypatch):
    install_shims(monkeypatch)
    monkeypatch.setattr(dsa.DSAIndexerLossAutoScaler, "main_loss_backward_scale", torch.tensor(1.0))


class Batch(NamedTuple):
    ids: torch.Tensor
    pos: torch.Tensor
    mask: torch.Tensor | None
    params: object
    weight: torch.Tensor


def make_batch(layout: str, seed: int = 0) -> Batch:
    """sbhd: 2 x 16 tokens; thd: packed 5, 11, 1 and 7 tokens; mask: 2 x 12 tokens under a boolean
    [b, 1, s, s] mask (causal, the second sample left-padded by 3)."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "thd":
        lens = (5, 11, 1, 7)
        ids = torch.randint(0, VOCAB, (1, sum(lens)), generator=gen)
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        return Batch(ids, pos, None, packed_params(lens), torch.randn(1, sum(lens), VOCAB, generator=gen))
    b, s = (2, 16) if layout == "sbhd" else (2, 12)
    ids = torch.randint(0, VOCAB, (b, s), generator=gen)
    mask = None
    if layout == "mask":
        keep = torch.ones(b, s, dtype=torch.bool)
        keep[1, :3] = False
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None] | ~keep[:, None, None, :]
    return Batch(ids, torch.arange(s).expand(b, s), mask, None, torch.randn(b, s, VOCAB, generator=gen))


def model_spec(variant: str, config):
    """Megatron's own DSA spec (absorbed MLA), or (``per-head``) an MLA layer whose core attention is
    Megatron's DSAttention with per-head K and V (0.19's non-absorbed path)."""
    spec = dsa_block_spec(config)
    if variant == "mask":  # DSAttention reads the boolean attention_mask when no mask type is set
        for layer in spec.layer_specs:
            layer.submodules.self_attention.params["attn_mask_type"] = None
    if variant == "per-head":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        layer = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm")
        dsa_entry = spec.layer_specs[0].submodules.self_attention.submodules.core_attention
        layer.submodules.self_attention.submodules.core_attention = copy.deepcopy(dsa_entry)
        return layer
    return spec


class _IndexerLossInFloat32:
    """Megatron's indexer loss computes in float32 whatever its inputs' dtype (and its backward raises
    on float64 ones): the float64 reference model runs it on float32 copies, as it would run."""

    megatron = getattr(dsa, "FusedDSAIndexerLoss", None)  # 0.17+

    @classmethod
    def apply(cls, q, weights, k, query, key, *rest):
        topk, loss = cls.megatron.apply(q.float(), weights.float(), k.float(), query.float(), key.float(), *rest)
        return topk, loss.to(q.dtype)


def _indexer_in_float32(forward_with_scores):
    """megatron-core 0.16's indexer adds a float32 mask to scores of its own dtype (float64 raises):
    the float64 reference keeps the indexer in float32 and hands it float32 inputs."""
    def run(self, x, qr, *args, **kwargs):
        index_scores, topk = forward_with_scores(self, x.float(), qr.float(), *args, **kwargs)
        return index_scores.to(x.dtype), topk

    return run


def _recording(fn, seen: list, calls: list | None):
    """``fn`` (Megatron's step, or with ``calls`` coreattn's, module first) recording the top-k
    indices it gets (and, into ``calls``, the module and all its arguments by name)."""
    def record(*args, **kwargs):
        named = dict(zip(SEAM.params, args[1:] if calls is not None else args), **kwargs)
        seen.append(named["topk_indices"])
        if calls is not None:
            calls.append((args[0], {n: v.detach() if torch.is_tensor(v) else v for n, v in named.items()}))
        return fn(*args, **kwargs)

    return record


def run_model(model, batch: Batch, monkeypatch, step=None, calls: list | None = None):
    """Logits, the indexer loss logged per layer, the parameter gradients of a fixed linear loss and
    the top-k indices each layer's sparse attention got. ``step`` replaces Megatron's sparse-attention
    step for this run (the float64 oracle); a float64 model runs Megatron's indexer loss in float32."""
    seen = []
    with monkeypatch.context() as patch:
        if isinstance(model.decoder.layers[0].self_attention.core_attention, CoreDSAttention):
            patch.setattr(SEAM, "replacement", _recording(SEAM.replacement, seen, calls))
        else:
            patch.setattr(dsa, SEAM.name, _recording(step or getattr(dsa, SEAM.name), seen, None))
        if model.output_layer.weight.dtype == torch.float64 and hasattr(dsa, "FusedDSAIndexerLoss"):
            patch.setattr(dsa, "FusedDSAIndexerLoss", _IndexerLossInFloat32)
        elif model.output_layer.weight.dtype == torch.float64:  # 0.16
            patch.setattr(dsa.DSAIndexer, "forward_with_scores", _indexer_in_float32(dsa.DSAIndexer.forward_with_scores))
        dsa.DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
        model.zero_grad(set_to_none=True)
        logits = model(batch.ids, batch.pos, attention_mask=batch.mask, packed_seq_params=batch.params)
        (logits * batch.weight.to(logits.dtype)).sum().backward()
    losses = dsa.DSAIndexerLossLoggingHelper.tracker["values"].clone()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), losses, grads, seen


def assert_seam_criterion(layer: int, module, kwargs: dict, gen) -> None:
    """One layer's sparse-attention step on the inputs Megatron handed it in the model: coreattn's
    against the float64 oracle, relative to Megatron's own step in float32 (flash criterion), the
    output and the gradients of query, key and value / up_v_weight under a random incoming gradient."""
    names = [n for n in ("query", "key", "value", "up_v_weight") if kwargs.get(n) is not None]
    results = []
    steps = ((torch.float32, functools.partial(SEAM.replacement, module)), (torch.float64, ORACLE_STEP),
             (torch.float32, getattr(dsa, SEAM.name)))
    for dtype, fn in steps:
        kw = dict(kwargs, **{n: kwargs[n].to(dtype).requires_grad_(True) for n in names})
        out = fn(**kw)
        results.append((out, kw))
    grad = torch.randn(results[0][0].shape, generator=gen, dtype=torch.float64)
    (got, kg), (ref, kr), (naive, kn) = results
    assert_flash_criterion(f"layer {layer} sparse attention", got, naive, ref)
    dg = torch.autograd.grad(got, [kg[n] for n in names], grad.float())
    dr = torch.autograd.grad(ref, [kr[n] for n in names], grad)
    dn = torch.autograd.grad(naive, [kn[n] for n in names], grad.float())
    for name, g, r, n in zip(names, dg, dr, dn):
        assert_flash_criterion(f"layer {layer} sparse attention d{name}", g, n, r)


TRITON = pytest.mark.interpreter_only("Megatron on CPU (gloo, CPU shims): the Triton kernels on CPU tensors")
MODEL_CASES = [
    ("sbhd", "torch", "absorbed"), ("thd", "torch", "absorbed"),
    pytest.param("sbhd", "triton", "absorbed", marks=TRITON), pytest.param("thd", "triton", "absorbed", marks=TRITON),
    ("thd", "torch", "index-sharing"), ("sbhd", "torch", "index-sharing"), ("mask", "torch", "mask"),
    ("sbhd", "torch", "per-head"), ("thd", "torch", "per-head"),
]


def compare_with_megatron(config, spec, backend: str, batch: Batch, monkeypatch) -> list:
    """Megatron's own DSA model, the same spec through use_coreattn and the float64 reference, same
    weights, on ``batch``: the checks of section 3 of the module docstring. Returns what each layer
    handed coreattn's sparse-attention step."""
    megatron_model = build(config, spec)
    model = build(config, use_coreattn(spec, backend=backend))
    model.load_state_dict(megatron_model.state_dict())  # the same parameters and state-dict keys
    reference = build(config, spec)
    reference.load_state_dict(megatron_model.state_dict())
    reference.double()
    if not hasattr(dsa, "FusedDSAIndexerLoss"):  # 0.16: its indexer runs in float32 (_indexer_in_float32)
        for layer in reference.decoder.layers:
            layer.self_attention.core_attention.indexer.float()
    attentions = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert all(isinstance(attention, CoreDSAttention) for attention in attentions)

    calls = []
    got = run_model(model, batch, monkeypatch, calls=calls)
    naive = run_model(megatron_model, batch, monkeypatch)
    ref = run_model(reference, batch, monkeypatch, step=ORACLE_STEP)
    assert len(calls) == config.num_layers, "each layer's sparse attention ran on coreattn"
    for i, (a, r, n) in enumerate(zip(got[3], ref[3], naive[3])):  # else a near-tie moved: change the seed
        assert torch.equal(a, r) and torch.equal(n, r), f"layer {i + 1}: the indexers picked different keys"
    if getattr(config, "dsa_indexer_topk_freq", 1) > 1:  # layer 2 reuses layer 1's top-k
        assert torch.equal(got[3][1], got[3][0]) and attentions[1].indexer is None
    assert_flash_criterion("logits", got[0], naive[0], ref[0])
    computing = torch.tensor([attention.indexer is not None for attention in attentions])
    assert (got[1][computing] > 0).all() and (got[1][~computing] == 0).all(), got[1]  # logged by computing layers
    assert_flash_criterion("logged indexer loss", got[1], naive[1], ref[1])
    assert got[2].keys() == ref[2].keys() == naive[2].keys()
    for name, grad in got[2].items():
        assert_flash_criterion(f"grad {name}", grad, naive[2][name], ref[2][name])
    gen = torch.Generator().manual_seed(1)
    for layer, (module, kwargs) in enumerate(calls, 1):
        assert_seam_criterion(layer, module, kwargs, gen)
    return calls


@needs_019
@pytest.mark.usefixtures("dsa_cpu")
@pytest.mark.parametrize("layout,backend,variant", MODEL_CASES)
def test_model_matches_megatron(layout, backend, variant, monkeypatch):
    share = dict(dsa_indexer_topk_freq=2) if variant == "index-sharing" else {}
    per_head = dict(q_lora_rank=None) if variant == "per-head" else {}
    config = dsa_config(init_method_std=INIT_STD, **share, **per_head)
    compare_with_megatron(config, model_spec(variant, config), backend, make_batch(layout), monkeypatch)


@needs_016
@pytest.mark.usefixtures("dsa_cpu")
def test_model_matches_megatron_v016(monkeypatch):
    """megatron-core 0.16's DSA (MLA with per-head K and V, sbhd only, causal)."""
    config = dsa_config(init_method_std=INIT_STD)
    compare_with_megatron(config, dsa_block_spec(config), "torch", make_batch("sbhd"), monkeypatch)


@needs_019
@pytest.mark.usefixtures("dsa_cpu")
def test_the_fully_fused_hook_is_declined(monkeypatch):
    """With a fused DSA backend configured, Megatron would hand indexer and attention to its fully
    fused hook (cuDNN) when it accepts; a CoreDSAttention declines it and Megatron's fused top-k hooks
    (TileLang), so one layer's indexer and sparse attention both run on coreattn."""
    kernels = dsa.dsa_kernels
    reached = []
    monkeypatch.setattr(kernels, "use_fused_dsa_kernels", lambda config: True)
    monkeypatch.setattr(kernels, "run_fused_dsa_attention", lambda **kw: reached.append("fused") or 1 / 0)
    for hook in ("run_fused_qk_topk", "run_fused_qk_topk_with_loss"):
        monkeypatch.setattr(kernels, hook, lambda *a, **kw: reached.append("topk") and None)
    config = dsa_config(init_method_std=INIT_STD, dsa_indexer_use_sparse_loss=True)
    spec = dsa_block_spec(config)
    with pytest.raises(ZeroDivisionError):  # Megatron's own DSAttention hands the layer to the fused hook
        run_model(build(config, spec), make_batch("sbhd"), monkeypatch)
    assert reached == ["fused"]
    reached.clear()
    calls = []
    got = run_model(build(config, use_coreattn(spec, backend="torch")), make_batch("sbhd"), monkeypatch, calls=calls)
    assert len(calls) == 2 and reached == []  # coreattn's indexer: the fused top-k + loss hooks are declined unasked
    assert torch.isfinite(got[0]).all()
    assert kernels.run_fused_dsa_attention.__name__ == "<lambda>"  # put back


INDEXER_CASES = [("sbhd", True, False, False), ("thd", True, False, True), ("sbhd", True, True, True),
                 ("thd", False, False, False), ("sbhd", False, True, False)]


@needs_019
@pytest.mark.usefixtures("dsa_cpu")
@pytest.mark.parametrize("layout,training,sparse,rotate", INDEXER_CASES,
                         ids=[f"{l}-{'train' if t else 'eval'}-{'sparse' if s else 'dense'}{'-rotate' if r else ''}"
                              for l, t, s, r in INDEXER_CASES])
def test_the_indexer_runs_on_coreattn(layout, training, sparse, rotate, monkeypatch):
    """Through use_coreattn, the indexer's top-k (and, training, its loss) and the Hadamard rotation run
    on coreattn's indexer ops: Megatron's S x S scoring (``_compute_index_scores``) raises if reached,
    and its rotation would raise here (bf16 only, fast_hadamard_transform absent) where the indexer
    computes in float32. The layers still log their indexer loss when training."""
    import coreattn.layers.dsa.indexer as ix

    assert dsa_attention.INDEXER_ON_COREATTN, dsa_attention.INDEXER_REASON
    monkeypatch.setattr(dsa, "_compute_index_scores", lambda *a, **kw: 1 / 0)
    seen = []
    for name in ("indexer_topk", "indexer_topk_and_loss", "rotate_activation"):
        monkeypatch.setattr(ix, name, functools.partial(lambda fn, name, *a, **kw: seen.append(name) or fn(*a, **kw),
                                                        getattr(ix, name), name))
    config = dsa_config(init_method_std=INIT_STD, dsa_indexer_use_sparse_loss=sparse,
                        dsa_indexer_rotate_activation=rotate, dsa_indexer_scoring_relu=True)
    model = build(config, use_coreattn(dsa_block_spec(config), backend="torch"))
    batch = make_batch(layout)
    if training:
        logits, losses, grads, indices = run_model(model, batch, monkeypatch)
        assert all(torch.isfinite(g).all() for g in grads.values()) and len(indices) == config.num_layers
        assert any(n.endswith("indexer.linear_wq_b.weight") for n in grads), "the indexer loss trains the indexer"
    else:
        model.eval()
        dsa.DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
        with torch.no_grad():
            logits = model(batch.ids, batch.pos, attention_mask=batch.mask, packed_seq_params=batch.params)
        losses = dsa.DSAIndexerLossLoggingHelper.tracker.get("values", torch.zeros(config.num_layers))
    step = "indexer_topk_and_loss" if training else "indexer_topk"
    assert seen == (["rotate_activation"] * 2 * rotate + [step]) * config.num_layers
    assert torch.isfinite(logits).all()
    assert (losses > 0).all() if training else (losses == 0).all(), losses


TRAIN_STEPS, LR = 3, 0.05


@needs_019
@pytest.mark.usefixtures("dsa_cpu")
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_two_layer_model_trains_like_megatron(layout, monkeypatch):
    """A 2-layer DSA GPTModel trained a few SGD steps through use_coreattn (indexer and sparse attention
    on coreattn) and Megatron's own model from the same weights: at every step the loss and each
    layer's logged indexer loss meet the flash criterion against a float64 copy trained alongside
    (err(coreattn) <= 2 * err(Megatron) + 1e-5 of the value), each model following its own trajectory."""
    config = dsa_config(init_method_std=INIT_STD)  # identity scoring: ReLU's exact ties at 0 rank by rule
    spec = dsa_block_spec(config)
    megatron_model = build(config, spec)
    model = build(config, use_coreattn(spec, backend="torch"))
    model.load_state_dict(megatron_model.state_dict())
    reference = build(config, spec)
    reference.load_state_dict(megatron_model.state_dict())
    reference.double()
    batch = make_batch(layout)
    for step in range(TRAIN_STEPS):
        results = []
        for m in (model, megatron_model, reference):
            logits, losses, grads, _ = run_model(m, batch, monkeypatch)
            results.append(((logits.double() * batch.weight.double()).sum(), losses))
            with torch.no_grad():
                for name, param in m.named_parameters():
                    if name in grads:
                        param -= LR * grads[name]
        (loss, ilosses), (loss_m, ilosses_m), (loss_r, ilosses_r) = results
        assert_flash_criterion(f"step {step} loss", loss[None], loss_m[None], loss_r[None], eps=1e-5 * abs(loss_r))
        assert_flash_criterion(f"step {step} indexer losses", ilosses, ilosses_m, ilosses_r,
                               eps=1e-5 * ilosses_r.abs().max())


def _core_attentions(spec) -> list:
    layers = spec.layer_specs if hasattr(spec, "layer_specs") else [spec]  # 0.16: one layer spec
    return [layer.submodules.self_attention.submodules.core_attention for layer in layers]


@pytest.mark.usefixtures("dsa_cpu")
def test_use_coreattn_swaps_dsattention(caplog):
    config = dsa_config()
    spec = dsa_block_spec(config)
    before = _core_attentions(spec)
    with caplog.at_level("WARNING", logger="coreattn"):
        swapped = use_coreattn(spec)
        pinned = use_coreattn(spec, backend="torch")
    assert "kept" not in caplog.text
    assert all(e.module is dsa.DSAttention for e in _core_attentions(spec)), "the input spec must not change"
    for entry, old in zip(_core_attentions(swapped), before):
        assert entry.module is CoreDSAttention and entry.params == old.params and entry.submodules == old.submodules
    assert all(e.params == {"backend": dsa_attention.Backend.TORCH} for e in _core_attentions(pinned))
    again = use_coreattn(pinned)  # idempotent, keeps the pinned backend
    assert all(e.module is CoreDSAttention and e.params == {"backend": "torch"} or e.params["backend"] == "torch"
               for e in _core_attentions(again))

    custom = type("MyDSAttention", (dsa.DSAttention,), {})  # someone's own subclass: not replaced
    _core_attentions(spec)[0].module = custom
    with caplog.at_level("WARNING", logger="coreattn"):
        kept = use_coreattn(spec)
    assert _core_attentions(kept)[0].module is custom and "MyDSAttention" in caplog.text


@pytest.mark.usefixtures("dsa_cpu")
def test_backend_override_reaches_the_module(monkeypatch):
    config = dsa_config()
    model = build(config, use_coreattn(dsa_block_spec(config), backend="torch"))
    assert model.decoder.layers[0].self_attention.core_attention.backend.value == "torch"
    config.coreattn_backend = "triton"
    model = build(config, use_coreattn(dsa_block_spec(config)))
    assert model.decoder.layers[0].self_attention.core_attention.backend.value == "triton"
    config.coreattn_backend = "npu_fused"  # dense attention's Ascend op: the sparse default instead
    model = build(config, use_coreattn(dsa_block_spec(config)))
    assert model.decoder.layers[0].self_attention.core_attention.backend is None
    with pytest.raises(ValueError, match="not a coreattn backend"):
        config.coreattn_backend = "cuda"
        build(config, use_coreattn(dsa_block_spec(config)))


# ---------------------------------------------------------------- 4. two gloo processes

THD_REAL, THD_PADDED = (5, 11, 7), (8, 12, 8)  # context parallelism: each sequence padded to a multiple of 2 * cp


def parallel_batch(layout: str, mode: str, world: int, rank: int) -> Batch:
    """Sequence parallelism: every rank holds the whole batch (Megatron splits it) and its vocabulary
    block of the logits. Context
    parallelism: this rank's zig-zag share (sbhd: 2 x 16 tokens; thd: sequences of 5, 11 and 7
    tokens padded to 8, 12 and 8), cut as Megatron's get_batch_on_this_cp_rank cuts it."""
    from coreattn.layers.context_parallel.indices import cp_partition_indices, cp_partition_indices_sbhd

    if mode == "sp":  # the logits are vocab-parallel: this rank's block of the loss weights
        full, part = make_batch(layout), VOCAB // world
        return full._replace(weight=full.weight[..., rank * part:(rank + 1) * part])
    gen = torch.Generator().manual_seed(0)
    if layout == "sbhd":
        full = make_batch("sbhd")
        index = cp_partition_indices_sbhd(full.ids.shape[1], world, rank)
        return Batch(full.ids[:, index], full.pos[:, index], None, None, full.weight[:, index])
    total = sum(THD_PADDED)
    params = packed_params(THD_REAL, THD_PADDED)
    index = cp_partition_indices(params.cu_seqlens_q_padded, world, rank, total=total)
    ids = torch.randint(0, VOCAB, (1, total), generator=gen)
    pos = torch.cat([torch.arange(n) for n in THD_PADDED])[None]
    weight = torch.randn(1, total, VOCAB, generator=gen)
    return Batch(ids[:, index], pos[:, index], None, params, weight[:, index])


def _parallel_worker(rank: int, world: int, init_file: str) -> None:
    """One rank: Megatron's DSA model, CoreDSAttention's and the reference, compared on this rank,
    under context parallelism (cp_comm_type "allgather"; sbhd and thd), then under sequence
    parallelism (TP 2; sbhd)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    import megatron.core.transformer.multi_latent_attention as mla

    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: "cpu"  # the test-only CPU shims, in this child process
    if not isinstance(getattr(mla, "TELinear", None), type):
        mla.TELinear = type("NoTELinear", (), {})
    install_shims()
    # under sequence parallelism Megatron draws dropout inside its CUDA RNG tracker, which has no CPU
    # state; the models have no dropout
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    dsa.DSAIndexerLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    runs = [("cp", dict(context_parallel_size=world, cp_comm_type="allgather"), ("sbhd", "thd")),
            ("sp", dict(tensor_model_parallel_size=world, sequence_parallel=True), ("sbhd",))]
    try:
        for mode, sizes, layouts in runs:
            parallel_state.initialize_model_parallel(**{k: v for k, v in sizes.items() if k.endswith("_size")})
            config = dsa_config(init_method_std=INIT_STD, **sizes)
            for layout in layouts:
                batch = parallel_batch(layout, mode, world, rank)
                try:
                    calls = compare_with_megatron(config, dsa_block_spec(config), "torch", batch, pytest.MonkeyPatch())
                    for _, kw in calls:  # what the step got: local query rows and all keys / this rank's heads
                        q, k = kw["query"], kw["key"]
                        assert (q.shape[0] * world, q.shape[2]) == (k.shape[0], 4) if mode == "cp" else \
                            (q.shape[0], q.shape[2]) == (k.shape[0], 4 // world), (q.shape, k.shape)
                except AssertionError as exc:
                    raise AssertionError(f"{mode} {layout}, rank {rank}: {exc}") from exc
            parallel_state.destroy_model_parallel()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@needs_019
@pytest.mark.usefixtures("megatron_cpu")
def test_parallel_models_match_megatron(tmp_path):
    """Two gloo processes; on each rank the three models of section 3 under context parallelism
    (cp 2, cp_comm_type "allgather", the only one Megatron's DSA takes; local query rows against all
    keys) and sequence parallelism (TP 2, which absorbed MLA requires with TP; heads split over TP):
    what Megatron hands the sparse-attention step there runs on coreattn."""
    import torch.multiprocessing as mp

    mp.spawn(_parallel_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


@needs_019
def test_layer_bench_smoke():
    """``python -m bench.dsa_layer`` (docs/dsa-indexer.md's one-layer memory figures) runs both
    providers at a small T, each in its own process, and reports time and memory growth."""
    from bench import dsa_layer

    rows = dsa_layer.run([96], ["coreattn", "megatron"], quick=True)
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    assert all(r["extra_mib"] is not None and r["s"] > 0 for r in rows)
