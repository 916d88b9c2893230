"""torch.distributed.checkpoint save/load through the daemon (UcpdStorageWriter/Reader):
two gloo ranks save DTensor shards with DCP; one process loads whole tensors with DCP, and
two ranks load again with another sharding."""

from __future__ import annotations

import pytest
import torch

from helpers import ranks

pytestmark = pytest.mark.slow


def full() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(8, 6, generator=g), "b": torch.randn(6, generator=g)}


def save_ranks(rank, world, rendezvous, q, run_dir):
    ranks.init_gloo(rank, world, rendezvous)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ucpd_client import Checkpointer
    from ucpd_client.dcp import UcpdStorageWriter

    mesh = init_device_mesh("cpu", (world,))
    f = full()
    sd = {"w": distribute_tensor(f["w"], mesh, [Shard(0)]), "b": distribute_tensor(f["b"], mesh, [Replicate()]), "epoch": 4}
    with Checkpointer(run_dir, embedded=False) as ckpt:
        dcp.save(sd, storage_writer=UcpdStorageWriter(ckpt, step=5))
    q.put((rank, True))


def load_ranks(rank, world, rendezvous, q, run_dir):
    ranks.init_gloo(rank, world, rendezvous)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ucpd_client import Checkpointer
    from ucpd_client.dcp import UcpdStorageReader

    mesh = init_device_mesh("cpu", (world,))
    sd = {"w": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)]), "b": distribute_tensor(torch.zeros(6), mesh, [Shard(0)]), "epoch": 0}
    with Checkpointer(run_dir, embedded=False) as ckpt:
        dcp.load(sd, storage_reader=UcpdStorageReader(ckpt))
    f = full()
    q.put((rank, torch.equal(sd["w"].full_tensor(), f["w"]) and torch.equal(sd["b"].full_tensor(), f["b"]) and sd["epoch"] == 4))


def test_dcp_save_and_load_through_the_daemon(daemon):
    procs, _ = ranks.spawn(save_ranks, 2, daemon.run_dir)
    ranks.join(procs)

    import torch.distributed.checkpoint as dcp

    from ucpd_client import Checkpointer
    from ucpd_client.dcp import UcpdStorageReader

    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        assert ckpt.latest() == 5
        sd = {"w": torch.zeros(8, 6), "b": torch.zeros(6), "epoch": 0}
        dcp.load(sd, storage_reader=UcpdStorageReader(ckpt), checkpoint_id="step-5")
    f = full()
    assert torch.equal(sd["w"], f["w"]) and torch.equal(sd["b"], f["b"]) and sd["epoch"] == 4

    procs, results = ranks.spawn(load_ranks, 2, daemon.run_dir)
    ranks.join(procs)
    assert all(ok for _, ok in results)
