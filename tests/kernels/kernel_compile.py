"""Compile the attention kernels through the Triton compiler without a device (run as a script).

``python tests/kernels/kernel_compile.py cuda``: upstream Triton, sm90 target, both launch modes
(3D grid and PERSISTENT), through ptxas to cubin (Triton ships ptxas); the tile map's two
kernels once per layout (cu_seqlens, spans).
``python tests/kernels/kernel_compile.py ascend``: triton-ascend, PERSISTENT, Triton IR and then
triton-adapter-opt's lowering to Linalg/HIVM (the last stage before the bisheng compiler, which
needs the CANN toolkit). Prints one line per kernel and variant; exits non-zero on failure.
TRITON_INTERPRET must be unset (the kernels must be JIT functions).
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from coreattn.kernels.attn_bwd import (_attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel,  # noqa: E402
                                       _attn_bwd_preprocess_kernel)
from coreattn.kernels.attn_fwd import _varlen_attn_fwd_kernel  # noqa: E402
from coreattn.kernels.tile_map import SCAN_CHUNK, MAP_TILES, _tile_map_kernel, _tile_scan_kernel  # noqa: E402

POINTER_TYPES = {"lse_ptr": "*fp32", "delta_ptr": "*fp32", "q_seq_ptr": "*i32", "q_len_ptr": "*i32",
                 "k_seq_ptr": "*i32", "k_len_ptr": "*i32", "q_keep_ptr": "*u8", "k_keep_ptr": "*u8",
                 "q_gid_ptr": "*i32", "k_gid_ptr": "*i32", "rng_ptr": "*i64", "sink_ptr": "*fp32", "max_ptr": "*fp32",
                 "dsink_ptr": "*fp32", "map_ptr": "*i32", "first_ptr": "*i32", "first_q_ptr": "*i32",
                 "first_k_ptr": "*i32", "status_ptr": "*i32"}
SHAPES = dict(HEAD_DIM_QK=192, HEAD_DIM_V=128, BLOCK_DQK=128, BLOCK_DQK2=64, BLOCK_DV=128, BLOCK_M=32, BLOCK_N=32,
              DK=True, DV=True, BLOCK_Q=32, BLOCK_K=64, MAP_Q=True, MAP_K=True, CHUNK=SCAN_CHUNK, BLOCK=32,
              REVERSE=True, TILES=MAP_TILES)
# the pointer loads and the plain loop (the TMA and warp-specialized variants: tests/tune/test_dry_run.py);
# the descriptor arguments are then None, which Triton makes constexprs; int32 lane offsets, the default
# variant (the INT64_LANES one: tests/kernels/test_lane_offsets_compiled.py)
POINTER_LOOP = dict(TMA=False, WARP_SPEC=False, k_desc=None, k2_desc=None, v_desc=None, q_desc=None, q2_desc=None,
                    do_desc=None, INT64_LANES=False)
# no additive bias, one sink per head (the bias kernels compile in test_kernel_structure.py and the pipeline scan)
NO_BIAS = dict(BIAS=False, BIAS_RANK=1, BIAS_COEF=0, BIAS_CLAMP=False, BIAS_GRAD=False, BIAS_RB=1, SINK_ROWS=False,
               bias_extent=1)
NO_FEATURES = dict(DROPOUT=False, HAS_GID=False, HAS_SINK=False, RETURN_MAX=False, SINK_GRAD=False)
VARIANTS = {
    "thd-causal-window": dict(HAS_LEFT=True, HAS_RIGHT=True, BOTTOM_RIGHT=True, SPANS=False, PACKED=True,
                              HAS_Q_KEEP=False, HAS_K_KEEP=False, **NO_FEATURES),
    "spans-keep-masks": dict(HAS_LEFT=False, HAS_RIGHT=False, BOTTOM_RIGHT=False, SPANS=True, PACKED=False,
                             HAS_Q_KEEP=True, HAS_K_KEEP=True, **NO_FEATURES),
    "dropout-sink-max-logit": dict(HAS_LEFT=False, HAS_RIGHT=True, BOTTOM_RIGHT=True, SPANS=True, PACKED=True,
                                   HAS_Q_KEEP=False, HAS_K_KEEP=False, DROPOUT=True, HAS_GID=True, HAS_SINK=True,
                                   RETURN_MAX=True, SINK_GRAD=True),
}
KERNELS = (_varlen_attn_fwd_kernel, _attn_bwd_preprocess_kernel, _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel)
LAYOUT_KERNELS = (_tile_scan_kernel, _tile_map_kernel)  # compiled once per layout (SPANS), not per variant


def _signature(fn, consts: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = POINTER_TYPES.get(name, "*fp16")
        else:
            sig[name] = "fp32" if name.startswith(("sm_scale", "drop_scale")) else "i32"
    return sig


def _cuda(fn, consts: dict) -> str:
    src = ASTSource(fn, _signature(fn, consts), {(fn.arg_names.index(k),): v for k, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    return f"cubin {len(compiled.asm['cubin'])} bytes"


def _ascend(fn, consts: dict) -> str:
    import triton._C.libtriton as libtriton
    from triton.backends.ascend.compiler import AscendBackend, make_ttir, ttir_to_linalg

    sig = {k: v for k, v in _signature(fn, consts).items() if v != "constexpr"}
    backend = AscendBackend(GPUTarget("npu", "Ascend910B3", 0))
    options = backend.parse_options({})
    context = libtriton.ir.context()
    libtriton.ir.load_dialects(context)
    backend.load_dialects(context)
    mod = ASTSource(fn, sig, consts).make_ir(options, backend.get_codegen_implementation(), backend.get_module_map(),
                                             context)
    metadata = {k: getattr(options, k, None) for k in ("enable_nd2nz_on_vector", "enable_select_analysis",
                                                      "compile_on_910_95", "force_simt_template", "enable_linearize")}
    metadata["hash"] = fn.__name__
    mod = make_ttir(mod, metadata, options)
    try:
        linalg = ttir_to_linalg(mod, metadata, options, named_ops=True)
    except Exception as exc:  # subprocess.CalledProcessError from triton-adapter-opt
        raise RuntimeError((getattr(exc, "stderr", b"") or b"").decode()[-4000:]) from exc
    return f"ttadapter {len(str(linalg))} chars"


def main(which: str) -> None:
    compile_one = _cuda if which == "cuda" else _ascend
    precision = "tf32" if which == "cuda" else "ieee"  # triton-ascend accepts ieee and hf32 only
    for variant, flags in VARIANTS.items():
        for fn in KERNELS:
            # CUDA launches the grid mode; PERSISTENT (Ascend's) is compiled for CUDA too, as a second frontend check
            modes = (False, True) if which == "cuda" and not flags["DROPOUT"] else (which != "cuda",)
            for persistent in modes:
                consts = dict(SHAPES, **POINTER_LOOP, **NO_BIAS, **flags, DOT_PRECISION=precision,
                              PERSISTENT=persistent)
                consts = {k: v for k, v in consts.items() if k in fn.arg_names}
                mode = "PERSISTENT" if persistent else "grid"
                print(f"{which} {fn.__name__} {variant} {mode}: {compile_one(fn, consts)}", flush=True)
    for spans in (False, True):  # the tile map's kernels follow the layout only
        for fn in LAYOUT_KERNELS:
            consts = {k: v for k, v in dict(SHAPES, SPANS=spans, PERSISTENT=which != "cuda").items()
                      if k in fn.arg_names}
            print(f"{which} {fn.__name__} {'spans' if spans else 'cu_seqlens'}: {compile_one(fn, consts)}",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
