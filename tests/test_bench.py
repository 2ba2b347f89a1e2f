"""The benchmark suite: its FLOP model against brute force, and a quick CPU run end to end."""

import itertools
import json
import sys

import pytest
import torch

from bench import cli, configs, providers
from coreattn.selfcheck.faults import INJECT_ENV
from bench import context_parallel as cp_bench
from bench import masks as mask_bench
from bench.flops import attention_flops, batch_pairs, visible_pairs
from bench.seqlens import DISTRIBUTIONS, draw_seqlens
from coreattn import masks
from coreattn.layers.checks import VarlenParams
from coreattn.layers.torch_backend import visible_mask


def brute_force_pairs(lq, lk, causal, window, bottom_right):
    left, right = window
    if causal:
        right = 0
    shift = lk - lq if bottom_right else 0
    return sum(1 for i in range(lq) for j in range(lk)
               if (left < 0 or j >= i + shift - left) and (right < 0 or j <= i + shift + right))


LENGTHS = [(0, 5), (1, 1), (1, 7), (7, 1), (5, 5), (6, 13), (13, 6), (17, 17)]
WINDOWS = [(-1, -1), (0, 0), (3, -1), (-1, 2), (2, 4), (0, 5)]


@pytest.mark.parametrize("bottom_right", [True, False], ids=["bottom_right", "top_left"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"win{w[0]}_{w[1]}")
def test_visible_pairs_matches_brute_force(window, causal, bottom_right):
    for lq, lk in LENGTHS:
        assert visible_pairs(lq, lk, causal, window, bottom_right) == brute_force_pairs(lq, lk, causal, window, bottom_right), (lq, lk)


@pytest.mark.parametrize("bottom_right", [True, False], ids=["bottom_right", "top_left"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_batch_pairs_matches_coreattn_mask(causal, bottom_right):
    lens_q, lens_k = [3, 0, 9, 12], [5, 4, 9, 7]
    window = (4, 1)
    right = 0 if causal else window[1]
    vis = visible_mask(torch.tensor(lens_q), torch.tensor(lens_k), max(lens_q), max(lens_k),
                       VarlenParams(1.0, window[0], right, bottom_right))
    assert batch_pairs(lens_q, lens_k, causal, window, bottom_right) == int(vis.sum())


def test_closed_forms():
    assert visible_pairs(4096, 4096, causal=True) == 4096 * 4097 // 2
    assert visible_pairs(4096, 4096) == 4096 ** 2
    pairs = 1000
    assert attention_flops(pairs, 32, 192, 128, "fwd") == 2 * pairs * 320 * 32
    assert attention_flops(pairs, 32, 192, 128, "bwd") == 2 * pairs * (3 * 192 + 2 * 128) * 32
    assert attention_flops(pairs, 1, 64, 64, "fwdbwd") == 2 * pairs * (128 + 320)
    with pytest.raises(ValueError):
        attention_flops(pairs, 1, 64, 64, "backward")


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("total", [16384, 65536])
def test_seqlens_fill_the_batch_and_are_reproducible(dist, total):
    lens = draw_seqlens(dist, total)
    assert sum(lens) == total and min(lens) > 0
    assert lens == draw_seqlens(dist, total)


def _run_quick(tmp_path, capsys):
    assert cli.main(["--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    return json.loads((tmp_path / "results.json").read_text()), capsys.readouterr().out


def test_quick_run_on_cpu(tmp_path, capsys):
    doc, out = _run_quick(tmp_path, capsys)
    meta = doc["meta"]
    assert meta["performance_data"] is False and "NOT PERFORMANCE DATA" in doc["note"]
    assert "NOT PERFORMANCE DATA" in out
    for key in ("device", "torch", "triton", "git_commit", "date"):
        assert meta[key]
    rows = doc["results"]
    assert all(r["status"] in ("ok", "skipped", "error") for r in rows)
    assert all(r.get("reason") for r in rows if r["status"] != "ok")
    assert not [r for r in rows if r["status"] == "error"]

    attn = [r for r in rows if r["kind"] == "attention"]
    ok = {(r["config"], r["mode"], r["provider"]): r for r in attn if r["status"] == "ok"}
    for cfg in ("hdim128x128-gqa4-causal-short-256", "hdim192x128-gqa4-causal-short-256"):
        for mode in ("fwd", "fwdbwd"):
            core = ok[(cfg, mode, "coreattn")]
            assert core["info"]["backend"] == "torch"  # never Triton's interpreter
            assert core["num_seqs"] > 1  # the multi-document paths run before any GPU run
            assert core["ms"] > 0 and core["tflops"] == pytest.approx(core["flops"] / core["ms"] / 1e9)
            sdpa = ok[(cfg, mode, "sdpa-padded")]
            assert sdpa["speedup_of_coreattn"] > 0
            assert sdpa["info"]["mask"] == "[B, 1, S, S] bool" and "gqa" in sdpa["info"]  # masked GQA repeat
    assert ok[("hdim192x128-gqa4-causal-short-256", "fwdbwd", "padded-v")]["info"]["inner"] == "coreattn-torch"
    assert "via coreattn-torch" in out
    assert ("hdim128x128-gqa4-causal-short-256", "fwd", "flex") in ok
    skipped = {r["provider"]: r["reason"] for r in attn if r["status"] == "skipped"}
    assert "megatron-local" in skipped and "torch-varlen" in skipped
    for feature in ("dropout0.1", "sink"):  # the attention options run (on CPU: only that they run)
        for dims in ("128x128", "192x128"):
            cfg = f"hdim{dims}-gqa4-causal-short-256-{feature}"
            assert (cfg, "fwdbwd", "coreattn") in ok
            flex = next(r for r in attn if (r["config"], r["mode"], r["provider"]) == (cfg, "fwd", "flex"))
            assert flex["status"] == "skipped" and feature in flex["reason"]
    assert ("hdim128x128-gqa4-causal-short-256-dropout0.1", "fwdbwd", "sdpa-padded") in ok

    masks = {(r["op"], r["provider"]): r for r in rows if r["kind"] == "masks"}
    for op in ("padding_mask", "cu_seqlens", "position_ids", "unpad", "pad", "dense_4d_causal"):
        assert masks[(op, "loop")]["status"] == "ok"
        assert masks[(op, "vectorized")]["status"] == "ok" and masks[(op, "vectorized")]["speedup_over_loop"] > 0
        assert masks[(op, "triton")]["status"] == "skipped"  # CPU: coreattn runs no Triton kernel
    assert "CUDA only" in masks[("unpad", "triton")]["reason"]
    assert masks[("dense_4d_causal", "torch-dense")]["dense_bytes"] == 8 * 2048 * 2048

    cp = [r for r in rows if r["kind"] == "cp"]
    comm = {(r["config"], r["cp_size"], r["comm"]): r for r in cp if r["op"] == "comm"}
    assert {c for _, c, _ in comm} == set(cp_bench.CP_SIZES)
    hierarchical = {"a2a+p2p-2x2", "a2a+p2p-2x4", "a2a+p2p-4x2"}  # cp 4 and 8
    assert {m for _, c, m in comm if c > 1} == set(cp_bench.COMMS) | hierarchical
    for (_, cp_size, name), r in comm.items():  # a2a skipped where the heads do not split
        assert (r["status"] == "ok" and "not measured" in r["method"]) or (name.startswith("a2a") and
                                                                           f"{name} needs" in r["reason"])
    assert all(r["status"] == "skipped" for r in cp if r["op"] != "comm")  # CPU: nothing timed
    assert "context parallelism, per layer per rank (bytes COMPUTED" in out

    pngs = {p.name for p in tmp_path.glob("*.png")}
    assert {"attention_tflops_bfloat16_fwd.png", "attention_speedup_bfloat16_fwdbwd.png", "masks_ms.png"} <= pngs
    assert all((tmp_path / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_masks_skipped_with_reason_when_module_missing(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "coreattn.masks", None)  # import raises ImportError
    assert cli.main(["--quick", "--device", "cpu", "--what", "masks", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["status"] for r in rows] == ["skipped"] and "coreattn.masks" in rows[0]["reason"]


def test_list_and_filters(capsys):
    assert cli.main(["--list", "--device", "cpu", "--configs", "hdim192x128", "--providers", "coreattn", "flex"]) == 0
    out = capsys.readouterr().out
    assert "hdim192x128-mha-causal-short-256" in out and "hdim64x64" not in out
    assert "provider flex" in out and "provider sdpa-padded" not in out


def test_vectorized_mask_provider_switches_triton_off():
    from coreattn.layers.masks import padding as padding_function

    cuda = torch.device("cuda")  # only asked, never used
    assert padding_function.use_triton(cuda)
    with mask_bench.torch_path():
        assert not padding_function.use_triton(cuda)
    assert padding_function.use_triton(cuda)


def test_megatron_memory_estimate_runs_16k_equal_fwd_on_80gb(monkeypatch):
    monkeypatch.setattr(providers, "memory_budget", lambda device: 80 * 10**9 // 2)
    megatron = providers.PROVIDERS["megatron-local"]
    cfgs = [c for c in configs.attention_configs(on_gpu=True, quick=False)
            if c.dist == "equal" and c.total_tokens == 16384 and c.head_dim_qk == c.head_dim_v]
    assert cfgs
    for cfg in cfgs:
        assert megatron.skip_reason(cfg, "fwd", torch.bfloat16, torch.device("cuda")) is None
        assert "score buffers" in megatron.skip_reason(cfg, "fwdbwd", torch.bfloat16, torch.device("cuda"))


def test_cp_comm_volume_closed_form():
    mla = next(c for c in cp_bench.cp_configs() if c.name == "mla" and c.total_tokens == 131072)
    kv, q, o = 128 * (192 + 128) * 2, 128 * 192 * 2, 128 * 128 * 2  # bf16 bytes per token
    assert mla.id == "cp-mla-hdim192x128-h128kv128-causal-1x128k"
    assert cp_bench.comm_volume(mla, 1, "none", 2)["fwd_bytes"] == 0
    for cp in (2, 4, 8):
        n = 131072 // cp
        ag = cp_bench.comm_volume(mla, cp, "all_gather", 2)
        assert ag["fwd_bytes"] == ag["bwd_bytes"] == (cp - 1) * n * kv and ag["bwd_fallback_bytes"] == 2 * ag["bwd_bytes"]
        assert ag["kv_saved_bytes"] == 131072 * kv == 10 * 2**30  # the whole layer's K/V whatever cp is
        ring = cp_bench.comm_volume(mla, cp, "p2p", 2)
        assert ring["fwd_bytes"] == (cp - 1) * n * kv and ring["bwd_bytes"] == (2 * cp - 1) * n * kv
        assert ring["kv_peak_bytes"] == 2 * n * kv and ring["kv_saved_bytes"] == 0
        a2a = cp_bench.comm_volume(mla, cp, "a2a", 2)
        assert a2a["fwd_bytes"] == a2a["bwd_bytes"] == (cp - 1) * n * (q + kv + o) // cp
        assert a2a["kv_saved_bytes"] == n * kv
    for a, b in ((2, 4), (4, 2)):  # a2a inside the a2a group (inner links), the ring over b ranks (outer links)
        n = 131072 // 8
        hier = cp_bench.comm_volume(mla, 8, f"a2a+p2p-{a}x{b}", 2)
        inner = (a - 1) * n * (q + kv + o) // a
        assert hier["fwd_inner_bytes"] == hier["bwd_inner_bytes"] == inner
        assert hier["fwd_outer_bytes"] == (b - 1) * n * kv and hier["bwd_outer_bytes"] == (2 * b - 1) * n * kv
        assert hier["outer_hop_bytes"] == n * kv and hier["fwd_bytes"] == inner + (b - 1) * n * kv
        assert hier["bwd_bytes"] == inner + (2 * b - 1) * n * kv and hier["kv_saved_bytes"] == n * kv
    assert cp_bench.hierarchical_comms(2) == [] and cp_bench.hierarchical_comms(8) == ["a2a+p2p-2x4", "a2a+p2p-4x2"]
    gqa = cp_bench.CPConfig(heads_q=8, heads_kv=2, total_tokens=4096)
    assert cp_bench.comm_volume(gqa, 8, "a2a", 2)["kv_saved_bytes"] == 512 * 4 * (2 * 256 * 2)  # kv heads x4
    # a2a+p2p-4x2: K/V heads x2 for the a2a group of 4; each ring hop carries n tokens' worth of them
    assert cp_bench.comm_volume(gqa, 8, "a2a+p2p-4x2", 2)["outer_hop_bytes"] == 512 * 4 * (2 * 256 * 2) // 2
    assert "a2a+p2p-4x2 needs Hq divisible by 4" in cp_bench.skip_reason(cp_bench.CPConfig(heads_q=6, heads_kv=2), 8,
                                                                         "a2a+p2p-4x2")
    assert cp_bench.a2a_skip_reason(cp_bench.CPConfig(heads_q=12, heads_kv=4), 8) is not None
    assert cp_bench.a2a_skip_reason(cp_bench.CPConfig(heads_q=16, heads_kv=3), 4) is not None


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cp_rank_pairs_are_balanced_and_cover_the_sequence(causal):
    cfg = cp_bench.CPConfig(total_tokens=96, causal=causal)
    full = visible_pairs(96, 96, causal)
    assert cp_bench.rank_pairs(cfg, 1) == full
    for cp in (2, 4):
        per_rank = [cp_bench.rank_pairs(cfg, cp, r) for r in range(cp)]
        assert sum(per_rank) == full and len(set(per_rank)) == 1


def test_cp_rank_compute_is_rank0_of_full_attention():
    """The timed closure computes rank 0's rows of global causal attention (torch backend on CPU)."""
    cfg = cp_bench.CPConfig(total_tokens=32, heads_q=4, heads_kv=2, head_dim_qk=16, head_dim_v=8)
    fn, (q, k, v) = cp_bench.rank_compute(cfg, 2, torch.float64, torch.device("cpu"), backend="torch")
    out = fn()
    pos = masks.cp_partition_indices(torch.tensor([0, 32], dtype=torch.int32), 2, 0)  # rank 0's global positions
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = torch.einsum("ihd,jhd->hij", q, kk) / 16 ** 0.5
    s = s.masked_fill(torch.arange(32)[None, None, :] > pos[None, :, None], float("-inf"))
    ref = torch.einsum("hij,jhd->ihd", s.softmax(-1), vv)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


@pytest.mark.parametrize("comm,cp,shape,heads,share", [("p2p", 2, (16, 4, 8), 4, 2), ("a2a", 2, (32, 2, 8), 2, 1),
                                                       ("a2a+p2p-2x2", 4, (16, 2, 8), 2, 2)])
def test_cp_rank_compute_other_exchanges_run(comm, cp, shape, heads, share):
    """The ring's steps on a local buffer, a2a's whole sequences and a2a+p2p's ring over its group's
    tokens run forward and backward, with the FLOPs of rank 0's share (a causal cp split gives every
    rank the same pairs)."""
    cfg = cp_bench.CPConfig(total_tokens=32, heads_q=4, heads_kv=2, head_dim_qk=16, head_dim_v=8)
    fn, leaves = cp_bench.rank_compute(cfg, cp, torch.float64, torch.device("cpu"), backend="torch", comm=comm)
    out = fn()
    assert out.shape == shape and torch.isfinite(out).all()
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)
    pairs, flops = cp_bench.rank_flops(cfg, cp, comm)
    assert flops == attention_flops(visible_pairs(32, 32, True), heads, 16, 8, "fwdbwd") // share


def test_layer_section_runs_on_cpu(tmp_path, capsys):
    """End-to-end layer: a tiny transformers decoder layer runs forward + backward with coreattn (its
    position-ids packing, no mask) and SDPA (a dense packed mask); nothing is timed on CPU."""
    pytest.importorskip("transformers")
    argv = ["--quick", "--device", "cpu", "--what", "layer", "--configs", "llama", "--no-plots", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    rows = {r["provider"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert set(rows) == {"coreattn", "sdpa", "flash_attention_2"}
    assert rows["coreattn"]["status"] == rows["sdpa"]["status"] == "ok"
    assert rows["coreattn"]["info"]["mask"] == "none" and rows["coreattn"]["info"]["num_seqs"] > 1
    assert rows["sdpa"]["info"]["mask"] == "[1, 1, 96, 96] bool"
    assert "ms" not in rows["coreattn"] and "not timed on CPU" in rows["coreattn"]["timing"]
    assert rows["flash_attention_2"]["status"] == "skipped" and "CUDA" in rows["flash_attention_2"]["reason"]
    assert "end-to-end layer" in capsys.readouterr().out


def test_cpu_section_smoke(tmp_path, capsys):
    """``--what cpu`` alone: performance data (no NOT PERFORMANCE DATA label), one subprocess per row
    with time and peak RSS, coreattn's ratios to the fastest PyTorch path."""
    argv = ["--what", "cpu", "--quick", "--configs", "hdim64x64-1x256", "--cpu-providers", "coreattn", "sdpa-loop",
            "--modes", "fwdbwd", "--out", str(tmp_path), "--no-plots"]
    assert cli.main(argv) == 0
    doc, out = json.loads((tmp_path / "results.json").read_text()), capsys.readouterr().out
    assert doc["meta"]["performance_data"] is True and doc["note"] is None and "NOT PERFORMANCE DATA" not in out
    assert doc["meta"]["cpu"] and doc["meta"]["torch_threads"] >= 1
    rows = {r["provider"]: r for r in doc["results"] if r["kind"] == "cpu"}
    assert set(rows) == {"coreattn", "sdpa-loop"} and all(r["status"] == "ok" for r in rows.values())
    for r in rows.values():
        assert r["ms"] > 0 and r["peak_rss_mib"] > 0 and r["mode"] == "fwdbwd" and r["threads"] >= 1
    core = rows["coreattn"]
    assert core["best_pytorch"] == "sdpa-loop" and core["time_ratio"] > 0 and core["mem_ratio"] > 0
    assert "CPU attention, performance data for the torch backend" in out and "vs sdpa-loop: time x" in out


def test_cpu_section_matrix_and_skips():
    from bench import cpu_attention as cpu

    cases = {c.id: c for c in cpu.cpu_cases(quick=False)}
    for dims in ("hdim64x64", "hdim192x128"):
        for name in ("1x4k", "1x16k", "uniform-16k", "short-16k"):
            case = cases[f"{dims}-{name}"]
            assert sum(case.seqlens) in (4096, 16384) and case.heads == 8 and case.causal
    assert cases["hdim64x64-1x32k"].memory_check and cases["hdim64x64-1x32k"].seqlens == (32768,)
    big = cases["hdim192x128-1x16k"]
    assert "math path" in cpu.skip_reason(big, "sdpa-loop", "fwdbwd")  # [H, L, L] buffers too big here
    assert cpu.skip_reason(big, "sdpa-loop-padv", "fwdbwd") is None
    assert "no backward on CPU" in cpu.skip_reason(big, "flex", "fwdbwd")
    assert "one sequence" in cpu.skip_reason(big, "sdpa-padded", "fwd")
    assert cpu.skip_reason(cases["hdim64x64-1x32k"], "flex", "fwdbwd").startswith("memory check")


def test_many_short_sequence_rows_build_on_cpu():
    gpu = configs.many_short_configs(on_gpu=True)
    assert {(c.head_dim_qk, c.head_dim_v) for c in gpu} == {(128, 128), (192, 128)}
    assert all(c.causal and c.total_tokens == 1 << 20 for c in gpu)
    assert {len(draw_seqlens(c.dist, c.total_tokens)) for c in gpu} == {4096, 16384, 65536}
    assert set(gpu) <= set(configs.attention_configs(on_gpu=True, quick=False))
    flex = providers.PROVIDERS["flex"].skip_reason(gpu[0], "fwd", torch.bfloat16, torch.device("cuda"))
    assert flex and "create_block_mask" in flex
    from bench.attention import run_attention

    cpu = configs.many_short_configs(on_gpu=False)
    assert set(cpu) <= set(configs.attention_configs(on_gpu=False, quick=False))
    rows = run_attention(cpu, ("fwd", "fwdbwd"), ["coreattn", "flash-attn", "flash-attn3", "torch-varlen"],
                         torch.float32, torch.device("cpu"), quick=True)
    ok = [r for r in rows if r["status"] == "ok"]
    assert {(r["config"], r["mode"]) for r in ok} == {(c.id, m) for c in cpu for m in ("fwd", "fwdbwd")}
    assert all(r["provider"] == "coreattn" and r["num_seqs"] == 1024 // int(r["dist"][4:]) for r in ok)
    assert all(r["status"] == "skipped" and r["reason"] for r in rows if r["provider"] != "coreattn")


def test_timed_rows_record_the_kernel_configs_that_ran():
    """A coreattn row names each Triton kernel's launch config and its source (shipped table or a tuned
    file). The benchmark's coreattn provider runs the torch backend on CPU, so this one runs Triton
    (the interpreter here)."""
    from bench.attention import _measure

    class TritonOnCpu(providers.Coreattn):
        def build(self, inp, cfg, mode):
            from coreattn import varlen_attn

            q, k, v = (t.detach().requires_grad_() for t in (inp.q, inp.k, inp.v))
            fn = lambda: varlen_attn(q, k, v, inp.cu_seqlens, inp.cu_seqlens, inp.max_seqlen,  # noqa: E731
                                     inp.max_seqlen, causal=cfg.causal, backend="triton")
            return providers.Prepared(fn, [q, k, v], {"backend": "triton"})

    cfg = configs.AttnConfig(32, 16, 2, 1, True, "short", 64)
    row = {"flops": 1}
    _measure(row, TritonOnCpu(), cfg, "fwdbwd", torch.float16, torch.device("cpu"), quick=True)
    assert row["status"] == "ok", row
    used = {use["kernel"]: use for use in row["kernel_configs"]}
    assert set(used) == {"fwd", "dkdv", "dq", "preprocess"}
    assert used["fwd"]["class"] == "hdim32x16-fp16-causal-gqa" and used["fwd"]["source"].startswith("shipped table")
    assert json.loads(json.dumps(row["kernel_configs"]))[0]["config"]["block_m"] > 0


def test_a_faulting_provider_is_recorded_and_the_run_goes_on_in_a_fresh_process(tmp_path, monkeypatch, capsys):
    """--isolation process (the default on a GPU) on CPU, with faults injected (test-only: COREATTN_INJECT_FAULT)
    into two units: one worker aborts, one raises a CUDA-like error (its process is then poisoned); each is
    recorded in results.json and the table, and the units after it run in a fresh worker. (A unit that hangs
    is killed at --timeout by the same child-process code the self-check's hang test exercises.)"""
    base = "hdim128x128-gqa4-causal-short-256"
    monkeypatch.setenv(INJECT_ENV, f"abort@bench attention {base} sdpa-padded fwd;"
                                   f"cuda-error@bench attention {base}-dropout0.1 coreattn fwd")
    argv = ["--quick", "--device", "cpu", "--isolation", "process", "--timeout", "300", "--what", "attention",
            "--configs", base, "--providers", "coreattn", "sdpa-padded", "--modes", "fwd", "--no-plots",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["meta"]["isolation"].startswith("worker process")
    rows = {(r["config"], r["provider"]): r for r in doc["results"]}
    assert len(rows) == 6 == len(doc["results"])
    assert rows[(base, "coreattn")]["status"] == "ok" and rows[(f"{base}-dropout0.1", "sdpa-padded")]["status"] == "ok"
    assert rows[(f"{base}-sink", "coreattn")]["status"] == "ok"  # after the last fault: a fresh worker
    assert rows[(f"{base}-sink", "sdpa-padded")]["status"] == "skipped"
    failed = {key: rows[key] for key in [(base, "sdpa-padded"), (f"{base}-dropout0.1", "coreattn")]}
    assert [r["status"] for r in failed.values()] == ["fault", "fault"]
    assert "the worker died (killed by SIGABRT)" in failed[(base, "sdpa-padded")]["reason"]
    assert "illegal memory access" in failed[(f"{base}-dropout0.1", "coreattn")]["reason"]
    for r in failed.values():
        assert r["fault"]["unit"] == f"attention bf16 {r['config']} {r['provider']} fwd" and r["mode"] == "fwd"
        assert r["fault"]["unit"] in out and "kernel launch: none traced yet" in r["reason"]
    assert "faults and timeouts" in out and "FAULT attention bf16 hdim128x128-gqa4-causal-short-256 sdpa-padded" in out


@pytest.mark.parametrize("argv, name", [(["--timeout", "0"], "--timeout"), (["--time-limit", "-5"], "--time-limit"),
                                        (["--isolation", "maybe"], "--isolation")])
def test_bad_isolation_options_exit_2_naming_the_option(argv, name, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2 and name in capsys.readouterr().err


def test_units_past_the_time_limit_are_skipped(tmp_path):
    assert cli.main(["--quick", "--device", "cpu", "--what", "attention", "masks", "--time-limit", "1e-9",
                     "--no-plots", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert rows and all(r["status"] == "skipped" and "--time-limit" in r["reason"] for r in rows)


def test_compile_report_tables_name_the_triton_that_compiled():
    from bench.kernels import format_tables

    row = dict(arch="sm90", triton="3.6.0", kernel="dq", problem="hdim256x256-bf16-causal", block_m=128, block_n=32,
               dk=True, dv=True, num_warps=8, num_stages=2, regs=255, spill_stores=4, spill_loads=4, smem=196608,
               smem_fits=True, mma={"wgmma": 68}, mma_dup=1, hash="a", ctas_per_sm=1, occupancy_limit="regs")
    text = format_tables([row, dict(row, arch="sm80", triton="3.9.0", hash="b")])
    assert "sm90 (compiled for capability 9.0 by Triton 3.6.0;" in text
    assert "sm80 (compiled for capability 8.0 by Triton 3.9.0;" in text


def test_sparse_section_smoke(tmp_path, capsys):
    """``--what sparse`` alone: performance data, the providers of a case timed in one subprocess (the
    ratios to dense attention from it), each row's peak memory from its own, the FLOPs of the useful
    pairs; Megatron's row runs where megatron-core >= 0.19 imports, else is skipped with the reason."""
    argv = ["--what", "sparse", "--quick", "--configs", "dsa-absorbed", "T256", "--sparse-providers", "coreattn-torch",
            "megatron",
            "dense", "--modes", "fwdbwd", "--out", str(tmp_path), "--no-plots"]
    assert cli.main(argv) == 0
    doc, out = json.loads((tmp_path / "results.json").read_text()), capsys.readouterr().out
    assert doc["meta"]["performance_data"] is True and "NOT PERFORMANCE DATA" not in out
    rows = {r["provider"]: r for r in doc["results"] if r["kind"] == "sparse"}
    core = rows["coreattn-torch"]
    assert core["status"] == "ok" and core["ms"] > 0 and core["peak_mib"] > 0 and core["extra_mib"] is not None
    assert core["pairs"] == 64 * 65 // 2 + (256 - 64) * 64 and core["gflops"] > 0
    assert core["regime"] == "sparse" and core["x_dense"] == core["ms"] / rows["dense"]["ms"]
    assert rows["megatron"]["status"] == "ok" or "megatron-core >= 0.19" in rows["megatron"]["reason"]
    assert "sparse (top-k) attention" in out


def test_sparse_section_indices_and_pairs():
    from bench import sparse as sparse_bench

    rows = sparse_bench.topk_rows(10, 4, "cpu")
    for i, row in enumerate(rows.tolist()):
        named = [j for j in row if j >= 0]
        assert len(set(named)) == len(named) == min(4, i + 1) and all(0 <= j <= i for j in named)
    case = sparse_bench.SparseBenchCase(10, 4, 2)
    assert sparse_bench.visible_pairs(case) == sum(min(4, i + 1) for i in range(10))
    overlap = sparse_bench.topk_rows(40, 8, "cpu", "overlap")
    for i, row in enumerate(overlap.tolist()):
        named = [j for j in row if j >= 0]
        assert len(set(named)) == len(named) and all(0 <= j <= i for j in named)
        assert set(range(max(0, i - 3), i + 1)) <= set(named)  # its K/2 most recent keys
    assert sparse_bench.visible_pairs(sparse_bench.SparseBenchCase(40, 8, 2, "overlap")) == int((overlap >= 0).sum())
    cases = [c for c in sparse_bench.sparse_cases(quick=False) if not c.v4 and not c.blocks]
    assert {c.tokens for c in cases} == {1024, 2048, 4096, 8192} and {c.topk for c in cases} == {2048, 1024, 512, 256}
    assert {(c.heads, c.tokens, c.topk, c.regime) for c in cases} >= {(16, 1024, 2048, "full"), (4, 1024, 2048, "full"),
                                                                     (4, 2048, 2048, "full"), (16, 2048, 256, "sparse")}
    assert {c.tokens for c in sparse_bench.sparse_cases(quick=False) if c.v4} == {4096, 8192, 16384, 32768}


def test_sparse_section_v4_rows_compute_what_transformers_eager_computes():
    """The v4-csa case: coreattn's call (window as key_window, compressed entries as indices after the raw
    keys, sinks as softmax_offset) and transformers' DeepSeek-V4 eager attention on its layer's mask give
    the same output and gradients (float64); its pairs count the window and the complete entries."""
    pytest.importorskip("transformers.models.deepseek_v4")
    from bench import sparse as sparse_bench

    case = sparse_bench.SparseBenchCase(300, 16, 2, "v4-csa")
    assert sparse_bench.visible_pairs(case) == sum(min(i + 1, 128) + min(16, (i + 1) // 4) for i in range(300))
    assert sparse_bench.skip_reason(case, "hf-eager", "fwdbwd", torch.device("cpu")) is None
    assert "no DeepSeek-V4" in sparse_bench.skip_reason(case, "megatron", "fwdbwd", torch.device("cpu"))
    assert "v4-csa" in sparse_bench.skip_reason(case._replace(pattern="spread"), "hf-eager", "fwd", torch.device("cpu"))
    entries = sparse_bench.v4_entries(300, 16, "cpu")
    for i, row in enumerate(entries.tolist()):
        named = [w for w in row if w >= 0]
        assert len(set(named)) == len(named) == min(16, (i + 1) // 4) and all(w < (i + 1) // 4 for w in named)
    results = []
    for provider in ("coreattn-torch", "hf-eager"):
        fn, leaves = sparse_bench.build(case, provider, torch.device("cpu"), torch.float64)
        out = fn()
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape))
        results.append([out.detach()] + [x.grad for x in leaves])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_sparse_section_block_rows_compute_what_minimax_eager_computes():
    """The blocks case (MiniMax-M3's block-sparse attention): coreattn's block mode and transformers'
    MiniMax-M3 eager path (its block mask, its eager attention) give the same output and gradients
    (float64 inputs; eager's softmax runs in float32 whatever the dtype, hence float32's tolerance); each
    token names its own block and distinct earlier ones; pairs count their causal keys."""
    pytest.importorskip("transformers.models.minimax_m3_vl")
    from bench import sparse as sparse_bench

    case = sparse_bench.SparseBenchCase(700, 3, 8, "blocks")
    rows = sparse_bench.block_rows(700, 3, "cpu")
    for i, row in enumerate(rows.tolist()):
        named = [c for c in row if c >= 0]
        assert named[0] == i // 128 and len(set(named)) == len(named) == min(3, i // 128 + 1)
    assert sparse_bench.visible_pairs(case) == sum(
        len({j for c in row if c >= 0 for j in range(c * 128, (c + 1) * 128) if j <= i})
        for i, row in enumerate(rows.tolist()))
    assert sparse_bench.skip_reason(case, "hf-eager", "fwdbwd", torch.device("cpu")) is None
    assert "block-sparse" in sparse_bench.skip_reason(case, "megatron", "fwdbwd", torch.device("cpu"))
    assert {c.tokens for c in sparse_bench.sparse_cases(quick=False) if c.blocks} == {2048, 4096, 8192}
    results = []
    for provider in ("coreattn-torch", "hf-eager"):
        fn, leaves = sparse_bench.build(case, provider, torch.device("cpu"), torch.float64)
        out = fn()
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape))
        results.append([out.detach()] + [x.grad for x in leaves])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_cpu_timing_warms_up_before_timing():
    """The first calls of a process cost more (imports, the first custom-op call, heap growth): the CPU
    timer calls a function several times before timing it, so a row's figure is not its warm-up
    (``--quick`` timed its first coreattn forward at 43.7 ms against 8.6 ms for forward + backward)."""
    import time

    from bench.timing import WARMUP_CALLS, time_cpu

    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.05 if len(calls) <= WARMUP_CALLS else 0.0)  # slow until warmed up

    timing = time_cpu(fn, quick=True)
    assert timing.ms < 25 and len(calls) >= WARMUP_CALLS + 3 and "warm-up calls" in timing.method


def test_compile_report_tables_show_i32_stride_offsets():
    from bench.kernels import format_tables

    row = dict(arch="sm90", triton="3.9.0", kernel="fwd", problem="hdim128x128-bf16-causal", block_m=128, block_n=64,
               dk=True, dv=True, num_warps=8, num_stages=3, regs=250, spill_stores=0, spill_loads=0, smem=131072,
               smem_fits=True, mma={"wgmma": 24}, mma_dup=1, hash="a", ctas_per_sm=1, occupancy_limit="regs",
               pipeline_hazards=0, async_loads=18, i32_offsets=8, int64_lanes=False)
    text = format_tables([row, dict(row, hash="b", regs=249, i32_offsets=0, int64_lanes=True),
                          {k: v for k, v in dict(row, hash="c").items() if k not in ("i32_offsets", "int64_lanes")}])
    lines = [line.rstrip() for line in text.splitlines()]
    assert lines[1].split()[-3:] == ["hazards", "i32", "offs"]
    assert lines[3].endswith(" 8") and lines[4].endswith(" 0 (i64)") and lines[5].endswith(" -")
    assert "i32 offs = " in text


def test_bias_section_smoke(tmp_path, capsys):
    """``--what bias`` alone: coreattn with and without the bias and eager attention with the materialized
    bias timed in one subprocess (the ratios from it), each row's memory from its own; FlexAttention's
    backward skipped on CPU with the reason."""
    argv = ["--what", "bias", "--quick", "--configs", "t5", "--bias-providers", "coreattn", "coreattn-nobias", "eager",
            "flex", "--modes", "fwdbwd", "--out", str(tmp_path), "--no-plots"]
    assert cli.main(argv) == 0
    doc, out = json.loads((tmp_path / "results.json").read_text()), capsys.readouterr().out
    rows = {r["provider"]: r for r in doc["results"] if r["kind"] == "bias"}
    core = rows["coreattn"]
    assert core["status"] == "ok" and core["ms"] > 0 and core["extra_mib"] is not None
    assert core["x_eager"] == core["ms"] / rows["eager"]["ms"] and core["x_nobias"] == core["ms"] / rows[
        "coreattn-nobias"]["ms"]
    assert rows["flex"]["status"] == "skipped" and "backward on CPU" in rows["flex"]["reason"]
    assert "attention with a relative bias" in out and doc["meta"]["performance_data"] is True


def test_bias_section_eager_rows_compute_what_coreattn_computes():
    """The eager provider's materialized bias is the one coreattn computes in registers."""
    import torch

    from bench import bias as bias_bench

    for kind in ("rel", "t5"):
        case = bias_bench.BiasBenchCase(kind, 40, 2)
        outs = [bias_bench.build(case, p, torch.device("cpu"), torch.float32)[0]() for p in ("coreattn", "eager")]
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
