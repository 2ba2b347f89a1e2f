"""A new packed batch never changes the attention kernels' compile key (no recompiles), checked on
CPU by recording the launchers' arguments instead of launching.

Triton specializes an int argument that is not in ``do_not_specialize`` on its value being 1
(it becomes a constexpr) and on its divisibility by 16; the kernels would then compile a variant
per class. So across batches of different lengths, every int argument outside
``do_not_specialize`` must keep its class. (test_gpu.py checks the same on a real GPU cache.)
"""

import inspect

import pytest
import torch

from coreattn.kernels import attn_bwd, attn_fwd, sparse_bwd, sparse_fwd, sparse_index, tile_map
from coreattn.kernels.packing import Packing, packed

H, HKV, DQK, DV = 4, 2, 40, 24  # H * D multiples of 16, as in real models
KERNELS = {"fwd": (attn_fwd, "_varlen_attn_fwd_kernel"),
           "pre": (attn_bwd, "_attn_bwd_preprocess_kernel"),
           "dkdv": (attn_bwd, "_attn_bwd_dkdv_kernel"),
           "dq": (attn_bwd, "_attn_bwd_dq_kernel"),
           "scan": (tile_map, "_tile_scan_kernel"),
           "map": (tile_map, "_tile_map_kernel")}
LAUNCHES = {"fwd": 1, "pre": 1, "dkdv": 1, "dq": 1, "scan": 2, "map": 3}  # per forward + backward


def _spec_class(value):
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return "one" if value == 1 else "div16" if value % 16 == 0 else "plain"


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kw)`` records the int arguments by name."""

    def __init__(self, real, calls):
        self.real, self.calls = real, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = dict(zip(self.real.arg_names, args), **kwargs)
            self.calls.append({k: v for k, v in named.items() if _spec_class(v) is not None})
        return launch


def _thd(lens):
    t = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v = torch.zeros(t, H, DQK), torch.zeros(t, HKV, DQK), torch.zeros(t, HKV, DV)
    return q, k, v, packed(cu), packed(cu), max(lens)


def _padded(layout, seqlen, batch=2):
    shape = (lambda h, d: (batch, seqlen, h, d)) if layout == "bshd" else (lambda h, d: (seqlen, batch, h, d))
    q, k, v = torch.zeros(shape(H, DQK)), torch.zeros(shape(HKV, DQK)), torch.zeros(shape(HKV, DV))
    start = torch.zeros(batch, dtype=torch.int32)
    length = torch.full((batch,), seqlen, dtype=torch.int32)
    keep = torch.ones(batch, seqlen, dtype=torch.uint8)
    pack = Packing(layout, start, length, keep)
    return q, k, v, pack, pack, seqlen


def _record(monkeypatch, inputs):
    calls = {name: [] for name in KERNELS}
    for name, (module, attr) in KERNELS.items():
        monkeypatch.setattr(module, attr, _Recorder(getattr(module, attr), calls[name]))
    q, k, v, q_pack, k_pack, max_len = inputs
    out, lse = attn_fwd.varlen_attn_fwd(q, k, v, q_pack, k_pack, max_len, 0.1, 3, 0, True)
    attn_bwd.varlen_attn_bwd(torch.zeros_like(out), q, k, v, out, lse, q_pack, k_pack, max_len, max_len, 0.1, 3, 0,
                             True)
    monkeypatch.undo()
    assert {n: len(c) for n, c in calls.items()} == LAUNCHES
    return {f"{name}{i}": call for name, c in calls.items() for i, call in enumerate(c)}


BATCHES = {
    "thd": [lambda: _thd((1,)), lambda: _thd((16,)), lambda: _thd((7,)), lambda: _thd((5, 0, 28))],
    "bshd": [lambda s=s: _padded("bshd", s) for s in (1, 16, 7, 33)],
    "sbhd": [lambda s=s: _padded("sbhd", s) for s in (1, 16, 7, 33)],
}


@pytest.mark.interpreter_only("records the launchers on CPU tensors, whose launch target is the interpreter "
                              "(tests/test_gpu.py checks the compile caches on a GPU)")
@pytest.mark.parametrize("layout", list(BATCHES))
def test_new_lengths_keep_every_specialized_argument_class(monkeypatch, layout):
    _assert_classes_kept(KERNELS, LAUNCHES, [_record(monkeypatch, make()) for make in BATCHES[layout]])


def _assert_classes_kept(kernels: dict, launches: dict, runs: list[dict]) -> None:
    """Every int argument outside a kernel's ``do_not_specialize`` takes one class in every run."""
    for name, (module, attr) in kernels.items():
        kernel = getattr(module, attr)
        free = set(getattr(kernel, "kwargs", {}).get("do_not_specialize") or
                   [p.name for p in kernel.params if p.do_not_specialize])
        for launch in (f"{name}{i}" for i in range(launches[name])):
            for arg in runs[0][launch]:
                if arg in free:
                    continue
                classes = {_spec_class(run[launch][arg]) for run in runs}
                assert len(classes) == 1, f"{attr}: {arg} is specialized and takes {[r[launch][arg] for r in runs]}"


SPARSE_KERNELS = {"fwd": (sparse_fwd, "_sparse_attn_fwd_kernel"), "pre": (sparse_bwd, "_attn_bwd_preprocess_kernel"),
                  "dq": (sparse_bwd, "_sparse_attn_dq_kernel"), "dkv": (sparse_bwd, "_sparse_attn_dkv_kernel"),
                  "reduce": (sparse_bwd, "_sparse_attn_reduce_kernel"),
                  "keys": (sparse_bwd, "_sparse_attn_dkv_keys_kernel")}
# per forward + backward: the slot and range modes of fwd, dq and dK/dV, then one chunk's reduce (the
# token-centric schedule) or the key-centric dK/dV
SPARSE_LAUNCHES = {"partials": {"fwd": 2, "pre": 1, "dq": 2, "dkv": 2, "reduce": 1, "keys": 0},
                   "keys": {"fwd": 2, "pre": 1, "dq": 2, "dkv": 1, "reduce": 0, "keys": 1}}
SDQK, SDV = 48, 32  # one latent key head: its row a multiple of 16, as in real models (576)


def _sparse_record(monkeypatch, fmt, lens, n_slots, schedule="partials", heads=H, dims=(SDQK, SDV)):
    """The int arguments of every sparse kernel launch of one forward + backward (absorbed MLA, GQA
    of ``heads`` heads on one latent head), each token naming its whole causal range or part of it."""
    calls = {name: [] for name in SPARSE_KERNELS}
    for name, (module, attr) in SPARSE_KERNELS.items():
        monkeypatch.setattr(module, attr, _Recorder(getattr(module, attr), calls[name]))
    monkeypatch.setenv(sparse_bwd.ENV_SCHEDULE, schedule)
    dqk, dv = dims
    if fmt == "thd":
        tokens, seqlen = sum(lens), sum(lens)
        q, k = torch.zeros(tokens, heads, dqk), torch.zeros(tokens, 1, dqk)
    else:
        batch, seqlen = len(lens), max(lens)
        q, k = torch.zeros(batch, seqlen, heads, dqk), torch.zeros(batch, seqlen, 1, dqk)
        tokens = batch * seqlen
    pos = torch.arange(tokens, dtype=torch.int32) % seqlen
    lo, hi = torch.zeros(tokens, dtype=torch.int32), pos + 1
    topk = sparse_index.prepare_topk(torch.arange(n_slots).expand(tokens, n_slots), "thd")
    out, lse = sparse_fwd.sparse_attn_fwd(q, k, None, topk, lo, hi, fmt, 0.1, v_dim=dv)
    sparse_bwd.sparse_attn_bwd(torch.zeros_like(out), q, k, None, out, lse, topk, lo, hi, fmt, 0.1, v_dim=dv)
    monkeypatch.undo()
    assert {n: len(c) for n, c in calls.items()} == SPARSE_LAUNCHES[schedule]
    return {f"{name}{i}": call for name, c in calls.items() for i, call in enumerate(c)}


@pytest.mark.interpreter_only("records the launchers on CPU tensors, whose launch target is the interpreter "
                              "(tests/test_gpu.py checks the compile caches on a GPU)")
@pytest.mark.parametrize("schedule", list(SPARSE_LAUNCHES))
@pytest.mark.parametrize("fmt", ["thd", "bshd"])
def test_sparse_lengths_and_topk_keep_every_specialized_argument_class(monkeypatch, fmt, schedule):
    """The sparse kernels (both modes, both dK/dV schedules) across lengths and top-k of every class (1, a
    multiple of 16, neither), full rows and partial ones."""
    batches = [((1,), 1), ((16,), 16), ((7,), 33), ((5, 0, 28), 7), ((40, 3), 64)]
    _assert_classes_kept(SPARSE_KERNELS, SPARSE_LAUNCHES[schedule],
                         [_sparse_record(monkeypatch, fmt, lens, n_slots, schedule) for lens, n_slots in batches])


@pytest.mark.interpreter_only("records the launchers on CPU tensors, whose launch target is the interpreter "
                              "(tests/test_gpu.py checks the compile caches on a GPU)")
@pytest.mark.parametrize("schedule", list(SPARSE_LAUNCHES))
def test_sparse_bshd_rows_not_a_multiple_of_16_keep_every_class(monkeypatch, schedule):
    """bshd where H x D is not a multiple of 16 (3 heads of 40; the key's one head of 40): the batch
    strides S x H x D change their divisibility by 16 with S's parity. They are never specialized, and
    typed int64, so a stride past 2**31 changes no compile key either: one compile for every S."""
    batches = [((7, 3), 9), ((8, 2), 9), ((33, 1), 12), ((16, 16), 5)]
    _assert_classes_kept(SPARSE_KERNELS, SPARSE_LAUNCHES[schedule],
                         [_sparse_record(monkeypatch, "bshd", lens, n_slots, schedule, heads=3, dims=(40, 24))
                          for lens, n_slots in batches])
    for module, attr in SPARSE_KERNELS.values():
        params = inspect.signature(getattr(module, attr).fn).parameters
        if attr == "_attn_bwd_preprocess_kernel":  # the dense kernel's: never specialized, i32 below 2**31
            continue
        for name in sparse_fwd.BATCH_STRIDES:
            if name in params:
                assert "int64" in str(params[name].annotation), f"{attr}: {name} is not typed int64"
