"""Launch plans at production scale, on CPU: ``python -m bench.plan`` (docs/benchmarks.md).

A plan runs a public op's host path, forward and backward, on meta tensors (shapes and dtypes, no
storage), with the launch target forced to the arch being planned for (sm90, sm100, gfx942, ascend,
...) and every Triton launch recorded instead of run (``JITFunction.run`` and the interpreter's
``InterpretedFunction.run``, the one call every ``kernel[grid](...)`` ends in). Nothing is compiled
or executed, and a host read of a device value would fail (a meta tensor has none), so a plan also
shows that the path needs none. It records, per op:

- every launch: kernel, grid, num_warps, programs and work-items (programs x 32 (CUDA) or 64 (HIP)
  threads a warp x warps), its int arguments and constexpr flags, and the bytes of the tensors it is
  handed (an upper bound of what it touches);
- the torch ops the host side dispatches (views left out: they launch nothing), and the device memory
  it allocates: a TorchDispatchMode
  counts every new storage (tensors made before the op, its inputs, are not counted) until it is
  freed: ``peak_bytes`` live at once, ``kept_bytes`` still held at the end (the gradients).

``plan_op(op, shape, arch)`` returns an ``OpPlan``; ``OPS`` names the ops; ``sparse_bwd_summary``
the sparse backward's launches, programs and partial-buffer traffic (docs/dsa.md). The limits a
plan is checked against are coreattn/kernels/launch.py's, restated here (``within_limits``) so a
plan can be checked against code that does not fit its grids.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import math
import pkgutil
import sys
import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

CDNA = ("gfx90a", "gfx942", "gfx950")
ARCHS = ("sm80", "sm90", "sm100", "sm120", *CDNA, "ascend")
ASCEND_CORES = (24, 48)  # an Atlas A2 training chip (910B): AI cores (cube) and vector cores
CUDA_MAX_X, CUDA_MAX_YZ, HIP_WORK_ITEMS, ASCEND_MAX_GRID = 2**31 - 1, 65535, 2**32, 65535
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MAX_LAUNCHES = 10_000  # a plan stops there (a host loop whose launches grow with T^2 would go on for hours)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One op's problem. ``tokens``: query tokens of the whole batch; ``batch``: sequences (thd) or
    samples (bshd/sbhd, each ``tokens // batch`` long); ``key_rows``: key positions per sample
    (padded) or in all (thd), None for as many as the queries (context parallelism's all_gather: cp
    times that); ``heads``/``heads_kv``/``dim_qk``/``dim_v``: the attention's; ``absorbed``: sparse
    ops with V as K's first ``dim_v`` columns (v None); ``topk``: K; ``index_heads``/``index_dim``:
    the DSA indexer's."""

    tokens: int = 8192
    batch: int = 1
    heads: int = 128
    heads_kv: int = 1
    dim_qk: int = 576
    dim_v: int = 512
    absorbed: bool = True
    topk: int = 2048
    layout: str = "thd"
    key_rows: int | None = None
    index_heads: int = 64
    index_dim: int = 128
    dtype: str = "bf16"

    @property
    def seqlen(self) -> int:
        return self.tokens // self.batch

    @property
    def keys(self) -> int:
        """Key rows per sample (thd: in all)."""
        if self.key_rows is not None:
            return self.key_rows
        return self.tokens if self.layout == "thd" else self.seqlen

    @property
    def total_keys(self) -> int:
        return self.keys if self.layout == "thd" else self.keys * self.batch

    def label(self) -> str:
        kv = f"{self.dim_qk}/{self.dim_v}" + (" absorbed" if self.absorbed else "")
        keys = "" if self.key_rows is None else f" keys {self.key_rows}"
        return (f"{self.layout} T={self.tokens} B={self.batch}{keys} H={self.heads} Hkv={self.heads_kv} {kv} "
                f"K={self.topk} {self.dtype}")


PER_HEAD = dict(heads_kv=128, dim_qk=192, dim_v=128, absorbed=False)  # transformers' DSA models, plain MLA
ABSORBED = dict(heads_kv=1, dim_qk=576, dim_v=512, absorbed=True)  # Megatron's absorbed MLA (one latent head)


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple
    num_warps: int
    ints: dict
    flags: dict
    tensor_bytes: int

    @property
    def programs(self) -> int:
        return math.prod(self.grid)

    def work_items(self, arch: str) -> int:
        return self.programs * (64 if arch in CDNA else 32) * self.num_warps


def within_limits(launch: Launch, arch: str) -> str | None:
    """None when ``launch`` fits ``arch``'s grid limits, else the limit it passes."""
    x, y, z = (tuple(launch.grid) + (1, 1))[:3]
    if arch == "ascend":
        return None if launch.programs <= ASCEND_MAX_GRID else f"Ascend grid {launch.programs:,} > {ASCEND_MAX_GRID:,}"
    if y > CUDA_MAX_YZ or z > CUDA_MAX_YZ:
        return f"grid y/z {(y, z)} > {CUDA_MAX_YZ:,}"
    if x > CUDA_MAX_X:
        return f"grid x {x:,} > {CUDA_MAX_X:,}"
    if arch in CDNA and launch.work_items(arch) >= HIP_WORK_ITEMS:
        return f"HIP work-items {launch.work_items(arch):,} >= 2**32 ({launch.programs:,} programs x 64 x " \
               f"{launch.num_warps} warps)"
    return None


@dataclasses.dataclass
class OpPlan:
    op: str
    shape: Shape
    arch: str
    launches: list = dataclasses.field(default_factory=list)
    torch_ops: int = 0
    peak_bytes: int = 0
    kept_bytes: int = 0
    skipped: str | None = None

    @property
    def programs(self) -> int:
        return sum(launch.programs for launch in self.launches)

    def by_kernel(self) -> dict:
        """kernel -> (launches, programs)."""
        table: dict = {}
        for launch in self.launches:
            n, p = table.get(launch.kernel, (0, 0))
            table[launch.kernel] = (n + 1, p + launch.programs)
        return table


class TooManyLaunches(RuntimeError):
    pass


class _Memory(TorchDispatchMode):
    """Counts the storages the ops under it create (live and peak bytes) and the ops themselves.
    coreattn's custom ops (``torch.library``) are entered: their Python bodies run under it, so the
    ops and launches inside them count (on meta tensors torch would otherwise run their fake
    implementations, which launch nothing)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.ops = 0
        self._seen: dict[int, int] = {}

    def _track(self, out) -> None:
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st._cdata
            if key in self._seen:
                continue
            size = st.nbytes()
            self._seen[key] = size
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        opdef = _custom_op(func)
        if opdef is not None:  # run its Python body under this mode (func() would hide the ops inside)
            with self:
                return opdef._init_fn(*args, **kwargs)
        out = func(*args, **kwargs)
        if not func.is_view:  # a view launches nothing and aliases its input (whose meta storage it may not share)
            self.ops += 1
            self._track(out)
        return out


def _custom_op(func):
    from torch._library import custom_ops

    return custom_ops.OPDEFS.get(func._schema.name) if func.namespace == "coreattn" else None


def _load_coreattn() -> list:
    """Every coreattn module that may look the target up (kernels and layers, imported now so that
    every reference to the lookup can be replaced), and the others already imported."""
    import coreattn

    for info in pkgutil.walk_packages(coreattn.__path__, "coreattn."):
        if not info.name.startswith(("coreattn.kernels", "coreattn.layers")) or info.name.endswith("__main__"):
            continue
        with contextlib.suppress(Exception):
            importlib.import_module(info.name)
    return [m for name, m in sys.modules.items() if name.startswith("coreattn") and m is not None]


def _arg_names(kernel) -> list:
    return list(getattr(kernel, "arg_names", None) or [])


@contextlib.contextmanager
def planning(arch: str, sink: list, *, ascend_cores: tuple[int, int] = ASCEND_CORES):
    """Within: kernels launch for ``arch`` on meta tensors, and every launch is appended to ``sink``
    as a ``Launch`` instead of running."""
    from triton.runtime import interpreter, jit

    from coreattn.kernels.configs import targets
    from coreattn.layers import backends

    modules = _load_coreattn()
    real_target, real_grid = targets.target_of, targets.persistent_grid

    def persistent_grid(device, tasks, vector_only=False):
        return max(1, min(ascend_cores[1] if vector_only else ascend_cores[0], tasks, targets.MAX_PERSISTENT_GRID))

    def record(self, *args, grid, warmup, **kwargs):
        if warmup:
            return None
        named = dict(zip(_arg_names(self), args), **kwargs)
        if callable(grid):
            grid = grid(named)
        storages = {}
        for value in named.values():
            if isinstance(value, torch.Tensor):
                st = value.untyped_storage()
                storages[st._cdata] = st.nbytes()
        ints = {k: v for k, v in named.items() if isinstance(v, int) and not isinstance(v, bool)}
        flags = {k: v for k, v in named.items() if isinstance(v, bool)}
        name = getattr(getattr(self, "fn", None), "__name__", None) or getattr(self, "__name__", "?")
        sink.append(Launch(name, tuple(int(g) for g in grid), int(kwargs.get("num_warps") or 4), ints, flags,
                           sum(storages.values())))
        if len(sink) > MAX_LAUNCHES:
            raise TooManyLaunches(f"more than {MAX_LAUNCHES:,} launches")
        return None

    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    for module in modules:
        if getattr(module, "target_of", None) is real_target:
            patch(module, "target_of", lambda device: arch)
        if getattr(module, "persistent_grid", None) is real_grid:
            patch(module, "persistent_grid", persistent_grid)
    patch(jit.JITFunction, "run", record)
    patch(interpreter.InterpretedFunction, "run", record)
    registry = backends._REGISTRY
    real_triton = registry[backends.Backend.TRITON]
    registry[backends.Backend.TRITON] = lambda device: (
        backends.Availability(True, f"planned for {arch}") if device.type == "meta" else real_triton(device))
    try:
        yield
    finally:
        registry[backends.Backend.TRITON] = real_triton
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


# ---- the ops: each a function (shape, device) that makes the op's inputs (the caller's memory, not counted)
# and returns the call to plan: forward and backward (its incoming gradient made beforehand too)


def _t(*shape, dtype=None, grad=False, device="meta"):
    x = torch.empty(shape, dtype=dtype, device=device)
    return x.requires_grad_() if grad else x


def _cu(shape: Shape, device) -> torch.Tensor:
    return torch.empty(shape.batch + 1, dtype=torch.int32, device=device)


def _lead(shape: Shape, rows: int) -> tuple:
    """The token dims of ``rows`` rows per sample in the shape's layout."""
    if shape.layout == "thd":
        return (rows,)
    return (shape.batch, rows) if shape.layout == "bshd" else (rows, shape.batch)


def _qkv(shape: Shape, device, dense: bool = False):
    """q, k, v (v None when absorbed and not ``dense``) in the shape's layout, requiring grad."""
    dt = DTYPES[shape.dtype]
    lead_q = _lead(shape, shape.tokens if shape.layout == "thd" else shape.seqlen)
    lead_k = _lead(shape, shape.keys)
    q = _t(*lead_q, shape.heads, shape.dim_qk, dtype=dt, grad=True, device=device)
    k = _t(*lead_k, shape.heads_kv, shape.dim_qk, dtype=dt, grad=True, device=device)
    v = None if shape.absorbed and not dense else _t(*lead_k, shape.heads_kv, shape.dim_v, dtype=dt, grad=True,
                                                     device=device)
    return q, k, v


def _grad_out(q: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.empty(*q.shape[:-1], dim, dtype=q.dtype, device=q.device)


def _dense(shape: Shape, device) -> Callable:
    import coreattn

    q, k, v = _qkv(shape, device, dense=True)
    dout = _grad_out(q, shape.dim_v)
    cu_q, cu_k = _cu(shape, device), _cu(shape, device)

    def run():
        if shape.layout == "thd":
            out = coreattn.varlen_attn(q, k, v, cu_q, cu_k, shape.tokens, shape.total_keys, causal=True,
                                       backend="triton")
        else:
            out = coreattn.padded_attn(q, k, v, layout=shape.layout, causal=True, backend="triton")
        out.backward(dout)
    return run


WINDOW = 128  # the sparse_window op's key window (DeepSeek-V4's sliding window: 128 keys left of the token)


def _sparse(shape: Shape, device, atomic: bool = False, window: bool = False, backward: bool = True) -> Callable:
    import coreattn
    from coreattn.layers.dsa import sparse_function

    q, k, v = _qkv(shape, device)
    dout = _grad_out(q, shape.dim_v)
    idx = torch.empty(*_lead(shape, shape.tokens if shape.layout == "thd" else shape.seqlen), shape.topk,
                      dtype=torch.int32, device=device)
    cu_q, cu_k = _cu(shape, device), _cu(shape, device)
    v_dim = shape.dim_v if shape.absorbed else None
    extra = dict(key_window=(WINDOW - 1, 0)) if window else {}

    def run():
        real = sparse_function.TRITON
        if atomic:
            sparse_function.TRITON = real._replace(bwd=functools.partial(real.bwd, atomic=True))
        try:
            if shape.layout == "thd":
                out = coreattn.sparse_varlen_attn(q, k, v, idx, cu_q, cu_k, v_head_dim=v_dim, backend="triton",
                                                  **extra)
            else:
                out = coreattn.sparse_padded_attn(q, k, v, idx, layout=shape.layout, v_head_dim=v_dim,
                                                  backend="triton", **extra)
            if backward:
                out.backward(dout)
        finally:
            sparse_function.TRITON = real
    return run


def _core_attention(shape: Shape, device) -> Callable:
    """Megatron-Core's core attention slot (coreattn.layers.CoreAttention): thd with packed_seq_params,
    else sbhd."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from coreattn.layers import CoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=shape.heads * shape.dim_qk, num_attention_heads=shape.heads,
                               num_query_groups=shape.heads_kv, kv_channels=shape.dim_qk, attention_dropout=0.0,
                               hidden_dropout=0.0)
    layer = CoreAttention(config, 1, AttnMaskType.causal, "self", backend="triton")
    thd = shape.layout == "thd"
    q, k, v = _qkv(dataclasses.replace(shape, layout="thd" if thd else "sbhd"), device, dense=True)
    dout = torch.empty(*q.shape[:-2], shape.heads * shape.dim_v, dtype=q.dtype, device=device)
    cu = _cu(shape, device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=shape.tokens,
                             max_seqlen_kv=shape.total_keys) if thd else None
    mask = AttnMaskType.padding_causal if thd else AttnMaskType.causal
    return lambda: layer(q, k, v, None, attn_mask_type=mask, packed_seq_params=params).backward(dout)


def _indexer_inputs(shape: Shape, device, grad: bool):
    dt = DTYPES[shape.dtype]
    q = _t(shape.tokens, shape.index_heads, shape.index_dim, dtype=dt, grad=grad, device=device)
    k = _t(shape.total_keys, shape.index_dim, dtype=dt, grad=grad, device=device)
    w = _t(shape.tokens, shape.index_heads, dtype=torch.float32, grad=grad, device=device)
    return q, k, w


def _indexer_topk(shape: Shape, device) -> Callable:
    import coreattn

    q, k, w = _indexer_inputs(shape, device, False)
    cu = _cu(shape, device)
    return lambda: coreattn.indexer_topk(q, k, w, shape.topk, layout="thd", cu_seqlens=cu, max_seqlen=shape.tokens,
                                         backend="triton")


def _indexer_loss(shape: Shape, device) -> Callable:
    import coreattn

    q, k, w = _indexer_inputs(shape, device, True)
    dt = DTYPES[shape.dtype]
    query = _t(shape.tokens, shape.heads, shape.dim_qk, dtype=dt, device=device)
    key = _t(shape.total_keys, shape.heads_kv, shape.dim_qk, dtype=dt, device=device)
    cu = _cu(shape, device)

    def run():
        _, loss = coreattn.indexer_topk_and_loss(q, k, w, query, key, shape.topk, shape.dim_qk ** -0.5, 0.1,
                                                 sparse=True, layout="thd", cu_seqlens=cu, max_seqlen=shape.tokens,
                                                 backend="triton")
        loss.backward()
    return run


def _rotate(shape: Shape, device) -> Callable:
    import coreattn

    q, _, _ = _indexer_inputs(shape, device, True)
    grad = torch.empty_like(q)
    return lambda: coreattn.rotate_activation(q, backend="triton").backward(grad)


def _masks(shape: Shape, device) -> Callable:
    from coreattn.kernels import masks as mask_kernels

    cu = _cu(shape, device)
    x = _t(shape.tokens, shape.heads * shape.dim_v, dtype=DTYPES[shape.dtype], device=device)
    index = torch.empty(shape.tokens, dtype=torch.int64, device=device)

    def run():
        packed = mask_kernels.gather_rows(x, index)
        mask_kernels.scatter_rows(packed, index, shape.tokens)
        mask_kernels.token_ids(cu, shape.tokens, torch.int64, torch.int32)
    return run


OPS: dict[str, Callable] = {
    "dense": _dense,  # varlen_attn (thd) or padded_attn (bshd, sbhd), forward + backward
    "sparse": _sparse,  # sparse_varlen_attn / sparse_padded_attn, forward + deterministic backward
    "sparse_atomic": functools.partial(_sparse, atomic=True),  # the same with the atomic dK/dV option
    "sparse_window": functools.partial(_sparse, window=True),  # the same with a key window of WINDOW keys
    "sparse_fwd": functools.partial(_sparse, backward=False),  # the forward alone
    "sparse_window_fwd": functools.partial(_sparse, window=True, backward=False),
    "indexer_topk": _indexer_topk,
    "indexer_loss": _indexer_loss,  # top-k + sparse loss, forward + backward
    "rotate_activation": _rotate,  # forward + backward
    "masks": _masks,  # unpad/pad's row gather and scatter, position and sequence ids
    "core_attention": _core_attention,  # Megatron-Core's CoreAttention (needs megatron-core), forward + backward
}


def plan_op(op: str, shape: Shape, arch: str = "sm90") -> OpPlan:
    """The launches, torch ops and memory of ``op`` (``OPS``) at ``shape`` for ``arch``."""
    result = OpPlan(op, shape, arch)
    device = torch.device("meta")
    with planning(arch, result.launches):
        try:
            run = OPS[op](shape, device)
        except ImportError as exc:  # an adapter's framework (megatron-core) not installed
            result.skipped = f"cannot import {exc.name}"
            return result
        memory = _Memory()
        with memory:
            run()
        result.torch_ops, result.peak_bytes, result.kept_bytes = memory.ops, memory.peak, memory.live
    return result


# ---- what an op may allocate (docs/benchmarks.md)


MIB = 2**20


def memory_bound(op: str, shape: Shape) -> int:
    """Bytes the host side of ``op`` may allocate at once at ``shape`` (forward + backward, its inputs
    not counted): the formulas of docs/benchmarks.md. With N query tokens, Nk key rows (all samples),
    e bytes per element:

    - ``io`` = N x H x (Dqk + Dv) x e + Nk x Hkv x (Dqk + Dv) x e: out and the gradients dq, dk, dv (the
      op's own outputs; 1.25 io allowed);
    - ``rows`` = 16 B per (token, q head): lse, delta and the like, fp32;
    - sparse, beyond: the fp32 dK/dV accumulator 4 x Nk x Hkv x (Dqk + Dv) (twice where absorbed V folds
      into dK), the index rows 3 x 4 B per (token, index head, slot) (the prepared rows, the key-centric
      CSR, their construction's chunks), the partial buffer (at most its budget,
      ``COREATTN_SPARSE_BWD_BYTES``) and 64 B per entry of one chunk (its CSR's sort);
    - the indexer: its q, k and weights' size again (top-k: the indices and scores, 12 B per (token,
      slot)); the rotation: its input twice; the mask kernels: their rows twice;
    - 64 MiB for everything of fixed size (tile maps, row classes' and visits' per-call arrays)."""
    from coreattn.kernels.sparse_bwd import partial_budget

    e = DTYPES[shape.dtype].itemsize
    n, nk = shape.tokens, shape.total_keys
    width = shape.dim_qk + shape.dim_v
    io = n * shape.heads * width * e + nk * shape.heads_kv * width * e
    rows = 16 * n * shape.heads
    fixed = 64 * MIB
    if op in ("dense", "core_attention"):
        return int(1.25 * io) + rows + fixed
    if op.startswith("sparse"):
        slots = shape.topk + (WINDOW if "window" in op else 0)
        acc = 4 * nk * shape.heads_kv * width * (2 if shape.absorbed else 1)
        index = 3 * 4 * n * slots  # one index head (the ops here pass [N, K] indices)
        partial = min(partial_budget(), n * shape.heads_kv * slots * width * 4)
        chunk = 64 * min(n, max(1, partial_budget() // (shape.heads_kv * slots * width * 4))) * slots
        return int(1.25 * io) + rows + acc + index + partial + chunk + fixed
    if op == "indexer_topk":
        return 12 * n * shape.topk + fixed
    if op == "indexer_loss":  # the loss in torch ops: its chunk budget, the gradients of q, k, weights
        side = n * shape.index_heads * (shape.index_dim + 1) * 4 + nk * shape.index_dim * 4
        return 2 * side + 12 * n * shape.topk + 1024 * MIB
    if op == "rotate_activation":
        return 2 * n * shape.index_heads * shape.index_dim * e + fixed
    if op == "masks":
        return 2 * n * shape.heads * shape.dim_v * e + 16 * n + fixed
    raise ValueError(f"no memory formula for {op!r}")


# ---- the sparse backward's summary (docs/dsa.md's table)

SPARSE_BWD_KERNELS = ("_attn_bwd_preprocess_kernel", "_sparse_attn_dq_kernel", "_sparse_attn_dkv_kernel",
                      "_sparse_attn_reduce_kernel", "_sparse_attn_dkv_keys_kernel")


def partial_traffic(launch: Launch) -> int:
    """Bytes of partial rows a deterministic slot-mode dK/dV launch writes (the reduce reads them back:
    twice this in all), every slot of its tokens counted: tokens x Hkv x K x row stride x 4 B."""
    ints, flags = launch.ints, launch.flags
    if launch.kernel != "_sparse_attn_dkv_kernel" or flags.get("ATOMIC") or flags.get("RANGE"):
        return 0
    per_token = ints["heads_kv"] * ints["n_sblocks"]
    tokens = ints["n_tasks"] // max(per_token, 1)
    return tokens * ints["heads_kv"] * ints["n_slots"] * ints["stride_row"] * 4


def partial_buffer(launch: Launch) -> int:
    """Bytes of the partial buffer a deterministic slot-mode dK/dV launch writes into: Hkv x C x K x row
    stride x 4 B (C the chunk's tokens)."""
    if not partial_traffic(launch):
        return 0
    ints = launch.ints
    return ints["heads_kv"] * ints["chunk"] * ints["n_slots"] * ints["stride_row"] * 4


def sparse_bwd_summary(plan: OpPlan) -> dict:
    """The backward's share of a sparse plan: launches, programs, the partial buffer (bytes) and its
    traffic (written + read back, every slot counted)."""
    bwd = [launch for launch in plan.launches if launch.kernel in SPARSE_BWD_KERNELS]
    return dict(launches=len(bwd), programs=sum(launch.programs for launch in bwd),
                partial_buffer=max([partial_buffer(launch) for launch in bwd] + [0]),
                partial_traffic=2 * sum(partial_traffic(launch) for launch in bwd))


# ---- command line


def _size(text: str) -> int:
    text = text.strip().lower()
    scale = 1024 if text.endswith("k") else 1
    return int(text.rstrip("k")) * scale


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"


def format_plan(plan: OpPlan, detail: bool = False) -> str:
    lines = [f"{plan.op} on {plan.arch}: {plan.shape.label()}"]
    if plan.skipped:
        return lines[0] + f"\n  skipped: {plan.skipped}"
    lines.append(f"  {len(plan.launches):,} launches, {plan.programs:,} programs, {plan.torch_ops:,} torch ops, "
                 f"peak allocated {_bytes(plan.peak_bytes)}, kept {_bytes(plan.kept_bytes)}")
    width = max([len(k) for k in plan.by_kernel()] + [6])
    lines.append(f"  {'kernel':<{width}}  {'launches':>9}  {'programs':>16}  {'largest grid':>14}  warps  limit")
    for kernel, (n, programs) in plan.by_kernel().items():
        mine = [launch for launch in plan.launches if launch.kernel == kernel]
        big = max(mine, key=lambda launch: launch.programs)
        bad = [within_limits(launch, plan.arch) for launch in mine]
        bad = next((b for b in bad if b), "ok")
        lines.append(f"  {kernel:<{width}}  {n:>9,}  {programs:>16,}  {big.programs:>14,}  {big.num_warps:>5}  {bad}")
    if plan.op.startswith("sparse"):
        s = sparse_bwd_summary(plan)
        lines.append(f"  backward: {s['launches']:,} launches, {s['programs']:,} programs, partial buffer "
                     f"{_bytes(s['partial_buffer'])}, partial traffic {_bytes(s['partial_traffic'])}")
    if detail:
        for launch in plan.launches:
            lines.append(f"    {launch.kernel} grid={launch.grid} warps={launch.num_warps} "
                         f"tensors={_bytes(launch.tensor_bytes)}")
    return "\n".join(lines)


TABLE_TOKENS = (8192, 32768, 131072)


def sparse_table(arch: str = "sm90") -> str:
    """docs/dsa.md's table: the sparse backward at 8k/32k/128k tokens, absorbed MLA and per-head K/V."""
    rows = ["| K/V | tokens | launches | programs | partial buffer | partial traffic |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, kv in (("absorbed (Hkv 1, 576/512)", ABSORBED), ("per-head (Hkv 128, 192/128)", PER_HEAD)):
        for tokens in TABLE_TOKENS:
            s = sparse_bwd_summary(plan_op("sparse", Shape(tokens=tokens, **kv), arch))
            rows.append(f"| {name} | {tokens:,} | {s['launches']:,} | {s['programs']:,} | "
                        f"{_bytes(s['partial_buffer'])} | {_bytes(s['partial_traffic'])} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plan", description="The launches and device memory of coreattn's "
                                "public ops at a given shape, planned on CPU (nothing is compiled or run).")
    p.add_argument("--op", nargs="+", choices=list(OPS), default=["sparse"])
    p.add_argument("--arch", nargs="+", choices=list(ARCHS), default=["sm90"])
    p.add_argument("--tokens", type=_size, default=8192, help="query tokens of the batch (8192 or 8k)")
    p.add_argument("--batch", type=int, default=1, help="sequences (thd) or samples (bshd, sbhd)")
    p.add_argument("--key-rows", type=_size, help="key rows per sample (thd: in all), e.g. context parallelism's "
                   "gathered keys; default: as many as the queries")
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--heads-kv", type=int, default=1)
    p.add_argument("--dims", default="576/512", help="q/k and v head dims")
    p.add_argument("--per-head", action="store_true", help="v given (not absorbed: V as K's first columns)")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--layout", choices=("thd", "bshd", "sbhd"), default="thd")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--detail", action="store_true", help="every launch")
    p.add_argument("--sparse-table", action="store_true", help="the sparse backward at 8k/32k/128k tokens, "
                   "absorbed and per-head (docs/dsa.md), for the first --arch")
    args = p.parse_args(argv)
    if args.sparse_table:
        print(sparse_table(args.arch[0]))
        return 0
    dim_qk, _, dim_v = args.dims.partition("/")
    shape = Shape(tokens=args.tokens, batch=args.batch, heads=args.heads, heads_kv=args.heads_kv,
                  dim_qk=int(dim_qk), dim_v=int(dim_v or dim_qk), absorbed=not args.per_head, topk=args.topk,
                  layout=args.layout, key_rows=args.key_rows, dtype=args.dtype)
    for arch in args.arch:
        for op in args.op:
            print(format_plan(plan_op(op, shape, arch), args.detail))
    return 0


if __name__ == "__main__":
    sys.exit(main())
