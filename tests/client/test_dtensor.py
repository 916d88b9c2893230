"""DTensors bring their own placement: two gloo ranks snapshot DTensor shards on a device
mesh and restore them into fresh DTensors; one plain rank then restores the whole tensors."""

from __future__ import annotations

import pytest
import torch

from helpers import ranks

pytestmark = pytest.mark.slow


def full(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(10, 6, generator=g), "b": torch.randn(6, generator=g), "r": torch.randn(3, generator=g)}


def dtensor_ranks(rank, world, rendezvous, q, run_dir):
    ranks.init_gloo(rank, world, rendezvous)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ucpd_client import Checkpointer

    mesh = init_device_mesh("cpu", (world,))
    f = full(1)
    state = {
        "w": distribute_tensor(f["w"], mesh, [Shard(0)]),  # 10 rows over 2 ranks
        "b": distribute_tensor(f["b"], mesh, [Shard(0)]),
        "r": distribute_tensor(f["r"], mesh, [Replicate()]),
    }
    with Checkpointer(run_dir, embedded=False) as ckpt:
        ckpt.snapshot(1, state).wait()
        # restore into fresh DTensors of the same mesh
        back = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)] if k != "r" else [Replicate()]) for k, v in f.items()}
        ckpt.restore(back)
    ok = all(torch.equal(back[k].full_tensor(), f[k]) for k in f)
    q.put((rank, ok))


def test_dtensor_shards_snapshot_and_restore_to_a_plain_rank(daemon):
    procs, results = ranks.spawn(dtensor_ranks, 2, daemon.run_dir)
    ranks.join(procs)
    assert all(ok for _, ok in results)
    from ucpd_client import Checkpointer

    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        target = {k: torch.zeros_like(v) for k, v in full(1).items()}
        assert ckpt.restore(target) == 1
    for k, v in full(1).items():
        assert torch.equal(target[k], v), k
