"""One Inkling 2 attention layer under ``attn_implementation="coreattn"`` and "eager": peak memory growth
of one forward + backward over the token count, each (implementation, T) in its own process.

``python -m bench.hf_bias [--layer full|sliding] [--tokens 8192 32768] [--eager-tokens 1024 2048]
[--dtype float32]``

The layer is transformers' ``Inkling2FullAttention`` (``--layer full``, the long-context one: the
relative bias over 1,024 distances, per-token sinks, attention over every earlier token) or
``Inkling2SlidingAttention`` (``sliding``: a window of 1,024), with its projections, short
convolutions, norms, sinks and relative-bias module, at Inkling 2's attention shapes scaled down in
width (hidden 512, 8 query heads and 2 KV heads of 64, d_rel 16, rel_extent 1,024) so that it runs on
a CPU; one sequence, no padding, the torch backend, called as the text model calls it (coreattn:
the relative distances as offsets, eager: the ``[T, T]`` int64 tensor), ``out.sum()`` backward.
``grown``: the process's peak resident memory during the call minus before it, inputs built (run
under glibc settings that return freed blocks: ``bench.cpu_attention.MEMORY_ENV``).
``eager_bias_mib`` is eager's ``position_bias`` tensor alone, ``[1, 8, T, T]`` float32 (32 GiB at
32,768 tokens); ``eager_distances_mib`` the text model's two ``[T, T]`` int64 relative distances. Prints
one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.cpu_attention import _reset_peak, _status_kib, worker_row

HEADS, KV_HEADS, HEAD_DIM, EXTENT = 8, 2, 64, 1024


def config(layer: str, tokens: int):
    from transformers import Inkling2TextConfig

    return Inkling2TextConfig(vocab_size=256, unpadded_vocab_size=256, hidden_size=512, num_hidden_layers=1,
                              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                              swa_num_attention_heads=HEADS, swa_num_key_value_heads=KV_HEADS, swa_head_dim=HEAD_DIM,
                              sliding_window_size=EXTENT, d_rel=16, rel_extent=EXTENT, moe_intermediate_size=256,
                              n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=1,
                              layer_types=["hybrid" if layer == "full" else "hybrid_sliding"],
                              max_position_embeddings=max(tokens, 64), pad_token_id=0, eos_token_id=1)


def run_worker(impl: str, layer: str, tokens: int, dtype: str) -> dict:
    import coreattn.adapters.transformers as coreattn_hf
    from coreattn.adapters.transformers.models.inkling2 import Distances
    from transformers.models.inkling2 import modeling_inkling2 as mod

    coreattn_hf.register("coreattn_torch", backend="torch")
    torch.manual_seed(0)
    cfg = config(layer, tokens)
    cfg._attn_implementation = "coreattn_torch" if impl == "coreattn" else "eager"
    dt = getattr(torch, dtype)
    attention = (mod.Inkling2FullAttention if layer == "full" else mod.Inkling2SlidingAttention)(cfg, 0).to(dt)
    hidden = torch.randn(1, tokens, cfg.hidden_size, dtype=dt, requires_grad=True)
    position_ids = torch.arange(tokens)[None]
    distances = Distances(0, tokens, tokens) if impl == "coreattn" else (position_ids[0, :, None] - position_ids)
    kwargs = dict(hidden_states=hidden, attention_mask=None, relative_distance=distances, position_ids=position_ids)
    if layer == "full":
        kwargs.update(key_hidden_states=hidden, value_hidden_states=hidden)
    if impl == "eager":  # eager's causal mask, as its mask builder makes it ([1, 1, T, T])
        from transformers.masking_utils import create_causal_mask

        kwargs["attention_mask"] = create_causal_mask(cfg, hidden, None, None, position_ids)
    _reset_peak()
    before = _status_kib("VmRSS")
    out, _ = attention(**kwargs)
    out.float().sum().backward()
    peak = _status_kib("VmHWM")
    return dict(impl=impl, layer=layer, tokens=tokens, dtype=dtype, grown_mib=round((peak - before) / 1024, 1),
                eager_bias_mib=HEADS * tokens * tokens * 4 / 2**20, eager_distances_mib=2 * tokens * tokens * 8 / 2**20)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hf_bias", description=__doc__.split("\n\n")[0])
    p.add_argument("--layer", default="full", choices=["full", "sliding"])
    p.add_argument("--tokens", nargs="*", type=int, default=[8192, 32768])
    p.add_argument("--eager-tokens", nargs="*", type=int, default=[1024, 2048])
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--worker", nargs=2, metavar=("IMPL", "TOKENS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args.worker[0], args.layer, int(args.worker[1]), args.dtype)))
        return 0
    for impl, counts in (("coreattn", args.tokens), ("eager", args.eager_tokens)):
        for tokens in counts:
            row = dict(impl=impl, layer=args.layer, tokens=tokens)
            print(json.dumps(worker_row(["-m", "bench.hf_bias", "--layer", args.layer, "--dtype", args.dtype,
                                         "--worker", impl, str(tokens)], row)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
