"""Attention benchmark runner: every (config, provider, mode) becomes one result row."""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch

from bench.configs import AttnConfig
from bench.flops import attention_flops, batch_pairs
from bench.inputs import input_set_bytes, make_inputs
from bench.providers import PROVIDERS, Prepared, memory_budget
from bench.seqlens import draw_seqlens
from bench.timing import kernel_configs, rotating, time_fn, untimed

MAX_INPUT_SETS = 3


def _short(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:200]}"


def num_input_sets(cfg: AttnConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Several sets cycled so caches do not flatter; fewer when memory is tight."""
    if device.type != "cuda":
        return 2  # CPU runs check the rotation, they do not measure caches
    budget = memory_budget(device) // 4
    return max(1, min(MAX_INPUT_SETS, budget // max(1, input_set_bytes(cfg, dtype))))


def _timed_callable(sets: list[Prepared], mode: str) -> tuple[Callable[[], object], list[torch.Tensor] | None]:
    """The function to time for ``mode`` and the tensors whose .grad is cleared between runs."""
    if mode == "fwd":
        return rotating([s.fn for s in sets]), None
    leaves = [t for s in sets for t in s.leaves]
    outs = [s.fn() for s in sets]
    douts = [torch.randn_like(o) for o in outs]
    if mode == "bwd":
        calls = [functools.partial(o.backward, d, retain_graph=True) for o, d in zip(outs, douts)]
    else:
        calls = [functools.partial(lambda s, d: s.fn().backward(d), s, d) for s, d in zip(sets, douts)]
        del outs
    return rotating(calls), leaves


def run_attention(configs: Iterable[AttnConfig], modes: tuple[str, ...], provider_names: list[str],
                  dtype: torch.dtype, device: torch.device, quick: bool, progress=None) -> list[dict]:
    rows = []
    dtype_name = str(dtype).removeprefix("torch.")
    unavailable = {name: PROVIDERS[name].unavailable(device) for name in provider_names}
    for cfg in configs:
        seqlens = draw_seqlens(cfg.dist, cfg.total_tokens)
        pairs = batch_pairs(seqlens, causal=cfg.causal)
        base = {"kind": "attention", "config": cfg.id, **cfg._asdict(), "dtype": dtype_name,
                "num_seqs": len(seqlens), "max_seqlen": max(seqlens), "pairs": pairs}
        for name in provider_names:
            provider = PROVIDERS[name]
            for mode in modes:
                row = dict(base, mode=mode, provider=name, flops=attention_flops(
                    pairs, cfg.heads_q, cfg.head_dim_qk, cfg.head_dim_v, mode))
                rows.append(row)
                reason = unavailable[name] or provider.feature_skip(cfg) or provider.skip_reason(cfg, mode, dtype,
                                                                                                 device)
                if reason:
                    row.update(status="skipped", reason=reason)
                else:
                    _measure(row, provider, cfg, mode, dtype, device, quick)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix_str(f"{cfg.id} {mode} {name}"[:60], refresh=False)
    return rows


def _measure(row: dict, provider, cfg: AttnConfig, mode: str, dtype: torch.dtype, device: torch.device,
             quick: bool) -> None:
    sets = None
    try:
        n_sets = num_input_sets(cfg, dtype, device)
        with kernel_configs(row):
            with untimed():  # in an isolated worker, these launches are traced (and a fault names its kernel)
                sets = [provider.build(make_inputs(cfg, dtype, device, seed=i), cfg, mode) for i in range(n_sets)]
                fn, grad_to_none = _timed_callable(sets, mode)
                fn()
            timing = time_fn(fn, device, grad_to_none, quick)
    except Exception as exc:  # one failing provider must not end the run; the row says why
        row.update(status="error", reason=_short(exc))
    else:
        row.update(status="ok", ms=timing.ms, ms_p20=timing.ms_p20, ms_p80=timing.ms_p80,
                   tflops=row["flops"] / (timing.ms * 1e-3) / 1e12, timing=timing.method,
                   input_sets=n_sets, info=sets[0].info)
    finally:
        del sets
        if device.type == "cuda":
            torch.cuda.empty_cache()
