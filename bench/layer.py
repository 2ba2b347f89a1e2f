"""End-to-end layer: one transformers decoder layer, forward + backward, with coreattn against SDPA
and flash attention (``flash_attention_2``, where flash-attn is installed) as the model's
``attn_implementation``.

The batch is packed the way transformers' ``DataCollatorWithFlattening`` packs it: one row of
documents with restarting ``position_ids`` (the same long-tail lengths as the attention suite).
Each implementation then takes its own path: coreattn reads the sequences from the position ids
in its op, flash attention derives cu_seqlens from them per layer, and SDPA gets transformers'
dense ``[1, 1, T, T]`` packed-sequence mask. The mask and the rotary embeddings are built once,
outside the timed region (a model builds them once per step for all its layers). Timed on a CUDA
device only; on CPU every row runs one forward + backward of a tiny layer to check the suite.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from bench.seqlens import draw_seqlens
from bench.timing import kernel_configs, time_fn, untimed

IMPLS = ("coreattn", "sdpa", "flash_attention_2")
PRIMARY = "coreattn"


class LayerConfig(NamedTuple):
    model: str  # "llama" (GQA) or "deepseek_v3" (MLA, q/k 192 = 128 + 64 rope, v 128)
    total_tokens: int
    dist: str = "longtail"
    scale: str = "full"  # "full": the real model's layer sizes; "tiny": for CPU checks

    @property
    def id(self) -> str:
        tokens = f"{self.total_tokens // 1024}k" if self.total_tokens % 1024 == 0 else str(self.total_tokens)
        return f"layer-{self.model}-{self.scale}-{self.dist}-{tokens}"


def layer_configs(on_gpu: bool, quick: bool) -> list[LayerConfig]:
    if not on_gpu:
        return [LayerConfig(m, 96, "short", "tiny") for m in ("llama", "deepseek_v3")]
    totals = (16384,) if quick else (16384, 65536)
    return [LayerConfig(m, t) for m in ("llama", "deepseek_v3") for t in totals]


def _config(cfg: LayerConfig):
    """Llama-3-8B's layer (hidden 4096, 32/8 heads of 128, MLP 14336); DeepSeek-V3's dense first
    layer (hidden 7168, 128 heads, q/k 192, v 128, MLP 18432). Tiny: the same shapes scaled down."""
    from transformers import DeepseekV3Config, LlamaConfig

    tiny = cfg.scale == "tiny"
    if cfg.model == "llama":
        return LlamaConfig(hidden_size=64 if tiny else 4096, intermediate_size=128 if tiny else 14336,
                           num_attention_heads=4 if tiny else 32, num_key_value_heads=2 if tiny else 8,
                           num_hidden_layers=1, vocab_size=128, max_position_embeddings=max(cfg.total_tokens, 8192))
    return DeepseekV3Config(hidden_size=64 if tiny else 7168, intermediate_size=128 if tiny else 18432,
                            num_attention_heads=4 if tiny else 128, num_key_value_heads=4 if tiny else 128,
                            q_lora_rank=32 if tiny else 1536, kv_lora_rank=16 if tiny else 512,
                            qk_nope_head_dim=16 if tiny else 128, qk_rope_head_dim=8 if tiny else 64,
                            v_head_dim=16 if tiny else 128, first_k_dense_replace=1, num_hidden_layers=1,
                            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, vocab_size=128,
                            max_position_embeddings=max(cfg.total_tokens, 8192))


def unavailable(impl: str, device: torch.device, dtype: torch.dtype) -> str | None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed (pip install transformers)"
    if impl == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available

        if device.type != "cuda":
            return "flash attention runs on CUDA only"
        if not is_flash_attn_2_available():
            return "flash-attn is not installed"
        if dtype not in (torch.float16, torch.bfloat16):
            return "flash attention takes fp16/bf16 only"
    return None


def _implementation(impl: str, device: torch.device) -> str:
    """The attn_implementation name; coreattn registered with transformers (torch backend on CPU:
    the tests run with TRITON_INTERPRET=1, and the interpreter is not timed)."""
    if impl != "coreattn":
        return impl
    import coreattn.adapters.transformers as coreattn_hf

    if device.type == "cuda":
        return coreattn_hf.register()
    return coreattn_hf.register("coreattn_torch", backend="torch")


def build(cfg: LayerConfig, impl: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """(fn, leaves, info): fn runs the layer forward and backward on a packed batch."""
    from transformers import AutoModel
    from transformers.masking_utils import create_causal_mask

    torch.manual_seed(seed)
    model = AutoModel.from_config(_config(cfg), attn_implementation=_implementation(impl, device))
    model = model.to(device=device, dtype=dtype)
    layer = model.layers[0]
    lens = draw_seqlens(cfg.dist, cfg.total_tokens)
    position_ids = torch.cat([torch.arange(n, device=device) for n in lens])[None]
    hidden = torch.randn(1, cfg.total_tokens, model.config.hidden_size, device=device, dtype=dtype,
                         requires_grad=True)
    with torch.no_grad():
        position_embeddings = model.rotary_emb(hidden, position_ids)
        # positional: the cache argument was renamed (past_key_values -> cache) within transformers 5.x
        mask = create_causal_mask(model.config, hidden, None, None, position_ids)
    dout = torch.randn_like(hidden)

    def fn():
        out = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dout)

    mask_info = "none" if mask is None else f"{list(mask.shape)} {str(mask.dtype).removeprefix('torch.')}"
    info = {"attn_implementation": model.config._attn_implementation, "num_seqs": len(lens), "mask": mask_info,
            "params": sum(p.numel() for p in layer.parameters())}
    return fn, [hidden, *layer.parameters()], info


def run_layer(configs, dtype: torch.dtype, device: torch.device, quick: bool, progress=None) -> list[dict]:
    rows = []
    dtype_name = str(dtype).removeprefix("torch.")
    for cfg in configs:
        for impl in IMPLS:
            row = {"kind": "layer", "config": cfg.id, **cfg._asdict(), "provider": impl, "dtype": dtype_name,
                   "mode": "fwdbwd"}
            rows.append(row)
            reason = unavailable(impl, device, dtype)
            if reason:
                row.update(status="skipped", reason=reason)
            else:
                _run_one(row, cfg, impl, dtype, device, quick)
            if progress is not None:
                progress.update(1)
    ok = {r["config"]: r["ms"] for r in rows if r["provider"] == PRIMARY and r.get("ms")}
    for r in rows:
        if r.get("ms") and r["provider"] != PRIMARY and r["config"] in ok:
            r[f"speedup_of_{PRIMARY}"] = r["ms"] / ok[r["config"]]
    return rows


def _run_one(row: dict, cfg: LayerConfig, impl: str, dtype: torch.dtype, device: torch.device, quick: bool) -> None:
    try:
        with kernel_configs(row):
            with untimed():
                fn, leaves, info = build(cfg, impl, dtype, device)
                row["info"] = info
                fn()  # on CPU the only call: it checks that the layer runs forward and backward
            if device.type == "cuda":
                timing = time_fn(fn, device, leaves, quick)
    except Exception as exc:  # one failing implementation must not end the run; the row says why
        first = (str(exc).strip().splitlines() or [""])[0]
        row.update(status="error", reason=f"{type(exc).__name__}: {first[:200]}")
    else:
        row["status"] = "ok"
        if device.type == "cuda":
            row.update(ms=timing.ms, ms_p20=timing.ms_p20, ms_p80=timing.ms_p80, timing=timing.method,
                       tokens_per_s=cfg.total_tokens / (timing.ms * 1e-3))
        else:
            row["timing"] = "not timed on CPU (one forward + backward ran)"
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
