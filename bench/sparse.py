"""Sparse (top-k) attention, DeepSeek Sparse Attention's core: coreattn against Megatron's path and dense attention.

One sequence of T tokens in DeepSeek-V3.2's absorbed MLA form: q ``[T, H, 576]``, one latent key head
``[T, 1, 576]`` whose first 512 columns are V, causal, softmax scale 1/sqrt(192). Index patterns:

- ``spread`` (the default): query token i names min(K, i + 1) distinct keys spread evenly over
  ``[0, i]`` (``(j * (i + 1)) // K``; the rest of its row is -1). While ``T <= K`` every token names
  its whole causal range (the *full* regime: DSA's top-k there is causal attention); past K it
  names K of its i + 1 keys (the *sparse* regime);
- ``overlap``: token i names its K/2 most recent keys and the K/2 latest, below them, of one fixed
  set of K/2 keys (seeded) shared by every token: neighbouring tokens' sets overlap almost entirely,
  as a real indexer's do (local keys and heavy hitters), and spread over a range much wider than K.
- ``v4-csa``: DeepSeek-V4's compressed sparse attention layer, its own form: q ``[T, H, 512]``, one
  512-wide head that is K and V, over the T raw keys followed by T/4 compressed entries
  (``[T + T/4, 1, 512]``); token i sees its last ``V4_WINDOW`` raw keys (the sliding window, as
  ``key_window``) and K compressed entries (the indexer's top-k, spread evenly over the entries
  complete at i, ``w < (i + 1) // 4``), plus a learnable sink per head (``softmax_offset``), scale
  1/sqrt(512).
- ``blocks``: MiniMax-M3's block-sparse attention, its own form: q ``[T, H, 128]``, k and v
  ``[T, H / 4, 128]`` (GQA 4; the model's group is 16 at 64 heads), blocks of ``BLOCK_SIZE`` = 128 keys;
  token i (in block b = i // 128) names its own block (causal inside) and min(K - 1, b) earlier blocks
  spread evenly over [0, b) (``topk`` counts blocks: 16, MiniMax-M3's ``index_topk_blocks``), the
  same for every kv head; scale 1/sqrt(128). While T <= 16 x 128 every token names every block (the
  full regime).

Providers:

- ``coreattn-torch``: ``coreattn.sparse_varlen_attn(q, k, None, topk, ..., v_head_dim=512,
  backend="torch")``;
- ``coreattn-triton``: the same call on the sparse Triton kernels (CUDA only; the interpreter is
  not timed);
- ``megatron``: Megatron-Core 0.19's own DSA attention (``dsa_kernel_backend="none"``:
  ``megatron.core.transformer.experimental_attention_variant.dsa._unfused_absorbed_dsa_fn``) on
  q ``[T, 1, H, 576]``, k ``[T, 1, 1, 576]``, indices ``[1, T, K]``: dense ``[b, H, T, T]`` scores
  and a ``[b, T, T]`` index mask. Needs megatron-core >= 0.19 in the interpreter that runs the bench
  (``pip install "megatron-core>=0.19"``, Python >= 3.12); skipped with the reason otherwise, and
  where its estimated S x S buffers pass ``MEGATRON_BUDGET``;
- ``dense``: ``coreattn.varlen_attn`` (causal; torch backend on CPU, Triton on CUDA) over the same
  tokens at the head dims the same model's attention has without DSA (MLA's 192 / 128, H heads;
  ``blocks``: the same 128 / 128 GQA heads): what dense attention costs at that T;
- ``hf-eager`` (``v4-csa`` only): transformers' DeepSeek-V4 eager attention
  (``models.deepseek_v4.modeling_deepseek_v4.eager_attention_forward``) on the mask its layer
  builds: the sliding-window causal mask over the raw keys with the compressor's block bias over
  the entries appended, ``[1, 1, T, T + T/4]``, what ``attn_implementation="eager"`` runs;
  skipped where transformers has no DeepSeek-V4 and where its estimated ``[H, T, T + T/4]``
  buffers pass ``MEGATRON_BUDGET``. (Megatron-Core has no DeepSeek-V4 attention in a release.)
  On ``blocks``: transformers' MiniMax-M3 eager path, the layer's ``build_block_mask`` (the blocks
  expanded to a ``[1, H, T, T]`` mask) and ``eager_attention_forward`` on it, both timed (the layer
  runs both per call); skipped where transformers has no MiniMax-M3 or its estimated ``[H, T, T]``
  buffers pass the budget.

``fwd`` is a training forward (inputs require grad); ``fwdbwd`` adds the backward of a fixed output
gradient. fp32 on CPU, bf16 on CUDA. Two kinds of subprocess (``python -m bench.sparse SPEC``):

- time: one per (T, mode) running every provider, their calls interleaved (provider after provider,
  round after round), each provider warmed up on a small T first; ``ms`` is a provider's median, and
  the ratios (``x_megatron``, ``x_dense``: this row's time over that provider's) come from the same
  process, so the machine's load changes them little. Under the default allocator: what users get;
- memory: one per (T, mode, provider), under ``bench.cpu_attention.MEMORY_ENV`` (glibc returns freed
  blocks at once, so RSS follows what is live), one call after a warm-up: ``peak_mib`` the
  process's peak resident memory over it, ``extra_mib`` that peak minus the resident memory before it
  (what the call needs on top of its inputs). Those allocator settings make chunked code pay a page
  fault per chunk (coreattn's torch backend measured 3.4x slower under them), so no time is taken there.

On CUDA, peak and extra come from ``torch.cuda.max_memory_allocated``. FLOPs count the useful
(query, key) pairs only (docs/benchmarks.md).
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import sys
import time
from typing import Iterable, NamedTuple

import torch

from bench.cpu_attention import _reset_peak, _status_kib, worker_json
from bench.env import REPO_ROOT
from bench.flops import attention_flops

PROVIDERS = ("coreattn-torch", "coreattn-triton", "megatron", "dense", "hf-eager")
MODES = ("fwd", "fwdbwd")
PATTERNS = ("spread", "overlap", "v4-csa", "blocks")
DQK, DV, ROPE = 576, 512, 64  # DeepSeek-V3.2: kv_lora_rank 512 + rope 64; qk_head_dim 128 + rope 64 = 192
SCALE = 1.0 / math.sqrt(128 + ROPE)
DENSE_DQK, DENSE_DV = 192, 128
V4_DIM, V4_WINDOW, V4_RATE = 512, 128, 4  # DeepSeek-V4: K = V head dim, sliding window, CSA compression
BLOCK_DIM, BLOCK_SIZE, BLOCK_GROUP = 128, 128, 4  # MiniMax-M3: head dim, keys per block; the bench's GQA group
MEGATRON_BUDGET = 10 << 30  # skip Megatron rows whose estimated S x S buffers pass this (the machine must survive)
TIME_BUDGET_S = 60.0  # per provider: the rounds stop once the slowest passes it
MORE_REPS_S = 10.0
MAX_REPS = 10
SUBPROCESS_TIMEOUT_S = 3600
WARMUP_TOKENS = 64


class SparseBenchCase(NamedTuple):
    tokens: int
    topk: int
    heads: int
    pattern: str = "spread"

    @property
    def id(self) -> str:
        t = f"{self.tokens // 1024}k" if self.tokens % 1024 == 0 else str(self.tokens)
        if self.v4:
            return f"v4-csa-kv{V4_DIM}-h{self.heads}-win{V4_WINDOW}-topk{self.topk}-T{t}"
        if self.blocks:
            return f"blocks-hdim{BLOCK_DIM}-h{self.heads}-gqa{BLOCK_GROUP}-b{BLOCK_SIZE}-topk{self.topk}-T{t}"
        tail = "" if self.pattern == "spread" else f"-{self.pattern}"
        return f"dsa-absorbed{DQK}x{DV}-h{self.heads}-topk{self.topk}-T{t}{tail}"

    @property
    def v4(self) -> bool:
        return self.pattern == "v4-csa"

    @property
    def blocks(self) -> bool:
        return self.pattern == "blocks"

    @property
    def dims(self) -> tuple[int, int]:
        """(Dqk, Dv) of the sparse providers."""
        if self.blocks:
            return BLOCK_DIM, BLOCK_DIM
        return (V4_DIM, V4_DIM) if self.v4 else (DQK, DV)

    @property
    def key_rows(self) -> int:
        """Key rows of the sparse providers: v4-csa's raw keys and compressed entries."""
        return self.tokens + self.tokens // V4_RATE if self.v4 else self.tokens

    @property
    def regime(self) -> str:
        """"full" where every token names its whole causal range, else "sparse"."""
        if self.blocks:
            return "full" if self.tokens <= self.topk * BLOCK_SIZE else "sparse"
        return "full" if self.pattern == "spread" and self.tokens <= self.topk else "sparse"


def sparse_cases(quick: bool, on_gpu: bool = False) -> list[SparseBenchCase]:
    """CPU: the full regime (T <= K: T 1k at 16 and 4 heads, 2k at 4) and the sparse one (16 heads, T 2k,
    top-k 256) side by side, T 1k..8k at top-k 2,048 and 512 with 4 heads (memory growth), and the
    overlap pattern at T 8k (one gather serving many tokens); GPU: 16 heads, T up to 32k; quick: tiny
    shapes that check the section."""
    if quick:
        return [SparseBenchCase(t, 64, 2) for t in (256, 512)] + [SparseBenchCase(64, 64, 2),
                                                                   SparseBenchCase(256, 16, 2, "v4-csa"),
                                                                   SparseBenchCase(384, 2, 4, "blocks")]
    if on_gpu:
        return [SparseBenchCase(t, 2048, 16) for t in (4096, 8192, 16384, 32768)] + \
            [SparseBenchCase(t, 512, 16, "v4-csa") for t in (8192, 16384, 32768)] + \
            [SparseBenchCase(t, 16, 64, "blocks") for t in (8192, 16384, 32768)]
    regimes = [SparseBenchCase(1024, 2048, 16), SparseBenchCase(2048, 256, 16)]
    sweep = [SparseBenchCase(t, k, 4) for k in (2048, 512) for t in (1024, 2048, 4096, 8192)]
    v4 = [SparseBenchCase(t, 512, 4, "v4-csa") for t in (4096, 8192, 16384, 32768)]
    blocks = [SparseBenchCase(t, 16, 8, "blocks") for t in (2048, 4096, 8192)]
    return regimes + sweep + [SparseBenchCase(8192, 1024, 4, "overlap")] + v4 + blocks


def visible_pairs(case: SparseBenchCase) -> int:
    """Useful (query, key) pairs (spread: token i sees min(K, i + 1) keys)."""
    t, k = case.tokens, case.topk
    if case.pattern == "spread":
        full = min(t, k)
        return full * (full + 1) // 2 + (t - full) * k
    if case.v4:
        return sum(min(i + 1, V4_WINDOW) + min(k, (i + 1) // V4_RATE) for i in range(t))
    if case.blocks:  # the own block's causal part and every earlier named block whole
        return sum(i % BLOCK_SIZE + 1 + BLOCK_SIZE * min(k - 1, i // BLOCK_SIZE) for i in range(t))
    return int((topk_rows(t, k, "cpu", case.pattern) >= 0).sum())


def megatron_bytes(case: SparseBenchCase, mode: str) -> int:
    """Estimated extra memory of Megatron's unfused DSA attention: float32 ``[H, T, T]`` scores, masked
    copies, their softmax (and gradients), plus ``[T, T]`` masks. Measured on this project's CPU
    machine at 4 heads, T 1k-8k (2026-11-28): about (7 H + 2) T^2 float32 forward (autograd keeps the
    intermediates) and forward + backward alike, e.g. 7.3 / 7.6 GiB at 8k."""
    return (7 * case.heads + 2) * case.tokens ** 2 * 4


def eager_v4_bytes(case: SparseBenchCase, mode: str) -> int:
    """Estimated extra memory of transformers' V4 eager attention: float32 ``[H, T, T + T/4]`` scores and
    the copies autograd keeps (masked, sink-extended, shifted, softmaxed), plus the ``[T, T + T/4]`` mask.
    Measured on this project's CPU machine at 4 heads (2026-11-29): 964 / 1,036 MiB at 4k (forward /
    forward + backward), 3,845 MiB forward at 8k, about 3 such buffers; the estimate counts 4 and 5."""
    copies = 4 if mode == "fwd" else 5
    return (copies * case.heads + 1) * case.tokens * case.key_rows * 4


def eager_blocks_bytes(case: SparseBenchCase, mode: str) -> int:
    """Estimated extra memory of MiniMax-M3's eager path: the float32 ``[H, T, T]`` mask and the bool
    ``[H, T, T]`` temporaries that build it, the scores with the copies autograd keeps."""
    copies = 4 if mode == "fwd" else 5
    return ((copies + 1) * 4 + 3) * case.heads * case.tokens ** 2


def _baseline_reason(importer, what: str, need: int, buffers: str) -> str | None:
    """Why a baseline cannot run: ``importer`` fails (``what`` is missing), or its estimated ``need``
    bytes pass ``MEGATRON_BUDGET``."""
    try:
        importer()
    except ImportError as exc:
        return f"{what} is not importable in this interpreter ({type(exc).__name__}: {exc})"
    if need > MEGATRON_BUDGET:
        return f"its {buffers} buffers need about {need / 2**30:.0f} GiB (budget {MEGATRON_BUDGET >> 30} GiB)"
    return None


def _import_v4_eager():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward  # noqa: F401


def _import_minimax_eager():
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLIndexer  # noqa: F401


def _import_megatron_dsa():
    from megatron.core.transformer.experimental_attention_variant.dsa import _unfused_absorbed_dsa_fn  # noqa: F401


def skip_reason(case: SparseBenchCase, provider: str, mode: str, device: torch.device) -> str | None:
    if provider == "hf-eager":
        if case.blocks:
            return _baseline_reason(_import_minimax_eager, "transformers with MiniMax-M3",
                                    eager_blocks_bytes(case, mode), "[H, T, T]")
        if not case.v4:
            return "transformers' eager attention runs the v4-csa and blocks cases only"
        return _baseline_reason(_import_v4_eager, "transformers with DeepSeek-V4", eager_v4_bytes(case, mode),
                                "[H, T, T + T/4]")
    if provider == "megatron":
        if case.v4:
            return "Megatron-Core has no DeepSeek-V4 attention in a release"
        if case.blocks:
            return "Megatron-Core has no block-sparse attention"
        return _baseline_reason(_import_megatron_dsa, "megatron-core >= 0.19", megatron_bytes(case, mode), "S x S")
    if provider == "coreattn-triton":
        if device.type != "cuda":
            return "the sparse Triton kernels are timed on a GPU only (the interpreter is not timed)"
        try:
            import coreattn.kernels.sparse_fwd  # noqa: F401
        except ImportError as exc:
            return f"the sparse Triton kernels are not in this build ({exc})"
    if provider == "coreattn-torch" and device.type == "cuda":
        return "the torch backend is timed on CPU"
    return None


# ---- the workers: one (case, mode) timed for every provider, or one (case, mode, provider)'s memory


def topk_rows(tokens: int, topk: int, device, pattern: str = "spread") -> torch.Tensor:
    """int64 ``[T, K]``: the keys each token names (see the module docstring), the rest -1."""
    i = torch.arange(tokens, device=device)[:, None]
    j = torch.arange(topk, device=device)[None, :]
    if pattern == "spread":
        spread = (j * (i + 1)) // topk  # distinct when i + 1 >= K
        return torch.where(i + 1 >= topk, spread, torch.where(j <= i, j, -1))
    half = topk // 2
    recent = i - j[:, :half]  # [T, K/2]: i, i - 1, ...
    shared = torch.randperm(tokens, generator=torch.Generator().manual_seed(0))[:topk - half].sort().values
    shared = shared.to(device)[None, :].expand(tokens, -1)
    older = torch.where(shared <= i - half, shared, -1)  # below the recent keys: distinct from them
    return torch.cat([recent.clamp(min=-1), older], 1)


def build(case: SparseBenchCase, provider: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """(forward closure, leaves) of a provider."""
    import coreattn

    gen = torch.Generator(device=device).manual_seed(seed)
    t, h = case.tokens, case.heads

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype).requires_grad_()

    cu = torch.tensor([0, t], dtype=torch.int32, device=device)
    if case.blocks:
        return _build_blocks(case, provider, device, randn, cu)
    if provider == "dense":
        q, k, v = randn(t, h, DENSE_DQK), randn(t, h, DENSE_DQK), randn(t, h, DENSE_DV)
        backend = "triton" if device.type == "cuda" else "torch"
        return (lambda: coreattn.varlen_attn(q, k, v, cu, cu, t, t, causal=True, backend=backend)), [q, k, v]
    if case.v4:
        return _build_v4(case, provider, device, randn)
    q, k = randn(t, h, DQK), randn(t, 1, DQK)
    topk = topk_rows(t, case.topk, device, case.pattern)
    if provider == "megatron":
        from megatron.core.transformer.experimental_attention_variant.dsa import _unfused_absorbed_dsa_fn

        q4, k4, idx = q.unsqueeze(1), k.unsqueeze(1), topk.unsqueeze(0)  # [s, b, np, D], [s, b, 1, D], [b, s, K]
        return (lambda: _unfused_absorbed_dsa_fn(q4, k4, idx, SCALE, DV)), [q, k]
    backend = "triton" if provider == "coreattn-triton" else "torch"
    return (lambda: coreattn.sparse_varlen_attn(q, k, None, topk, cu, cu, softmax_scale=SCALE, v_head_dim=DV,
                                                backend=backend)), [q, k]


def v4_entries(tokens: int, topk: int, device) -> torch.Tensor:
    """int64 ``[T, K]``: the compressed entries token i sees, K spread evenly over the ``(i + 1) // 4``
    complete at i (all of them while fewer than K), the rest -1; entry numbers, not key rows."""
    i = torch.arange(tokens, device=device)[:, None]
    j = torch.arange(topk, device=device)[None, :]
    n = (i + 1) // V4_RATE
    return torch.where(n >= topk, (j * n) // topk, torch.where(j < n, j, -1))


def _build_v4(case: SparseBenchCase, provider: str, device: torch.device, randn):
    import coreattn

    t, h = case.tokens, case.heads
    q, kv, sinks = randn(t, h, V4_DIM), randn(case.key_rows, 1, V4_DIM), randn(h)
    entries = v4_entries(t, case.topk, device)
    scale = V4_DIM ** -0.5
    if provider == "hf-eager":
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward

        module = torch.nn.Module()
        module.num_key_value_groups, module.sinks = h, sinks
        pos, key = torch.arange(t, device=device)[:, None], torch.arange(t, device=device)[None, :]
        window = (key <= pos) & (key > pos - V4_WINDOW)
        chosen = torch.zeros(t, t // V4_RATE + 1, dtype=torch.bool, device=device)
        chosen.scatter_(1, torch.where(entries >= 0, entries, t // V4_RATE), True)
        visible = torch.cat([window, chosen[:, :-1]], 1)
        mask = torch.zeros(visible.shape, device=device, dtype=q.dtype).masked_fill_(~visible, float("-inf"))

        def eager():
            q4, kv4 = q.transpose(0, 1)[None], kv.transpose(0, 1)[None]  # [1, H, T, D], [1, 1, T + T/4, D]
            return eager_attention_forward(module, q4, kv4, kv4, mask[None, None], scale)[0][0]

        return eager, [q, kv, sinks]
    cu_q = torch.tensor([0, t], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, case.key_rows], dtype=torch.int32, device=device)
    rows = torch.where(entries >= 0, entries + t, -1)  # the entries' key rows, after the raw keys
    backend = "triton" if provider == "coreattn-triton" else "torch"
    return (lambda: coreattn.sparse_varlen_attn(
        q, kv, None, rows, cu_q, cu_k, softmax_scale=scale, causal=False, causal_alignment="top_left",
        v_head_dim=V4_DIM, key_window=(V4_WINDOW - 1, 0), softmax_offset=sinks, backend=backend)), [q, kv, sinks]


def block_rows(tokens: int, n_blocks: int, device) -> torch.Tensor:
    """int64 ``[T, K]``: the blocks token i names (``blocks``: its own, then min(K - 1, b) earlier ones spread
    over [0, b)), the rest -1."""
    i = torch.arange(tokens, device=device)[:, None]
    own = i // BLOCK_SIZE
    j = torch.arange(n_blocks, device=device)[None, :]
    spread = ((j - 1) * own) // max(n_blocks - 1, 1)  # distinct when own >= K - 1
    earlier = torch.where(own >= n_blocks - 1, spread, torch.where(j - 1 < own, j - 1, -1))
    return torch.where(j == 0, own, earlier)


def _build_blocks(case: SparseBenchCase, provider: str, device: torch.device, randn, cu):
    import coreattn

    t, h = case.tokens, case.heads
    hkv = max(h // BLOCK_GROUP, 1)
    q, k, v = randn(t, h, BLOCK_DIM), randn(t, hkv, BLOCK_DIM), randn(t, hkv, BLOCK_DIM)
    scale = BLOCK_DIM ** -0.5
    if provider == "dense":
        backend = "triton" if device.type == "cuda" else "torch"
        return (lambda: coreattn.varlen_attn(q, k, v, cu, cu, t, t, causal=True, backend=backend)), [q, k, v]
    rows = block_rows(t, case.topk, device)[:, None, :].expand(t, hkv, -1)  # [T, Hkv, K]
    if provider == "hf-eager":
        from types import SimpleNamespace

        from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (MiniMaxM3VLIndexer,
                                                                             eager_attention_forward)

        layer = SimpleNamespace(block_size=BLOCK_SIZE, config=SimpleNamespace(num_attention_heads=h))
        module = torch.nn.Module()
        module.num_key_value_groups = h // hkv
        positions = torch.arange(t, device=device)[None]

        def eager():
            mask = MiniMaxM3VLIndexer.build_block_mask(layer, rows.permute(1, 0, 2)[None], None, t, q.dtype, device,
                                                        positions)  # [1, H, T, T]
            q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))
            return eager_attention_forward(module, q4, k4, v4, mask, scale)[0][0]

        return eager, [q, k, v]
    backend = "triton" if provider == "coreattn-triton" else "torch"
    return (lambda: coreattn.sparse_varlen_attn(q, k, v, rows, cu, cu, softmax_scale=scale, block_size=BLOCK_SIZE,
                                                backend=backend)), [q, k, v]


def _call(fn, leaves, mode: str, dout):
    for x in leaves:
        x.grad = None
    out = fn()
    if mode == "fwdbwd":
        out.backward(dout.view(out.shape))


class _Prepared(NamedTuple):
    fn: object
    leaves: list
    dout: torch.Tensor


def _prepare(case: SparseBenchCase, provider: str, mode: str, device: torch.device, dtype) -> _Prepared:
    """A provider warmed up on a small T (imports, first-call dispatch, kernel compiles), then built at T."""
    dv = DENSE_DV if provider == "dense" and not case.blocks else case.dims[1]
    small = case._replace(tokens=WARMUP_TOKENS, topk=case.topk if case.blocks else min(case.topk, WARMUP_TOKENS))
    fn, leaves = build(small, provider, device, dtype)
    _call(fn, leaves, mode, torch.randn(small.tokens * small.heads * dv, device=device, dtype=dtype))
    del fn, leaves
    fn, leaves = build(case, provider, device, dtype)
    return _Prepared(fn, leaves, torch.randn(case.tokens * case.heads * dv, device=device, dtype=dtype))


def _setup(spec: dict):
    import coreattn  # noqa: F401 (every worker holds the same modules, so RSS differences are the calls)

    device = torch.device(spec["device"])
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    return SparseBenchCase(**spec["case"]), device, torch.bfloat16 if device.type == "cuda" else torch.float32


def time_rounds(prepared: dict, mode: str, device: torch.device, spec: dict) -> dict:
    """{provider: [ms, ...]} of ``prepared`` ({provider: (fn, leaves, dout)}), their calls interleaved round
    by round until the spec's repetitions and the time budgets say stop; also the torch threads."""
    times = {p: [] for p in prepared}
    start = time.perf_counter()
    while True:
        for p, (fn, leaves, dout) in prepared.items():
            t0 = time.perf_counter()
            _call(fn, leaves, mode, dout)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[p].append((time.perf_counter() - t0) * 1e3)
        rounds, elapsed = len(next(iter(times.values()))), (time.perf_counter() - start) / len(prepared)
        if spec["quick"] or rounds >= MAX_REPS or elapsed >= TIME_BUDGET_S \
                or (rounds >= spec["reps"] and elapsed >= MORE_REPS_S):
            break
    return {"times": times, "threads": torch.get_num_threads()}


def call_memory(fn, leaves, dout, mode: str, device: torch.device) -> dict:
    """The peak memory of one call (``_call``) on top of what is resident before it."""
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) / 2**10
        exact = True
    else:
        base = _status_kib("VmRSS")
        exact = _reset_peak()
    _call(fn, leaves, mode, dout)
    if cuda:
        torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**10 if cuda else _status_kib("VmHWM")
    return {"peak_mib": peak / 1024 if peak else None, "base_mib": base / 1024 if base else None,
            "extra_mib": (peak - base) / 1024 if peak and base else None, "peak_reset": exact,
            "memory": "torch.cuda.max_memory_allocated" if cuda else "VmHWM (peak RSS), memory allocator settings"}


def time_worker(spec: dict) -> dict:
    """{provider: [ms, ...]} of every provider of the spec, their calls interleaved round by round."""
    case, device, dtype = _setup(spec)
    mode = spec["mode"]
    return time_rounds({p: _prepare(case, p, mode, device, dtype) for p in spec["providers"]}, mode, device, spec)


def memory_worker(spec: dict) -> dict:
    """The peak memory of one call of one provider on top of its inputs."""
    case, device, dtype = _setup(spec)
    fn, leaves, dout = _prepare(case, spec["provider"], spec["mode"], device, dtype)
    return call_memory(fn, leaves, dout, spec["mode"], device)


# ---- the parent


def _run_child(spec: dict, memory: bool, module: str = "bench.sparse") -> dict:
    result = worker_json(["-m", module, json.dumps(spec)], SUBPROCESS_TIMEOUT_S, memory)
    if "error" in result:
        raise RuntimeError(result["error"])
    return result


def _base_row(case: SparseBenchCase, mode: str, provider: str, device: torch.device) -> dict:
    dense = provider == "dense"
    dims = (DENSE_DQK, DENSE_DV) if dense and not case.blocks else case.dims
    pairs = case.tokens * (case.tokens + 1) // 2 if dense else visible_pairs(case)
    return {"kind": "sparse", "config": case.id, "tokens": case.tokens, "topk": case.topk, "heads": case.heads,
            "pattern": case.pattern, "regime": case.regime, "head_dim_qk": dims[0], "head_dim_v": dims[1],
            "mode": mode, "provider": provider, "pairs": pairs, "flops": attention_flops(pairs, case.heads, *dims, mode),
            "dtype": "bfloat16" if device.type == "cuda" else "float32", "device": device.type}


def run_groups(cases, providers: list[str], quick: bool, device: torch.device, progress, modes, threads,
               module: str, base_row, skip, ratios) -> list[dict]:
    """One row per (case, mode, provider) of a section whose workers are ``python -m module SPEC``: time
    from the (case, mode)'s time worker (every live provider in it), memory from the row's own memory
    worker; ``base_row(case, mode, provider, device)``, ``skip(case, provider, mode, device)`` (a reason
    or None) and ``ratios(group)`` are the section's."""
    rows = []
    for case in cases:
        for mode in modes:
            group = [base_row(case, mode, p, device) for p in providers]
            live = []
            for row in group:
                reason = skip(case, row["provider"], mode, device)
                if reason:
                    row.update(status="skipped", reason=reason)
                else:
                    live.append(row)
            spec = {"case": case._asdict(), "mode": mode, "device": str(device), "reps": 1 if quick else 3,
                    "quick": quick, "threads": threads, "providers": [r["provider"] for r in live]}
            try:
                timed = _run_child(dict(spec, kind="time"), False, module) if live else {}
            except RuntimeError as exc:
                timed = {"error": str(exc).splitlines()[0][:300]}
            for row in live:
                if "error" in timed:
                    row.update(status="error", reason=timed["error"])
                    continue
                ms_all = timed["times"][row["provider"]]
                row.update(status="ok", ms=statistics.median(ms_all), ms_min=min(ms_all), ms_all=ms_all,
                           threads=timed["threads"])
                if "flops" in row:
                    row["gflops"] = row["flops"] / (row["ms"] * 1e-3) / 1e9
                try:
                    row.update(_run_child(dict(spec, kind="memory", provider=row["provider"]), True, module))
                except RuntimeError as exc:
                    row.update(memory_error=str(exc).splitlines()[0][:300])
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix_str(f"{row['kind']} {case.id} {mode} {row['provider']}"[:60], refresh=False)
            ratios(group)
            rows += group
    return rows


def run_sparse(cases: Iterable[SparseBenchCase], providers: list[str], quick: bool, device: torch.device,
               progress=None, modes=MODES, threads: int | None = None) -> list[dict]:
    """One row per (case, mode, provider): time from the (case, mode)'s time worker, memory from the
    row's own memory worker."""
    rows = run_groups(cases, providers, quick, device, progress, modes, threads, "bench.sparse", _base_row,
                      skip_reason, add_ratios)
    add_growth(rows)
    return rows


def count(cases: Iterable[SparseBenchCase], providers: list[str], device: torch.device, modes=MODES) -> int:
    return sum(1 for c in cases for m in modes for p in providers if skip_reason(c, p, m, device) is None)


def add_ratios(group: list[dict]) -> None:
    """On each row of one (case, mode), timed in one process: its time over Megatron's, dense attention's
    and transformers' eager V4 attention's (``x_megatron``, ``x_dense``, ``x_eager``)."""
    ok = {r["provider"]: r for r in group if r["status"] == "ok"}
    for r in ok.values():
        for name, other in (("x_megatron", "megatron"), ("x_dense", "dense"), ("x_eager", "hf-eager")):
            if other in ok and other != r["provider"]:
                r[name] = r["ms"] / ok[other]["ms"]


def add_growth(rows: list[dict]) -> None:
    """On each row: its time and extra memory over the same provider's at half the tokens (same
    top-k, heads, pattern, mode): about x2 when linear in T, x4 when quadratic."""
    ok = {(r["provider"], r["mode"], r["topk"], r["heads"], r["pattern"], r["tokens"]): r
          for r in rows if r["status"] == "ok"}
    for (provider, mode, topk, heads, pattern, tokens), r in ok.items():
        half = ok.get((provider, mode, topk, heads, pattern, tokens // 2))
        if half is None:
            continue
        r["time_growth"] = r["ms"] / half["ms"]
        if r.get("extra_mib") and half.get("extra_mib"):
            r["memory_growth"] = r["extra_mib"] / half["extra_mib"]


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    print(json.dumps(time_worker(spec) if spec["kind"] == "time" else memory_worker(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
