"""What the compiler makes of the kernels for a CUDA or AMD CDNA architecture, without a GPU.

``emulate(arch)`` makes Triton compile for that architecture (its active driver is replaced by
one that reports the arch's GPUTarget: ``cuda`` and a capability, or ``hip``, a gfx arch and
wave64) and answers the project's own launch-target lookup as a device of that arch would, so
``coreattn.kernels.configs`` picks the arch's tiles and launch options.
Every kernel launch inside becomes a compile-only warmup. ``compile_problem`` then calls the real
launchers (``varlen_attn_fwd``/``varlen_attn_bwd``) on CPU tensors laid out as a packed thd batch,
so each kernel is compiled with the constexprs, warps, stages and argument specialization a GPU
launch would use, and ``describe`` reads each compiled kernel: registers and spill bytes (ptxas
-v), shared memory (Triton's metadata), MMA kind and count (PTX), duplicated MMA work (TTGIR), an
occupancy estimate from the arch's limits (``ARCHS``), pipelined-load hazards (TTGIR: divisions
by a value that may be zero on an asynchronous load's address, coreattn/tune/hazards.py) and i32
stride products on pointer offsets (TTGIR: coreattn/tune/offsets.py; ``int64_lanes`` records which
variant of the kernels' lane offsets compiled, kernels/attn_common.py). A
``Problem`` is head dims, dtype, mask, GQA group and features (``FEATURES``: dropout, softmax
offset, max logit, a sliding window, a padded batch with keep masks; several may be combined);
``launch_mask_kernels`` compiles the mask utilities' kernels. For a CDNA arch (``CDNA_ARCHS``) the
same rows come from the AMDGCN assembly LLVM emits (no ROCm needed): VGPR/AGPR/SGPR counts, spills
(memory spill bytes, spilled VGPRs and SGPRs), scratch, MFMA instructions by kind, LDS against the
arch's limit and waves per SIMD. Static compiler output, not speed.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import math
import os
import pkgutil
import re
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch


class ArchLimits(NamedTuple):
    """Per-SM limits of a compute capability (NVIDIA's CUDA programming guide, compute capability
    table; the same figures as CCCL's cuda/__device/arch_traits.h). Shared memory in bytes; every
    block also takes 1 KB of the SM's shared memory for the driver (RESERVED_SMEM)."""

    capability: int
    smem_per_sm: int
    smem_per_block: int  # the opt-in maximum a kernel may use
    max_warps_per_sm: int
    max_ctas_per_sm: int


KB = 1024
ARCHS = {
    "sm80": ArchLimits(80, 164 * KB, 163 * KB, 64, 32),  # A100, and 8.7 (Orin)
    "sm86": ArchLimits(86, 100 * KB, 99 * KB, 48, 16),  # RTX 30, A10, A40
    "sm89": ArchLimits(89, 100 * KB, 99 * KB, 48, 24),  # RTX 40, L4, L40S
    "sm90": ArchLimits(90, 228 * KB, 227 * KB, 64, 32),  # H100, H200
    "sm100": ArchLimits(100, 228 * KB, 227 * KB, 64, 32),  # B200, GB200
    "sm120": ArchLimits(120, 100 * KB, 99 * KB, 48, 24),  # RTX 50, RTX PRO Blackwell
}


class CdnaLimits(NamedTuple):
    """Per-CU limits of an AMD CDNA arch (LLVM's AMDGPUUsage and AMDGPU subtarget tables; AMD's CDNA
    ISA guides). LDS in bytes; registers per SIMD lane: the unified file of arch VGPRs and AGPRs
    (512 since gfx90a), allocated in granules of 8. A workgroup's waves are spread over the 4 SIMDs."""

    lds_per_cu: int
    lds_per_workgroup: int
    vgprs_per_simd: int = 512
    vgpr_granule: int = 8
    max_waves_per_simd: int = 8
    simds_per_cu: int = 4


CDNA_ARCHS = {
    "gfx90a": CdnaLimits(64 * KB, 64 * KB),  # MI210, MI250X
    "gfx942": CdnaLimits(64 * KB, 64 * KB),  # MI300X, MI325X
    "gfx950": CdnaLimits(160 * KB, 160 * KB),  # MI350X, MI355X
}
REGS_PER_SM = 64 * 1024
MAX_REGS_PER_THREAD = 255
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256
RESERVED_SMEM = 1 * KB

KERNEL_NAMES = {"_varlen_attn_fwd_kernel": "fwd", "_attn_bwd_preprocess_kernel": "bwd_pre",
                "_attn_bwd_bias_kernel": "bias_grad",
                "_attn_bwd_dkdv_kernel": "dkdv", "_attn_bwd_dq_kernel": "dq", "_tile_scan_kernel": "tile_scan",
                "_tile_map_kernel": "tile_map", "_copy_rows_kernel": "copy_rows", "_token_ids_kernel": "token_ids",
                "_sparse_attn_fwd_kernel": "sparse_fwd", "_sparse_attn_dq_kernel": "sparse_dq",
                "_sparse_attn_dkv_kernel": "sparse_dkv", "_sparse_attn_reduce_kernel": "sparse_reduce",
                "_sparse_attn_dkv_keys_kernel": "sparse_dkv_keys",
                "_sparse_attn_block_dkv_kernel": "sparse_dkv",  # the block mode's dK/dV: its own kernel
                "_indexer_topk_kernel": "indexer_topk", "_hadamard_kernel": "hadamard"}
ATTENTION_KERNELS = ("fwd", "dkdv", "dq")  # the kernels with tl.dot (the others: preprocess and the tile map)
SPARSE_MMA_KERNELS = ("sparse_fwd", "sparse_dq", "sparse_dkv")  # the sparse kernels with tl.dot
# sink: softmax_offset, with the dQ kernel's SINK_GRAD; window: a 256-token left window (with causal's right
# edge when causal, else left only); keep: a padded bshd batch with spans and [B, S] keep masks; keep_strided:
# the same with keep masks that are views of [S, B] storage (position stride B, not specialized to 1, so the
# masks' lane offsets are multiplies). A problem's feature is one of these or several joined by "+"
# ("dropout+sink"): one kernel with all of their code.
# bias_rel: Inkling 2's low-rank relative bias (16 coefficients per row, a 1,024-distance table; the dQ kernel's
# coefficient gradient and the table-gradient kernel); bias_t5: T5's bucketed bias (a clamped table per head);
# token_sink: sinks per token and head (the forward's SINK_ROWS)
FEATURES = ("", "dropout", "sink", "max_logit", "window", "keep", "keep_strided", "bias_rel", "bias_t5", "token_sink")
WINDOW_LEFT = 256
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Problem(NamedTuple):
    dim_qk: int
    dim_v: int
    dtype: str = "bf16"
    causal: bool = False
    group: int = 1  # q heads per kv head
    feature: str = ""  # one of FEATURES, or several joined by "+"

    @property
    def id(self) -> str:
        parts = [f"hdim{self.dim_qk}x{self.dim_v}", self.dtype, "causal" if self.causal else "full"]
        parts += [f"gqa{self.group}"] if self.group > 1 else []
        return "-".join(parts + ([self.feature] if self.feature else []))

    @property
    def features(self) -> frozenset:
        found = frozenset(f for f in self.feature.split("+") if f)
        unknown = found - set(FEATURES)
        if unknown:
            raise ValueError(f"{self.feature!r}: unknown features {sorted(unknown)}; expected some of {FEATURES[1:]}")
        return found


HEADS_Q = 16  # keeps every token stride a multiple of 16 elements, as real models have
SEQLENS = (1000, 3096)  # only the grid size follows the lengths; the kernels do not


# ---------------------------------------------------------------------------------------------
# Emulating a target


class _EmulatedDriver:
    """The part of Triton's CUDA or HIP driver that a compile-only warmup uses. The "device" is the
    capability or gfx arch itself, so each arch gets its own per-device kernel cache in every
    JITFunction."""

    def __init__(self, arch: str):
        from triton.backends.compiler import GPUTarget

        if arch in CDNA_ARCHS:
            self.device, self.target = arch, GPUTarget("hip", arch, 64)
        else:
            self.device = ARCHS[arch].capability
            self.target = GPUTarget("cuda", self.device, 32)

    def is_active(self):
        return True

    def get_current_device(self):
        return self.device

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_device_capability(self, device=None):
        return divmod(self.device, 10)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:
        backend = "amd" if self.target.backend == "hip" else "nvidia"
        return importlib.import_module(f"triton.backends.{backend}.driver").ty_to_cpp(ty)


def arch_target(arch: str) -> str:
    """The launch-config target (kernels/configs/targets.py) of an emulated arch: a CDNA arch is its
    own target, a CUDA arch maps through its compute capability."""
    from coreattn.kernels.configs.targets import cuda_target

    return arch if arch in CDNA_ARCHS else cuda_target(*divmod(ARCHS[arch].capability, 10))


@contextlib.contextmanager
def emulate(arch: str):
    """Inside: Triton compiles for ``arch``, the project's launchers choose its configs, and every
    kernel launch is compiled only; yields the list that each launch's record is appended to
    (dict: fn, kernel, ptxas_log, constants)."""
    import triton.runtime.jit as jit
    from triton import knobs
    from triton.runtime import driver

    import coreattn.kernels as kernels
    from coreattn.kernels.configs.targets import target_of as real_target_of

    target = arch_target(arch)
    # every module that bound target_of, kernels/configs/ included
    patched = [importlib.import_module(m.name) for m in pkgutil.walk_packages(kernels.__path__, "coreattn.kernels.")]
    patched = [m for m in patched if getattr(m, "target_of", None) is real_target_of]
    launches: list[dict] = []
    real_run = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        log = io.StringIO()
        with contextlib.redirect_stdout(log):  # Triton prints ptxas -v output when it runs ptxas
            kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        constants = {k: v for k, v in kwargs.items() if k.isupper()}  # the launchers pass constexprs by name
        launches.append(dict(fn=self.__name__, kernel=kernel, ptxas_log=log.getvalue(), constants=constants))
        return kernel

    saved_driver, saved_dump = driver._active, knobs.nvidia.dump_ptxas_log  # None without a GPU: no active driver
    driver.set_active(_EmulatedDriver(arch))
    knobs.nvidia.dump_ptxas_log = True
    jit.JITFunction.run = compile_only
    for module in patched:
        module.target_of = lambda device, _t=target: _t
    try:
        yield launches
    finally:
        for module in patched:
            module.target_of = real_target_of
        jit.JITFunction.run = real_run
        knobs.nvidia.dump_ptxas_log = saved_dump
        driver._active = saved_driver


@contextlib.contextmanager
def captured_launches():
    """Inside, every kernel launch (a real one, on any device) is recorded: yields the list of
    dicts (fn: the kernel's name, kernel: the compiled kernel, whose n_regs and n_spills a GPU
    launch has filled in)."""
    import triton.runtime.jit as jit

    launches: list[dict] = []
    real_run = jit.JITFunction.run

    def run(self, *args, **kwargs):
        kernel = real_run(self, *args, **kwargs)
        launches.append(dict(fn=self.__name__, kernel=kernel))
        return kernel

    jit.JITFunction.run = run
    try:
        yield launches
    finally:
        jit.JITFunction.run = real_run


# ---------------------------------------------------------------------------------------------
# Reading a compiled kernel


def _ptxas_log_file(kernel) -> Path:
    """Where the ptxas -v log of a compiled kernel is kept: beside Triton's disk cache (the kernel's hash
    names its PTX, target and options; the cache belongs to one Triton, whose ptxas made the log)."""
    from triton import knobs

    return Path(knobs.cache.dir) / "coreattn-ptxas-v" / f"{kernel.hash}.log"


def ptxas_stats(log: str, kernel, capability: int) -> dict:
    """Registers and spill bytes from ptxas -v. A kernel that came from Triton's disk cache ran
    no ptxas here: its log is read from beside that cache, else its PTX goes through the same
    ptxas, for the same target, once more (and the log is kept there)."""
    if "Used" not in log:
        from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

        kept = _ptxas_log_file(kernel)
        if kept.exists():
            log = kept.read_text()
        else:
            with tempfile.TemporaryDirectory() as tmp:
                src = Path(tmp, "k.ptx")
                src.write_text(kernel.asm["ptx"])
                fmad = [] if kernel.metadata.enable_fp_fusion else ["--fmad=false"]
                log = subprocess.run([get_ptxas(capability).path, "-v", *fmad, "--regAllocOptLevel=2",
                                      f"--gpu-name={sm_arch_from_capability(capability)}", str(src), "-o",
                                      str(Path(tmp, "k.o"))], capture_output=True, text=True).stderr
    if "Used" in log:
        kept = _ptxas_log_file(kernel)
        if not kept.exists():
            try:
                kept.parent.mkdir(parents=True, exist_ok=True)
                tmp = kept.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(log)
                tmp.replace(kept)  # atomic: another process may read it at once
            except OSError:
                pass  # a read-only cache: ptxas runs again next time
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return dict(regs=int(regs.group(1)) if regs else None,
                spill_stores=int(spills.group(1)) if spills else None,
                spill_loads=int(spills.group(2)) if spills else None)


MMA_PTX = {"wgmma": r"\bwgmma\.mma_async\.", "mma.sync": r"\bmma\.sync\.aligned\.", "tcgen05": r"\btcgen05\.mma\."}


def mma_counts(ptx: str) -> dict:
    """MMA instructions in the PTX, by kind (wgmma: sm90; tcgen05: sm100; mma.sync: the rest)."""
    return {kind: n for kind, pattern in MMA_PTX.items() if (n := len(re.findall(pattern, ptx)))}


def mma_inputs(ptx: str) -> list[str]:
    """The operand types of the PTX's MMA instructions (``bf16``, ``f16``, ``tf32``; tcgen05's
    ``kind::f16`` covers bf16 and fp16): a dot whose MMA takes another type than its inputs shows."""
    found = set(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync\.aligned)\.[\w.]*?\.f32\.(bf16|f16|tf32|e4m3|e5m2)\b", ptx))
    found |= {f"kind::{k}" for k in re.findall(r"\btcgen05\.mma\.[\w:.]*?kind::(\w+)", ptx)}
    return sorted(found)


def dot_ops(ttgir: str) -> dict:
    """The dots of the TTGIR by op: ttng.warp_group_dot (wgmma), ttng.tc_gen5_mma (tcgen05) or
    tt.dot (mma.sync, or FMA when no MMA layout fits)."""
    ops = {op: len(re.findall(rf"\b{re.escape(op)}\b", ttgir)) for op in ("tt.dot", "ttng.warp_group_dot",
                                                                        "ttng.tc_gen5_mma")}
    return {op: n for op, n in ops.items() if n}


def mma_duplication(ttgir: str) -> int:
    """The largest factor by which a dot's MMA layout covers more rows or columns than the dot's
    result has (1: none). Such a dot repeats the same MMA in several warps: e.g. 8 warps in a
    [8, 1] wgmma layout span 128 rows, twice a 64-row tile. Hopper (v3) and Ampere (v2) layouts and
    AMD's MFMA layouts; tcgen05 (v5) accumulates in tensor memory and is not checked."""
    layouts = {}
    for name, body in re.findall(r"^#(mma\d*) = #ttg\.(?:nvidia_mma|amd_mfma)<\{([^}]*)\}>", ttgir, re.M):
        warps = [int(w) for w in re.search(r"warpsPerCTA = \[([^\]]*)\]", body).group(1).split(",")]
        instr = [int(w) for w in re.search(r"instrShape = \[([^\]]*)\]", body).group(1).split(",")]
        layouts[name] = (warps, instr)
    worst = 1
    dots = r"(?:\btt\.dot|\bttng\.warp_group_dot)\b[^\n]*-> tensor<(\d+)x(\d+)xf32, #(mma\d*)>"
    for rows, cols, name in re.findall(dots, ttgir):
        if name not in layouts:
            continue
        warps, instr = layouts[name]
        span_rows, span_cols = instr[0] * warps[0], instr[1] * warps[1]
        worst = max(worst, span_rows // int(rows), span_cols // int(cols))
    return worst


def occupancy(regs: int, num_warps: int, smem: int, limits: ArchLimits) -> dict:
    """Blocks per SM by registers, shared memory (plus the driver's 1 KB per block), warps and the
    block cap; ``limit`` names the binding one. 0 blocks: the kernel cannot launch."""
    regs_per_warp = math.ceil(regs * 32 / REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by = dict(regs=(REGS_PER_SM // regs_per_warp) // num_warps,
              smem=limits.smem_per_sm // (smem + RESERVED_SMEM) if smem <= limits.smem_per_block else 0,
              warps=limits.max_warps_per_sm // num_warps, cap=limits.max_ctas_per_sm)
    limit = min(by, key=by.get)
    return dict(ctas_per_sm=by[limit], warps_per_sm=by[limit] * num_warps, occupancy_limit=limit)


def fma_dots(ttgir: str) -> int:
    """Dots of the TTGIR whose result is not in an MMA layout: they run as FMA loops."""
    layouts = re.findall(r"\btt\.dot\b[^\n]*-> tensor<[^,>]*, #(\w+)>", ttgir)
    return sum(not layout.startswith("mma") for layout in layouts)


# LLVM marks each spill and reload it inserts: "; 4-byte Folded Spill"; memory ones go through
# scratch (scratch_* on gfx942/gfx950, buffer_* on the private segment's resource on gfx90a)
_AMD_SPILL = r"^\s*(?:scratch|buffer|global|flat)_(?:store|load)\w*[^\n]*; (\d+)-byte Folded (Spill|Reload)"


def amdgcn_stats(asm: str) -> dict:
    """Registers, spills and scratch from the AMDGCN of a kernel: LLVM's kernel-info comments
    (``regs`` = TotalNumVgprs, arch VGPRs + AGPRs, what occupancy counts), the code object's
    metadata (VGPRs and SGPRs spilled; SGPRs spill to VGPR lanes, not memory) and, as ptxas counts
    them, the bytes per lane of the spill stores and reloads in the code."""
    def info(key):
        return int(re.search(rf"^; {key}: (\d+)", asm, re.M).group(1))

    def meta(key):
        return int(re.search(rf"^\s+\.{key}:\s+(\d+)", asm, re.M).group(1))

    spills = {"Spill": 0, "Reload": 0}
    for size, kind in re.findall(_AMD_SPILL, asm, re.M):
        spills[kind] += int(size)
    return dict(regs=info("TotalNumVgprs"), vgprs=info("NumVgprs"), agprs=info("NumAgprs"), sgprs=info("TotalNumSgprs"),
                spill_stores=spills["Spill"], spill_loads=spills["Reload"], vgpr_spills=meta("vgpr_spill_count"),
                sgpr_spills=meta("sgpr_spill_count"), scratch=info("ScratchSize"), llvm_occupancy=info("Occupancy"))


def mfma_counts(asm: str) -> dict:
    """MFMA instructions in the AMDGCN, by mnemonic (kind, shape and input type: v_mfma_f32_32x32x8_bf16)."""
    found = re.findall(r"^\s*(v_mfma_\w+)", asm, re.M)
    return {kind: found.count(kind) for kind in sorted(set(found))}


def mfma_input(mnemonic: str) -> str | None:
    """The input type of an MFMA mnemonic ("bf16", "f16", "f32"; v_mfma_f32_16x16x16bf16_1k: "bf16"), or None."""
    m = re.fullmatch(r"v_mfma_f32_\d+x\d+x\d+_?(bf16|f16|f32)(?:_1k)?", mnemonic)
    return m.group(1) if m else None


def cdna_occupancy(regs: int, num_warps: int, lds: int, limits: CdnaLimits) -> dict:
    """Workgroups per CU by registers (the SIMD's unified file, in granules), LDS and the wave cap,
    and the waves per SIMD they make; ``limit`` names the binding one. 0: the kernel cannot launch."""
    alloc = math.ceil(regs / limits.vgpr_granule) * limits.vgpr_granule
    waves_by_regs = min(limits.max_waves_per_simd, limits.vgprs_per_simd // max(alloc, 1))
    per_simd = math.ceil(num_warps / limits.simds_per_cu)  # a workgroup's waves on each SIMD
    by = dict(regs=waves_by_regs // per_simd,
              lds=limits.lds_per_cu // max(lds, 1) if lds <= limits.lds_per_workgroup else 0,
              waves=limits.max_waves_per_simd // per_simd)
    limit = min(by, key=by.get)
    return dict(workgroups_per_cu=by[limit], waves_per_simd=by[limit] * per_simd, occupancy_limit=limit)


def pipeline_hazards(ttgir) -> dict:
    """The asynchronous (pipelined) loads of a kernel and the divisions by a maybe-zero value on
    their addresses (coreattn/tune/hazards.py): ``async_loads``, ``pipeline_hazards`` (how many
    division sites) and ``hazards`` (one line each). ``ttgir``: the text or its parsed Graph."""
    from coreattn.tune import hazards

    graph = ttgir if isinstance(ttgir, hazards.Graph) else hazards.Graph(ttgir)
    found = hazards.scan(graph)
    return dict(async_loads=hazards.load_counts(graph)["async_loads"], pipeline_hazards=len(found),
                hazards=[h.describe() for h in found])


def describe(launch: dict, arch: str) -> dict:
    """One row of static compiler figures for a compiled launch; ``triton`` names the release that
    compiled it (its figures differ by release: kernels/versions.py)."""
    import triton

    from coreattn.tune import hazards, offsets

    kernel = launch["kernel"]
    md = kernel.metadata
    ttgir = kernel.asm["ttgir"]
    graph = hazards.Graph(ttgir)
    constants = launch["constants"]
    row = dict(arch=arch, triton=triton.__version__, kernel=KERNEL_NAMES.get(launch["fn"], launch["fn"]),
               # sparse: MMA rows (q heads x BLOCK_T tokens) x slots or keys
               block_m=constants.get("BLOCK_M", constants.get("BLOCK_H") and
                                     constants["BLOCK_H"] * constants.get("BLOCK_T", 1)),
               block_n=constants.get("BLOCK_N", constants.get("BLOCK_W")),  # sparse reduce: columns
               dk=constants.get("DK", True), dv=constants.get("DV", True), atomic=constants.get("ATOMIC", False),
               range=constants.get("RANGE", False),  # the sparse kernels' range mode (full rows)
               # the block mode (block-sparse rows); its dK/dV is a kernel of its own
               blocks=constants.get("BLOCKS", launch["fn"] == "_sparse_attn_block_dkv_kernel"),
               int64_lanes=constants.get("INT64_LANES"), num_warps=md.num_warps, num_stages=md.num_stages,
               smem=md.shared, **pipeline_hazards(graph), **offsets.counts(graph))
    if arch in CDNA_ARCHS:
        limits = CDNA_ARCHS[arch]
        asm = kernel.asm["amdgcn"]
        row.update(**amdgcn_stats(asm), mma=mfma_counts(asm), mma_dup=mma_duplication(ttgir), dots=dot_ops(ttgir),
                   fma_dots=fma_dots(ttgir), smem_fits=md.shared <= limits.lds_per_workgroup,
                   matrix_instr_nonkdim=md.matrix_instr_nonkdim, hash=kernel.hash)
        row.update(cdna_occupancy(row["regs"], md.num_warps, md.shared, limits))
        return row
    limits = ARCHS[arch]
    row.update(**ptxas_stats(launch["ptxas_log"], kernel, limits.capability),
               mma=mma_counts(kernel.asm["ptx"]), mma_inputs=mma_inputs(kernel.asm["ptx"]),
               mma_dup=mma_duplication(ttgir),
               dots=dot_ops(ttgir), fma_dots=fma_dots(ttgir), tma_loads=ttgir.count("ttng.async_tma_copy_global_to_local"),
               ws_regions=ttgir.count("ttg.warp_specialize"),
               smem_fits=md.shared <= limits.smem_per_block, hash=kernel.hash)
    if row["regs"] is not None:
        row.update(occupancy(row["regs"], md.num_warps, md.shared, limits))
    return row


# ---------------------------------------------------------------------------------------------
# Driving the launchers


def compile_problem(problem, launches: list[dict], arch: str, kernels=None) -> list[dict]:
    """Forward and backward of ``problem`` (a ``Problem``, or a ``SparseProblem``: the sparse
    kernels) through the real launchers (inside ``emulate``); one row per kernel launch, the
    preprocess kernel included (a sparse problem's as ``sparse_pre``). ``kernels`` (names as in
    KERNEL_NAMES' values; dense problems only): run only the launchers these need and describe
    only their launches."""
    start = len(launches)
    if isinstance(problem, SparseProblem):
        launch_sparse_problem(problem)
        rows = [describe(launch, arch) for launch in launches[start:]]
        return [dict(r, kernel="sparse_pre" if r["kernel"] == "bwd_pre" else r["kernel"], problem=problem.id,
                     **problem._asdict()) for r in rows]
    launch_problem(problem, kernels)
    return [dict(describe(launch, arch), problem=problem.id, **problem._asdict()) for launch in launches[start:]
            if kernels is None or KERNEL_NAMES.get(launch["fn"]) in kernels]


def launch_problem(problem: Problem, kernels=None) -> None:
    """Run the launchers of ``problem``'s forward and backward (or of ``kernels`` only, as in
    ``compile_problem``) on CPU tensors: inside ``emulate``, compile-only launches."""
    from coreattn.kernels import varlen_attn_bwd, varlen_attn_fwd
    from coreattn.kernels.attn_common import TableBias
    from coreattn.kernels.packing import Packing, new_rowstat, packed
    from coreattn.kernels.dropout import rng_state
    from coreattn.masks import cu_seqlens_from_seqlens

    dtype = DTYPES[problem.dtype]
    features = problem.features
    heads_kv = HEADS_Q // problem.group
    lens = torch.tensor(SEQLENS, dtype=torch.int32)
    if features & {"keep", "keep_strided"}:  # padded bshd [B, S, H, D] with spans and keep masks, used in place
        rows, longest = (len(SEQLENS), max(SEQLENS)), max(SEQLENS)
        keep = torch.ones(*rows, dtype=torch.uint8)  # [B, S]
        if "keep_strided" in features:
            keep = torch.ones(*rows[::-1], dtype=torch.uint8).t()  # [B, S] over [S, B] storage
        pack = Packing("bshd", torch.zeros(len(SEQLENS), dtype=torch.int32), lens, keep)
    else:  # packed thd [T, H, D]
        rows, longest = (sum(SEQLENS),), max(SEQLENS)
        pack = packed(cu_seqlens_from_seqlens(lens))
    q = torch.empty(*rows, HEADS_Q, problem.dim_qk, dtype=dtype)  # [T, Hq, Dqk] or [B, S, Hq, Dqk]
    k = torch.empty(*rows, heads_kv, problem.dim_qk, dtype=dtype)  # [T, Hkv, Dqk]
    v = torch.empty(*rows, heads_kv, problem.dim_v, dtype=dtype)  # [T, Hkv, Dv]
    scale = problem.dim_qk ** -0.5
    window_right = 0 if problem.causal else -1  # what layers/checks.py passes for causal=True
    window_left = WINDOW_LEFT if "window" in features else -1
    dropout = dict(dropout_p=0.1, rng_state=rng_state(torch.device("cpu"))) if "dropout" in features else {}
    offset = torch.zeros(HEADS_Q, dtype=torch.float32) if "sink" in features else None
    if "token_sink" in features:  # one per row and head, in lse's layout
        offset = new_rowstat(q, pack).zero_()
    bias = None
    if "bias_rel" in features:
        bias = TableBias(torch.zeros(1, 16, 1024), torch.zeros(*rows, HEADS_Q, 16), 0, False)
    elif "bias_t5" in features:
        bias = TableBias(torch.zeros(HEADS_Q, 1, 257), None, -128, True)
    if kernels is None or "fwd" in kernels:
        out, lse, *_ = varlen_attn_fwd(q, k, v, pack, pack, longest, scale, window_left, window_right, True,
                                       **dropout, softmax_offset=offset, return_max_logit="max_logit" in features,
                                       bias=bias)
    else:  # compile-only launches never write: the backward needs out and lse only as arguments
        out, lse = torch.empty(*rows, HEADS_Q, problem.dim_v, dtype=dtype), new_rowstat(q, pack)
    if kernels is None or set(kernels) - {"fwd"}:
        sink_rowsum = torch.zeros_like(lse) if offset is not None else None
        varlen_attn_bwd(torch.empty_like(out), q, k, v, out, lse, pack, pack, longest, longest, scale, window_left,
                        window_right, True, **dropout, sink_rowsum=sink_rowsum, bias=bias)


def launch_mask_kernels() -> None:
    """The mask utilities' kernels (kernels/masks.py) through their launchers: the row gather and
    scatter and the token ids with both outputs (inside ``emulate``: compile-only launches)."""
    from coreattn.kernels.masks import gather_rows, scatter_rows, token_ids

    rows = torch.empty(sum(SEQLENS), HEADS_Q, 128, dtype=torch.bfloat16)  # [T, H, D]
    index = torch.arange(SEQLENS[0], dtype=torch.int32)
    gather_rows(rows, index)
    scatter_rows(rows[:SEQLENS[0]], index, rows.shape[0])
    token_ids(torch.tensor([0, *SEQLENS], dtype=torch.int32).cumsum(0).to(torch.int32), sum(SEQLENS), torch.int32,
              torch.int64)


class SparseProblem(NamedTuple):
    """A sparse (top-k) attention problem (kernels/sparse_fwd.py, sparse_bwd.py): head dims, q heads
    over kv heads (absorbed MLA: one kv head whose first dim_v columns are V; otherwise a separate V,
    per-head when heads_kv == heads_q), dtype."""

    dim_qk: int
    dim_v: int
    heads_q: int
    heads_kv: int = 1
    absorbed: bool = False
    dtype: str = "bf16"
    block_size: int = 0  # > 0: the block mode (entries name blocks of that many keys, a row per kv head)

    @property
    def kind(self) -> str:
        """absorbed, perhead (K/V per q head: group 1) or gqa<group> (separate V)."""
        if self.absorbed:
            return "absorbed"
        return "perhead" if self.heads_kv == self.heads_q else f"gqa{self.heads_q // self.heads_kv}"

    @property
    def id(self) -> str:
        blocks = f"-blocks{self.block_size}" if self.block_size else ""
        return f"sparse-hdim{self.dim_qk}x{self.dim_v}-{self.dtype}-{self.kind}-h{self.heads_q}{blocks}"


def sparse_problem_of(text: str, dtype: str = "bf16") -> SparseProblem:
    """A SparseProblem from ``576/512a128`` (absorbed: q/k dim, v dim, q heads on one kv head),
    ``192/128g4`` (GQA: 4 kv heads, group 4), ``512/512g16k1`` (group 16 on 1 kv head, separate V)
    or ``576/512p16`` (per-head K/V: 16 q heads, 16 kv heads), any followed by ``b128`` for the block
    mode (blocks of 128 keys: ``128/128g16b128`` is MiniMax-M3's)."""
    m = re.fullmatch(r"(\d+)(?:/(\d+))?(?:a(\d+)|g(\d+)(?:k(\d+))?|p(\d+))(?:b(\d+))?", text)
    if m is None:
        raise ValueError(f"{text!r}: expected QK/Va<heads>, QK/Vg<group>[k<kv heads>] or QK/Vp<heads>, then "
                         f"optionally b<block size>")
    qk, v, absorbed, group, heads_kv, perhead, block = m.groups()
    qk, v, block = int(qk), int(v or qk), int(block or 0)
    if absorbed:
        return SparseProblem(qk, v, int(absorbed), 1, True, dtype, block)
    if perhead:
        return SparseProblem(qk, v, int(perhead), int(perhead), False, dtype, block)
    heads_kv = int(heads_kv or 4)
    return SparseProblem(qk, v, int(group) * heads_kv, heads_kv, False, dtype, block)


SPARSE_TOKENS = 64  # only the grids follow the token count and top-k; the kernels do not
SPARSE_TOPK = 2048  # DeepSeek-V3.2's
SPARSE_BLOCKS = 16  # block mode: blocks per row (MiniMax-M3's index_topk_blocks)


def launch_sparse_problem(problem: SparseProblem) -> None:
    """The sparse forward and every backward variant (the deterministic dK/dV's two schedules,
    token-centric and, for groups it may run, key-centric; the atomic one) of ``problem`` on CPU tensors
    laid out as thd: inside ``emulate``, compile-only launches (the deterministic backward's CSR is built
    by torch on the CPU, from indices that name no key). A block-mode problem: its forward and backward
    (one dK/dV kernel)."""
    from coreattn.kernels.sparse_blocks import BlockLayout
    from coreattn.kernels.sparse_bwd import KEYS_MAX_GROUP, sparse_attn_bwd
    from coreattn.kernels.sparse_fwd import sparse_attn_fwd

    dtype = DTYPES[problem.dtype]
    tokens = SPARSE_TOKENS
    q = torch.empty(tokens, problem.heads_q, problem.dim_qk, dtype=dtype)  # [T, Hq, Dqk]
    k = torch.empty(tokens, problem.heads_kv, problem.dim_qk, dtype=dtype)  # [T, Hkv, Dqk]
    v = None if problem.absorbed else torch.empty(tokens, problem.heads_kv, problem.dim_v, dtype=dtype)
    topk = torch.full((tokens, 1, SPARSE_TOPK), -1, dtype=torch.int32)  # [T, Hidx, K]
    lo = torch.zeros(tokens, dtype=torch.int32)
    hi = torch.arange(1, tokens + 1, dtype=torch.int32)
    args = (topk, lo, hi, "thd", problem.dim_qk ** -0.5)
    v_dim = dict(v_dim=problem.dim_v if problem.absorbed else None)
    if problem.block_size:
        blocks = BlockLayout(problem.block_size, torch.tensor([0, tokens], dtype=torch.int32))
        topk = torch.full((tokens, problem.heads_kv, SPARSE_BLOCKS), -1, dtype=torch.int32)  # [T, Hkv, blocks]
        args = (topk, *args[1:])
        out, lse = sparse_attn_fwd(q, k, v, *args, **v_dim, blocks=blocks)
        sparse_attn_bwd(torch.empty_like(out), q, k, v, out, lse, *args, **v_dim, blocks=blocks)
        return
    out, lse = sparse_attn_fwd(q, k, v, *args, **v_dim)
    key_centric = problem.heads_q // problem.heads_kv <= KEYS_MAX_GROUP  # the groups the launcher may run it for
    for schedule, atomic in (("partials", False), *((("keys", False),) if key_centric else ()), (None, True)):
        sparse_attn_bwd(torch.empty_like(out), q, k, v, out, lse, *args, **v_dim, atomic=atomic, schedule=schedule)


INDEXER_TOKENS = 4096  # only the grid follows it


def launch_indexer_topk(heads: int, dim: int, topk: int, dtype: str, relu: bool = True, scores: bool = False) -> str:
    """The DSA indexer's fused scores + top-k (kernels/indexer_topk.py) for ``heads`` x ``dim`` and ``topk`` on
    CPU tensors laid out as thd (inside ``emulate``: a compile-only launch); returns the problem's name."""
    from coreattn.kernels.indexer_topk import indexer_topk_fwd

    q = torch.empty(INDEXER_TOKENS, heads, dim, dtype=DTYPES[dtype])  # [T, H, D]
    k = torch.empty(INDEXER_TOKENS, dim, dtype=DTYPES[dtype])  # [T, D]
    bounds = torch.zeros(INDEXER_TOKENS, dtype=torch.int32)
    indexer_topk_fwd(q, k, torch.empty(INDEXER_TOKENS, heads, dtype=DTYPES[dtype]), bounds, bounds, topk, "thd",
                     relu=relu, return_scores=scores)
    return topk_problem_name(heads, dim, topk, dtype, relu, scores)


def topk_problem_name(heads: int, dim: int, topk: int, dtype: str, relu: bool = True, scores: bool = False) -> str:
    return f"indexer-h{heads}xd{dim}-topk{topk}-{dtype}" + ("-relu" if relu else "") + ("-scores" if scores else "")


def launch_block_scores(heads: int, dim: int, block: int, dtype: str) -> str:
    """The block-max scores of the indexer's block mode (kernels/indexer_blocks.py) for ``heads`` x ``dim`` in
    blocks of ``block`` keys on CPU tensors laid out as bshd (inside ``emulate``: compile-only); returns the
    problem's name."""
    from coreattn.kernels.indexer_blocks import indexer_block_scores

    q = torch.empty(1, INDEXER_TOKENS, heads, dim, dtype=DTYPES[dtype])  # [B, S, H, D]
    k = torch.empty(1, INDEXER_TOKENS, dim, dtype=DTYPES[dtype])  # [B, Sk, D]
    bounds = torch.zeros(INDEXER_TOKENS, dtype=torch.int32)
    indexer_block_scores(q, k, bounds, bounds, "bshd", 0, 64, block_size=block, n_blocks=INDEXER_TOKENS // block)
    return f"indexer-h{heads}xd{dim}-block{block}-{dtype}"


def launch_hadamard(dim: int, dtype: str) -> str:
    """The Hadamard rotation (kernels/hadamard.py) of ``dim`` columns (inside ``emulate``: compile-only); returns
    the problem's name."""
    from coreattn.kernels.hadamard import hadamard_fwd

    hadamard_fwd(torch.empty(INDEXER_TOKENS, dim, dtype=DTYPES[dtype]), dim ** -0.5)
    return f"hadamard-d{dim}-{dtype}"


def compile_report(archs, problems, int64_lanes: bool | None = None) -> list[dict]:
    """Every kernel of every problem on every arch, one row each. ``int64_lanes``: force that variant
    of the attention kernels' lane offsets (kernels/attn_common.py); None: what the launchers pick
    (the problems' strides are ordinary: the int32 one)."""
    from coreattn.kernels.attn_common import forced_int64_lanes

    rows = []
    for arch in archs:
        with contextlib.ExitStack() as stack:
            if int64_lanes is not None:
                stack.enter_context(forced_int64_lanes(int64_lanes))
            launches = stack.enter_context(emulate(arch))
            for problem in problems:
                rows += compile_problem(problem, launches, arch)
    return rows
