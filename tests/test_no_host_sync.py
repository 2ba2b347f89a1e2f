"""No host read of a device tensor on an attention path (tests/sync_detector.py).

Every public path of tests/public_paths.py (``varlen_attn`` and the flash-attn drop-in with
seqused, 0-dim max_seqlen tensors, dropout, sinks, max logits and windows; ``padded_attn`` with
spans and keep masks in bshd and sbhd; the position-ids layout; the transformers attention
function; Megatron's ``CoreAttention`` in sbhd and thd; ``cp_attn`` on a one-rank group; the mask
utilities given their sync-free arguments) runs forward and backward on the Triton kernels (the
interpreter) with ``COREATTN_VALIDATE=0``, which makes coreattn read on CPU what it reads on a
device, and with every host-read entry point raising when coreattn's own code calls it. The GPU
side, ``torch.cuda.set_sync_debug_mode("error")`` over the same paths, is in tests/test_gpu.py.
"""

import os
import tempfile

import pytest
import torch

from attn_cases import KERNEL_DEVICE
from public_paths import PATHS
from sync_detector import HostRead, no_host_reads

pytestmark = pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="the CPU detector; tests/test_gpu.py checks a GPU")


def test_the_detector_catches_a_read(monkeypatch):
    """The detector itself: a coreattn frame that reads a value raises; the test's own reads do not."""
    from coreattn.layers import checks

    cu = torch.tensor([0, 5, 19], dtype=torch.int32)
    with no_host_reads(monkeypatch):
        with pytest.raises(HostRead, match="Tensor.tolist called by coreattn.layers.checks"):
            checks.check_cu_seqlens_values("cu_seqlens_q", cu, 19, "max_seqlen_q", 14)
        assert cu.tolist()[-1] == 19
        assert not checks.reads_values(cu)


@pytest.fixture(scope="module")
def one_rank_group():
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        fd, path = tempfile.mkstemp(prefix="coreattn-gloo-")
        os.close(fd)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()
        os.unlink(path)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_public_path_reads_nothing_on_the_host(monkeypatch, one_rank_group, path):
    with no_host_reads(monkeypatch):
        PATHS[path]("cpu", one_rank_group)
