"""Mask benchmarks: per-sample Python loops vs coreattn.masks' vectorized torch builders vs its
Triton kernels (what coreattn runs on CUDA tensors), plus the dense ``[B, 1, S, S]`` mask for
reference (its time and bytes are what the compact forms avoid).

coreattn.masks is imported lazily: without it the section is skipped with one reason.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import random
from typing import Callable, Iterable, NamedTuple
from unittest import mock

import torch

from bench.configs import MaskConfig
from bench.seqlens import SEED
from bench.timing import time_fn, untimed

PROVIDERS = ("loop", "vectorized", "triton", "torch-dense")


class MaskInputs(NamedTuple):
    seqlens: torch.Tensor  # int32 [B]
    lens: list[int]
    keep: torch.Tensor  # bool [B, S], True = real token
    cu_seqlens: torch.Tensor  # int32 [B+1]
    padded: torch.Tensor  # [B, S, hidden]
    packed: torch.Tensor  # [T, hidden]
    indices: torch.Tensor  # int64 [T], flat positions of the real tokens in [B*S]
    seqlen: int


def import_masks():
    """(module, None) or (None, one-line reason)."""
    try:
        return importlib.import_module("coreattn.masks"), None
    except ImportError as exc:
        return None, f"coreattn.masks is not importable ({exc})"


def make_mask_inputs(cfg: MaskConfig, dtype: torch.dtype, device: torch.device) -> MaskInputs:
    rng = random.Random(f"masks-{cfg.batch}-{cfg.seqlen}-{SEED}")
    lens = [rng.randint(max(1, cfg.seqlen // 8), cfg.seqlen) for _ in range(cfg.batch)]
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    pos = torch.arange(cfg.seqlen, device=device)
    keep = pos[None, :] < seqlens[:, None]
    cu = torch.zeros(cfg.batch + 1, dtype=torch.int32, device=device)
    cu[1:] = seqlens.cumsum(0)
    padded = torch.randn(cfg.batch, cfg.seqlen, cfg.hidden, device=device).to(dtype)
    indices = keep.reshape(-1).nonzero().squeeze(1)
    return MaskInputs(seqlens, lens, keep, cu, padded, padded[keep], indices, cfg.seqlen)


# Per-sample loops, written the way model code often does it (host lists, one op per sample).

def loop_padding_mask(inp: MaskInputs) -> torch.Tensor:
    mask = torch.zeros(len(inp.lens), inp.seqlen, dtype=torch.bool, device=inp.seqlens.device)
    for b, length in enumerate(inp.seqlens.tolist()):
        mask[b, :length] = True
    return mask


def loop_cu_seqlens(inp: MaskInputs) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(inp.seqlens.tolist())], dtype=torch.int32,
                        device=inp.seqlens.device)


def loop_position_ids(inp: MaskInputs) -> torch.Tensor:
    return torch.cat([torch.arange(n, device=inp.seqlens.device) for n in inp.seqlens.tolist()])


def loop_unpad(inp: MaskInputs) -> torch.Tensor:
    return torch.cat([inp.padded[b, :n] for b, n in enumerate(inp.seqlens.tolist())])


def loop_pad(inp: MaskInputs) -> torch.Tensor:
    out = inp.packed.new_zeros(len(inp.lens), inp.seqlen, inp.packed.shape[-1])
    cu = inp.cu_seqlens.tolist()
    for b in range(len(inp.lens)):
        out[b, :cu[b + 1] - cu[b]] = inp.packed[cu[b]:cu[b + 1]]
    return out


def loop_dense_causal(inp: MaskInputs) -> torch.Tensor:
    s, device = inp.seqlen, inp.seqlens.device
    tril = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    out = torch.empty(len(inp.lens), 1, s, s, dtype=torch.bool, device=device)
    for b, n in enumerate(inp.seqlens.tolist()):
        keep = torch.arange(s, device=device) < n
        out[b, 0] = ~(keep[:, None] & keep[None, :] & tril)  # Megatron convention: True = masked out
    return out


def dense_causal(inp: MaskInputs) -> torch.Tensor:
    s = inp.seqlen
    tril = torch.ones(s, s, dtype=torch.bool, device=inp.keep.device).tril()
    return ~(inp.keep[:, None, :, None] & inp.keep[:, None, None, :] & tril)  # [B, 1, S, S]


class MaskOp(NamedTuple):
    name: str
    loop: Callable[[MaskInputs], torch.Tensor]
    builder: str  # coreattn.masks function
    args: Callable[[MaskInputs], tuple]
    kwargs: Callable[[MaskInputs], dict] = lambda i: {}
    dense: bool = False
    triton: bool = False  # coreattn has a Triton kernel for it (else vectorized torch everywhere)


OPS = (
    MaskOp("padding_mask", loop_padding_mask, "padding_mask_from_seqlens", lambda i: (i.seqlens, i.seqlen)),
    MaskOp("cu_seqlens", loop_cu_seqlens, "cu_seqlens_from_seqlens", lambda i: (i.seqlens,)),
    MaskOp("position_ids", loop_position_ids, "position_ids_from_cu_seqlens",
           lambda i: (i.cu_seqlens, i.packed.shape[0]), triton=True),
    # total and max_seqlen given, as a training loop that knows its batch does: no host sync
    MaskOp("unpad", loop_unpad, "unpad", lambda i: (i.padded, i.keep),
           lambda i: dict(total=i.packed.shape[0], max_seqlen=max(i.lens)), triton=True),
    MaskOp("pad", loop_pad, "pad", lambda i: (i.packed, i.indices, len(i.lens), i.seqlen), triton=True),
    MaskOp("dense_4d_causal", loop_dense_causal, "megatron_mask_from_keep_mask", lambda i: (i.keep, True),
           dense=True),
)


def dense_bytes(cfg: MaskConfig) -> int:
    return cfg.batch * cfg.seqlen * cfg.seqlen  # bool


def dense_budget(device: torch.device) -> int:
    if device.type == "cuda":
        # the broadcast build peaks at about three [B, 1, S, S] temporaries
        return torch.cuda.get_device_properties(device).total_memory // 8
    return 256 << 20


@contextlib.contextmanager
def torch_path():
    """coreattn's mask builders with their Triton kernels switched off, whatever the device."""
    from coreattn.layers.masks import padding as padding_function

    def never(device):
        return False

    # every mask utility dispatches through padding.use_triton
    with mock.patch.object(padding_function, "use_triton", never):
        yield


def _callable_for(provider: str, op: MaskOp, masks, inp: MaskInputs, device: torch.device):
    """(fn, None) or (None, reason)."""
    if provider == "loop":
        return functools.partial(op.loop, inp), None
    if provider == "torch-dense":
        return (functools.partial(dense_causal, inp), None) if op.dense else (None, "dense reference only")
    if provider == "triton":
        from coreattn.layers.masks.padding import use_triton

        if not op.triton:
            return None, "no Triton kernel (coreattn runs the vectorized builder)"
        if not use_triton(device):
            return None, f"coreattn uses its Triton kernels on CUDA only, not {device.type}"
    builder = getattr(masks, op.builder, None)
    if builder is None:
        return None, f"coreattn.masks has no {op.builder}"
    return functools.partial(builder, *op.args(inp), **op.kwargs(inp)), None


def _output_bytes(out) -> int:
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.numel() * out.element_size() if isinstance(out, torch.Tensor) else 0


def run_masks(configs: Iterable[MaskConfig], provider_names: list[str], dtype: torch.dtype,
              device: torch.device, quick: bool, progress=None) -> list[dict]:
    masks, missing = import_masks()
    configs = list(configs)
    if masks is None:
        if progress is not None:
            progress.update(len(configs) * len(OPS) * len(provider_names))
        return [{"kind": "masks", "config": "*", "op": "*", "provider": "*", "status": "skipped", "reason": missing}]
    rows = []
    for cfg in configs:
        inp = make_mask_inputs(cfg, dtype, device)
        for op in OPS:
            for provider in provider_names:
                row = {"kind": "masks", "config": cfg.id, **cfg._asdict(), "op": op.name, "provider": provider,
                       "dtype": str(dtype).removeprefix("torch.")}
                if op.dense:
                    row["dense_bytes"] = dense_bytes(cfg)
                rows.append(row)
                fn, reason = _callable_for(provider, op, masks, inp, device)
                if fn is not None and op.dense and dense_bytes(cfg) > dense_budget(device):
                    fn, reason = None, (f"the dense mask is {dense_bytes(cfg) / 2**30:.1f} GiB "
                                        f"(budget {dense_budget(device) / 2**30:.1f} GiB)")
                if fn is None:
                    row.update(status="skipped", reason=reason)
                else:
                    try:
                        # patched around the warm-up and all timed calls, not inside each call
                        with torch_path() if provider == "vectorized" else contextlib.nullcontext():
                            with untimed():
                                row["output_bytes"] = _output_bytes(fn())
                            timing = time_fn(fn, device, quick=quick)
                    except Exception as exc:  # a signature mismatch or bug in one builder: record it
                        first = (str(exc).strip().splitlines() or [""])[0]
                        row.update(status="error", reason=f"{type(exc).__name__}: {first[:200]}")
                    else:
                        row.update(status="ok", ms=timing.ms, ms_p20=timing.ms_p20, ms_p80=timing.ms_p80,
                                   timing=timing.method)
                if progress is not None:
                    progress.update(1)
        del inp
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
