"""A megatron-core GPTModel with context_parallel_size 2 (gloo, CPU) gives the same logits, loss and
parameter gradients as context_parallel_size 1 on the same packed (thd) and sbhd batches.

The model runs in float64 on the torch backend, so both sides agree to rounding; the CP side is
the real thing: Megatron's own process groups, rotary embeddings (thd) and zig-zag layout,
CoreAttention all-gathering K/V over the cp group. The sbhd model uses learned absolute positions:
megatron-core 0.16.1's sbhd rotary slicing under CP pins memory, which needs an accelerator. Each rank's inputs are cut with coreattn.masks' partition
helpers (the same layout as Megatron's get_batch_on_this_cp_rank / TE's thd partitioning).
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
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from coreattn import masks  # noqa: E402
from coreattn.adapters.megatron import use_coreattn  # noqa: E402
from megatron_env import VOCAB, build_gpt, megatron_cpu, megatron_cpu_shims  # noqa: E402,F401

CP = 2
REAL, PADDED = (5, 11, 7), (8, 12, 8)  # thd: each padded length a multiple of 2 * CP
SBHD_B, SBHD_S = 2, 8


def config(cp: int) -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                             ffn_hidden_size=96, attention_dropout=0.0, hidden_dropout=0.0,
                             use_cpu_initialization=True, context_parallel_size=cp)


def spec():
    return use_coreattn(get_gpt_layer_local_spec(), backend="torch")


POSITIONS = dict(thd="rope", sbhd="learned_absolute")


def models(cp: int) -> dict:
    return {layout: build_gpt(config(cp), spec(), position_embedding_type=pos) for layout, pos in POSITIONS.items()}


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


def _worker(rank: int, world: int, init_file: str, out_dir: str, state_file: str) -> None:
    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: "cpu"  # the test-only CPU shim, in this child process
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(context_parallel_size=world)
        cp_group = parallel_state.get_context_parallel_group()
        states = torch.load(state_file)
        results = {}
        for layout, model in models(world).items():
            model.load_state_dict(states[layout], strict=False)
            model.double()
            b = batches()[layout]
            if layout == "thd":
                index = masks.cp_partition_indices(b["cu_pad"], world, rank, total=sum(PADDED))
            else:
                index = masks.cp_partition_indices_sbhd(SBHD_S, world, rank)
            logits, loss, grads = run(model, layout, b, index)
            dist.all_reduce(loss, group=cp_group)
            for g in grads.values():  # what Megatron's DDP does over the data x context parallel group
                dist.all_reduce(g, group=cp_group)
            results[layout] = dict(index=index, logits=logits, loss=loss, grads=grads)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.usefixtures("megatron_cpu", "megatron_cpu_shims")
def test_gpt_context_parallel_matches_cp1(tmp_path):
    ref_models = models(1)
    state_file = str(tmp_path / "state.pt")
    torch.save({layout: m.state_dict() for layout, m in ref_models.items()}, state_file)
    ref = {layout: run(m.double(), layout, batches()[layout]) for layout, m in ref_models.items()}

    mp.spawn(_worker, args=(CP, str(tmp_path / "init"), str(tmp_path), state_file), nprocs=CP, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(CP)]
    tol = dict(rtol=1e-9, atol=1e-11)
    for layout, (ref_logits, ref_loss, ref_grads) in ref.items():
        logits = torch.empty_like(ref_logits)
        for r in ranks:
            logits[:, r[layout]["index"]] = r[layout]["logits"]
        torch.testing.assert_close(logits, ref_logits, **tol, msg=f"{layout} logits")
        for r in ranks:
            torch.testing.assert_close(r[layout]["loss"], ref_loss, **tol, msg=f"{layout} loss")
            for name, grad in ref_grads.items():
                torch.testing.assert_close(r[layout]["grads"][name], grad, **tol, msg=f"{layout} grad {name}")
