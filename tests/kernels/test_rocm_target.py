"""AMD GPUs under ROCm's PyTorch, faked on any machine: a ROCm build reports ``cuda`` devices with
``torch.version.hip`` set and the arch in ``gcnArchName``; the capability (9, 4 on an MI300X) must
not pick a CUDA table. What the launchers pass to an AMD launch is checked against Triton's HIP
backend options (no ``maxnreg``; a dot precision the arch accepts)."""

from types import SimpleNamespace

import logging

import pytest
import torch

import coreattn.kernels
from coreattn.kernels import attn_bwd, attn_fwd
from coreattn.kernels.configs import dense, targets
from coreattn.kernels.configs.targets import CDNA_TARGETS, hip_target, target_of
from coreattn.kernels.packing import packed
from coreattn.layers import backends
from coreattn.layers.backends import Backend, is_available, select_backend
from coreattn.masks import cu_seqlens_from_seqlens

CUDA0 = torch.device("cuda", 0)
ROCM_ARCH_NAMES = {"gfx90a": "gfx90a:sramecc+:xnack-", "gfx942": "gfx942:sramecc+:xnack-", "gfx950": "gfx950"}


@pytest.fixture
def rocm(monkeypatch):
    """A faked ROCm PyTorch with one AMD GPU; returns a setter for its gcnArchName."""
    props = SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-", name="AMD Instinct MI300X", major=9, minor=4)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482-0f2d60242")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (props.major, props.minor))
    monkeypatch.setattr(coreattn.kernels, "runs_in_interpreter", lambda: False)
    monkeypatch.delenv(targets.ENV_TRITON_TARGET, raising=False)
    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    return lambda name: setattr(props, "gcnArchName", name)


@pytest.mark.parametrize("arch", CDNA_TARGETS)
def test_rocm_device_gets_its_cdna_target_not_a_cuda_one(rocm, arch):
    rocm(ROCM_ARCH_NAMES[arch])
    assert target_of(CUDA0) == arch
    assert target_of(torch.device("cuda")) == arch


@pytest.mark.parametrize("name", ["gfx908:sramecc+:xnack-", "gfx1100", "gfx1201", "gfx1250"])
def test_unknown_amd_arch_falls_back_to_the_torch_backend(rocm, name, caplog, monkeypatch):
    from coreattn.layers import backends

    rocm(name)
    monkeypatch.setattr(backends, "_logged", set())
    with pytest.raises(RuntimeError, match=rf"{name.split(':')[0]}.*backend='torch'"):
        target_of(CUDA0)
    avail = is_available(Backend.TRITON, CUDA0)
    assert not avail.ok and "backend='torch'" in avail.reason
    with caplog.at_level(logging.INFO, logger="coreattn"):
        assert select_backend(CUDA0) is Backend.TORCH  # a device without kernels falls back, never raises
    assert any(name.split(":")[0] in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match=rf"backend='triton' cannot run on cuda.*{name.split(':')[0]}"):
        select_backend(CUDA0, "triton")
    assert select_backend(CUDA0, "torch") is Backend.TORCH


def test_hip_target_takes_the_part_before_the_features():
    assert hip_target("gfx942:sramecc+:xnack-") == "gfx942"
    assert hip_target("gfx90a") == "gfx90a"


def test_rocm_device_defaults_to_triton(rocm):
    rocm("gfx950")
    assert select_backend(CUDA0) is Backend.TRITON
    assert "gfx950" in is_available(Backend.TRITON, CUDA0).reason


def test_cuda_device_still_gets_a_cuda_target(rocm, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    assert target_of(CUDA0) == "sm90"  # capability 9.4 read as CUDA: the point of the ROCm branch


@pytest.mark.parametrize("elem", [2, 4])
@pytest.mark.parametrize("arch", CDNA_TARGETS)
def test_cdna_configs_carry_no_cuda_option(monkeypatch, arch, elem):
    monkeypatch.setattr(dense, "target_of", lambda device: arch)
    for dims in ((64, 64), (128, 128), (192, 128), (256, 256)):
        for dropout in (False, True):
            for cfg in (dense.fwd_config(CUDA0, *dims, elem, dropout), *dense.bwd_configs(CUDA0, *dims, elem, dropout)):
                assert "maxnreg" not in cfg.launch()
    monkeypatch.setattr(dense, "target_of", lambda device: "sm90")
    assert dense.fwd_config(CUDA0, 128, 128).launch()["maxnreg"] == targets.MAXNREG



@pytest.mark.parametrize("target", [*CDNA_TARGETS, "sm90", "sm80", "interpreter", "ascend"])
def test_small_kernels_launch_options_are_their_backends(target):
    """The tile scan and map and the mask kernels: the register ceiling on CUDA targets (Triton
    3.8.0's ptxas held the eight-warp tile scan to 64 registers on sm90 without it, and spilled),
    never on AMD ones; nothing where the launch takes no options (interpreter, Ascend)."""
    opts = targets.launch_options(target)
    if target in ("interpreter", "ascend"):
        assert opts == {}
        return
    assert opts["enable_fp_fusion"] == targets.FP_FUSION
    assert ("maxnreg" in opts) == (target not in CDNA_TARGETS)
    options = _backend(target).parse_options(dict(opts))
    assert all(getattr(options, k) == v for k, v in opts.items()), opts

class _Recorder:
    """Stands in for a kernel object: records what a launch passes, runs nothing."""

    def __init__(self, kernel, log):
        self.arg_names, self.name, self.log = kernel.arg_names, kernel.__name__, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append((self.name, self.arg_names, kwargs))


def _launches(monkeypatch, target: str, dtype: torch.dtype, dims, feature: str) -> list:
    log = []
    for module in (attn_fwd, attn_bwd, dense):
        monkeypatch.setattr(module, "target_of", lambda device: target)
    for module, name in ((attn_fwd, "_varlen_attn_fwd_kernel"), (attn_bwd, "_attn_bwd_preprocess_kernel"),
                         (attn_bwd, "_attn_bwd_dkdv_kernel"), (attn_bwd, "_attn_bwd_dq_kernel")):
        monkeypatch.setattr(module, name, _Recorder(getattr(module, name), log))
    from coreattn.kernels.dropout import rng_state

    lens = (37, 100)
    pack = packed(cu_seqlens_from_seqlens(torch.tensor(lens, dtype=torch.int32)))
    q = torch.zeros(sum(lens), 4, dims[0], dtype=dtype)
    k = torch.zeros(sum(lens), 2, dims[0], dtype=dtype)
    v = torch.zeros(sum(lens), 2, dims[1], dtype=dtype)
    extra = dict(dropout_p=0.1, rng_state=rng_state(torch.device("cpu"))) if feature == "dropout" else {}
    out, lse = attn_fwd.varlen_attn_fwd(q, k, v, pack, pack, max(lens), 0.1, -1, 0, True, **extra)
    attn_bwd.varlen_attn_bwd(out, q, k, v, out, lse, pack, pack, max(lens), max(lens), 0.1, -1, 0, True, **extra)
    return log


def _backend(target: str):
    from triton.backends.compiler import GPUTarget

    if target in CDNA_TARGETS:
        from triton.backends.amd.compiler import HIPBackend

        return HIPBackend(GPUTarget("hip", target, 64))
    from triton.backends.nvidia.compiler import CUDABackend

    return CUDABackend(GPUTarget("cuda", 90, 32))


def _has_backends() -> bool:
    from triton.backends import backends as triton_backends

    return {"amd", "nvidia"} <= set(triton_backends)


@pytest.mark.interpreter_only("calls the launchers on CPU tensors, and their tile-map kernels launch for real")
@pytest.mark.skipif(not _has_backends(), reason="upstream Triton's amd and nvidia backends are not installed")
@pytest.mark.parametrize("dims", [(64, 64), (192, 128), (256, 256)], ids=lambda d: f"hdim{d[0]}x{d[1]}")
@pytest.mark.parametrize("dtype,feature", [(torch.bfloat16, ""), (torch.float32, ""), (torch.float16, "dropout")],
                         ids=["bf16", "fp32", "fp16-dropout"])
@pytest.mark.parametrize("target", [*CDNA_TARGETS, "sm90"])
def test_every_launch_option_is_one_the_targets_backend_knows(monkeypatch, target, dtype, feature, dims):
    """Triton's JIT raises on a launch keyword that is neither a kernel argument nor one of the
    backend's options (the HIP backend has no maxnreg); the dot precision must be one the arch allows."""
    backend = _backend(target)
    launches = _launches(monkeypatch, target, dtype, dims, feature)
    assert {name for name, _, _ in launches} == {"_varlen_attn_fwd_kernel", "_attn_bwd_preprocess_kernel",
                                                 "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"}
    for name, arg_names, kwargs in launches:
        opts = {k: v for k, v in kwargs.items() if k not in arg_names}
        options = backend.parse_options(dict(opts))
        assert not [k for k in opts if k not in options.__dict__], (name, opts)
        assert all(getattr(options, k) == v for k, v in opts.items()), (name, opts)
        if "DOT_PRECISION" in kwargs:
            assert kwargs["DOT_PRECISION"] in options.allowed_dot_input_precisions, (name, kwargs["DOT_PRECISION"])
            if target in CDNA_TARGETS or dtype == torch.float32:
                assert kwargs["DOT_PRECISION"] == "ieee"
    if target in CDNA_TARGETS:
        assert not any("maxnreg" in kwargs for _, _, kwargs in launches)
