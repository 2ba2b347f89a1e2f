"""megatron-core models with context_parallel_size 2 (gloo, CPU) give the same logits, loss and
parameter gradients as context_parallel_size 1, for every cp_comm_type CoreAttention runs, and
with context_parallel_size 4 for cp_comm_type "a2a+p2p" with hierarchical_context_parallel_sizes
[2, 2] (Megatron's own hierarchical groups from initialize_model_parallel).

A GQA GPTModel on packed (thd) and sbhd batches and an MLA GPTModel (q/k 24, v 12) on thd, each
built with ``TransformerConfig.cp_comm_type`` = "p2p", "all_gather", "a2a" and None (Megatron's
default, run as p2p), plus a GPT whose two layers run different exchanges. The models run in
float64 on the torch backend, so both sides agree to rounding; the CP side is the real thing:
Megatron's own process groups, rotary embeddings (thd) and zig-zag layout, CoreAttention
exchanging K/V (or heads) over the cp group. The sbhd model uses learned absolute positions:
megatron-core 0.16.1's sbhd rotary slicing under CP pins memory, which needs an accelerator. Each
rank's inputs are cut with coreattn.masks' partition helpers (the same layout as Megatron's
get_batch_on_this_cp_rank / TE's thd partitioning).

megatron-core 0.16.1 cannot take a per-layer list: TransformerLayer indexes
``config.cp_comm_type[self.layer_number]`` with the 1-based layer number (IndexError on the last
layer), so the mixed model sets each layer's exchange on its CoreAttention after the build.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("megatron.core")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig  # noqa: E402

from coreattn import masks  # noqa: E402
from coreattn.adapters.megatron import use_coreattn  # noqa: E402
from megatron_env import VOCAB, build_gpt, megatron_cpu, megatron_cpu_shims  # noqa: E402,F401

CP = 2
HIER_SIZES = [2, 2]  # the a2a+p2p run: hierarchical_context_parallel_sizes, cp 4
REAL, PADDED = (5, 11, 7), (8, 16, 8)  # thd: each padded length a multiple of 2 * cp (cp 2 and 4)
SBHD_B, SBHD_S = 2, 8
COMM_TYPES = ("p2p", "all_gather", "a2a", None)
MIXED = ("a2a", "p2p")  # the exchange of each layer of the mixed model


def config(cp: int, kind: str, comm: str | None = None) -> TransformerConfig:
    common = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, attention_dropout=0.0,
                  hidden_dropout=0.0, use_cpu_initialization=True, context_parallel_size=cp, cp_comm_type=comm)
    if comm == "a2a+p2p":
        common.update(hierarchical_context_parallel_sizes=HIER_SIZES)
    if kind == "mla":
        return MLATransformerConfig(q_lora_rank=None, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
                                    v_head_dim=12, normalization="RMSNorm", rope_type="rope", **common)
    return TransformerConfig(num_query_groups=2, kv_channels=16, **common)


def spec(kind: str):
    if kind == "mla":
        return use_coreattn(get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm"),
                            backend="torch")
    return use_coreattn(get_gpt_layer_local_spec(), backend="torch")


# model kind -> (batch layout, position embedding)
KINDS = dict(gpt_thd=("thd", "rope"), gpt_sbhd=("sbhd", "learned_absolute"), mla_thd=("thd", "rope"))


def model(cp: int, kind: str, comm: str | None = None):
    layout, pos = KINDS[kind]
    return build_gpt(config(cp, kind.split("_")[0], comm), spec(kind.split("_")[0]), position_embedding_type=pos)


def batches() -> dict:
    gen = torch.Generator().manual_seed(0)
    total = sum(PADDED)
    cu = torch.tensor([0] + torch.tensor(REAL).cumsum(0).tolist(), dtype=torch.int32)
    cu_pad = torch.tensor([0] + torch.tensor(PADDED).cumsum(0).tolist(), dtype=torch.int32)
    real = torch.zeros(total, dtype=torch.bool)
    for start, n in zip(cu_pad[:-1].tolist(), REAL):
        real[start:start + n] = True
    weight = torch.randn(1, total, VOCAB, generator=gen, dtype=torch.float64) * real[None, :, None]
    return dict(
        thd=dict(ids=torch.randint(0, VOCAB, (1, total), generator=gen),
                 pos=torch.cat([torch.arange(n) for n in PADDED])[None], weight=weight, cu=cu, cu_pad=cu_pad),
        sbhd=dict(ids=torch.randint(0, VOCAB, (SBHD_B, SBHD_S), generator=gen),
                  pos=torch.arange(SBHD_S).expand(SBHD_B, SBHD_S),
                  weight=torch.randn(SBHD_B, SBHD_S, VOCAB, generator=gen, dtype=torch.float64)),
    )


def thd_params(b: dict) -> PackedSeqParams:
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=b["cu"], cu_seqlens_kv=b["cu"],
                           cu_seqlens_q_padded=b["cu_pad"], cu_seqlens_kv_padded=b["cu_pad"],
                           max_seqlen_q=max(PADDED), max_seqlen_kv=max(PADDED))


def run(model, layout: str, b: dict, index: torch.Tensor | None = None):
    """Logits (this rank's tokens), the loss and parameter gradients of a fixed linear loss."""
    ids, pos, weight = b["ids"], b["pos"], b["weight"]
    if index is not None:  # this CP rank's tokens, along the sequence dim
        ids, pos, weight = ids[:, index], pos[:, index], weight[:, index]
    model.zero_grad(set_to_none=True)
    extra = dict(packed_seq_params=thd_params(b)) if layout == "thd" else {}
    logits = model(ids, pos, attention_mask=None, **extra)
    loss = (logits * weight).sum()
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _runs(world: int):
    """(result key, model kind, cp_comm_type in the config, per-layer override or None)."""
    if world != CP:  # the hierarchical run
        return [((kind, "a2a+p2p"), kind, "a2a+p2p", None) for kind in KINDS]
    runs = [((kind, comm), kind, comm, None) for kind in KINDS for comm in COMM_TYPES]
    return runs + [(("gpt_thd", "mixed"), "gpt_thd", None, MIXED)]


def _worker(rank: int, world: int, init_file: str, out_dir: str, state_file: str) -> None:
    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: "cpu"  # the test-only CPU shims, in this child process
    import megatron.core.transformer.multi_latent_attention as mla

    if not isinstance(getattr(mla, "TELinear", None), type):
        mla.TELinear = type("NoTELinear", (), {})
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        hier = dict(hierarchical_context_parallel_sizes=HIER_SIZES) if world != CP else {}
        parallel_state.initialize_model_parallel(context_parallel_size=world, **hier)
        cp_group = parallel_state.get_context_parallel_group()
        states = torch.load(state_file)
        results = {}
        for key, kind, comm, per_layer in _runs(world):
            m = model(world, kind, comm)
            attns = [layer.self_attention.core_attention for layer in m.decoder.layers]
            built = [a.cp_comm_type for a in attns]
            if per_layer is not None:
                for attn, value in zip(attns, per_layer):
                    attn.cp_comm_type = value
            m.load_state_dict(states[kind], strict=False)
            m.double()
            layout = KINDS[kind][0]
            b = batches()[layout]
            if layout == "thd":
                index = masks.cp_partition_indices(b["cu_pad"], world, rank, total=sum(PADDED))
            else:
                index = masks.cp_partition_indices_sbhd(SBHD_S, world, rank)
            logits, loss, grads = run(m, layout, b, index)
            dist.all_reduce(loss, group=cp_group)
            for g in grads.values():  # what Megatron's DDP does over the data x context parallel group
                dist.all_reduce(g, group=cp_group)
            results[key] = dict(index=index, logits=logits, loss=loss, grads=grads, built=built)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.usefixtures("megatron_cpu", "megatron_cpu_shims")
@pytest.mark.parametrize("world", [CP, HIER_SIZES[0] * HIER_SIZES[1]], ids=["cp2", "cp4-a2a+p2p-2x2"])
def test_models_under_context_parallel_match_cp1(tmp_path, world):
    ref_models = {kind: model(1, kind) for kind in KINDS}
    state_file = str(tmp_path / "state.pt")
    torch.save({kind: m.state_dict() for kind, m in ref_models.items()}, state_file)
    ref = {kind: run(m.double(), KINDS[kind][0], batches()[KINDS[kind][0]]) for kind, m in ref_models.items()}

    mp.spawn(_worker, args=(world, str(tmp_path / "init"), str(tmp_path), state_file), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    tol = dict(rtol=1e-9, atol=1e-11)
    for key, kind, comm, per_layer in _runs(world):
        ref_logits, ref_loss, ref_grads = ref[kind]
        # Megatron hands each layer its cp_comm_type; None runs as p2p
        assert all(r[key]["built"] == [comm or "p2p"] * 2 for r in ranks), (key, ranks[0][key]["built"])
        logits = torch.empty_like(ref_logits)
        for r in ranks:
            logits[:, r[key]["index"]] = r[key]["logits"]
        torch.testing.assert_close(logits, ref_logits, **tol, msg=f"{key} logits")
        for r in ranks:
            torch.testing.assert_close(r[key]["loss"], ref_loss, **tol, msg=f"{key} loss")
            for name, grad in ref_grads.items():
                torch.testing.assert_close(r[key]["grads"][name], grad, **tol, msg=f"{key} grad {name}")
