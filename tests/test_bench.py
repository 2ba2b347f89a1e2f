"""The benchmark suite: its FLOP model against brute force, and a quick CPU run end to end."""

import itertools
import json
import sys

import pytest
import torch

from bench import cli, configs, providers
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

    masks = {(r["op"], r["provider"]): r for r in rows if r["kind"] == "masks"}
    for op in ("padding_mask", "cu_seqlens", "position_ids", "unpad", "pad", "dense_4d_causal"):
        assert masks[(op, "loop")]["status"] == "ok"
        assert masks[(op, "vectorized")]["status"] == "ok" and masks[(op, "vectorized")]["speedup_over_loop"] > 0
        assert masks[(op, "triton")]["status"] == "skipped"  # CPU: coreattn runs no Triton kernel
    assert "CUDA only" in masks[("unpad", "triton")]["reason"]
    assert masks[("dense_4d_causal", "torch-dense")]["dense_bytes"] == 8 * 2048 * 2048

    cp = [r for r in rows if r["kind"] == "cp"]
    comm = {r["cp_size"]: r for r in cp if r["op"] == "comm"}
    assert set(comm) == {1, 2, 4} and all(r["status"] == "ok" and "not measured" in r["method"] for r in comm.values())
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
    from coreattn.layers import masks as layer_masks, padding_function

    cuda = torch.device("cuda")  # only asked, never used
    assert padding_function.use_triton(cuda) and layer_masks.use_triton(cuda)
    with mask_bench.torch_path():
        assert not padding_function.use_triton(cuda) and not layer_masks.use_triton(cuda)
    assert padding_function.use_triton(cuda) and layer_masks.use_triton(cuda)


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
    cfg = cp_bench.CPConfig()  # 64k tokens, Hkv 8, Dqk 192, Dv 128
    per_token = 8 * (192 + 128) * 2  # bf16
    for cp in (1, 2, 4):
        vol = cp_bench.comm_volume(cfg, cp, 2)
        ring = (cp - 1) * (65536 // cp) * per_token
        assert vol["allgather_kv_bytes"] == vol["reducescatter_dkv_bytes"] == ring
        assert vol["allreduce_fallback_dkv_bytes"] == 2 * ring
        assert vol["kv_held_bytes"] == 65536 * per_token
    assert cp_bench.comm_volume(cfg, 2, 2)["allgather_kv_bytes"] == 160 * 2**20


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
