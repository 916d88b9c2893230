"""``torch.distributed.checkpoint.async_save`` through ``UcpdStorageWriter``: with DCP's default
thread executor the save completes in the background and the trainer may change its tensors as
soon as ``async_save`` returns; the process executor, which would pickle the writer into a
checkpoint process, is refused with a typed error that says what to use instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import ranks

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))


def full() -> dict:
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(9, 6, generator=g), "b": torch.randn(6, generator=g)}


def async_save_ranks(rank, world, rendezvous, q, run_dir):
    ranks.init_gloo(rank, world, rendezvous)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ucpd_client import Checkpointer
    from ucpd_client.dcp import UcpdStorageWriter

    mesh = init_device_mesh("cpu", (world,))
    f = full()
    sd = {"w": distribute_tensor(f["w"], mesh, [Shard(0)]), "b": distribute_tensor(f["b"], mesh, [Replicate()]), "epoch": 3}
    with Checkpointer(run_dir, embedded=False) as ckpt:
        writer = UcpdStorageWriter(ckpt, step=7)
        future = dcp.async_save(sd, storage_writer=writer)
        sd["w"].to_local().fill_(-1.0)  # staged already: the next step may change the tensors
        sd["b"].to_local().fill_(-1.0)
        future.result(timeout=60)
        committed = ckpt.latest()
    q.put((rank, committed))


def process_executor_main(run_dir: str, rendezvous: str) -> None:
    """One rank (its own process: DCP's checkpoint process must be its child, and the test's
    spawned ranks are daemonic) that asks for a process-based async save; prints the outcome."""
    import json

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from ucpd_client import Checkpointer
    from ucpd_client.dcp import UcpdStorageWriter
    from ucpd_client.errors import AsyncSaveUnsupported

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    with Checkpointer(run_dir, embedded=False) as ckpt:
        future = dcp.async_save(
            {"w": torch.ones(3)}, storage_writer=UcpdStorageWriter(ckpt, step=1),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        try:
            future.result(timeout=120)
            raised = None
        except AsyncSaveUnsupported as exc:
            raised = str(exc)
        print(json.dumps({"raised": raised, "latest": ckpt.latest()}))
    dist.destroy_process_group()


def test_dcp_async_save_commits_in_the_background_and_the_tensors_may_change_once_it_returns(daemon):
    procs, messages = ranks.spawn(async_save_ranks, 2, daemon.run_dir)
    ranks.join(procs)
    assert [step for _, step in messages] == [7, 7]

    import torch.distributed.checkpoint as dcp

    from ucpd_client import Checkpointer
    from ucpd_client.dcp import UcpdStorageReader

    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        sd = {"w": torch.zeros(9, 6), "b": torch.zeros(6), "epoch": 0}
        dcp.load(sd, storage_reader=UcpdStorageReader(ckpt))
    f = full()
    assert torch.equal(sd["w"], f["w"]) and torch.equal(sd["b"], f["b"]) and sd["epoch"] == 3


def test_dcp_async_save_in_a_checkpoint_process_raises_async_save_unsupported_naming_the_thread_executor(daemon, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, __file__, daemon.run_dir, str(tmp_path / "rendezvous")],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["raised"] is not None and "AsyncCheckpointerType.THREAD" in result["raised"]
    assert result["latest"] is None  # nothing half-written was committed


if __name__ == "__main__":
    process_executor_main(*sys.argv[1:3])
