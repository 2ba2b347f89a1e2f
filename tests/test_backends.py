"""Backend selection: per-device default, explicit override (argument and environment), logged once."""

import logging

import pytest
import torch

import coreattn

from coreattn.layers import backends
from coreattn.layers.backends import Backend, is_available, select_backend
from coreattn.kernels import runs_in_interpreter
from conftest import HAS_CUDA

CPU = torch.device("cpu")


def test_cpu_default_follows_the_interpreter(monkeypatch):
    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    expected = Backend.TRITON if runs_in_interpreter() else Backend.TORCH
    assert select_backend(CPU) is expected


def test_override_by_argument_and_environment(monkeypatch):
    monkeypatch.setenv(backends.ENV_BACKEND, "torch")
    assert select_backend(CPU) is Backend.TORCH
    assert select_backend(CPU, "TRITON" if runs_in_interpreter() else "torch") in (Backend.TRITON, Backend.TORCH)
    monkeypatch.setenv(backends.ENV_BACKEND, "nope")
    with pytest.raises(ValueError, match="COREATTN_BACKEND='nope' is not a coreattn backend"):
        select_backend(CPU)


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only answer")
def test_unusable_override_raises_with_reason(monkeypatch):
    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    cuda = torch.device("cuda")
    avail = is_available(Backend.TRITON, cuda)
    assert not avail.ok and avail.reason
    with pytest.raises(RuntimeError, match="backend='triton' cannot run on cuda"):
        select_backend(cuda, "triton")


def test_other_device_types_default_to_torch(monkeypatch):
    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    assert select_backend(torch.device("meta")) is Backend.TORCH
    with pytest.raises(RuntimeError, match="backend='triton' cannot run on meta"):
        select_backend(torch.device("meta"), "triton")


@pytest.fixture
def compiled_cuda(monkeypatch):
    """A CUDA device as the selection sees it, for the capability given (no GPU needed): compiled
    kernels (not the interpreter), NVIDIA (not ROCm)."""
    import coreattn.kernels

    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    monkeypatch.setattr(backends, "_logged", set())
    monkeypatch.setattr(coreattn.kernels, "runs_in_interpreter", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)

    def with_capability(major, minor):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        return torch.device("cuda", 0)

    return with_capability


@pytest.mark.parametrize("capability", [(7, 0), (7, 5), (6, 1)])
def test_pre_ampere_gpu_falls_back_to_torch_with_the_reason(compiled_cuda, capability, caplog):
    cuda = compiled_cuda(*capability)
    with caplog.at_level(logging.INFO, logger="coreattn"):
        assert select_backend(cuda) is Backend.TORCH
        assert select_backend(cuda) is Backend.TORCH
    messages = [r.getMessage() for r in caplog.records if "backend" in r.getMessage()]
    assert len(messages) == 1, messages  # logged once
    assert "torch backend" in messages[0] and "compute capability >= 8.0" in messages[0]
    assert f"{capability[0]}.{capability[1]}" in messages[0]
    with pytest.raises(RuntimeError, match=rf"backend='triton' cannot run on cuda: .*{capability[0]}\.{capability[1]}"):
        select_backend(cuda, "triton")


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_ampere_and_newer_default_to_triton(compiled_cuda, capability):
    assert select_backend(compiled_cuda(*capability)) is Backend.TRITON


def test_pre_ampere_gpu_runs_the_public_functions_on_torch(compiled_cuda, monkeypatch):
    """What a T4 user of the public functions gets: the torch backend, not an error (the selection
    is the op's; here the tensors are CPU tensors reported through a patched selection)."""
    from coreattn.layers import function

    cuda = compiled_cuda(7, 5)
    chosen = []
    real = function.select_backend
    monkeypatch.setattr(function, "select_backend", lambda device, override=None: chosen.append(real(cuda, override))
                        or chosen[-1])
    q, k, v = (torch.randn(5, 2, 8) for _ in range(3))
    cu = torch.tensor([0, 5], dtype=torch.int32)
    out = coreattn.varlen_attn(q, k, v, cu, cu, 5, 5, causal=True)
    assert chosen and set(chosen) == {Backend.TORCH} and torch.isfinite(out).all()


def test_choice_is_logged_once(monkeypatch, caplog):
    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    monkeypatch.setattr(backends, "_logged", set())
    with caplog.at_level(logging.INFO, logger="coreattn"):
        for _ in range(3):
            select_backend(CPU, "torch")
    assert sum("use the torch backend" in r.getMessage() for r in caplog.records) == 1
