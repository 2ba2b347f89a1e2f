"""The Triton releases coreattn is tested with (coreattn/kernels/versions.py): pyproject's floor is
the oldest one CI installs, importing coreattn with an older upstream Triton warns once naming the
tested range (triton-ascend, which reports 3.2, does not), and an interpreter that cannot run the
kernels (Triton 3.6's with numpy >= 2.4) fails the first launch with an error naming the fix
instead of a TypeError from inside Triton."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from coreattn.kernels import npu, versions

ROOT = Path(__file__).resolve().parents[2]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def test_release_parsing():
    assert versions.release("3.7.1") == (3, 7, 1)
    assert versions.release("3.6.0+git1a2b3c") == (3, 6, 0)
    assert versions.release("3.10.0rc1") == (3, 10, 0) > versions.release("3.9.0")
    assert versions.release("3.2") == (3, 2, 0)
    with pytest.raises(ValueError):
        versions.release("main")


def test_pyproject_floor_is_the_oldest_triton_ci_installs():
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = [d for d in deps if re.match(r"triton\b", d)]
    assert floor == [f"triton>={versions.MIN_TRITON.removesuffix('.0')}"]
    assert versions.MIN_TRITON == min(versions.TESTED_TRITON, key=versions.release)
    ci = (ROOT / ".ci" / "run").read_text()
    for version in versions.TESTED_TRITON:  # each tested release is installed by a lane
        assert f"triton=={version}" in ci, version


def test_this_triton_is_in_the_tested_range():
    """Every CI lane's Triton (and triton-ascend in the Ascend lane) passes the import check."""
    assert versions.old_triton_message(triton.__version__, npu.triton_distribution()) is None


@pytest.mark.parametrize("version", ["3.5.1", "3.2.0", "3.4.0+gitabc"])
def test_older_upstream_triton_names_the_tested_range(version):
    message = versions.old_triton_message(version, "triton")
    assert message and version in message and versions.MIN_TRITON in message
    assert all(v in message for v in versions.TESTED_TRITON) and "backend='torch'" in message
    assert versions.old_triton_message(version, "triton-ascend") is None  # reports its base version, 3.2
    assert versions.old_triton_message("3.6.0", "triton") is None
    assert versions.old_triton_message("3.10.0", "triton") is None


def _import_warnings(fake_version: str | None) -> list[str]:
    """Import coreattn in a fresh process (this checkout), with Triton's version faked; the
    messages of every warning raised during the import, by category name."""
    script = ("import warnings, triton\n"
              + (f"triton.__version__ = {fake_version!r}\n" if fake_version else "")
              + "with warnings.catch_warnings(record=True) as caught:\n"
                "    warnings.simplefilter('always')\n"
                "    import coreattn\n"
                "for w in caught:\n"
                "    print(w.category.__name__, '|', w.message)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if line.startswith("UnsupportedTritonWarning")]


@pytest.mark.skipif(npu.triton_ascend_installed(), reason="triton-ascend reports its base version: no warning")
def test_import_with_an_older_triton_warns_once():
    caught = _import_warnings("3.5.0")
    assert len(caught) == 1 and "Triton 3.5.0" in caught[0] and f"Triton {versions.MIN_TRITON} and newer" in caught[0]
    assert _import_warnings(None) == []


def test_interpreter_failure_names_the_fix():
    numpy_error = TypeError("only 0-dimensional arrays can be converted to Python scalars")
    message = versions.interpreter_failure_message(numpy_error, "3.6.0", "2.4.6")
    assert "numpy<2.4" in message and "Triton 3.7" in message and "3.6.0" in message and "2.4.6" in message
    other = versions.interpreter_failure_message(ValueError("something else"), "3.6.0", "2.4.6")
    assert "numpy<2.4" not in other and "something else" in other and versions.MIN_TRITON in other


needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="checks Triton's CPU interpreter")


@needs_interpreter
def test_this_interpreter_runs_the_probe():
    versions.check_interpreter.cache_clear()
    versions.check_interpreter()  # raises where the kernels could not run


@needs_interpreter
def test_a_failing_interpreter_stops_the_first_launch_with_the_fix(monkeypatch):
    """Triton 3.6's interpreter under numpy >= 2.4 raises this TypeError (wrapped in its
    InterpreterError) in every loop over a runtime int; a probe that raises it the same way stands in."""
    from coreattn import varlen_attn

    @triton.jit
    def _failing_probe(n):
        raise TypeError("only 0-dimensional arrays can be converted to Python scalars")

    monkeypatch.setattr(versions, "_range_probe", _failing_probe)
    versions.check_interpreter.cache_clear()
    try:
        q = torch.randn(8, 2, 16)
        cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        with pytest.raises(RuntimeError, match=re.escape('pip install "numpy<2.4"')):
            varlen_attn(q, q, q, cu, cu, max_seqlen_q=5, max_seqlen_k=5, backend="triton")
    finally:
        monkeypatch.undo()
        versions.check_interpreter.cache_clear()
    versions.check_interpreter()
