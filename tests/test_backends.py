"""Backend selection: per-device default, explicit override (argument and environment), logged once."""

import logging

import pytest
import torch

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


def test_unknown_device_type_needs_an_explicit_backend(monkeypatch):
    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    with pytest.raises(RuntimeError, match="no default backend for device type 'meta'"):
        select_backend(torch.device("meta"))
    assert select_backend(torch.device("meta"), "torch") is Backend.TORCH


def test_choice_is_logged_once(monkeypatch, caplog):
    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    monkeypatch.setattr(backends, "_logged", set())
    with caplog.at_level(logging.INFO, logger="coreattn"):
        for _ in range(3):
            select_backend(CPU, "torch")
    assert sum("use the torch backend" in r.getMessage() for r in caplog.records) == 1
