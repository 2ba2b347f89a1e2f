"""CoreAttention: a Megatron-Core ``core_attention`` module on coreattn's kernels.

Drop it into a layer spec (``coreattn.adapters.megatron.use_coreattn`` does it for a whole
spec). It takes what Megatron passes a core attention (megatron-core 0.13 to current, including
MLA's ``k_channels``/``v_channels``), runs sbhd/bshd batches in place and packed thd batches
(with ``cu_seqlens_*_padded`` gaps) on the backend selected per device, and V's head dim may
differ from Q/K's, so MLA needs no zero-padded V.

Masks follow Megatron / Transformer Engine: boolean, True = masked out. ``causal`` is top-left
aligned, ``causal_bottom_right`` bottom-right; ``padding``/``padding_causal`` read a
``[b, 1, 1, s]`` mask as per-token keep masks in the kernels (no S×S tensor); a dense
``[b, 1, sq, sk]`` mask (``arbitrary``, or a dense padding mask) runs a correct O(S²) torch path,
or npu_fusion_attention with that mask under the npu_fused backend.
The mask is ignored for ``causal``/``no_mask``/``causal_bottom_right`` and on thd batches (cu_seqlens
carry the padding there), as Transformer Engine does.

Megatron's attention options: ``attention_dropout`` in training (drawn inside Megatron's CUDA RNG
tracker fork on CUDA, as ``DotProductAttention`` does), ``softmax_type`` "off-by-one"/"learnable"
(the same ``softmax_offset`` tensor or parameter as ``DotProductAttention``: name, init, per-rank
head slice, sharded checkpoint) and ``qk_clip`` / ``log_max_attention_logit``
(``current_max_attn_logits``, a running per-head max kept as Transformer Engine's wrapper keeps it).
"""

from __future__ import annotations

import contextlib
import inspect
import math

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from coreattn.layers.backends import ENV_BACKEND, Backend, parse_backend, select_backend
from coreattn.layers.context_parallel import check_comm, cp_attn
from coreattn.layers.context_parallel.groups import hierarchical_sizes
from coreattn.layers.torch_backend.dense_mask import dense_mask_attn
from coreattn.layers.padded_attn import padded_attn
from coreattn.layers.varlen_attn import varlen_attn

CONFIG_BACKEND_ATTR = "coreattn_backend"

_CAUSAL_ALIGNMENT = {
    AttnMaskType.causal: "top_left",
    AttnMaskType.padding_causal: "top_left",
}
if hasattr(AttnMaskType, "causal_bottom_right"):  # megatron-core >= 0.15
    _CAUSAL_ALIGNMENT[AttnMaskType.causal_bottom_right] = "bottom_right"
_PADDING = (AttnMaskType.padding, AttnMaskType.padding_causal)
# megatron-core >= 0.16 takes the process groups here; older releases read parallel_state's
_SHARDED_TAKES_GROUPS = "tp_group" in inspect.signature(make_sharded_tensors_for_checkpoint).parameters


def _tp_group(pgs):
    """The tensor-parallel group Megatron passed, or the global one (None when not initialized)."""
    tp = getattr(pgs, "tp", None)
    if tp is not None:
        return tp
    try:
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    except (AssertionError, AttributeError, RuntimeError, TypeError):
        return None


def _param_device() -> torch.device:
    """Where Megatron's DotProductAttention creates its softmax offset (the current CUDA device)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _cp_group(pgs, config):
    """The context-parallel group when config.context_parallel_size > 1 (else None)."""
    size = getattr(config, "context_parallel_size", 1) or 1
    if size == 1:
        return None
    group = getattr(pgs, "cp", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
    if group.size() != size:
        raise ValueError(f"config.context_parallel_size={size} but the context-parallel group has {group.size()} ranks")
    return group


def _layer_window(config, layer_number: int) -> tuple[int, int]:
    """config.window_size for layers that use a sliding window (Megatron's window_attn_skip_freq rule)."""
    window = getattr(config, "window_size", None)
    if not window:
        return (-1, -1)
    skip = getattr(config, "window_attn_skip_freq", None)
    if isinstance(skip, int) and layer_number % skip == 0:
        return (-1, -1)
    if isinstance(skip, (list, tuple)) and not skip[layer_number - 1]:
        return (-1, -1)
    return tuple(window)


def _layer_cp_comm_type(cp_comm_type, config, layer_number: int) -> str:
    """The exchange this layer runs under context parallelism. Megatron passes the layer's own
    value (``config.cp_comm_type``, or its entry for this layer when it is a list) and nothing
    when config.cp_comm_type is None; None means "p2p", as Megatron's Transformer Engine wrapper
    runs it. Built without the argument, the layer reads config.cp_comm_type itself (entry
    ``layer_number - 1`` of a list). Unknown values raise ValueError."""
    value = cp_comm_type if cp_comm_type is not None else getattr(config, "cp_comm_type", None)
    if isinstance(value, (list, tuple)):
        if not 1 <= layer_number <= len(value):
            raise ValueError(f"config.cp_comm_type has {len(value)} entries, none for layer {layer_number}")
        value = value[layer_number - 1]
    value = "p2p" if value is None else value
    check_comm(value)
    return value


def _hierarchical_groups(pgs, sizes: tuple[int, int], cp_group) -> list:
    """[a2a_group, p2p_group]: pg_collection.hcp, else parallel_state's (as Megatron's TE wrapper
    takes them), checked against the sizes and the cp group's layout (cp rank = p2p rank * a + a2a rank)."""
    groups = getattr(pgs, "hcp", None)
    if groups is None:
        from megatron.core import parallel_state

        groups = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
    if not groups:
        raise ValueError("cp_comm_type='a2a+p2p' needs the hierarchical context-parallel groups: pass "
                         "hierarchical_context_parallel_sizes to parallel_state.initialize_model_parallel "
                         "(or pg_collection.hcp)")
    if len(groups) != 2 or [g.size() for g in groups] != list(sizes):
        raise ValueError(f"the hierarchical context-parallel groups have sizes {[g.size() for g in groups]}, "
                         f"config.hierarchical_context_parallel_sizes says {list(sizes)}")
    inner, outer = groups
    if cp_group.rank() != outer.rank() * sizes[0] + inner.rank():
        raise ValueError(f"the hierarchical context-parallel groups do not match the cp group: cp rank "
                         f"{cp_group.rank()} is not p2p rank {outer.rank()} * {sizes[0]} + a2a rank {inner.rank()}")
    return list(groups)


def _masked_bool(mask: torch.Tensor) -> torch.Tensor:
    """Megatron mask (True / nonzero = masked out) as bool."""
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(f"attention_mask must be bool or integer (True = masked out), got {mask.dtype}; "
                        "additive float masks are not supported")
    return mask if mask.dtype == torch.bool else mask != 0


class CoreAttention(MegatronModule):
    """Megatron-Core core attention on coreattn (see the module docstring).

    Args beyond Megatron's: ``backend`` (``"triton"``/``"torch"``/``Backend``) overrides the
    per-device choice; so does ``config.coreattn_backend`` and the ``COREATTN_BACKEND``
    environment variable, in that order of precedence. An override that cannot run raises.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, num_splits: int | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, model_comm_pgs=None,
                 backend: str | Backend | None = None):
        super().__init__(config=config)
        self.config = config
        pgs = pg_collection if pg_collection is not None else model_comm_pgs
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.attention_dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.num_splits = num_splits  # accepted for Transformer Engine signature parity; unused
        self.cp_comm_type = _layer_cp_comm_type(cp_comm_type, config, self.layer_number)

        self.hidden_size_per_attention_head_k = k_channels if k_channels is not None else config.kv_channels
        self.hidden_size_per_attention_head_v = v_channels if v_channels is not None else config.kv_channels
        self.hidden_size_per_attention_head = self.hidden_size_per_attention_head_k
        self.tp_group = _tp_group(pgs)
        tp = self.tp_group.size() if self.tp_group is not None else 1
        self.cp_group = _cp_group(pgs, config)
        self.num_attention_heads_per_partition = config.num_attention_heads // tp
        self.num_query_groups_per_partition = max(1, (config.num_query_groups or config.num_attention_heads) // tp)
        self._pgs = pgs  # a2a+p2p reads its hierarchical groups from it (or parallel_state) when it first runs
        self._hierarchical = None  # [a2a_group, p2p_group] once looked up
        if self.cp_comm_type == "a2a+p2p" and self.cp_group is not None:
            self._hierarchical_sizes()  # a config that cannot run raises when the model is built
        self.hidden_size_per_partition = self.num_attention_heads_per_partition * self.hidden_size_per_attention_head_v
        # Megatron divides by layer_number under apply_query_key_layer_scaling and multiplies it
        # back inside its fp32 softmax: the net scale is unchanged, so it is not applied here.
        self.softmax_scale = (1.0 / math.sqrt(self.hidden_size_per_attention_head_k)
                              if softmax_scale is None else softmax_scale)
        self.window_size = _layer_window(config, self.layer_number)
        self.track_max_logit = bool(getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit",
                                                                                 False))
        self.current_max_attn_logits = None  # [heads per TP rank], read and reset by Megatron's clip_qk
        self._init_softmax_offset(config)

        override = backend if backend is not None else getattr(config, CONFIG_BACKEND_ATTR, None)
        source = "backend" if backend is not None else f"config.{CONFIG_BACKEND_ATTR}"
        self.backend = None if override is None else parse_backend(override, source)

    def _init_softmax_offset(self, config) -> None:
        """``softmax_offset`` as Megatron's DotProductAttention defines it: None (vanilla), zeros that
        are not part of the state dict ("off-by-one") or a learnable parameter initialized with
        ``config.init_method`` ("learnable"), one entry per attention head of this TP rank."""
        softmax_type = getattr(config, "softmax_type", "vanilla")
        shape = dict(size=(self.num_attention_heads_per_partition,), device=_param_device(),
                     dtype=config.params_dtype)
        if softmax_type == "vanilla":
            self.softmax_offset = None
        elif softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(**shape), persistent=False)
        elif softmax_type == "learnable":
            self.register_parameter("softmax_offset", torch.nn.Parameter(torch.empty(**shape)))
            if config.perform_initialization:
                self.softmax_offset = config.init_method(self.softmax_offset)
        else:
            raise ValueError(f"softmax_type={softmax_type!r} is not supported (vanilla, off-by-one, learnable)")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The learnable softmax offset, sharded over tensor-parallel ranks along its head dim (as
        Megatron's DotProductAttention shards it); nothing else."""
        state_dict = {}
        if getattr(self.config, "softmax_type", "vanilla") == "learnable":
            state_dict = self.state_dict(prefix="", keep_vars=True)
        groups = {}
        if _SHARDED_TAKES_GROUPS:
            groups = dict(tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"))
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   **groups)

    def _hierarchical_sizes(self) -> tuple[int, int]:
        # MLA expands K/V to every attention head
        heads_kv = (self.num_attention_heads_per_partition if getattr(self.config, "multi_latent_attention", False)
                    else self.num_query_groups_per_partition)
        return hierarchical_sizes(getattr(self.config, "hierarchical_context_parallel_sizes", None),
                                  self.config.context_parallel_size, self.num_attention_heads_per_partition, heads_kv)

    def _cp_groups(self, cp_group):
        """What cp_attn takes as cp_group for this layer's exchange."""
        if self.cp_comm_type != "a2a+p2p":
            return cp_group
        if self._hierarchical is None:
            self._hierarchical = _hierarchical_groups(self._pgs, self._hierarchical_sizes(), cp_group)
        return self._hierarchical

    def _backend_for(self, device: torch.device) -> Backend:
        return select_backend(device, self.backend)

    def _dropout_context(self, device: torch.device):
        """Dropout draws its RNG state inside Megatron's model-parallel CUDA RNG fork, as
        DotProductAttention does (except under sequence parallelism); elsewhere from the device's
        default generator."""
        if device.type == "cuda" and not getattr(self.config, "sequence_parallel", False):
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def _record_max_logit(self, max_logit: torch.Tensor) -> None:
        """Running per-head max across calls, until Megatron's clip_qk resets it to None."""
        max_logit = max_logit.detach()
        if self.current_max_attn_logits is None:
            self.current_max_attn_logits = max_logit
        else:
            self.current_max_attn_logits = torch.maximum(self.current_max_attn_logits, max_logit)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask=None,
                attn_mask_type: AttnMaskType | None = None, attention_bias=None, packed_seq_params=None,
                **kwargs) -> torch.Tensor:
        """sbhd: q ``[sq, b, np, dk]`` -> ``[sq, b, np*dv]``; bshd likewise; thd: q ``[t, np, dk]`` -> ``[t, np*dv]``."""
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by CoreAttention")
        if getattr(packed_seq_params, "local_cp_size", None) is not None:
            raise NotImplementedError("hybrid context parallelism (packed_seq_params.local_cp_size) is not "
                                      "supported by CoreAttention")
        self._backend_for(query.device)  # an override that cannot run raises here
        causal = mask_type in _CAUSAL_ALIGNMENT
        alignment = _CAUSAL_ALIGNMENT.get(mask_type, "bottom_right")
        fmt = getattr(packed_seq_params, "qkv_format", None) or "sbhd"
        dropout_p = self.attention_dropout if self.training else 0.0
        opts = dict(softmax_scale=self.softmax_scale, causal=causal, window_size=self.window_size,
                    causal_alignment=alignment, backend=self.backend,  # resolved when the attention op runs
                    dropout_p=dropout_p, softmax_offset=self.softmax_offset, return_max_logit=self.track_max_logit)
        cp_group = getattr(packed_seq_params, "cp_group", None) or self.cp_group
        if fmt not in ("sbhd", "bshd", "thd"):
            raise ValueError(f"packed_seq_params.qkv_format={fmt!r} is not supported (use 'sbhd', 'bshd' or 'thd')")
        with self._dropout_context(query.device) if dropout_p > 0 else contextlib.nullcontext():
            if cp_group is not None and cp_group.size() > 1:
                out = self._forward_cp(query, key, value, attention_mask, mask_type, fmt, packed_seq_params,
                                       cp_group, opts)
            elif fmt == "thd":
                out = self._forward_thd(query, key, value, attention_mask, mask_type, packed_seq_params, opts)
            else:
                out = self._forward_padded(query, key, value, attention_mask, mask_type, fmt, packed_seq_params,
                                           opts)
        if self.track_max_logit:
            out, max_logit = out
            self._record_max_logit(max_logit)
        return out.reshape(*out.shape[:2], -1) if fmt != "thd" else out.reshape(out.shape[0], -1)

    def _forward_padded(self, q, k, v, attention_mask, mask_type, layout, params, opts) -> torch.Tensor:
        if mask_type in _PADDING:
            # as in Transformer Engine, padding types may give the lengths as cu_seqlens (right padding)
            opts = dict(opts, **_lengths_from_cu_seqlens(params, q.shape[1] if layout == "sbhd" else q.shape[0]))
        if attention_mask is None or mask_type not in _PADDING + (AttnMaskType.arbitrary,):
            return padded_attn(q, k, v, layout=layout, **opts)
        if isinstance(attention_mask, (tuple, list)):
            # Megatron's cross-attention padding: (q mask [b, 1, 1, sq], kv mask [b, 1, 1, skv])
            if len(attention_mask) != 2:
                raise ValueError(f"a tuple attention_mask must be (q_mask, kv_mask), got {len(attention_mask)} items")
            q_keep, k_keep = (_keep_from_row_mask(m, f"attention_mask[{i}]") for i, m in enumerate(attention_mask))
            return padded_attn(q, k, v, layout=layout, q_keep_mask=q_keep, k_keep_mask=k_keep, **opts)
        masked = _masked_bool(attention_mask)
        if masked.dim() != 4:
            raise ValueError(f"attention_mask must be [b, 1, sq, sk] or [b, 1, 1, sk], got {tuple(masked.shape)}")
        if masked.shape[-2] == 1 and masked.shape[1] == 1:
            # [b, 1, 1, sk] padding mask: keep masks read in the kernels, no S×S tensor. It masks the
            # queries too only in self-attention (the keys are the queries' own tokens).
            k_keep = ~masked[:, 0, 0, :]
            self_attn = self.attention_type == "self" and q.shape[:2] == k.shape[:2]
            q_keep = k_keep if mask_type in _PADDING and self_attn else None
            return padded_attn(q, k, v, layout=layout, q_keep_mask=q_keep, k_keep_mask=k_keep, **opts)
        return self._forward_dense(q, k, v, masked, layout, opts)

    def _forward_dense(self, q, k, v, masked, layout, opts) -> torch.Tensor:
        """Dense [b, 1|h, sq, sk] masks, with causal/window masks (and cu_seqlens lengths) folded in:
        npu_fusion_attention's own dense mask under the npu_fused backend, else the O(S²) torch path."""
        sq, sk = (q.shape[0], k.shape[0]) if layout == "sbhd" else (q.shape[1], k.shape[1])
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        if "q_len" in opts:  # right padding: positions past each sample's length
            masked = masked | (i >= opts["q_len"][:, None, None, None]) | (j >= opts["k_len"][:, None, None, None])
        shift = sk - sq if opts["causal_alignment"] == "bottom_right" else 0
        left, right = opts["window_size"]
        if opts["causal"]:
            right = 0
        if left >= 0:
            masked = masked | (j < i + shift - left)
        if right >= 0:
            masked = masked | (j > i + shift + right)
        if self._backend_for(q.device) is Backend.NPU_FUSED:
            from coreattn.layers.npu_fused.attention import attn_npu_dense_mask

            if opts["softmax_offset"] is not None or opts["return_max_logit"]:
                raise NotImplementedError("softmax_type other than 'vanilla' and qk_clip/log_max_attention_logit are "
                                          "not supported by the npu_fused backend; use backend='triton' or 'torch'")
            return attn_npu_dense_mask(q, k, v, masked, layout, self.softmax_scale, opts["dropout_p"])
        return dense_mask_attn(q, k, v, masked, layout, self.softmax_scale, dropout_p=opts["dropout_p"],
                               softmax_offset=opts["softmax_offset"], return_max_logit=opts["return_max_logit"])

    def _forward_thd(self, q, k, v, attention_mask, mask_type, params, opts) -> torch.Tensor:
        if mask_type == AttnMaskType.arbitrary and attention_mask is not None:
            raise NotImplementedError("an arbitrary attention_mask is not supported with packed (thd) sequences")
        cu_q, cu_k = params.cu_seqlens_q, params.cu_seqlens_kv
        cu_q_pad = getattr(params, "cu_seqlens_q_padded", None)
        cu_k_pad = getattr(params, "cu_seqlens_kv_padded", None)
        used_q = used_k = None
        if cu_q_pad is not None or cu_k_pad is not None:
            # t is the padded total: cu_seqlens_*_padded lay the slots out, cu_seqlens_* count real tokens.
            used_q, used_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
            cu_q = cu_q if cu_q_pad is None else cu_q_pad
            cu_k = cu_k if cu_k_pad is None else cu_k_pad
        max_q = _max_seqlen(getattr(params, "max_seqlen_q", None), q.shape[0])
        max_k = _max_seqlen(getattr(params, "max_seqlen_kv", None), k.shape[0])
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, seqused_q=used_q, seqused_k=used_k, **opts)

    def _forward_cp(self, q, k, v, attention_mask, mask_type, fmt, params, cp_group, opts) -> torch.Tensor:
        """Context parallelism (coreattn.cp_attn): Megatron's zig-zag chunks, exchanged as
        ``self.cp_comm_type`` says (p2p ring, all_gather, a2a, or a2a+p2p over Megatron's
        hierarchical groups)."""
        if mask_type == AttnMaskType.arbitrary or (fmt != "thd" and attention_mask is not None
                                                   and mask_type in _PADDING):
            raise NotImplementedError(
                f"attention masks ({mask_type.name}) are not supported under context parallelism; pack the "
                "samples as thd with cu_seqlens(_padded) instead")
        if fmt not in ("thd", "sbhd"):
            raise NotImplementedError(f"qkv_format={fmt!r} is not supported under context parallelism (use thd or sbhd)")
        kw = dict(cp_group=self._cp_groups(cp_group), layout=fmt, causal=opts["causal"],
                  softmax_scale=opts["softmax_scale"], window_size=opts["window_size"], backend=opts["backend"],
                  dropout_p=opts["dropout_p"],
                  softmax_offset=opts["softmax_offset"], return_max_logit=opts["return_max_logit"],
                  comm=self.cp_comm_type)
        if fmt == "thd":
            kw.update(cu_seqlens_q=params.cu_seqlens_q, cu_seqlens_kv=params.cu_seqlens_kv,
                      cu_seqlens_q_padded=getattr(params, "cu_seqlens_q_padded", None),
                      cu_seqlens_kv_padded=getattr(params, "cu_seqlens_kv_padded", None),
                      max_seqlen_q=_max_or_none(getattr(params, "max_seqlen_q", None)),
                      max_seqlen_kv=_max_or_none(getattr(params, "max_seqlen_kv", None)))
        return cp_attn(q, k, v, **kw)


def _keep_from_row_mask(mask, name: str) -> torch.Tensor:
    """A Megatron [b, 1, 1, s] padding mask (True = masked out) as a [b, s] keep mask."""
    masked = _masked_bool(mask)
    if masked.dim() != 4 or masked.shape[1] != 1 or masked.shape[2] != 1:
        raise ValueError(f"{name} must be a [b, 1, 1, s] padding mask, got shape {tuple(masked.shape)}")
    return ~masked[:, 0, 0, :]


def _lengths_from_cu_seqlens(params, batch: int) -> dict:
    """Per-sample q/k lengths (right padding) from PackedSeqParams.cu_seqlens_q/kv on sbhd/bshd, as
    padded_attn's q_len/k_len spans; {} when not given."""
    cu_q, cu_k = getattr(params, "cu_seqlens_q", None), getattr(params, "cu_seqlens_kv", None)
    if cu_q is None and cu_k is None:
        return {}
    if cu_q is None or cu_k is None:
        raise ValueError("packed_seq_params must give both cu_seqlens_q and cu_seqlens_kv (or neither) on sbhd/bshd")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_kv", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() != batch + 1:
            shape = tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(f"packed_seq_params.{name} must be a [b+1] = [{batch + 1}] tensor on sbhd/bshd, "
                             f"got {shape}")
    return dict(q_len=(cu_q[1:] - cu_q[:-1]).to(torch.int32), k_len=(cu_k[1:] - cu_k[:-1]).to(torch.int32))


def _max_or_none(value):
    """PackedSeqParams.max_seqlen_* for cp_attn: an int, a 0-dim tensor (megatron-core < 0.14; passed
    on unread) or None."""
    return value if value is None or isinstance(value, (int, torch.SymInt, torch.Tensor)) else int(value)


def _max_seqlen(value, tokens: int):
    """PackedSeqParams.max_seqlen_* for varlen_attn, which takes an int or a 0-dim tensor (a tensor
    in megatron-core < 0.14) without reading it. None: the token count, an upper bound that reads
    no tensor (so torch.compile traces it): the kernels size their grids by the token count and
    never read max_seqlen, which only bounds the argument checks."""
    if value is None:
        return tokens
    if isinstance(value, (int, torch.SymInt, torch.Tensor)):
        return value  # int() would sync on a device tensor and specialize a compiled graph
    return int(value)


__all__ = ["CoreAttention", "CONFIG_BACKEND_ATTR", "ENV_BACKEND"]
