"""The package layout the docstrings promise: imports flow downward (kernels <- layers <- adapters),
each subpackage imports only what its ``__init__`` docstring allows, and the layers stay small."""

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "coreattn"
LAYERS = PACKAGE / "layers"
KERNELS = PACKAGE / "kernels"
MAX_LINES = 450
MAX_ROOT_MODULES = 8  # dense attention's api, ops and checks, backends, dispatch, the Megatron module; DSA is layers/dsa/

# package -> coreattn modules it may import (prefixes); the most specific package wins
ALLOWED = {
    "coreattn.kernels": ("coreattn.kernels",),
    "coreattn.layers": ("coreattn.kernels", "coreattn.layers"),
    "coreattn.layers.masks": ("coreattn.kernels", "coreattn.layers.masks", "coreattn.layers.checks"),
    "coreattn.layers.torch_backend": ("coreattn.kernels", "coreattn.layers.torch_backend", "coreattn.layers.checks"),
    "coreattn.layers.npu_fused": ("coreattn.kernels", "coreattn.layers.npu_fused", "coreattn.layers.checks",
                                  "coreattn.layers.masks", "coreattn.layers.torch_backend", "coreattn.layers.function"),
    "coreattn.layers.context_parallel": ("coreattn.kernels", "coreattn.layers.context_parallel", "coreattn.layers.masks",
                                         "coreattn.layers.checks", "coreattn.layers.backends", "coreattn.layers.dispatch",
                                         "coreattn.layers.function"),
    "coreattn.layers.dsa": ("coreattn.kernels", "coreattn.layers.dsa", "coreattn.layers.backends",
                            "coreattn.layers.checks", "coreattn.layers.core_attention",
                            "coreattn.layers.torch_backend", "coreattn.layers.npu_fused"),
    "coreattn.adapters": ("coreattn.kernels", "coreattn.layers", "coreattn.adapters"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[str]:
    """Every coreattn module a file imports, at any depth (lazy imports included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return [name for name in found if name == "coreattn" or name.startswith("coreattn.")]


def _rule(module: str) -> tuple[str, tuple[str, ...]] | None:
    owners = [pkg for pkg in ALLOWED if module == pkg or module.startswith(pkg + ".")]
    if not owners:
        return None
    owner = max(owners, key=len)
    return owner, ALLOWED[owner]


def _allowed(name: str, prefixes: tuple[str, ...]) -> bool:
    # "from coreattn.kernels import npu" yields both "coreattn.kernels" and "coreattn.kernels.npu"
    return any(name == p or name.startswith(p + ".") or p.startswith(name + ".") for p in prefixes)


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_flow_downward(path):
    rule = _rule(_module_name(path))
    if rule is None:
        return  # coreattn/__init__.py, coreattn/masks.py, coreattn/selfcheck: the top, may import anything
    owner, prefixes = rule
    upward = [name for name in _imports(path) if not _allowed(name, prefixes)]
    assert not upward, f"{path.relative_to(PACKAGE)} ({owner}) imports {upward}; allowed: {prefixes}"


def test_layers_root_holds_only_the_api_ops_checks_and_module():
    modules = sorted(p.name for p in LAYERS.glob("*.py"))
    assert len(modules) <= MAX_ROOT_MODULES, modules


@pytest.mark.parametrize("path", sorted(LAYERS.rglob("*.py")), ids=lambda p: str(p.relative_to(LAYERS)))
def test_layers_modules_stay_small(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES


def test_every_subpackage_says_what_it_owns_and_may_import():
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc or init.parent == PACKAGE, f"{init.relative_to(PACKAGE)}: {doc[:80]!r}"


def test_kernels_modules_import_without_a_circle():
    """No circle among the kernels' modules, function-level imports included (kernels/configs/ and
    kernels/tuned_cache.py were one until configs/pick.py could import the cache at module level).
    A package's own ``__init__`` is left out: Python imports it before any of its modules."""
    modules = {_module_name(p): p for p in KERNELS.rglob("*.py") if p.name != "__init__.py"}
    graph = {name: {m for m in _imports(path) if m in modules} for name, path in modules.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import circle: {' -> '.join(exc.args[1])}")


def test_test_files_have_unique_basenames():
    """tests/ has no __init__.py, so pytest imports each test file by its basename (rootdir import mode):
    two files with one name in different folders stop the whole run at collection ("import file mismatch")."""
    tests = Path(__file__).resolve().parent
    seen: dict[str, Path] = {}
    for path in sorted(tests.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        assert path.name not in seen, f"{path.relative_to(tests)} and {seen[path.name].relative_to(tests)} share a basename"
        seen[path.name] = path
