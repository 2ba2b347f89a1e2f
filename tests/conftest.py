"""Test set-up: without CUDA, the Triton kernels run under Triton's CPU interpreter.

TRITON_INTERPRET must be set before coreattn (and its @triton.jit kernels) is imported.
torch.cuda.is_available() does not create a CUDA context (on ROCm's PyTorch it is True for AMD GPUs,
and the GPU tests run there alike). Under the interpreter,
interpreter_bf16 corrects its bf16 tl.dot and casts so the bf16 kernel paths run on CPU, and
interp_memcheck fails any load or store outside the kernel's tensor arguments (every lane inside
a loop; ``COREATTN_MEMCHECK=masked`` or ``off`` relaxes it, see tests/interp_memcheck.py).

Markers (docs/testing.md says what a GPU run covers and skips):

- ``gpu``: needs a CUDA device; skipped without one.
- ``interpreter_only(reason)``: runs only under Triton's CPU interpreter (the kernels on CPU
  tensors, the interpreter's launch sizes, its bf16 correction, its cost model); skipped on a
  GPU, where the kernels are compiled, with the reason.
- ``compiler_output``: pins the compiler output (registers, spills, MMA kinds, warp-specialized
  regions, the emulated targets of coreattn/tune/compiler.py) of the Triton releases CI tests
  (coreattn/kernels/versions.py ``TESTED_TRITON``); skipped under another Triton, whose output
  these tests were not checked with.

On a GPU, a test that leaves CUDA unusable (a kernel fault poisons its process) is recorded;
under pytest-xdist its worker then exits, so xdist reports that test as crashed and goes on in a
fresh worker instead of failing everything after it there. With ``COREATTN_TEST_REPORT=PATH``
(bench/acceptance.py) every outcome is appended to PATH as a JSON line as it comes.
"""

import atexit
import json
import os
import shutil
import sys
import tempfile

import pytest
import torch

# Inductor's caches are keyed by the graph's code, not by the schema of the custom ops it calls: a graph cached
# by another checkout of coreattn (other op arguments) would be replayed here. Each run compiles into its own.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="coreattn-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MEMCHECK = "not installed (the kernels run compiled)"
if INTERPRETED:
    import interp_memcheck
    import interpreter_bf16

    interpreter_bf16.install()
    try:
        interp_memcheck.install()
        MEMCHECK = interp_memcheck.mode()
    except RuntimeError as exc:  # this Triton's interpreter lacks what it wraps: said in the header and failed
        MEMCHECK = f"DISABLED: {exc}"  # by tests/kernels/test_interp_memcheck.py



def pytest_report_header(config):
    return f"interpreter memcheck: {MEMCHECK}"


REPORT_ENV = "COREATTN_TEST_REPORT"
WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # set in pytest-xdist's workers
_POISONED: dict = {}  # the test after which CUDA became unusable in this process
_TRACE: dict = {}


def triton_version() -> str:
    import triton

    return getattr(triton, "__version__", "unknown")


def pytest_configure(config):
    config.addinivalue_line("markers", "interpreter_only(reason): runs only under Triton's CPU interpreter; "
                                       "skipped on a GPU, with the reason")
    config.addinivalue_line("markers", "compiler_output: pins the compiler output of the Triton releases CI tests; "
                                       "skipped under another Triton")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a GPU (CUDA, or ROCm's PyTorch, whose AMD GPUs are cuda devices)")
    from coreattn.kernels.versions import TESTED_TRITON  # after TRITON_INTERPRET is settled (above)

    version = triton_version()
    skip_compiler = pytest.mark.skip(reason=f"pins the compiler output of Triton {', '.join(TESTED_TRITON)}; this "
                                            f"is Triton {version} (coreattn/kernels/versions.py TESTED_TRITON)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "compiler_output" in item.keywords and version not in TESTED_TRITON:
            item.add_marker(skip_compiler)
        only = item.get_closest_marker("interpreter_only")
        if only is not None and not INTERPRETED:
            reason = only.args[0] if only.args else "needs Triton's CPU interpreter"
            item.add_marker(pytest.mark.skip(reason=f"interpreter only: {reason}"))


# ---- on a GPU: what a device fault leaves behind

def pytest_sessionstart(session):
    """With a report file on a GPU, every Triton launch is remembered (not synced: launches stay
    asynchronous), so a device fault can name the last kernel launched before it."""
    if HAS_CUDA and os.environ.get(REPORT_ENV):
        from coreattn.selfcheck.faults import launch_trace

        _TRACE["context"] = launch_trace(None, sync=False)
        _TRACE["trace"] = _TRACE["context"].__enter__()


def pytest_sessionfinish(session):
    if "context" in _TRACE:
        _TRACE.pop("context").__exit__(None, None, None)


def _write(record: dict) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    injected = os.environ.get("COREATTN_INJECT_FAULT")  # test-only faults stand for CUDA ones (faults.py)
    if not (HAS_CUDA or injected) or call.excinfo is None or call.excinfo.errisinstance(pytest.skip.Exception):
        return
    report = outcome.get_result()
    if _POISONED:
        report.sections.append(("coreattn", f"CUDA has been unusable in this process since {_POISONED['nodeid']} "
                                            "faulted: this failure may follow from it"))
        return
    from coreattn.selfcheck.faults import describe_launch, device_healthy, is_device_fault, short_error

    exc = call.excinfo.value
    poisoned = HAS_CUDA and torch.cuda.is_initialized() and not device_healthy(torch.device("cuda"))
    if not (is_device_fault(exc) or poisoned):
        return
    trace = _TRACE.get("trace")
    last = trace.last if trace is not None else None
    _POISONED.update(nodeid=item.nodeid, error=short_error(exc))
    record = {"event": "device-fault", "nodeid": item.nodeid, "when": call.when, "error": short_error(exc),
              "worker": WORKER, "last_launch": last,
              "last_launch_text": describe_launch(last) + " (the last launched before the error; launches are "
                                                          "asynchronous, so possibly an earlier one)" if last else None}
    _write(record)
    sys.stderr.write(f"\ncoreattn: CUDA unusable after {item.nodeid}: {record['error']}\n")
    if WORKER:  # xdist reports this test as crashed and goes on with the rest in a fresh worker
        sys.stderr.flush()
        os._exit(3)


def pytest_runtest_logreport(report):
    """With COREATTN_TEST_REPORT, each test's outcome as it comes (in xdist's controller, crashed
    workers' tests included), so a run cut short still says what it saw."""
    if WORKER or not os.environ.get(REPORT_ENV):
        return
    if report.when != "call" and report.passed:
        return
    if report.skipped and isinstance(report.longrepr, tuple):
        message = report.longrepr[2]
    else:
        message = None if report.passed else str(report.longrepr)[-1500:]
    _write({"event": "test", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
            "duration": round(report.duration, 3), "message": message,
            "worker": getattr(getattr(report, "node", None), "gateway", None) and report.node.gateway.id})
