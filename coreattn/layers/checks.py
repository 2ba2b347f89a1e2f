"""Argument checks for the varlen attention API: clear errors that name the argument."""

from __future__ import annotations

import math
import operator
import os
from typing import NamedTuple

import torch

from coreattn.kernels.dropout import check_dropout_p

ENV_VALIDATE = "COREATTN_VALIDATE"
MAX_HEAD_DIM = 256
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ALIGNMENTS = ("bottom_right", "top_left")
# sparse attention (coreattn.sparse_varlen_attn): the dense dims plus DeepSeek-V4's 512 (one head that is K and V)
# and DeepSeek-V3.2's absorbed MLA 576 / 512
SPARSE_EXTRA_HEAD_DIMS_QK = (512, 576)
SPARSE_HEAD_DIMS_QK = "1..256, 512 or 576"
SPARSE_MAX_HEAD_DIM_V = 512


class VarlenParams(NamedTuple):
    """Normalized attention options shared by every backend."""

    softmax_scale: float
    window_left: int  # -1: unlimited
    window_right: int  # -1: unlimited; causal sets 0
    bottom_right: bool  # diagonal alignment of causal masks and windows when q and k lengths differ
    dropout_p: float = 0.0  # attention dropout on the normalized probabilities (coreattn/kernels/dropout.py)


def _validate_setting() -> str:
    """COREATTN_VALIDATE: "on" (1/true/yes/on), "off" (0/false/no/off) or "" (unset: the default)."""
    value = os.environ.get(ENV_VALIDATE, "").strip().lower()
    return "on" if value in ("1", "true", "yes", "on") else "off" if value in ("0", "false", "no", "off") else ""


def validation_enabled() -> bool:
    """Data checks that need the values of device tensors (a host sync) run only when this is on."""
    return _validate_setting() == "on"


def reads_values(x: torch.Tensor | torch.device) -> bool:
    """Whether coreattn may read the values of tensors on ``x``'s device on the host: for checks
    (malformed cu_seqlens, spans, masks) and for exact sizes (compact cu_seqlens from position ids,
    the longest sequence). By default on CPU tensors (free) and not on a device (a host sync; the
    kernels answer malformed layouts with NaN instead). ``COREATTN_VALIDATE=1`` reads on a device
    too; ``COREATTN_VALIDATE=0`` reads nowhere, CPU included, which is how the tests run the CPU
    paths as a device would (tests/sync_detector.py)."""
    device = x.device if isinstance(x, torch.Tensor) else x
    setting = _validate_setting()
    return setting == "on" or (setting == "" and device.type == "cpu")


def _check_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def check_max_seqlen(name: str, value, bound: int) -> int:
    """An int >= 0, or a 0-dim (or one-element) integer tensor on any device (Transformer Engine and
    Megatron pass these), which is never read: ``bound``, a host int at least every sequence's length (the token
    count), stands in for it. The kernels never use max_seqlen (their grids follow the token
    counts); only the argument checks compare it with the longest sequence. Plain and symbolic
    ints are taken as they are: under torch.compile an ``operator.index`` would specialize the
    graph on the value (a recompile per new length)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an int or a 0-dim integer tensor, got a {value.dtype} tensor of shape "
                            f"{tuple(value.shape)}")
        return bound
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    if not isinstance(value, (int, torch.SymInt)):
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _check_unit_stride(name: str, t: torch.Tensor) -> None:
    """The kernels read per-sequence int32 tensors as plain arrays (element i at offset i)."""
    if t.numel() > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous (stride 1), got stride {t.stride(0)}")


def check_cu_seqlens(name: str, cu, device: torch.device) -> None:
    _check_tensor(name, cu, 1)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.numel() < 2:
        raise ValueError(f"{name} must have B+1 >= 2 entries, got {cu.numel()}")
    _check_unit_stride(name, cu)
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")


def check_cu_seqlens_values(name: str, cu: torch.Tensor, total: int, max_name: str, max_seqlen: int | None) -> None:
    """Checks that read cu_seqlens' values: free on CPU, a host sync elsewhere. ``max_seqlen``
    None skips the longest-sequence check (with seqused the used counts are checked instead)."""
    vals = cu.tolist()
    if vals[0] != 0:
        raise ValueError(f"{name} must start at 0, got {vals[0]}")
    lens = [b - a for a, b in zip(vals[:-1], vals[1:])]
    if min(lens) < 0:
        raise ValueError(f"{name} must be non-decreasing, got {vals}")
    if vals[-1] != total:
        raise ValueError(f"{name}[-1] = {vals[-1]} must equal the token count {total}")
    if max_seqlen is not None and max(lens) > max_seqlen:
        raise ValueError(f"{max_name} = {max_seqlen} is smaller than the longest sequence ({max(lens)})")


def check_window(window_size) -> tuple[int, int]:
    try:
        left, right = window_size
        left, right = operator.index(left), operator.index(right)
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair of ints, got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unlimited), got {window_size!r}")
    return left, right


def check_qkv(q, k, v, layout: str, *, sparse: bool = False) -> None:
    """Tensor checks shared by the packed (thd) and padded (bshd/sbhd) entry points. ``sparse``: the
    sparse attention's head dims (``SPARSE_HEAD_DIMS_QK``, Dv up to 512) and v may be None."""
    ndim = 3 if layout == "thd" else 4
    named = [("q", q), ("k", k)] + ([] if sparse and v is None else [("v", v)])
    for name, t in named:
        _check_tensor(name, t, ndim)
    if q.dtype not in KERNEL_DTYPES + (torch.float64,):
        raise TypeError(f"q has dtype {q.dtype}; supported: float16, bfloat16, float32")
    for name, t in named[1:]:
        if t.dtype != q.dtype:
            raise TypeError(f"dtype mismatch: q is {q.dtype} but {name} is {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"device mismatch: q is on {q.device} but {name} is on {t.device}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dim mismatch: q has Dqk={q.shape[-1]} but k has {k.shape[-1]}")
    if v is not None and k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in all dims but the last "
                         "(tokens, batch and heads)")
    if layout != "thd":
        b = 0 if layout == "bshd" else 1
        if q.shape[b] != k.shape[b]:
            raise ValueError(f"batch mismatch: q has {q.shape[b]} samples but k has {k.shape[b]} ({layout})")
    if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2] != 0:
        raise ValueError(f"q heads ({q.shape[-2]}) must be a multiple of k/v heads ({k.shape[-2]})")
    dqk_ok = 1 <= q.shape[-1] <= MAX_HEAD_DIM or (sparse and q.shape[-1] in SPARSE_EXTRA_HEAD_DIMS_QK)
    if not dqk_ok:
        raise ValueError(f"q/k head dim is {q.shape[-1]}; supported head dims are "
                         f"{SPARSE_HEAD_DIMS_QK if sparse else f'1..{MAX_HEAD_DIM}'}")
    max_v = SPARSE_MAX_HEAD_DIM_V if sparse else MAX_HEAD_DIM
    if v is not None and not 1 <= v.shape[-1] <= max_v:
        raise ValueError(f"v head dim is {v.shape[-1]}; supported head dims are 1..{max_v}")
    for name, t in named:
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have stride 1 in its last dim (got strides {t.stride()})")


def check_options(head_dim_qk: int, dropout_p, softmax_scale, causal, window_size, causal_alignment) -> VarlenParams:
    dropout_p = check_dropout_p(dropout_p)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {ALIGNMENTS}, got {causal_alignment!r}")
    left, right = check_window(window_size)
    if causal:
        right = 0
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim_qk)
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    return VarlenParams(float(softmax_scale), left, right, causal_alignment == "bottom_right", dropout_p)


def check_softmax_offset(softmax_offset, q: torch.Tensor, layout: str = "thd") -> torch.Tensor | None:
    """Sink logits on q's device: one per q head ``[Hq]``, or one per query token and head (thd
    ``[T, Hq]``, padded ``[B, Hq, S]``: Inkling 2's sinks). Returned in the compute dtype (float32,
    float64 for float64 inputs) through a differentiable cast, so a bf16 Megatron parameter gets its
    gradient in its own dtype; a per-token offset in lse's layout (``[Hq, T]`` / ``[B, Hq, S]``,
    contiguous)."""
    if softmax_offset is None:
        return None
    if not isinstance(softmax_offset, torch.Tensor):
        raise TypeError(f"softmax_offset must be a torch.Tensor, got {type(softmax_offset).__name__}")
    if not softmax_offset.dtype.is_floating_point:
        raise TypeError(f"softmax_offset must be a floating tensor, got {softmax_offset.dtype}")
    heads = q.shape[-2]
    if layout == "thd":
        per_token = (q.shape[0], heads)
    else:
        batch, seqlen = (q.shape[0], q.shape[1]) if layout == "bshd" else (q.shape[1], q.shape[0])
        per_token = (batch, heads, seqlen)
    shape = tuple(softmax_offset.shape)
    if softmax_offset.dim() == 1:
        if softmax_offset.numel() != heads:
            raise ValueError(f"softmax_offset has {softmax_offset.numel()} entries but q has {heads} heads "
                             "(one sink logit per q head)")
    elif shape != per_token:
        raise ValueError(f"softmax_offset has shape {shape}; expected [Hq] = [{heads}] (per head) or "
                         f"{list(per_token)} (per token and head, {'[T, Hq]' if layout == 'thd' else '[B, Hq, S]'})")
    if softmax_offset.device != q.device:
        raise ValueError(f"softmax_offset is on {softmax_offset.device} but q is on {q.device}")
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    offset = softmax_offset.to(work)
    if softmax_offset.dim() == 2:  # [T, Hq] -> lse's [Hq, T]
        offset = offset.t()
    return offset.contiguous()


def check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                        softmax_scale, causal, window_size, causal_alignment) -> tuple[VarlenParams, int, int]:
    """Validate the packed (thd) attention arguments without reading tensor values; returns the
    params and max_seqlen_q/k (ints; the token counts for 0-dim tensors, see check_max_seqlen). The checks that read cu_seqlens run inside the attention op
    (``check_layout_values``)."""
    check_qkv(q, k, v, "thd")
    params = check_options(q.shape[-1], dropout_p, softmax_scale, causal, window_size, causal_alignment)
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.numel()} entries but cu_seqlens_k has "
                         f"{cu_seqlens_k.numel()}: q and k batch sizes must match")
    max_seqlen_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, q.shape[0])
    max_seqlen_k = check_max_seqlen("max_seqlen_k", max_seqlen_k, k.shape[0])
    return params, max_seqlen_q, max_seqlen_k


def check_spans(start_name: str, start, len_name: str, length, batch: int, seqlen: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample spans of a padded batch: int32 [B] start and length, None = the whole row. Reads
    no values: whether each span fits is checked in the op (``check_span_values``)."""
    for name, t in ((start_name, start), (len_name, length)):
        if t is None:
            continue
        _check_tensor(name, t, 1)
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
        if t.numel() != batch:
            raise ValueError(f"{name} has {t.numel()} entries but the batch has {batch} samples")
        _check_unit_stride(name, t)
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}")
    if start is None:
        start = torch.zeros(batch, dtype=torch.int32, device=device)
    if length is None:
        length = (seqlen - start).to(torch.int32)
    return start, length


def check_span_values(start_name: str, start: torch.Tensor, len_name: str, length: torch.Tensor,
                      seqlen: int) -> None:
    bad = (start < 0) | (length < 0) | (start + length > seqlen)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"span {i} ({start_name}={int(start[i])}, {len_name}={int(length[i])}) "
                         f"does not fit in the padded length {seqlen}")


def check_seqused(name: str, used, cu: torch.Tensor) -> torch.Tensor:
    """Per-sequence used-token counts inside cu_seqlens slots (None: the whole slot). Reads no
    values: ``check_seqused_values`` runs in the op."""
    if used is None:
        used = (cu[1:] - cu[:-1]).to(torch.int32)
    _check_tensor(name, used, 1)
    if used.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {used.dtype}")
    if used.numel() != cu.numel() - 1:
        raise ValueError(f"{name} has {used.numel()} entries but cu_seqlens describes {cu.numel() - 1} sequences")
    _check_unit_stride(name, used)
    if used.device != cu.device:
        raise ValueError(f"{name} is on {used.device} but cu_seqlens is on {cu.device}")
    return used


def check_seqused_values(name: str, used: torch.Tensor, cu: torch.Tensor, max_name: str, max_seqlen: int) -> None:
    if used.numel() and int(used.max()) > max_seqlen:
        raise ValueError(f"{max_name} = {max_seqlen} is smaller than the longest used sequence ({int(used.max())})")
    bad = (used < 0) | (used > cu[1:] - cu[:-1])
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"{name}[{i}] = {int(used[i])} does not fit in sequence {i}'s slot of "
                         f"{int(cu[i + 1] - cu[i])} tokens")


def check_binary_values(name: str, mask: torch.Tensor) -> None:
    """An integer mask holds only 0 and 1 (reads the values): an additive-style mask (0 = keep,
    -1 = pad) would otherwise be read inverted."""
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        raise ValueError(f"{name} is an integer mask and must hold only 0 and 1, found {mask[bad][0].item()}")


def check_keep_mask(name: str, mask, batch: int, seqlen: int, device: torch.device) -> torch.Tensor | None:
    """A [B, S] keep mask (bool, or integer 0/1 with 1 = keep), returned as given: the op checks
    integer values (on the CPU or with COREATTN_VALIDATE=1) and converts it with ``keep_as_uint8``."""
    if mask is None:
        return None
    _check_tensor(name, mask, 2)
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(f"{name} must be bool or integer (nonzero = keep), got {mask.dtype}")
    if tuple(mask.shape) != (batch, seqlen):
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected [B, S] = [{batch}, {seqlen}]")
    if mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but q is on {device}")
    return mask


def keep_as_uint8(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The uint8 keep mask the kernels read (1 = keep): a view of a bool mask, else ``mask != 0``."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8)
    return (mask != 0).view(torch.uint8)


def check_layout_values(fmt: str, q_seq, q_lens, q_keep, k_seq, k_lens, k_keep, tokens_q: int, tokens_k: int,
                        max_seqlen_q: int, max_seqlen_k: int) -> None:
    """The checks of the public functions that read tensor values, run inside the attention op
    (so that traced code never reads them), with the public argument names. The layout is the op's
    (coreattn/layers/function.py): thd ``seq`` cu_seqlens ``[B+1]``, with ``lens`` the seqused
    counts; bshd/sbhd ``seq``/``lens`` the spans and ``keep`` the keep masks as given.
    ``tokens_*``: T (thd) or the padded length S."""
    if not reads_values(q_seq):
        return
    if fmt == "thd":
        seqused = q_lens is not None or k_lens is not None
        check_cu_seqlens_values("cu_seqlens_q", q_seq, tokens_q, "max_seqlen_q", None if seqused else max_seqlen_q)
        check_cu_seqlens_values("cu_seqlens_k", k_seq, tokens_k, "max_seqlen_k", None if seqused else max_seqlen_k)
        for name, used, cu, max_name, max_seqlen in (("seqused_q", q_lens, q_seq, "max_seqlen_q", max_seqlen_q),
                                                     ("seqused_k", k_lens, k_seq, "max_seqlen_k", max_seqlen_k)):
            if used is not None:
                check_seqused_values(name, used, cu, max_name, max_seqlen)
        return
    check_span_values("q_start", q_seq, "q_len", q_lens, tokens_q)
    check_span_values("k_start", k_seq, "k_len", k_lens, tokens_k)
    for name, mask in (("q_keep_mask", q_keep), ("k_keep_mask", k_keep)):
        if mask is not None and mask.dtype != torch.bool:
            check_binary_values(name, mask)


# ---- sparse (top-k) attention: coreattn.sparse_varlen_attn / sparse_padded_attn



def _token_dims(q: torch.Tensor, layout: str) -> tuple[int, ...]:
    """q's token dims: thd ``(T,)``, bshd ``(B, S)``, sbhd ``(S, B)``."""
    return tuple(q.shape[:1] if layout == "thd" else q.shape[:2])


def flat_tokens(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor with q's token dims first as ``[N, ...]``, token n = b * S + s (sbhd: reordered)."""
    if layout == "sbhd":
        t = t.transpose(0, 1)
    dims = 1 if layout == "thd" else 2
    return t.reshape(t.shape[:dims].numel(), *t.shape[dims:])  # not -1: a trailing dim may be 0


def _check_integer(name: str, t, q: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def check_sparse_qkv(q, k, v, layout: str, v_head_dim) -> int:
    """check_qkv's rules with sparse head dims, and v None = absorbed MLA (V is the first
    ``v_head_dim`` columns of k, which must then be given); returns Dv."""
    check_qkv(q, k, v, layout, sparse=True)
    if v is not None:
        if v_head_dim is not None and v_head_dim != v.shape[-1]:
            raise ValueError(f"v_head_dim = {v_head_dim} but v has head dim {v.shape[-1]}")
        return v.shape[-1]
    if v_head_dim is None:
        raise ValueError("v is None (absorbed MLA: V is the first v_head_dim columns of k), so v_head_dim must "
                         "be given")
    if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, int):
        raise TypeError(f"v_head_dim must be an int, got {type(v_head_dim).__name__}")
    if not 1 <= v_head_dim <= min(k.shape[-1], SPARSE_MAX_HEAD_DIM_V):
        raise ValueError(f"v_head_dim = {v_head_dim} must be in 1..min(Dqk, {SPARSE_MAX_HEAD_DIM_V}) = "
                         f"{min(k.shape[-1], SPARSE_MAX_HEAD_DIM_V)} (V is the first v_head_dim columns of k)")
    return v_head_dim


def check_topk_indices(topk_indices, q: torch.Tensor, heads_kv: int, layout: str) -> torch.Tensor:
    """``[.., K]`` or ``[.., Hkv, K]`` with q's token dims first; returns ``[N, Hidx, K]``."""
    _check_integer("topk_indices", topk_indices, q)
    tokens = _token_dims(q, layout)
    extra = topk_indices.dim() - len(tokens)
    if extra not in (1, 2) or tuple(topk_indices.shape[:len(tokens)]) != tokens:
        raise ValueError(f"topk_indices has shape {tuple(topk_indices.shape)}; expected q's token dims {tokens} "
                         f"then [K] or [Hkv, K] ({layout})")
    if extra == 2 and topk_indices.shape[-2] not in (1, heads_kv):
        raise ValueError(f"topk_indices has {topk_indices.shape[-2]} index heads; expected 1 or Hkv = {heads_kv}")
    flat = flat_tokens(topk_indices, layout)
    flat = flat if extra == 2 else flat.unsqueeze(1)
    if flat.shape[-1] == 0:  # no entry in any row (Megatron's K = min(topk, sk) with sk = 0): rows of one unused slot
        flat = torch.full((*flat.shape[:-1], 1), -1, dtype=flat.dtype, device=flat.device)
    return flat


def check_token_values(name: str, t, q: torch.Tensor, layout: str) -> torch.Tensor | None:
    """An integer tensor with q's token dims (topk_length, key bounds), returned as ``[N]``."""
    if t is None:
        return None
    _check_integer(name, t, q)
    if tuple(t.shape) != _token_dims(q, layout):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected q's token dims {_token_dims(q, layout)}")
    return flat_tokens(t, layout)


def check_key_bounds(key_bounds, q: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    if key_bounds is None:
        return None
    if not isinstance(key_bounds, (tuple, list)) or len(key_bounds) != 2:
        raise TypeError(f"key_bounds must be a pair (starts, ends) of integer tensors, got {type(key_bounds).__name__}")
    return (check_token_values("key_bounds[0] (starts)", key_bounds[0], q, layout),
            check_token_values("key_bounds[1] (ends)", key_bounds[1], q, layout))
