"""Every Triton launch in coreattn runs on its inputs' device (coreattn/kernels/device.py).

Triton launches on the current CUDA device, so a launcher handed cuda:1 tensors while cuda:0 is
current must enter ``torch.cuda.device``: a static check that every ``kernel[grid](...)`` call in
the package sits in a function wrapped by ``on_device``, and the guard itself with a tensor that
says it lives on cuda:1 (no GPU needed). The GPU side (two GPUs) is in tests/test_gpu.py.
"""

import ast
import pathlib

import pytest
import torch

import coreattn
from coreattn.kernels import device as device_mod

PACKAGE = pathlib.Path(coreattn.__file__).parent


def _launched_kernel(node) -> str | None:
    """The kernel a call launches: ``name[grid](...)`` (Triton's own syntax) or
    ``launch(target, name, grid, ...)`` (coreattn/kernels/launch.py), name a ``@triton.jit`` function of
    the package (named ``_..._kernel``); None for any other call."""
    if not isinstance(node, ast.Call):
        return None
    if isinstance(node.func, ast.Subscript) and isinstance(node.func.value, ast.Name):
        name = node.func.value.id
    elif isinstance(node.func, ast.Name) and node.func.id == "launch" and len(node.args) >= 2 \
            and isinstance(node.args[1], ast.Name):
        name = node.args[1].id
    else:
        return None
    return name if name.endswith("_kernel") else None


def _launch_sites():
    """(file, line, enclosing function node, direct) of every kernel launch in the package
    (``_launched_kernel``); direct: Triton's ``name[grid](...)``, not through ``launch``."""
    sites = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node
        for node in ast.walk(tree):
            if _launched_kernel(node) is not None:
                fn = parents.get(node)
                while fn is not None and not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    fn = parents.get(fn)
                sites.append((path.relative_to(PACKAGE.parent), node.lineno, fn, isinstance(node.func, ast.Subscript)))
    return sites


def _decorators(fn) -> set[str]:
    names = set()
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        names.add(target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", ""))
    return names


def test_every_launch_site_is_guarded():
    sites = _launch_sites()
    assert len(sites) >= 7, sites  # the attention, tile map and mask launches at least
    unguarded = [f"{path}:{line}" for path, line, fn, _ in sites if fn is None or "on_device" not in _decorators(fn)]
    assert not unguarded, f"kernel launches outside an @on_device launcher: {unguarded}"


def test_every_launch_goes_through_the_grid_check():
    """No ``kernel[grid](...)`` in the package: every launch goes through coreattn/kernels/launch.py, which
    fits its grid to the target's limits (CUDA's, HIP's work-item count, Ascend's grid)."""
    direct = [f"{path}:{line}" for path, line, _, is_direct in _launch_sites() if is_direct]
    assert not direct, f"launches that bypass coreattn.kernels.launch.launch: {direct}"


class _OnCuda1(torch.Tensor):
    """A CPU tensor that reports cuda:1 as its device (what the guard reads)."""

    @property
    def device(self):
        return torch.device("cuda", 1)


def test_guard_enters_the_tensors_device(monkeypatch):
    entered = []

    class Recorder:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", Recorder)
    seen = []

    @device_mod.on_device
    def launcher(x, y=None):
        seen.append(list(entered))
        return x

    x = torch.zeros(2).as_subclass(_OnCuda1)
    launcher(x)
    assert seen == [[torch.device("cuda", 1)]]
    launcher(torch.zeros(2))  # CPU: no guard
    assert seen[-1] == [torch.device("cuda", 1)] and len(entered) == 1
    launcher((x, None), y=1)  # a Packing-like tuple: its first tensor
    assert len(entered) == 2
    with device_mod.launch_device(x):
        pass
    assert entered[-1] == torch.device("cuda", 1)


@pytest.mark.parametrize("name", ["varlen_attn_fwd", "varlen_attn_bwd"])
def test_public_launchers_are_wrapped(name):
    assert getattr(getattr(coreattn.kernels, name), "__coreattn_on_device__", False)
