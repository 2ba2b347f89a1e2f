"""Attention providers: coreattn and the kernels users would run instead.

Each provider says why it cannot run (``unavailable``: not installed, wrong device) or why it
does not apply to a configuration (``skip_reason``), and otherwise ``build``s a forward closure
over inputs it owns: layout changes and padding that a user of that provider would not pay per
step are done in ``build``, outside the timed region. Every provider is timed on the same FLOP
count (the useful work of the packed batch), so padding shows up as lower TFLOP/s.
"""

from __future__ import annotations

import functools
import inspect
import os
import tempfile
import warnings
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from bench.configs import FEATURES, AttnConfig
from bench.inputs import AttnInputs


class Prepared(NamedTuple):
    fn: Callable[[], torch.Tensor]  # forward; backward goes through autograd into `leaves`
    leaves: list[torch.Tensor]
    info: dict


def memory_budget(device: torch.device) -> int:
    """Bytes a provider's extra buffers (padded copies, score matrices) may take."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 2
    return 1 << 30


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _elt(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _leaf(x: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    return x.detach().contiguous().requires_grad_(requires_grad)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class Provider:
    name = ""
    description = ""
    features = ("none",)  # the configs' attention options (bench.configs.FEATURES) it runs

    def unavailable(self, device: torch.device) -> str | None:
        return None

    def feature_skip(self, cfg: AttnConfig) -> str | None:
        if cfg.feature in self.features:
            return None
        return f"{cfg.feature}: not an option of {self.name} (or not comparable: another RNG, no sinks)"

    def skip_reason(self, cfg: AttnConfig, mode: str, dtype: torch.dtype, device: torch.device) -> str | None:
        return None

    def build(self, inp: AttnInputs, cfg: AttnConfig, mode: str) -> Prepared:
        raise NotImplementedError


class Coreattn(Provider):
    name = "coreattn"
    description = "coreattn.varlen_attn (Triton on GPU; its torch backend on CPU)"
    features = FEATURES

    def build(self, inp, cfg, mode):
        from coreattn import varlen_attn

        # explicit: on CPU the tests set TRITON_INTERPRET=1, and the interpreter is not timed
        backend = "triton" if inp.q.device.type == "cuda" else "torch"
        q, k, v = (_leaf(t, True) for t in (inp.q, inp.k, inp.v))
        leaves = [q, k, v]
        extra = {}
        if cfg.feature == "sink":  # learnable sinks, as gpt-oss trains them
            extra["softmax_offset"] = torch.zeros(cfg.heads_q, device=q.device, requires_grad=True)
            leaves.append(extra["softmax_offset"])
        fn = functools.partial(varlen_attn, q, k, v, inp.cu_seqlens, inp.cu_seqlens, inp.max_seqlen,
                               inp.max_seqlen, softmax_scale=inp.softmax_scale, causal=cfg.causal,
                               dropout_p=cfg.dropout_p, backend=backend, **extra)
        return Prepared(fn, leaves, {"backend": backend})


def _torch_varlen_attn():
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


class TorchVarlen(Provider):
    name = "torch-varlen"
    description = "torch.nn.attention.varlen.varlen_attn (flash-attn 2 / cuDNN inside)"

    def unavailable(self, device):
        try:
            _torch_varlen_attn()
        except ImportError as exc:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen ({exc})"
        if device.type != "cuda":
            return "needs a CUDA device (flash-attention kernels)"
        return None

    def skip_reason(self, cfg, mode, dtype, device):
        if cfg.head_dim_qk != cfg.head_dim_v:
            return "needs equal q/k and v head dims"
        if dtype not in (torch.float16, torch.bfloat16):
            return "fp16/bf16 only"
        if cfg.heads_q != cfg.heads_kv and "enable_gqa" not in inspect.signature(_torch_varlen_attn()).parameters:
            return f"torch {torch.__version__}'s varlen_attn has no enable_gqa"
        return None

    def build(self, inp, cfg, mode):
        varlen_attn = _torch_varlen_attn()
        q, k, v = (_leaf(t, True) for t in (inp.q, inp.k, inp.v))
        kwargs = {"scale": inp.softmax_scale, "window_size": (-1, 0) if cfg.causal else (-1, -1)}
        if cfg.heads_q != cfg.heads_kv:
            kwargs["enable_gqa"] = True
        fn = functools.partial(varlen_attn, q, k, v, inp.cu_seqlens, inp.cu_seqlens, inp.max_seqlen,
                               inp.max_seqlen, **kwargs)
        return Prepared(fn, [q, k, v], {})


def _padded(x: torch.Tensor, cu: torch.Tensor, seqlens: list[int], max_len: int) -> torch.Tensor:
    # x [T, H, D] -> zero-padded [B, H, S, D]
    out = x.new_zeros(len(seqlens), max_len, *x.shape[1:])
    for b, (start, length) in enumerate(zip(cu.tolist()[:-1], seqlens)):
        out[b, :length] = x[start:start + length]
    return out.transpose(1, 2)


class SdpaPadded(Provider):
    name = "sdpa-padded"
    description = "F.scaled_dot_product_attention on the zero-padded [B, H, S, D] batch"
    features = ("none", FEATURES[1])  # its own dropout (another RNG; the same work)

    @staticmethod
    def _extra_bytes(cfg: AttnConfig, seqlens: list[int], dtype: torch.dtype) -> int:
        b, s = len(seqlens), max(seqlens)
        masked = len(set(seqlens)) > 1
        heads_kv = cfg.heads_q if masked else cfg.heads_kv  # masked GQA repeats k/v heads (see build)
        per_token = cfg.heads_q * (cfg.head_dim_qk + 2 * cfg.head_dim_v) + heads_kv * (cfg.head_dim_qk + cfg.head_dim_v)
        mask = b * s * s if masked else 0
        return 2 * b * s * per_token * _elt(dtype) + mask  # padded tensors and their grads, bool mask

    def skip_reason(self, cfg, mode, dtype, device):
        from bench.seqlens import draw_seqlens

        need = self._extra_bytes(cfg, draw_seqlens(cfg.dist, cfg.total_tokens), dtype)
        if need > memory_budget(device):
            return f"the padded batch needs about {_gib(need)} (budget {_gib(memory_budget(device))})"
        return None

    def build(self, inp, cfg, mode):
        seqlens, s = inp.seqlens, inp.max_seqlen
        masked = len(set(seqlens)) > 1
        group = cfg.heads_q // cfg.heads_kv
        kv = (inp.k, inp.v)
        if masked and group > 1:
            # with a mask only the math/mem-efficient SDPA backends run, and enable_gqa would send
            # this to math ([B, H, S, S] scores): repeat the k/v heads once, outside the timed region
            kv = tuple(t.repeat_interleave(group, dim=1) for t in kv)
        q, k, v = (_leaf(_padded(t, inp.cu_seqlens, seqlens, s), True) for t in (inp.q, *kv))
        kwargs = {"scale": inp.softmax_scale, "dropout_p": cfg.dropout_p}
        if k.shape[1] != q.shape[1]:
            kwargs["enable_gqa"] = True
        if not masked:
            kwargs["is_causal"] = cfg.causal  # no padding: the flash/cuDNN SDPA backends can run
            mask_desc = "none (equal lengths)"
        else:
            pos = torch.arange(s, device=q.device)
            lens = torch.tensor(seqlens, device=q.device)
            # padded keys are masked out; padded query rows keep their keys so no row is empty
            mask = (pos[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, S]
            if cfg.causal:
                mask = mask & (pos[None, :] <= pos[:, None])[None, None]  # [B, 1, S, S]
            kwargs["attn_mask"] = mask.expand(len(seqlens), 1, s, s).contiguous()
            mask_desc = "[B, 1, S, S] bool"
        fn = functools.partial(F.scaled_dot_product_attention, q, k, v, **kwargs)
        info = {"padded_tokens": len(seqlens) * s, "mask": mask_desc}
        if masked and group > 1:
            info["gqa"] = "k/v heads repeated outside the timed region"
        return Prepared(fn, [q, k, v], info)


@functools.lru_cache(maxsize=None)
def _flex_fns(compiled: bool):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if compiled:
        # every configuration is a new shape: without this, dynamo stops compiling after 8 and
        # flex would silently run its unfused eager path; fail loudly if the limit is still hit
        import torch._dynamo.config as dynamo_config

        for limit in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, limit):
                setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), 1024))
        if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
            dynamo_config.fail_on_recompile_limit_hit = True
        return torch.compile(flex_attention, dynamic=False), create_block_mask
    return flex_attention, create_block_mask


FLEX_MAX_TOKENS = 1 << 17  # create_block_mask's [T, T] mask evaluation gets too slow beyond this


class Flex(Provider):
    name = "flex"
    description = "FlexAttention with a document mask (mask build timed separately)"

    def unavailable(self, device):
        try:
            _flex_fns(False)
        except ImportError as exc:
            return f"FlexAttention cannot be imported ({exc})"
        return None

    def skip_reason(self, cfg, mode, dtype, device):
        if device.type != "cuda" and mode != "fwd":
            return "FlexAttention has no backward on CPU"
        if cfg.total_tokens > FLEX_MAX_TOKENS:
            return (f"create_block_mask evaluates the document mask over [T, T] = [{cfg.total_tokens}]^2 "
                    f"positions (limit here T <= {FLEX_MAX_TOKENS})")
        return None

    def build(self, inp, cfg, mode):
        from bench.timing import time_fn

        device = inp.q.device
        on_gpu = device.type == "cuda"
        flex_attention, create_block_mask = _flex_fns(on_gpu)
        lens = torch.tensor(inp.seqlens, device=device)
        doc = torch.repeat_interleave(torch.arange(len(inp.seqlens), device=device), lens)  # [T]
        causal = cfg.causal

        def document_mask(b, h, q_idx, kv_idx):
            same = doc[q_idx] == doc[kv_idx]
            return same & (q_idx >= kv_idx) if causal else same

        t = cfg.total_tokens
        mask_kwargs = {"device": device}
        if on_gpu and "_compile" in inspect.signature(create_block_mask).parameters:
            mask_kwargs["_compile"] = True  # otherwise the mask is evaluated on a dense [T, T] grid
        build_mask = functools.partial(create_block_mask, document_mask, None, None, t, t, **mask_kwargs)
        block_mask = build_mask()
        mask_timing = time_fn(build_mask, device, quick=True)
        requires_grad = mode != "fwd" or on_gpu
        q, k, v = (_leaf(x.transpose(0, 1).unsqueeze(0), requires_grad) for x in (inp.q, inp.k, inp.v))
        kwargs = {"block_mask": block_mask, "scale": inp.softmax_scale}
        if cfg.heads_q != cfg.heads_kv:
            kwargs["enable_gqa"] = True

        def fn():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # eager (CPU) flex warns that it is unfused
                return flex_attention(q, k, v, **kwargs)

        return Prepared(fn, [q, k, v], {"mask_build_ms": mask_timing.ms, "compiled": on_gpu})


def _flash_attn_varlen():
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


class FlashAttn(Provider):
    name = "flash-attn"
    description = "flash_attn.flash_attn_varlen_func (flash-attn 2)"
    features = ("none", FEATURES[1])  # its own dropout (another RNG; the same work)

    def unavailable(self, device):
        try:
            _flash_attn_varlen()
        except ImportError as exc:
            return f"flash-attn is not installed ({exc})"
        if device.type != "cuda":
            return "needs a CUDA device"
        return None

    def skip_reason(self, cfg, mode, dtype, device):
        if cfg.head_dim_qk != cfg.head_dim_v:
            return "flash-attn 2 needs equal q/k and v head dims"
        if dtype not in (torch.float16, torch.bfloat16):
            return "fp16/bf16 only"
        return None

    def build(self, inp, cfg, mode):
        q, k, v = (_leaf(t, True) for t in (inp.q, inp.k, inp.v))
        fn = functools.partial(_flash_attn_varlen(), q, k, v, inp.cu_seqlens, inp.cu_seqlens, inp.max_seqlen,
                               inp.max_seqlen, dropout_p=cfg.dropout_p, softmax_scale=inp.softmax_scale,
                               causal=cfg.causal)
        return Prepared(fn, [q, k, v], {})


def _flash_attn3_varlen():
    from flash_attn_interface import flash_attn_varlen_func

    return flash_attn_varlen_func


class FlashAttn3(Provider):
    name = "flash-attn3"
    description = "flash_attn_interface.flash_attn_varlen_func (flash-attn 3, Hopper)"

    def unavailable(self, device):
        try:
            _flash_attn3_varlen()
        except ImportError as exc:
            return f"flash-attn 3 (flash_attn_interface) is not installed ({exc})"
        if device.type != "cuda":
            return "needs a CUDA device"
        if torch.version.hip:  # ROCm reports an MI300X as capability 9.4
            return "flash-attn 3 (flash_attn_interface) is Hopper-only; this is a ROCm device"
        if torch.cuda.get_device_capability(device)[0] != 9:
            return "flash-attn 3 needs a Hopper (sm90) GPU"
        return None

    def skip_reason(self, cfg, mode, dtype, device):
        if dtype not in (torch.float16, torch.bfloat16):
            return "fp16/bf16 only"
        return None

    def build(self, inp, cfg, mode):
        q, k, v = (_leaf(t, True) for t in (inp.q, inp.k, inp.v))
        varlen = _flash_attn3_varlen()

        def fn():
            return _first(varlen(q, k, v, inp.cu_seqlens, inp.cu_seqlens, inp.max_seqlen, inp.max_seqlen,
                                 softmax_scale=inp.softmax_scale, causal=cfg.causal))

        return Prepared(fn, [q, k, v], {})


class PaddedV(Provider):
    name = "padded-v"
    description = ("zero-pad V to Dqk, run the best equal-dims kernel (flash-attn 3, flash-attn 2, torch varlen_attn, "
                   "coreattn: the row's info.inner), slice the output (Megatron/verl MLA workaround)")

    @staticmethod
    def _inner(device: torch.device, dtype: torch.dtype, cfg: AttnConfig) -> tuple[str, Callable]:
        """The best equal-head-dim varlen kernel here: flash-attn 3 (Hopper), flash-attn 2, torch's
        varlen_attn, then coreattn."""
        half = dtype in (torch.float16, torch.bfloat16)
        if device.type == "cuda" and half:
            if FlashAttn3().unavailable(device) is None:
                fa3 = _flash_attn3_varlen()
                return "flash-attn3", lambda q, k, v, cu, m, scale, causal: _first(fa3(
                    q, k, v, cu, cu, m, m, softmax_scale=scale, causal=causal))
            try:
                fa = _flash_attn_varlen()
                return "flash-attn", lambda q, k, v, cu, m, scale, causal: fa(
                    q, k, v, cu, cu, m, m, softmax_scale=scale, causal=causal)
            except ImportError:
                pass
            try:
                tv = _torch_varlen_attn()
                gqa = {"enable_gqa": True} if cfg.heads_q != cfg.heads_kv else {}
                return "torch-varlen", lambda q, k, v, cu, m, scale, causal: tv(
                    q, k, v, cu, cu, m, m, scale=scale, window_size=(-1, 0) if causal else (-1, -1), **gqa)
            except ImportError:
                pass
        from coreattn import varlen_attn

        backend = "triton" if device.type == "cuda" else "torch"
        return f"coreattn-{backend}", lambda q, k, v, cu, m, scale, causal: varlen_attn(
            q, k, v, cu, cu, m, m, softmax_scale=scale, causal=causal, backend=backend)

    def skip_reason(self, cfg, mode, dtype, device):
        if cfg.head_dim_qk <= cfg.head_dim_v:
            return "applies only when Dqk > Dv"
        return None

    def build(self, inp, cfg, mode):
        inner_name, inner = self._inner(inp.q.device, inp.q.dtype, cfg)
        q, k, v = (_leaf(t, True) for t in (inp.q, inp.k, inp.v))
        pad = cfg.head_dim_qk - cfg.head_dim_v

        def fn():
            # the pad and the slice run every step in the workaround, so they are timed
            out = inner(q, k, F.pad(v, (0, pad)), inp.cu_seqlens, inp.max_seqlen, inp.softmax_scale, cfg.causal)
            return out[..., :cfg.head_dim_v]

        return Prepared(fn, [q, k, v], {"inner": inner_name})


@functools.lru_cache(maxsize=None)
def _init_megatron_single_rank() -> None:
    """A one-rank process group and Megatron's parallel state, which its attention needs."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="coreattn-bench-"), "store")
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


class Megatron(Provider):
    name = "megatron-local"
    description = "megatron.core DotProductAttention (local, unfused softmax) in sbhd"

    def unavailable(self, device):
        if device.type != "cuda":
            return "Megatron's local DotProductAttention allocates its score buffer on CUDA"
        try:
            import megatron.core.transformer.dot_product_attention  # noqa: F401
        except Exception as exc:  # absent, or broken against this torch
            return f"megatron-core cannot be imported ({type(exc).__name__}: {exc})"
        return None

    @staticmethod
    def _score_bytes(cfg: AttnConfig, batch: int, s: int, mode: str) -> int:
        # [b*np, sq, sk]: the global matmul buffer and baddbmm's scores in the input dtype, fp32
        # softmax input and probs, probs cast back; a backward about doubles it (their grads)
        per_score = (2 + 2 + 4 + 4 + 2) * (1 if mode == "fwd" else 2)
        return batch * cfg.heads_q * s * s * per_score

    def skip_reason(self, cfg, mode, dtype, device):
        if cfg.dist != "equal":
            return "sbhd needs equal lengths (local DotProductAttention has no THD)"
        if cfg.head_dim_qk != cfg.head_dim_v:
            return "local DotProductAttention has one head dim (no k/v_channels)"
        from bench.seqlens import draw_seqlens

        lens = draw_seqlens(cfg.dist, cfg.total_tokens)
        need = self._score_bytes(cfg, len(lens), lens[0], mode)
        if need > memory_budget(device):
            return f"the [b*np, s, s] score buffers need about {_gib(need)} (budget {_gib(memory_budget(device))})"
        return None

    def build(self, inp, cfg, mode):
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.transformer_config import TransformerConfig

        _init_megatron_single_rank()
        dtype = inp.q.dtype
        config = TransformerConfig(
            num_layers=1, hidden_size=cfg.heads_q * cfg.head_dim_qk, num_attention_heads=cfg.heads_q,
            num_query_groups=cfg.heads_kv, kv_channels=cfg.head_dim_qk, attention_dropout=0.0,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
            masked_softmax_fusion=False, attention_softmax_in_fp32=True, apply_query_key_layer_scaling=False)
        mask_type = AttnMaskType.causal if cfg.causal else AttnMaskType.no_mask
        attn = DotProductAttention(config, layer_number=1, attn_mask_type=mask_type, attention_type="self",
                                   softmax_scale=inp.softmax_scale)
        b, s = len(inp.seqlens), inp.max_seqlen

        def sbhd(x):  # [T, H, D] -> [S, B, H, D]
            return _leaf(x.view(b, s, *x.shape[1:]).transpose(0, 1), True)

        q, k, v = sbhd(inp.q), sbhd(inp.k), sbhd(inp.v)
        fn = functools.partial(attn, q, k, v, None, attn_mask_type=mask_type)
        return Prepared(fn, [q, k, v], {"softmax": "torch (masked_softmax_fusion=False)"})


PROVIDERS: dict[str, Provider] = {p.name: p for p in (
    Coreattn(), TorchVarlen(), FlashAttn(), FlashAttn3(), SdpaPadded(), Flex(), PaddedV(), Megatron())}
PRIMARY = "coreattn"
