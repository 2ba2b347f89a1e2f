"""coreattn.cp_attn under real collectives: 2 and 4 CPU processes (gloo) against single-process attention.

One spawn per world size runs every case with every exchange (comm = p2p, all_gather, a2a; a
few cases also a2a+p2p over hierarchical groups a x b: 2 x 2, and the degenerate 4 x 1 and 1 x 4,
named "a2a+p2p-AxB") and writes each rank's output and gradients to files; the parent reassembles
the global tensors and compares them, on the real tokens, with the float64 oracle (tests/oracle.py)
and coreattn.varlen_attn by the flash-attention criterion; padding tokens must give exact zeros.
Cases with dropout, a softmax offset (sink) or max logits are compared with a float64 oracle
written here (sink column, the shared keep mask on global token ids) and with single-process
attention on the global padded layout drawn from the same seed: cp > 1 must drop what cp = 1
drops. Most cases use the torch backend (float64/float32); tiny cases run the Triton kernels
under the interpreter.
"""

from __future__ import annotations

import math
import os
import re
import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import coreattn
from attn_cases import assert_flash_criterion
from conftest import INTERPRETED
from coreattn import masks
from coreattn.layers.context_parallel import attention as context_parallel
from coreattn.kernels import dropout
from coreattn.layers.context_parallel import cp_attn
from oracle import _mask, attention_ref

WORLDS = (2, 4)
COMMS = ("p2p", "all_gather", "a2a")
# a2a+p2p over [a2a_group, p2p_group] of sizes a x b (Megatron's hierarchical_context_parallel_sizes)
HIER = {"a2a+p2p-2x2": (2, 2), "a2a+p2p-4x1": (4, 1), "a2a+p2p-1x4": (1, 4)}
ALL_COMMS = COMMS + tuple(HIER)
HIER_GROUPS = dict(HIER, **{"a2a+p2p-2x1": (2, 1)})  # also built on 2 ranks, for the argument errors
SEED = 1234  # every rank and the reference draw the dropout RNG state right after this seed


@dataclass(frozen=True)
class CPCase:
    name: str
    layout: str = "thd"
    dtype: torch.dtype = torch.float64
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    hq: int = 4
    hkv: int = 2
    dqk: int = 32
    dv: int = 16
    lens: tuple[int, ...] = (5, 0, 13, 1, 8)  # thd: real lengths; sbhd: real length = S - lens[b] (clamped)
    extra: tuple[int, ...] = (0, 0, 1, 0, 0)  # thd: extra 2*cp blocks of padding per sequence
    unpadded: bool = False  # thd: real lengths are multiples of 2*cp, no cu_seqlens_padded
    units: int = 3  # sbhd: S = units * 2 * cp
    backend: str = "torch"
    allreduce_fallback: bool = False  # dK/dV through all_reduce + slice instead of reduce_scatter_tensor
    worlds: tuple[int, ...] = WORLDS
    comms: tuple[str, ...] = COMMS
    dropout_p: float = 0.0
    sink: bool = False  # a softmax offset [Hq] (learnable sinks), checked with its gradient
    max_logit: bool = False

    @property
    def id(self) -> str:
        return self.name

    @property
    def features(self) -> bool:
        return self.dropout_p > 0 or self.sink or self.max_logit

    def runs(self, comm: str, world: int) -> bool:
        """a2a needs heads divisible over the ranks of its group (K/V heads, or ranks over K/V heads)."""
        if comm not in self.comms or world not in self.worlds:
            return False
        if comm in HIER and math.prod(HIER[comm]) != world:
            return False
        if comm == "a2a" or comm in HIER:
            a = world if comm == "a2a" else HIER[comm][0]
            return self.hq % a == 0 and (self.hkv % a == 0 or a % self.hkv == 0)
        return not (comm != "all_gather" and self.allreduce_fallback)

    def a2a_size(self, comm: str, world: int) -> int:
        """The ranks whose heads are split (1: none; every rank holds all heads of its own tokens)."""
        return world if comm == "a2a" else HIER[comm][0] if comm in HIER else 1


CASES = [
    CPCase("thd-causal-gqa2-f64", comms=COMMS + ("a2a+p2p-2x2",)),
    CPCase("thd-full-f32", causal=False, dtype=torch.float32, hq=2, hkv=2),
    CPCase("thd-causal-hdim192x128-gqa4-f32", dtype=torch.float32, hq=4, hkv=1, dqk=192, dv=128),
    CPCase("thd-causal-window3-f64", window=(3, 0), lens=(17, 2, 9), extra=(0, 1, 0), comms=COMMS + ("a2a+p2p-2x2",)),
    CPCase("thd-causal-nopadding-f64", lens=(1, 0, 3, 2), unpadded=True, hq=2, hkv=1),
    CPCase("thd-full-allreduce-f64", causal=False, allreduce_fallback=True, lens=(7, 3), extra=(0, 0)),
    CPCase("sbhd-causal-gqa2-f64", layout="sbhd", lens=(0, 5, 10_000, 1)),
    CPCase("sbhd-full-hdim192x128-f32", layout="sbhd", causal=False, dtype=torch.float32, dqk=192, dv=128,
           lens=(0, 3)),
    CPCase("sbhd-causal-window2-f64", layout="sbhd", window=(2, 0), hq=2, hkv=1, lens=(4, 0)),
    # the Triton kernels (span mode on packed and padded tensors) under the interpreter, tiny
    CPCase("triton-thd-causal-gqa2-f32", dtype=torch.float32, hq=2, hkv=1, dqk=32, dv=16, lens=(7, 0, 12),
           extra=(0, 0, 1), backend="triton", worlds=(2,)),
    CPCase("triton-sbhd-full-f32", layout="sbhd", causal=False, dtype=torch.float32, hq=2, hkv=1, dqk=32, dv=16,
           lens=(3, 0), units=2, backend="triton", worlds=(2,)),
    # dropout (same mask as cp = 1), sinks and max logits
    CPCase("thd-causal-dropout-sink-maxlogit-f64", dropout_p=0.25, sink=True, max_logit=True, comms=ALL_COMMS),
    CPCase("thd-full-sink-maxlogit-gqa2-f64", causal=False, sink=True, max_logit=True, lens=(9, 2), extra=(0, 1)),
    CPCase("sbhd-causal-window3-dropout-sink-f64", layout="sbhd", window=(3, 0), dropout_p=0.3, sink=True,
           lens=(0, 4, 7), comms=COMMS + ("a2a+p2p-2x2",)),
    CPCase("thd-causal-window5-dropout-f32", dtype=torch.float32, window=(5, 0), dropout_p=0.2, max_logit=True,
           lens=(17, 2, 9), extra=(0, 1, 0)),
    # a2a runs whole sequences: any window
    CPCase("thd-window2_3-a2a-f64", causal=False, window=(2, 3), comms=("a2a",)),
    CPCase("triton-thd-causal-window3-dropout-sink-maxlogit-f32", dtype=torch.float32, hq=2, hkv=1, dqk=32, dv=16,
           window=(3, 0), lens=(5, 9), extra=(0, 1), backend="triton", worlds=(2,), comms=("p2p",), dropout_p=0.2, sink=True,
           max_logit=True),
    CPCase("triton-thd-causal-dropout-sink-maxlogit-a2a-f32", dtype=torch.float32, hq=2, hkv=1, dqk=32, dv=16,
           lens=(7, 12), extra=(0, 1), backend="triton", worlds=(2,), comms=("a2a",), dropout_p=0.2, sink=True,
           max_logit=True),
    # a2a+p2p: the ring's kernels on the all-to-all's head slices (strided views), K/V head replicated
    CPCase("triton-thd-causal-window3-dropout-sink-maxlogit-hier-f32", dtype=torch.float32, hq=2, hkv=1, dqk=32,
           dv=16, window=(3, 0), lens=(5, 9), extra=(0, 1), backend="triton", worlds=(4,), comms=("a2a+p2p-2x2",),
           dropout_p=0.2, sink=True, max_logit=True),
]


# the Triton cases run the kernels on CPU tensors: only under the interpreter (not on a GPU machine)
TRITON_ON_CPU = pytest.mark.interpreter_only("the Triton kernels on CPU tensors in gloo processes")


def runs_for(world: int) -> list[tuple[CPCase, str]]:
    return [(c, comm) for c in CASES for comm in ALL_COMMS
            if c.runs(comm, world) and (c.backend != "triton" or INTERPRETED)]


def sink_logits(case: CPCase) -> torch.Tensor:
    return torch.linspace(-1.0, 1.5, case.hq, dtype=torch.float64).to(case.dtype)


def case_inputs(case: CPCase, world: int) -> dict:
    """Global tensors (identical in every process: a fixed seed) and the layout metadata."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    two_cp = 2 * world
    if case.layout == "thd":
        real = [n * two_cp for n in case.lens] if case.unpadded else list(case.lens)
        padded = [-(-n // two_cp) * two_cp + e * two_cp for n, e in zip(real, case.extra)]
        if case.unpadded:
            padded = list(real)
        cu = masks.cu_seqlens_from_seqlens(torch.tensor(real, dtype=torch.int32))
        cu_padded = masks.cu_seqlens_from_seqlens(torch.tensor(padded, dtype=torch.int32))
        lead = (sum(padded),)
        keep = torch.cat([torch.arange(p) < n for n, p in zip(real, padded)])  # [T] real tokens
    else:
        seqlen = case.units * two_cp
        real = [max(0, seqlen - n) for n in case.lens]
        cu = masks.cu_seqlens_from_seqlens(torch.tensor(real, dtype=torch.int32))
        cu_padded = None
        lead = (seqlen, len(real))
        keep = torch.arange(seqlen)[:, None] < torch.tensor(real)[None, :]  # [S, B]

    def rand(h, d):
        return torch.randn(*lead, h, d, generator=gen, dtype=torch.float64).to(case.dtype)

    q, k, v = rand(case.hq, case.dqk), rand(case.hkv, case.dqk), rand(case.hkv, case.dv)
    dout = rand(case.hq, case.dv)
    return dict(q=q, k=k, v=v, dout=dout, cu=cu, cu_padded=cu_padded, real=real, keep=keep,
                max_seqlen=max(padded) if case.layout == "thd" else lead[0])


def partition(case: CPCase, inp: dict, world: int, rank: int) -> torch.Tensor:
    if case.layout == "thd":
        return masks.cp_partition_indices(inp["cu_padded"], world, rank)
    return masks.cp_partition_indices_sbhd(inp["q"].shape[0], world, rank)


def hierarchical_groups(world: int) -> dict[str, list]:
    """[a2a_group, p2p_group] of this process for every split a x b of the world, laid out as
    Megatron's create_hierarchical_groups does: a2a groups of a consecutive ranks, p2p groups of
    the ranks a apart (cp rank = p2p rank * a + a2a rank). Every process creates every group."""
    rank, out = dist.get_rank(), {}
    for name, (a, b) in HIER_GROUPS.items():
        if a * b != world:
            continue
        inner = [list(range(o * a, (o + 1) * a)) for o in range(b)]
        for ranks in inner + [list(range(i, world, a)) for i in range(a)]:
            g = dist.new_group(ranks)
            if rank in ranks:
                out.setdefault(name, []).append(g)  # the a2a group is created (and appended) first
    return out


def run_case(case: CPCase, comm: str, world: int, rank: int, group, hier: dict | None = None) -> dict:
    inp = case_inputs(case, world)
    idx = partition(case, inp, world, rank)
    q, k, v = (masks.cp_shard(inp[n], idx).requires_grad_() for n in ("q", "k", "v"))
    if comm in HIER:
        group, comm = hier[comm], "a2a+p2p"
    kwargs = dict(cp_group=group, layout=case.layout, cu_seqlens_q=inp["cu"], cu_seqlens_kv=inp["cu"],
                  causal=case.causal, window_size=case.window, backend=case.backend, comm=comm,
                  dropout_p=case.dropout_p, return_max_logit=case.max_logit)
    offset = sink_logits(case).requires_grad_() if case.sink else None
    if offset is not None:
        kwargs.update(softmax_offset=offset)
    if case.layout == "thd":
        kwargs.update(max_seqlen_q=inp["max_seqlen"], max_seqlen_kv=inp["max_seqlen"])
        if not case.unpadded:
            kwargs.update(cu_seqlens_q_padded=inp["cu_padded"], cu_seqlens_kv_padded=inp["cu_padded"])
    if case.allreduce_fallback:
        context_parallel._NO_REDUCE_SCATTER.add(str(dist.get_backend(group)))
    try:
        torch.manual_seed(SEED)
        out = cp_attn(q, k, v, **kwargs)
        out, max_logit = out if case.max_logit else (out, None)
        out.backward(masks.cp_shard(inp["dout"], idx))
    finally:
        context_parallel._NO_REDUCE_SCATTER.clear()
    return dict(idx=idx, out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad, max_logit=max_logit,
                d_offset=None if offset is None else offset.grad)


def deterministic_check(world: int, rank: int, group, hier: dict) -> dict[str, bool]:
    """The same call twice gives bitwise the same output and gradients, per exchange."""
    case = next(c for c in CASES if c.name == "thd-causal-window5-dropout-f32")
    alike = {}
    for comm in ("p2p", "all_gather"):
        a, b = (run_case(case, comm, world, rank, group) for _ in range(2))
        alike[comm] = all(torch.equal(a[n], b[n]) for n in ("out", "dq", "dk", "dv"))
    plain = next(c for c in CASES if c.name == "thd-causal-gqa2-f64")
    for comm in ("a2a",) + (("a2a+p2p-2x2",) if "a2a+p2p-2x2" in hier else ()):
        a, b = (run_case(plain, comm, world, rank, group, hier) for _ in range(2))
        alike[comm] = all(torch.equal(a[n], b[n]) for n in ("out", "dq", "dk", "dv"))
    return alike


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # recorded for the parent to assert on
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def bad_inputs(world: int, group, hier: dict) -> dict[str, str]:
    """Each bad call's exception as 'Type: message' (run on every rank alike: no rank hangs)."""
    two_cp = 2 * world
    cu = torch.tensor([0, 5, 5 + 2 * two_cp], dtype=torch.int32)
    cu_padded = torch.tensor([0, 2 * two_cp, 4 * two_cp], dtype=torch.int32)
    n = 4 * two_cp // world

    def qkv(tokens, lead=()):
        return (torch.zeros(tokens, *lead, 2, 8), torch.zeros(tokens, *lead, 2, 8), torch.zeros(tokens, *lead, 2, 4))

    def thd(tokens=n, **kw):
        args = dict(cp_group=group, layout="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=cu_padded,
                    max_seqlen_q=2 * two_cp, max_seqlen_kv=2 * two_cp, backend="torch")
        args.update(kw)
        return lambda: cp_attn(*qkv(tokens), **args)

    odd_padded = torch.tensor([0, two_cp + 2, 4 * two_cp + 2], dtype=torch.int32)

    def heads(hq, hkv, **kw):
        q = torch.zeros(n, hq, 8)
        k, v = torch.zeros(n, hkv, 8), torch.zeros(n, hkv, 4)
        args = dict(cp_group=group, layout="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=cu_padded,
                    max_seqlen_q=2 * two_cp, max_seqlen_kv=2 * two_cp, backend="torch", comm="a2a")
        args.update(kw)
        return lambda: cp_attn(q, k, v, **args)

    two = hier.get(f"a2a+p2p-2x{world // 2}")  # a2a groups of 2 ranks
    return {
        "comm_unknown": _error(thd(comm="ring")),
        "comm_type": _error(thd(comm=None)),
        "hier_one_group": _error(thd(comm="a2a+p2p")),
        "hier_list_other_comm": _error(thd(comm="p2p", cp_group=two)),
        "hier_q_heads": _error(heads(3, 1, comm="a2a+p2p", cp_group=two)),
        "hier_kv_heads": _error(heads(6, 3, comm="a2a+p2p", cp_group=two)),
        "a2a_q_heads": _error(heads(world + 1, 1)),
        "a2a_kv_heads": _error(heads(3 * world, 3)),
        "p2p_window": _error(thd(window_size=(2, 3), comm="p2p")),
        "padded_not_multiple": _error(thd(cu_seqlens_q_padded=odd_padded)),
        "real_not_multiple": _error(thd(cu_seqlens_q_padded=None)),
        "local_tokens": _error(thd(tokens=n + 2)),
        "real_exceeds_padded": _error(thd(cu_seqlens_q=torch.tensor([0, 2 * two_cp + 1, 2 * two_cp + 6],
                                                                    dtype=torch.int32))),
        "max_seqlen_small": _error(thd(max_seqlen_q=two_cp)),
        "kv_differs": _error(thd(cu_seqlens_kv=torch.tensor([0, 4, 9], dtype=torch.int32))),
        "window": _error(thd(window_size=(2, 3))),
        "window_noncausal_left": _error(thd(window_size=(2, -1))),
        "sbhd_odd_local": _error(lambda: cp_attn(*qkv(3, (2,)), cp_group=group, layout="sbhd", backend="torch")),
        "sbhd_padded": _error(lambda: cp_attn(*qkv(4, (2,)), cp_group=group, layout="sbhd",
                                              cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
                                              cu_seqlens_q_padded=torch.tensor([0, 4, 8], dtype=torch.int32))),
    }


def megatron_sbhd_check(world: int, rank: int, group) -> bool:
    """Megatron-Core's own get_batch_on_this_cp_rank slices a [b, s] batch like cp_partition_indices_sbhd."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    tokens = torch.arange(3 * 8 * world).reshape(3, 8 * world)  # [b, s]
    labels = tokens * 10
    got = get_batch_on_this_cp_rank({"tokens": tokens.clone(), "labels": labels.clone()}, cp_group=group)
    idx = masks.cp_partition_indices_sbhd(tokens.shape[1], world, rank)
    return torch.equal(got["tokens"], masks.cp_shard(tokens, idx, dim=1)) and \
        torch.equal(got["labels"], masks.cp_shard(labels, idx, dim=1))


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # world processes share two busy cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))  # a cp_group that is not the default group
        hier = hierarchical_groups(world)
        results = {(case.id, comm): run_case(case, comm, world, rank, group, hier) for case, comm in runs_for(world)}
        results["errors"] = bad_inputs(world, group, hier)
        results["deterministic"] = deterministic_check(world, rank, group, hier)
        if world == 2:
            results["megatron_sbhd"] = megatron_sbhd_check(world, rank, group)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    cache = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            d = tmp_path_factory.mktemp(f"cp{world}")
            mp.spawn(_worker, args=(world, str(d / "init"), str(d)), nprocs=world, join=True)
            cache[world] = [torch.load(d / f"rank{r}.pt") for r in range(world)]
        return cache[world]

    return get


def _real_rows(x: torch.Tensor, keep: torch.Tensor, layout: str) -> torch.Tensor:
    """Packed [t_real, H, D] real tokens, sequence after sequence, of a global thd or sbhd tensor."""
    if layout == "thd":
        return x[keep]
    return x.transpose(0, 1)[keep.transpose(0, 1)]  # [B, S, ...] rows in sample order


_REFS: dict = {}


def _reference(case: CPCase, inp: dict, world: int):
    """Oracle (float64 and naive same-dtype) and single-process coreattn.varlen_attn outputs and grads
    on the real tokens (cached per case and world)."""
    key = (case, world)
    if key in _REFS:
        return _REFS[key]
    layout = case.layout
    real = [_real_rows(inp[n], inp["keep"], layout) for n in ("q", "k", "v", "dout")]
    cu, longest = inp["cu"], max(inp["real"])
    results = {}
    for name in ("oracle", "naive", "varlen_attn"):
        q, k, v = (t.detach().clone().requires_grad_() for t in real[:3])
        if name == "varlen_attn":
            out = coreattn.varlen_attn(q, k, v, cu, cu, longest, longest, causal=case.causal,
                                       window_size=case.window, backend=case.backend)
        else:
            out, _ = attention_ref(q, k, v, cu, cu, causal=case.causal, window=case.window,
                                   upcast=name == "oracle")
        grads = torch.autograd.grad(out, (q, k, v), real[3].to(out.dtype))
        results[name] = dict(zip(("out", "dq", "dk", "dv"), (out.detach(), *grads)))
    _REFS[key] = results
    return results


def _sequences(case: CPCase, inp: dict):
    """(index into the global tensor's leading dims, dropout token ids) of each sequence's real tokens."""
    for b, n in enumerate(inp["real"]):
        pos = torch.arange(n)
        if case.layout == "thd":
            start = int(inp["cu_padded"][b])
            yield (start + pos,), start + pos
        else:
            yield (pos, torch.full_like(pos, b)), b * inp["q"].shape[0] + pos


def _feature_oracle(case: CPCase, inp: dict, state: torch.Tensor | None) -> dict:
    """Float64 attention with the sink as an extra logit column and dropout through the shared keep
    mask (coreattn/kernels/dropout.py) on global padded token ids; gradients by autograd, and the
    max visible logit per head (and per token, for each rank's share)."""
    q, k, v = (inp[n].double().requires_grad_() for n in ("q", "k", "v"))
    offset = sink_logits(case).double().requires_grad_() if case.sink else None
    scale = 1.0 / case.dqk ** 0.5
    group = case.hq // case.hkv
    out = q.new_zeros(q.shape[:-1] + (case.dv,))
    row_max = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64)  # [.., Hq] per token
    heads = torch.arange(case.hq)
    for index, ids in _sequences(case, inp):
        n = ids.numel()
        if n == 0:
            continue
        qs, ks, vs = q[index], k[index].repeat_interleave(group, 1), v[index].repeat_interleave(group, 1)
        s = (torch.einsum("ihd,jhd->hij", qs, ks) * scale).masked_fill(~_mask(n, n, case.causal, case.window, True,
                                                                               "cpu"), float("-inf"))
        row_max[index] = s.detach().amax(-1).t()
        if offset is not None:
            s = torch.cat([s, offset[:, None, None].expand(-1, n, 1)], dim=-1)
        p = s.softmax(-1)[..., :n]
        if case.dropout_p > 0:
            keep = dropout.keep_mask(state, case.dropout_p, heads[:, None, None], ids[None, :, None], ids[None, None, :])
            p = p * keep / (1 - case.dropout_p)
        out = out.index_put(index, torch.einsum("hij,jhd->ihd", p, vs))
    leaves = (q, k, v) + ((offset,) if offset is not None else ())
    grads = torch.autograd.grad(out, leaves, inp["dout"].double())
    res = dict(zip(("out", "dq", "dk", "dv", "d_offset"), (out.detach(), *grads)))
    res["row_max"] = row_max
    return res


def _single_process(case: CPCase, inp: dict) -> dict:
    """coreattn on the global padded layout (thd: cu_seqlens_padded with seqused; sbhd: q_len/k_len),
    so its dropout token ids are cp_attn's; the RNG state drawn right after SEED."""
    q, k, v = (inp[n].clone().requires_grad_() for n in ("q", "k", "v"))
    offset = sink_logits(case).requires_grad_() if case.sink else None
    opts = dict(causal=case.causal, window_size=case.window, dropout_p=case.dropout_p, softmax_offset=offset,
                return_max_logit=case.max_logit, backend=case.backend)
    torch.manual_seed(SEED)
    if case.layout == "thd":
        cu, used = inp["cu_padded"], (inp["cu"][1:] - inp["cu"][:-1])
        out = coreattn.varlen_attn(q, k, v, cu, cu, inp["max_seqlen"], inp["max_seqlen"], seqused_q=used,
                                   seqused_k=used, **opts)
    else:
        lens = (inp["cu"][1:] - inp["cu"][:-1])
        out = coreattn.padded_attn(q, k, v, layout="sbhd", q_len=lens, k_len=lens, **opts)
    out, max_logit = out if case.max_logit else (out, None)
    leaves = (q, k, v) + ((offset,) if offset is not None else ())
    grads = torch.autograd.grad(out, leaves, inp["dout"])
    res = dict(zip(("out", "dq", "dk", "dv", "d_offset"), (out.detach(), *grads)))
    res["max_logit"] = max_logit
    return res


def _unshard(ranks: list[dict], key, name: str, size: int) -> torch.Tensor:
    return masks.cp_unshard([r[key][name] for r in ranks], [r[key]["idx"] for r in ranks], size=size)


def _feature_references(case: CPCase, inp: dict, world: int) -> tuple[dict, dict]:
    """(float64 oracle, single process) for a case with features, cached per case and world (every
    exchange compares with the same two)."""
    key = ("features", case, world)
    if key not in _REFS:
        torch.manual_seed(SEED)
        state = dropout.rng_state(torch.device("cpu")) if case.dropout_p > 0 else None
        _REFS[key] = _feature_oracle(case, inp, state), _single_process(case, inp)
    return _REFS[key]


def _check_features(case: CPCase, comm: str, world: int, ranks: list[dict], key, inp: dict) -> None:
    oracle, single = _feature_references(case, inp, world)
    keep = inp["keep"]
    for name in ("out", "dq", "dk", "dv"):
        got = _unshard(ranks, key, name, inp["q"].shape[0])
        assert not got[~keep].any(), f"{name}: padding tokens must be exactly zero"
        assert_flash_criterion(f"{name} vs cp=1", got[keep], single[name][keep], oracle[name][keep])
    if case.sink:
        d_offset = torch.stack([r[key]["d_offset"] for r in ranks]).sum(0)  # Megatron sums it over dp x cp
        assert_flash_criterion("d softmax_offset", d_offset, single["d_offset"], oracle["d_offset"])
    if case.max_logit:
        per_rank = torch.stack([r[key]["max_logit"] for r in ranks])  # [cp, Hq]
        assert per_rank.dtype == (torch.float64 if case.dtype == torch.float64 else torch.float32)
        assert_flash_criterion("max_logit", per_rank.amax(0), single["max_logit"], oracle["row_max"].flatten(0, -2).amax(0))
        a = case.a2a_size(comm, world)
        for rank, r in enumerate(ranks):
            # the rank's heads (all without a2a) over its a2a group's queries (its own without a2a,
            # every query with plain a2a); -inf for the other heads
            i, first = rank % a, rank // a * a
            mine = torch.zeros(case.hq, dtype=torch.bool)
            mine[i * case.hq // a:(i + 1) * case.hq // a] = True
            assert torch.isneginf(r[key]["max_logit"][~mine]).all()
            rows = torch.cat([ranks[p][key]["idx"] for p in range(first, first + a)])
            expect = masks.cp_shard(oracle["row_max"], rows).flatten(0, -2).amax(0)[mine]
            torch.testing.assert_close(r[key]["max_logit"][mine].double(), expect, rtol=1e-5, atol=1e-5)


RUNS = [pytest.param(c, comm, w, id=f"{c.id}-{comm}-cp{w}", marks=[TRITON_ON_CPU] if c.backend == "triton" else [])
        for c in CASES for w in c.worlds for comm in ALL_COMMS if c.runs(comm, w)]


@pytest.mark.parametrize("case,comm,world", RUNS)
def test_cp_attn_matches_single_process(case, comm, world, cp_results):
    ranks = cp_results(world)
    inp = case_inputs(case, world)
    key = (case.id, comm)
    if case.features:
        _check_features(case, comm, world, ranks, key, inp)
        return
    ref = _reference(case, inp, world)
    for name in ("out", "dq", "dk", "dv"):
        got = _unshard(ranks, key, name, inp["q"].shape[0])
        assert got.dtype == case.dtype
        pad = ~inp["keep"]
        assert not got[pad].any(), f"{name}: padding tokens must be exactly zero"
        got_real = _real_rows(got, inp["keep"], case.layout)
        assert_flash_criterion(name, got_real, ref["naive"][name], ref["oracle"][name])
        assert_flash_criterion(f"{name} vs varlen_attn", got_real, ref["varlen_attn"][name], ref["oracle"][name])


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"cp{w}")
def test_backward_is_deterministic(world, cp_results):
    hier = {"a2a+p2p-2x2": True} if world == 4 else {}
    for r in cp_results(world):
        assert r["deterministic"] == {"p2p": True, "all_gather": True, "a2a": True, **hier}


@pytest.mark.parametrize("hier,plain", [("a2a+p2p-4x1", "a2a"), ("a2a+p2p-1x4", "p2p")])
def test_degenerate_hierarchical_is_plain(hier, plain, cp_results):
    """a2a+p2p with a stage over one rank is the other exchange alone: bitwise the same results."""
    names = ("out", "dq", "dk", "dv", "max_logit", "d_offset")
    for case in (c for c in CASES if c.runs(hier, 4)):
        for r in cp_results(4):
            a, b = r[(case.id, hier)], r[(case.id, plain)]
            assert all((a[n] is None and b[n] is None) or torch.equal(a[n], b[n]) for n in names), case.id


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"cp{w}")
def test_partition_matches_what_each_rank_held(world, cp_results):
    """Every global token is held by exactly one rank (the shards the workers used)."""
    ranks = cp_results(world)
    case = CASES[0]
    idx = torch.cat([r[(case.id, "p2p")]["idx"] for r in ranks])
    total = case_inputs(case, world)["q"].shape[0]
    assert torch.equal(idx.sort().values, torch.arange(total))


def test_megatron_get_batch_on_this_cp_rank_agrees(cp_results):
    assert all(r["megatron_sbhd"] for r in cp_results(2))


BAD = {
    "comm_unknown": ("ValueError", r"comm must be one of \('p2p', 'all_gather', 'a2a', 'a2a\+p2p'\), got 'ring'"),
    "comm_type": ("TypeError", r"comm must be a str"),
    "hier_one_group": ("TypeError", r"comm='a2a\+p2p' takes cp_group as \[a2a_group, p2p_group\].*got ProcessGroup"),
    "hier_list_other_comm": ("TypeError", r"a list \[a2a_group, p2p_group\] only with comm='a2a\+p2p'"),
    "hier_q_heads": ("ValueError", r"comm='a2a\+p2p' splits the q heads over the ranks of its a2a group.*Hq = 3 is "
                     r"not divisible by the a2a group's size = 2"),
    "hier_kv_heads": ("ValueError", r"Hkv = 3, the a2a group's size = 2"),
    "a2a_q_heads": ("ValueError", r"Hq = \d+ is not divisible by cp_size"),
    "a2a_kv_heads": ("ValueError", r"Hkv = 3, cp_size = \d"),
    "p2p_window": ("NotImplementedError", r"window_size=\(2, 3\)"),
    "padded_not_multiple": ("ValueError", r"cu_seqlens_q_padded: sequence 0 has length \d+, not a multiple of 2 \* cp_size"),
    "real_not_multiple": ("ValueError", r"cu_seqlens_q: sequence 0 has length 5, not a multiple of 2 \* cp_size"),
    "local_tokens": ("ValueError", r"local tokens but cu_seqlens_q_padded\[-1\]"),
    "real_exceeds_padded": ("ValueError", r"real tokens must fit in the padded sequence"),
    "max_seqlen_small": ("ValueError", r"max_seqlen_q = \d+ is smaller than the longest"),
    "kv_differs": ("ValueError", r"cu_seqlens_kv\(_padded\) must equal"),
    "window": ("NotImplementedError", r"window_size=\(2, 3\)"),
    "window_noncausal_left": ("NotImplementedError", r"window_size=\(2, -1\)"),
    "sbhd_odd_local": ("ValueError", r"local sequence length 3 must be even"),
    "sbhd_padded": ("ValueError", r"'sbhd' takes no cu_seqlens_q_padded"),
}


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"cp{w}")
@pytest.mark.parametrize("check", list(BAD))
def test_bad_inputs_under_cp(check, world, cp_results):
    kind, pattern = BAD[check]
    for r in cp_results(world):
        got = r["errors"][check]
        assert got.startswith(kind + ":") and re.search(pattern, got), got


# ---- in-process: no group (cp_size 1) and argument errors that need no collective


@pytest.mark.parametrize("comm", COMMS + ("a2a+p2p",))
@pytest.mark.parametrize("layout", ["thd", "sbhd"])
@pytest.mark.parametrize("window", [(-1, -1), (2, 1)], ids=["full", "win2_1"])
def test_without_group_is_plain_attention(layout, window, comm):
    case = CPCase("nogroup", layout=layout, causal=False, window=window, lens=(5, 0, 3) if layout == "thd" else (0, 4),
                  extra=(0, 1, 0))
    inp = case_inputs(case, 1)
    q, k, v = (inp[n].clone().requires_grad_() for n in ("q", "k", "v"))
    kwargs = dict(cu_seqlens_q=inp["cu"], causal=False, window_size=window, backend="torch")
    if layout == "thd":
        kwargs.update(cu_seqlens_q_padded=inp["cu_padded"])
    out = cp_attn(q, k, v, cp_group=None, layout=layout, comm=comm, **kwargs)
    ref = _reference(case, inp, 1)
    assert not out.detach()[~inp["keep"]].any()
    assert_flash_criterion("out", _real_rows(out.detach(), inp["keep"], layout), ref["naive"]["out"],
                           ref["oracle"]["out"])


def test_argument_errors_without_group():
    q, k, v = torch.zeros(8, 2, 8), torch.zeros(8, 2, 8), torch.zeros(8, 2, 4)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="layout must be one of"):
        cp_attn(q, k, v, cp_group=None, layout="bshd", cu_seqlens_q=cu)
    with pytest.raises(TypeError, match="cp_group must be a torch.distributed.ProcessGroup"):
        cp_attn(q, k, v, cp_group=2, layout="thd", cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="needs cu_seqlens_q"):
        cp_attn(q, k, v, cp_group=None, layout="thd")
    with pytest.raises(ValueError, match="comm must be one of"):
        cp_attn(q, k, v, cp_group=None, layout="thd", cu_seqlens_q=cu, comm="allgather")
    with pytest.raises(TypeError, match=r"comm='a2a\+p2p' takes cp_group as \[a2a_group, p2p_group\]"):
        cp_attn(q, k, v, cp_group=[None, None], layout="thd", cu_seqlens_q=cu, comm="a2a+p2p")
    with pytest.raises(ValueError, match="q has 8 local tokens/rows but k has 6"):
        cp_attn(q, k[:6], v[:6], cp_group=None, layout="thd", cu_seqlens_q=cu)
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        cp_attn(q, k, v, cp_group=None, layout="thd", cu_seqlens_q=cu.long())
    with pytest.raises(ValueError, match="cu_seqlens_q has 2 entries but the batch has 8 samples"):
        cp_attn(q[:, None].expand(8, 8, 2, 8), k[:, None].expand(8, 8, 2, 8), v[:, None].expand(8, 8, 2, 4),
                cp_group=None, layout="sbhd", cu_seqlens_q=cu)
