"""The tuner's logic on CPU (coreattn/tune): ranking, compile-check, acceptance and the file it writes,
with an injected timer that returns scripted milliseconds (no speed is measured or claimed here:
the kernels run under the interpreter only where a test needs their outputs)."""

import json

import pytest
import torch

from conftest import HAS_CUDA
from coreattn.kernels import tuned_cache
from coreattn.kernels.configs import dense, pick
from coreattn.kernels.configs.base import KERNELS, AttnConfig
from coreattn.kernels.tuned_cache import DeviceKey, KernelClass
from coreattn.tune import __main__ as cli
from coreattn.tune import accept as acceptance
from coreattn.tune import tuner
from coreattn.tune.batches import Batch, batches, fit_tokens
from coreattn.tune.report import after_table, share_hint
from coreattn.tune.space import KernelTask, classes, kernel_classes, parse_dims

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="CPU tests of the tuner's logic (the interpreter runs the kernels)")

CPU = torch.device("cpu")
SHIPPED = dense._INTERPRETER  # (16, 32): the interpreter's shipped config
FAST, FASTER = AttnConfig(32, 16, 1, 1), AttnConfig(16, 16, 1, 1, tma=True)
TINY = [Batch("tiny-a", (5, 17)), Batch("tiny-b", (3,) * 4)]
KEY = DeviceKey("NVIDIA H100 80GB HBM3", "9.0", "3.9.0", "0.1.0")


def scripted(ms: dict, seen: list):
    """A timer that returns ``ms[config][batch]`` and checks the config it is asked about is the one forced."""
    def timer(fn, case):
        assert pick._FORCED[case.kernel] == case.config
        seen.append(case)
        return ms[case.config][case.batch]
    return timer


def test_select_ranks_by_geometric_mean_over_batches():
    times = {SHIPPED: {"a": 10.0, "b": 1.0}, FAST: {"a": 5.0, "b": 1.5}, FASTER: {"a": 9.0, "b": 0.5}}
    ranked = tuner.select(times, SHIPPED)
    assert [r.config for r in ranked] == [FASTER, FAST, SHIPPED]
    assert ranked[0].speedup == pytest.approx((10 / 9 * 2) ** 0.5)
    assert ranked[1].speedup == pytest.approx((2 / 1.5) ** 0.5)
    tie = tuner.select({SHIPPED: {"a": 1.0}, FAST: {"a": 1.0}}, SHIPPED)
    assert tie[0].config == SHIPPED  # a tie keeps the shipped config


def test_classes_and_kernel_tasks():
    assert parse_dims("64, 192/128") == [(64, 64), (192, 128)]
    for bad in ("", "x", "0", "300/128"):
        with pytest.raises(ValueError):
            parse_dims(bad)
    found = classes([(128, 128)], "bf16", ["causal", "full", "sink"])
    assert [c.id for c in found] == ["hdim128x128-bf16-causal", "hdim128x128-bf16-causal-sink",
                                     "hdim128x128-bf16-full", "hdim128x128-bf16-full-sink"]
    tasks = kernel_classes(found)
    # dK/dV does not see sinks; the preprocess kernel sees neither masks nor sinks: 4 fwd, 4 dq, 2 dkdv, 1 preprocess
    assert sorted((t.kernel, t.cls.id) for t in tasks if t.kernel in ("dkdv", "preprocess")) == [
        ("dkdv", "hdim128x128-bf16-causal"), ("dkdv", "hdim128x128-bf16-full"), ("preprocess", "hdim128x128-bf16-full")]
    assert len(tasks) == 11
    with pytest.raises(ValueError):
        classes([(64, 64)], "bf16", ["windowed"])


def test_batches_cover_the_many_short_sequence_shapes():
    full = {b.name: b for b in batches()}
    assert {b.name: (len(b.seqlens), b.seqlens[0]) for b in full.values()} == {
        "long-docs-16k": (4, 16384), "short-docs-2k": (32, 2048), "many-short-256": (4096, 256),
        "many-short-64": (16384, 64), "many-short-16": (65536, 16)}
    assert [sum(b.seqlens) * 4 for b in batches(quick=True)] == [sum(b.seqlens) for b in full.values()]
    assert max(sum(b.seqlens) for b in batches(max_tokens=2**17)) == 2**17
    assert fit_tokens(80 * 2**30, 128, 128, 2, 8) == 2**20
    assert fit_tokens(8 * 2**30, 256, 256, 2, 8) < 2**20


def _task(kernel="fwd", cls=KernelClass(64, 64, "fp16", True)):
    return KernelTask(kernel, cls.for_kernel(kernel), cls)


def test_tune_task_takes_the_fastest_candidate_that_passes(monkeypatch):
    ms = {SHIPPED: {"tiny-a": 10.0, "tiny-b": 10.0}, FAST: {"tiny-a": 8.0, "tiny-b": 8.0},
          FASTER: {"tiny-a": 5.0, "tiny-b": 6.0}}
    seen, checked = [], []
    monkeypatch.setattr(tuner, "accept", lambda kernel, cls, cand, shipped, device, lens=None:
                        checked.append(cand) or acceptance.Acceptance(cand != FASTER, []))
    result = tuner.tune_task(_task(), CPU, TINY, scripted(ms, seen), candidates=[SHIPPED, FAST, FASTER])
    assert checked == [FASTER, FAST]  # the best first; FASTER fails acceptance, so FAST is taken
    assert result.chosen == FAST and result.speedup == pytest.approx(10 / 8)
    assert result.ms_chosen == ms[FAST] and result.ms_shipped == ms[SHIPPED]
    assert any("rejected" in note for note in result.notes)
    assert len(seen) == 6 and {c.batch for c in seen} == {"tiny-a", "tiny-b"}
    entry = result.entry
    assert entry["kernel"] == "fwd" and entry["class"] == "hdim64x64-fp16-causal"
    assert tuned_cache.config_from_json(entry["config"]) == FAST and entry["speedup"] == 1.25


def test_no_entry_without_a_clear_win(monkeypatch):
    ms = {SHIPPED: {"tiny-a": 10.0, "tiny-b": 10.0}, FAST: {"tiny-a": 9.95, "tiny-b": 9.95}}
    monkeypatch.setattr(tuner, "accept", lambda *a, **k: pytest.fail("nothing should reach acceptance"))
    result = tuner.tune_task(_task("dq"), CPU, TINY, scripted(ms, []), candidates=[SHIPPED, FAST])
    assert result.chosen == SHIPPED and result.entry is None and result.speedup == 1.0


def test_a_candidate_that_does_not_compile_is_dropped(monkeypatch):
    broken = AttnConfig(24, 16, 1, 1)  # tl.arange needs powers of two
    ms = {SHIPPED: {"tiny-a": 1.0, "tiny-b": 1.0}}
    result = tuner.tune_task(_task(), CPU, TINY[:1], scripted(ms, []), candidates=[SHIPPED, broken])
    assert result.chosen == SHIPPED and len(result.notes) == 1 and "does not compile" in result.notes[0]


@pytest.mark.parametrize("kernel, cls", [
    ("dkdv", KernelClass(192, 128, "fp16", True, True)),
    ("fwd", KernelClass(64, 64, "fp16", True, False, ("dropout",))),
    ("dq", KernelClass(64, 32, "fp16", False, True, ("sink",))),
    ("fwd", KernelClass(64, 64, "fp16", True, False, ("max_logit",))),
], ids=["dkdv-192x128-gqa-causal", "fwd-dropout", "dq-sink", "fwd-max-logit"])
def test_acceptance_of_a_good_candidate(kernel, cls):
    shipped = {k: SHIPPED for k in KERNELS}
    verdict = acceptance.accept(kernel, cls, FASTER, shipped, CPU)
    assert verdict.passed, verdict.note
    names = {c.name for c in verdict.checks}
    assert {"out", "dq", "dk", "dv", "out vs shipped", "bitwise repeatable"} <= names
    assert ("d_offset" in names) == ("sink" in cls.features)
    assert ("max_logit" in names) == ("max_logit" in cls.features)


def test_acceptance_rejects_wrong_outputs():
    cls = KernelClass(64, 64, "fp16", True)

    def runner(c, inp, configs):
        res = acceptance.run(c, inp, configs)
        if configs["dq"] == FASTER:  # a candidate whose dQ is off by a little more than rounding
            res["dq"] = res["dq"] * 1.01
        return res

    verdict = acceptance.accept("dq", cls, FASTER, {k: SHIPPED for k in KERNELS}, CPU, runner=runner)
    assert not verdict.passed and "dq" in verdict.note and "out:" not in verdict.note


def test_written_file_round_trips_and_merges(tmp_path, monkeypatch):
    ms = {SHIPPED: {"tiny-a": 2.0}, FAST: {"tiny-a": 1.0}}
    monkeypatch.setattr(tuner, "accept", lambda *a, **k: acceptance.Acceptance(True, []))
    won = tuner.tune_task(_task(), CPU, TINY[:1], scripted(ms, []), candidates=[SHIPPED, FAST])
    kept = tuner.tune_task(_task("dq"), CPU, TINY[:1], scripted({SHIPPED: {"tiny-a": 1.0}}, []),
                           candidates=[SHIPPED])
    path = tmp_path / "tuned_cache.json"
    old = {"kernel": "dq", "class": "hdim64x64-fp16-causal", "config": tuned_cache.config_to_json(FAST)}
    other = {"kernel": "fwd", "class": "hdim128x128-fp16-causal", "config": tuned_cache.config_to_json(FAST)}
    tuned_cache.write(path, KEY, "sm90", [old, other])
    tuned_cache.write(path, KEY, "sm90", cli._merge(path, KEY, [won, kept]), created="now")
    read = tuned_cache.read(path)
    assert read.key == KEY and read.raw["created"] == "now"
    # this run's win written, the measured-no-better dq entry dropped, the untouched class kept
    assert read.entries == {("fwd", "hdim64x64-fp16-causal"): FAST, ("fwd", "hdim128x128-fp16-causal"): FAST}
    table = after_table([won, kept], KEY)
    assert "hdim64x64-fp16-causal" in table and "2.00x" in table and "(shipped kept)" in table
    assert "coreattn/kernels/tuned/" in share_hint(path, KEY, 1)


def test_without_a_gpu_the_tuner_exits_nonzero_with_a_clear_message(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert "CUDA GPU" in err and "--dry-run --arch sm90" in err
    assert cli.main(["--dims", "1000"]) == 2


@pytest.mark.parametrize("argv, name", [(["--dry-run", "--limit", "0"], "--limit"),
                                        (["--dry-run", "--limit", "-1"], "--limit"),
                                        (["--min-speedup", "0"], "--min-speedup"),
                                        (["--min-speedup", "0.9"], "--min-speedup"),
                                        (["--min-speedup", "nan"], "--min-speedup"),
                                        (["--timeout", "0"], "--timeout"), (["--timeout", "-3"], "--timeout")])
def test_bad_numbers_exit_nonzero_naming_the_option(argv, name, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(name) and "CUDA GPU" not in err


def test_the_whole_run_writes_the_cache_the_launchers_read(tmp_path, monkeypatch, capsys):
    """``python -m coreattn.tune``'s run after its GPU checks, on the CPU: two tiny batches, the
    interpreter's shipped config against one candidate, a scripted timer; then the launchers' lookup
    (as on a GPU with the same key) finds what it wrote."""
    from coreattn.tune import space

    real = space.kernel_candidates
    monkeypatch.setattr(space, "kernel_candidates", lambda target, kernel, cls, limit=None:
                        real(target, kernel, cls, limit) + ([FAST] if kernel == "fwd" else []))
    monkeypatch.setattr(cli.batch_defs, "batches", lambda quick, max_tokens: TINY)
    monkeypatch.setattr(tuner, "accept", lambda *a, **k: acceptance.Acceptance(True, []))
    ms = {SHIPPED: {"tiny-a": 3.0, "tiny-b": 3.0}, FAST: {"tiny-a": 2.0, "tiny-b": 2.5}}
    out = tmp_path / "cache.json"
    args = cli.parse_args(["--dims", "32/16", "--features", "causal", "--kernels", "fwd", "dq", "--out", str(out)])
    assert cli.tune(args, CPU, KEY, scripted(ms, [])) == 0
    printed = capsys.readouterr().out
    assert "2 kernel/class tasks" in printed and "estimated" in printed and "(shipped kept)" in printed
    read = tuned_cache.read(out)
    assert read.key == KEY and read.entries == {("fwd", "hdim32x16-bf16-causal"): FAST}
    assert read.raw["tuner"]["batches"]["fwd hdim32x16-bf16-causal"] == [b.id for b in TINY]
    monkeypatch.setenv(tuned_cache.ENV_CACHE, str(out))
    monkeypatch.setattr(tuned_cache, "device_key", lambda device: KEY)
    tuned_cache.reload()
    try:
        cls = KernelClass(32, 16, "bf16", True)
        assert pick.pick_config("fwd", torch.device("cuda", 0), "sm90", cls, SHIPPED) == FAST._replace(fp_fusion=True)
    finally:
        tuned_cache.reload()


def test_a_candidate_that_faults_is_dropped_and_tuning_goes_on_in_a_fresh_worker(tmp_path, monkeypatch, capsys):
    """The tasks run in worker processes (as on a GPU), here on the CPU under the interpreter with a
    scripted timer and faults injected (test-only: COREATTN_INJECT_FAULT): the forward's 32x16 candidate
    aborts at its kernel launch in the compile check, a dQ candidate raises a CUDA-like error as its
    timing starts. Each is dropped with a note naming the step and the kernel launch, and a fresh
    worker runs that task again without it (the other candidates are timed there). The preprocess
    task's setup (its shipped configs) aborts: that task is recorded as not tuned and the run goes on."""
    from coreattn.selfcheck.faults import INJECT_ENV
    from coreattn.tune import isolated, space

    faulty, slow = AttnConfig(32, 16, 1, 1), AttnConfig(16, 16, 1, 1)
    extra = {"fwd": [faulty, slow], "dq": [slow]}
    real = space.kernel_candidates
    monkeypatch.setattr(space, "kernel_candidates", lambda target, kernel, cls, limit=None:
                        real(target, kernel, cls, limit) + extra.get(kernel, []))
    monkeypatch.setattr(cli.batch_defs, "batches", lambda quick, max_tokens: TINY[:1])
    monkeypatch.setenv(INJECT_ENV, "abort@tune fwd 32x16 compile launch fwd;cuda-error@tune dq 16x16 time;"
                                   "abort@tune preprocess setup")
    ms = {c: {"tiny-a": t} for c, t in ((SHIPPED, 1.0), (faulty, 0.5), (slow, 2.0))}
    log, out = tmp_path / "timed.jsonl", tmp_path / "cache.json"
    args = cli.parse_args(["--dims", "32/16", "--dtype", "fp16", "--kernels", "fwd", "dq", "preprocess",
                           "--out", str(out)])
    timer = {"kind": "scripted", "ms": [[isolated.cfg_json(c), t] for c, t in ms.items()], "log": str(log)}
    assert cli.tune(args, CPU, KEY, None, worker_timer=timer) == 0
    printed = capsys.readouterr().out
    timed = [json.loads(line) for line in log.read_text().splitlines()]
    timed = {(t["kernel"], t["config"]["block_m"], t["config"]["block_n"]) for t in timed}
    assert {("fwd", 16, 32), ("fwd", 16, 16), ("dq", 16, 32)} <= timed  # after the restarts
    assert ("fwd", 32, 16) not in timed  # dropped before its timing
    assert ("fwd 32x16 w1 s1: fault in its compile step: the worker died (killed by SIGABRT); kernel launch: fwd "
            "(_varlen_attn_fwd_kernel) hdim32x16-fp16-causal: BLOCK_M=32 BLOCK_N=16 num_warps=1 num_stages=1") in \
        printed.replace("hdim32x16-fp16-causal: 32x16", "32x16")
    assert ("16x16 w1 s1: fault in its time step: InjectedDeviceFault: CUDA error: an illegal memory access was "
            "encountered (injected by COREATTN_INJECT_FAULT); kernel launch: none traced yet (timings are not "
            "traced)") in printed
    assert "(not tuned: failed)" in printed and "preprocess hdim32x16-fp16-full: task not tuned: the shipped " \
           "config 16 rows w1 (setup step) fault: the worker died (killed by SIGABRT)" in printed
    table = printed[printed.index("Measured on"):]
    assert table.count("(shipped kept)") == 2 and table.count("1 dropped/rejected") == 3
    assert tuned_cache.read(out).entries == {}  # nothing beat the shipped configs
