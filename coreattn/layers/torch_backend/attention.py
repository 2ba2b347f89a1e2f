"""Pure-torch attention with the kernels' semantics: the CPU backend and the fallback.

``attn_torch_fwd`` / ``attn_torch_bwd`` are the torch backend's implementation of the backend
contract (coreattn/layers/function.py): the forward returns out, lse (including a softmax offset's
sink term) and optionally the max logit; the backward computes dq, dk, dv from the saved out and
lse with flash attention's formulas (P = exp(S - lse), delta = rowsum(dO * O)), so it also serves
callers that merge partial results through lse (context parallelism).

Memory is that of flash attention, O(T * H * D) plus a bounded tile buffer, on two paths:

- fused (CPU): PyTorch's own fused flash-attention kernel, called once or twice per sequence on
  views of q/k/v (coreattn/layers/torch_backend/fused.py). It runs full and causal attention in either
  alignment, right windows, spans, keep masks without holes, GQA, any head dims (zero-padding the
  smaller of Dqk and Dv), softmax offsets in the forward (fp32/fp64), float64 at float64 precision. The Python loop over
  sequences costs about two kernel calls and a dozen views per sequence, less than the blocked
  path's tile overheads even for thousands of 8-token sequences (measured on this project's
  2-core CPU machine).
- blocked (everything else, and any device): flash attention's online softmax over key blocks in
  torch ops, vectorized over the whole batch (coreattn/layers/torch_backend/blocked.py): left windows,
  keep masks with holes, dropout on the keep mask of coreattn/kernels/dropout.py (the kernels'
  mask, on the same token ids), max logits, softmax offsets with 16-bit inputs, and the backward of
  any call with a softmax offset (its gradient needs rowsum(P * dP) over the call's own keys).

Both give zeros and lse = -inf (or the sink's logit) for rows that see no key, never NaN, and a
deterministic backward. float64 inputs are computed in float64, everything else with float32
accumulation; lse and max logits are float32 (float64 for float64 inputs).

The sequence lengths are read from cu_seqlens or the spans (free on the CPU, one host sync on a
device; coreattn/layers/torch_backend/spans.py), never taken from a caller's max_seqlen; malformed layouts
raise ValueError here even where the public functions skip their value checks (device tensors,
no COREATTN_VALIDATE).
"""

from __future__ import annotations

import torch

from coreattn.kernels.packing import Packing
from coreattn.layers.torch_backend import fused as torch_fused
from coreattn.layers.checks import VarlenParams
from coreattn.layers.torch_backend.blocked import blocked_bwd, blocked_fwd
from coreattn.layers.torch_backend.spans import Spans, read_spans

def visible_mask(lens_q, lens_k, max_q: int, max_k: int, params: VarlenParams) -> torch.Tensor:
    """[B, Sq, Sk] bool: query i of sequence b may attend to key j (dense: a reference for tests
    and FLOP counts; the backend itself never builds it)."""
    i = torch.arange(max_q, device=lens_q.device)[None, :, None]
    j = torch.arange(max_k, device=lens_q.device)[None, None, :]
    shift = (lens_k - lens_q)[:, None, None] if params.bottom_right else 0
    vis = (i < lens_q[:, None, None]) & (j < lens_k[:, None, None])
    if params.window_left >= 0:
        vis = vis & (j >= i + shift - params.window_left)
    if params.window_right >= 0:
        vis = vis & (j <= i + shift + params.window_right)
    return vis


def _fused_calls(q, k, spans: Spans, params: VarlenParams, return_max_logit: bool, softmax_offset, bias=None):
    """The fused path's calls, or None when the call takes the blocked path. 16-bit inputs with a
    softmax offset take the blocked path: the fused path rounds out before the sink folds in, and its
    backward would take the sink's gradient from the rounded out. So does an additive bias."""
    if params.dropout_p > 0 or return_max_logit or bias is not None or not torch_fused.available(q, k):
        return None
    if softmax_offset is not None and q.dtype not in (torch.float32, torch.float64):
        return None
    return torch_fused.plan(spans, params)


def attn_torch_fwd(q, k, v, q_pack: Packing, k_pack: Packing, max_seqlen_q: int, max_seqlen_k: int,
                   params: VarlenParams, rng_state: torch.Tensor | None = None,
                   softmax_offset: torch.Tensor | None = None, return_max_logit: bool = False, bias=None):
    """(out, lse, max_logit or None). out: q's layout and dtype with last dim Dv; lse ([Hq, Tq]
    packed, [B, Hq, Sq] padded; -inf outside the spans) and max_logit [Hq] in float32, or float64
    for float64 inputs. max_seqlen_q/k are not used. ``bias``: an additive bias (a TableBias,
    coreattn/kernels/attn_common.py), on the blocked path."""
    spans = read_spans(q, k, q_pack, k_pack)
    calls = _fused_calls(q, k, spans, params, return_max_logit, softmax_offset, bias)
    if calls is None:
        return blocked_fwd(q, k, v, q_pack, k_pack, spans, params, rng_state, softmax_offset, return_max_logit,
                           bias)
    out, lse = torch_fused.fused_fwd(q, k, v, q_pack, calls, params)
    if softmax_offset is not None:
        torch_fused.fold_sink(out, lse, q_pack.fmt, spans, softmax_offset)
    return out, lse, None


def attn_torch_bwd(dout, q, k, v, out, lse, q_pack: Packing, k_pack: Packing, max_seqlen_q: int, max_seqlen_k: int,
                   params: VarlenParams, rng_state: torch.Tensor | None = None,
                   softmax_offset: torch.Tensor | None = None, bias=None):
    """(dq, dk, dv, d_offset) in the layouts and dtypes of q, k, v (and the offset), from the saved out
    and lse (which includes any softmax offset, so dq/dk/dv need nothing more); d_offset None without
    an offset. With ``bias``: (dq, dk, dv, d_offset, d_table, d_coef) (coreattn/layers/function.py)."""
    spans = read_spans(q, k, q_pack, k_pack)
    # the sink's gradient needs rowsum(P * dP) over this call's keys, which the fused kernel does not
    # expose (rowsum(dO * O) would be the whole row's when out and lse are merged from several calls)
    calls = None if softmax_offset is not None else _fused_calls(q, k, spans, params, False, None, bias)
    if calls is None:
        return blocked_bwd(dout, q, k, v, out, lse, q_pack, k_pack, spans, params, rng_state, softmax_offset, bias)
    return (*torch_fused.fused_bwd(dout, q, k, v, out, lse, q_pack.fmt, calls, params), None)
