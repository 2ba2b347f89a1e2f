"""What every result file records about the run: device, versions, commit, date."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def _version(dist: str) -> str | None:
    # package metadata, so that recording a version never imports (or breaks on) the package
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else the platform's processor or machine."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({cpu_model()}, {os.cpu_count()} CPUs)"


def device_slug(device: torch.device) -> str:
    """Directory-friendly device name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")


def run_metadata(device: torch.device) -> dict:
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "device_type": device.type,
        "performance_data": device.type == "cuda",
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(dirty) if dirty is not None else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "coreattn": _version("coreattn"),
        "flash_attn": _version("flash-attn") or _version("flash_attn_3"),
        "megatron_core": _version("megatron-core"),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),  # ROCm's PyTorch: AMD GPUs are cuda devices
        "driver": _driver_version() if device.type == "cuda" else None,
        "cpu": f"{cpu_model()}, {os.cpu_count()} CPUs",
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta["device_memory_gib"] = round(props.total_memory / 2**30, 1)
        meta["sm_count"] = props.multi_processor_count
        meta["capability"] = f"{props.major}.{props.minor}"
        if meta["hip"]:
            meta["gcn_arch"] = props.gcnArchName
    return meta
