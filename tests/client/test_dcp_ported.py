"""PyTorch's own DCP storage cases, ported to ``UcpdStorageWriter``/``UcpdStorageReader``.

Ported (rewritten for ucpd: a real daemon instead of a folder, gloo ranks in processes instead
of PyTorch's test harness) from pytorch/pytorch ``test/distributed/checkpoint/``:

- ``test_file_system_checkpoint_cpu.py``: ``test_read_write_only_tensor`` (no process group),
  ``test_read_write_tensor_and_blob`` (a ``Stateful`` holding bytes), the dtype casts of
  ``test_dtype_mismatch_casting`` that torch 2.13's planner makes (it has no
  ``allow_unsafe_types`` yet), and on two ranks ``test_read_write_shard_tensor``,
  ``test_load_with_different_shard_plan`` (every pair of 4 ShardedTensor specs, two of them
  with several shards on one rank), ``test_load_rowwise_to_colwise`` (on the CPU),
  ``test_save_load_bytes`` and ``test_switch_between_sharded_tensor_to_tensor``.
  Not ported: the Rot13 and ZStandard cases (``FileSystemWriter`` extensions: file encodings,
  which a daemon's RAM does not have) and the thread counts (a file writer's threads).
- ``test_fsspec.py``: ``test_fsspec`` with FSDP2 (``fully_shard``) on gloo instead of FSDP1 on
  NCCL (no GPU here), through ``get_state_dict``/``set_state_dict``: the model and Adam's state
  come back; ``test_overwrite`` (a saved step is immutable: a second save of it is refused).
  ``TestFileSystem`` (fsspec streams) has no counterpart.
- ``test_dtensor_resharding.py``: every 1-D -> 1-D, 2-D -> 2-D, 1-D -> 2-D and 2-D -> 1-D
  placement change of a 4x4 DTensor on 4 ranks; and its TODO, a load on another world size.

Each save is a new step of the test's job (the file tests overwrite one folder).
"""

from __future__ import annotations

import pytest
import torch

from helpers import ranks

pytestmark = pytest.mark.slow


class MyTestModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = torch.nn.Linear(5, 5)
        self.linear_2 = torch.nn.Linear(5, 1)
        self.emb = torch.nn.EmbeddingBag(5, 10)


class BlobState:
    """A Stateful holding bytes (DCP saves it as a BYTE_IO item)."""

    def __init__(self, value: bytes) -> None:
        self.state = {"blob": value}

    def state_dict(self):
        return self.state

    def load_state_dict(self, state_dict) -> None:
        self.state = state_dict

    def __eq__(self, other) -> bool:
        return isinstance(other, BlobState) and self.state == other.state


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            if not torch.equal(v, b[k]):
                return False
        elif v != b[k]:
            return False
    return True


def writer(ckpt, step):
    from ucpd_client.dcp import UcpdStorageWriter

    return UcpdStorageWriter(ckpt, step=step)


def reader(ckpt, step=None):
    from ucpd_client.dcp import UcpdStorageReader

    return UcpdStorageReader(ckpt, step=step)


# --- one process --------------------------------------------------------------------------------


def test_read_write_only_tensor_without_a_process_group(daemon):
    import torch.distributed.checkpoint as dcp

    from ucpd_client import Checkpointer

    torch.manual_seed(0)
    saved = MyTestModule().state_dict()
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        dcp.save(saved, storage_writer=writer(ckpt, 1), no_dist=True)
        loaded = MyTestModule().state_dict()
        assert not same(loaded, saved)
        dcp.load(loaded, storage_reader=reader(ckpt), no_dist=True)
    assert same(loaded, saved)


def test_read_write_tensor_and_blob(daemon):
    import torch.distributed.checkpoint as dcp

    from ucpd_client import Checkpointer

    torch.manual_seed(1)
    saved = MyTestModule().state_dict()
    saved["test_blob"] = BlobState(b"SomeBlobForTesting")
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        dcp.save(saved, storage_writer=writer(ckpt, 2), no_dist=True)
        loaded = MyTestModule().state_dict()
        loaded["test_blob"] = BlobState(b"")
        assert not same(loaded, saved)
        dcp.load(loaded, storage_reader=reader(ckpt), no_dist=True)
    assert same(loaded, saved)


def test_dtype_casts_on_load_narrowing_and_widening(daemon):
    import torch.distributed.checkpoint as dcp

    from ucpd_client import Checkpointer

    fp32 = {"w": torch.rand(4, 3, dtype=torch.float32)}
    bf16 = {"w": torch.rand(4, 3, dtype=torch.bfloat16)}
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        dcp.save(fp32, storage_writer=writer(ckpt, 3), no_dist=True)
        dcp.save(bf16, storage_writer=writer(ckpt, 4), no_dist=True)
        narrow = {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}
        dcp.load(narrow, storage_reader=reader(ckpt, 3), no_dist=True)  # fp32 checkpoint -> bf16 template
        wide = {"w": torch.zeros(4, 3, dtype=torch.float32)}
        dcp.load(wide, storage_reader=reader(ckpt, 4), no_dist=True)  # bf16 checkpoint -> fp32 template
    assert narrow["w"].dtype == torch.bfloat16 and torch.equal(narrow["w"], fp32["w"].to(torch.bfloat16))
    assert wide["w"].dtype == torch.float32 and torch.equal(wide["w"], bf16["w"].float())


def test_a_second_save_of_a_saved_step_is_refused_and_the_first_stays(daemon):
    """test_fsspec.py's test_overwrite: a checkpoint that exists is not overwritten (ucpd has no
    overwrite=True: a version is immutable; save the next step instead)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ucpd_client import Checkpointer

    t1, t2 = torch.randn(10), torch.randn(10)
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        dcp.save({"random": t1}, storage_writer=writer(ckpt, 5), no_dist=True)
        with pytest.raises(CheckpointException, match="step 5 is already committed; snapshot a new step number"):
            dcp.save({"random": t2}, storage_writer=writer(ckpt, 5), no_dist=True)
        dcp.save({"random": t2}, storage_writer=writer(ckpt, 6), no_dist=True)
        sd = {"random": torch.zeros(10)}
        dcp.load(sd, storage_reader=reader(ckpt), checkpoint_id="step-5", no_dist=True)
        assert torch.equal(sd["random"], t1)
        dcp.load(sd, storage_reader=reader(ckpt), no_dist=True)  # the newest
        assert torch.equal(sd["random"], t2)


# --- FSDP2 on two ranks (test_fsspec.py's test_fsspec) ------------------------------------------


def fsdp_case(rank, world, rendezvous, q, run_dir):
    ranks.init_gloo(rank, world, rendezvous)
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ucpd_client import Checkpointer

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net1 = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
            self.net2 = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
            self.net3 = nn.Linear(32, 64)
            self.net4 = nn.Sequential(nn.ReLU(), nn.Linear(64, 8))

        def forward(self, x):
            return self.net4(self.net3(self.net2(self.net1(x))))

    mesh = init_device_mesh("cpu", (world,))

    def build(seed):
        torch.manual_seed(seed)
        model = Net()
        for m in (model.net1, model.net2, model.net3, model.net4, model):
            fully_shard(m, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    model, optim = build(0)
    torch.manual_seed(1)
    model(torch.rand(8, 8)).sum().backward()
    optim.step()
    model2, optim2 = build(5)
    failures = []
    full = [p.full_tensor() for p in model.parameters()]
    if any(torch.equal(a, b.full_tensor()) for a, b in zip(full, model2.parameters())):
        failures.append("the second model starts equal")
    with Checkpointer(run_dir, embedded=False) as ckpt:
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer(ckpt, 300))
        msd2, osd2 = get_state_dict(model2, optim2)  # Adam's state is made before it is filled
        sd = {"model": msd2, "optim": osd2}
        dcp.load(sd, storage_reader=reader(ckpt, 300))
        set_state_dict(model2, optim2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    if not all(torch.equal(a, b.full_tensor()) for a, b in zip(full, model2.parameters())):
        failures.append("parameters differ")
    for (p1, s1), (p2, s2) in zip(optim.state.items(), optim2.state.items()):
        for key in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(s1[key].full_tensor(), s2[key].full_tensor()):
                failures.append(f"optimizer {key} differs")
    q.put((rank, failures))


def test_fsdp2_model_and_optimizer_through_dcp(daemon):
    procs, results = ranks.spawn(fsdp_case, 2, daemon.run_dir)
    ranks.join(procs)
    assert [f for _, f in sorted(results)] == [[], []]


# --- ShardedTensor on two ranks (test_file_system_checkpoint_cpu.py) -----------------------------


def sharded_cases(rank, world, rendezvous, q, run_dir):
    ranks.init_gloo(rank, world, rendezvous)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharded_tensor import ShardedTensor, state_dict_hook
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata

    from ucpd_client import Checkpointer

    failures = []
    step = [100]

    def save(sd):
        step[0] += 1
        dcp.save(sd, storage_writer=writer(ckpt, step[0]))

    def load(sd):
        dcp.load(sd, storage_reader=reader(ckpt, step[0]))

    def gathered(t: ShardedTensor):
        out = torch.zeros(t.shape) if rank == 0 else None
        t.gather(out=out)
        return out

    class Sharded(torch.nn.Module):  # MyShardedModel3: one [10, 20] ShardedTensor
        def __init__(self, spec):
            super().__init__()
            self.sharded_tensor = sharded_tensor.rand(spec, 10, 20, init_rrefs=False)
            self._register_state_dict_hook(state_dict_hook)

    def chunk(dim, placements):
        return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}" for r in placements])

    def enum(shards, width=None):
        return EnumerableShardingSpec(shards=[
            ShardMetadata(shard_offsets=[o] + ([0] if width else []), shard_sizes=[n] + ([width] if width else []),
                          placement=f"rank:{r}") for o, n, r in shards])

    with Checkpointer(run_dir, embedded=False) as ckpt:
        # test_read_write_shard_tensor
        torch.manual_seed(10 + rank)
        spec = chunk(0, [0, 1])
        m_save, m_load = Sharded(spec), Sharded(spec)
        save(m_save.state_dict())
        before = gathered(m_load.sharded_tensor)
        load(m_load.state_dict())
        a, b = gathered(m_save.sharded_tensor), gathered(m_load.sharded_tensor)
        if rank == 0 and (torch.equal(before, a) or not torch.equal(a, b)):
            failures.append("read_write_shard_tensor")

        # test_load_with_different_shard_plan
        specs = [chunk(0, [0, 1]), chunk(0, [0, 1, 1, 0]),
                 enum([(0, 2, 0), (2, 1, 1), (3, 3, 0), (6, 3, 1), (9, 1, 0)], width=20),
                 enum([(0, 8, 1), (8, 2, 0)], width=20)]
        for i, s0 in enumerate(specs):
            for j, s1 in enumerate(specs):
                if i == j:
                    continue
                torch.manual_seed(100 * i + j + rank)
                m_save, m_load = Sharded(s0), Sharded(s1)
                save(m_save.state_dict())
                load(m_load.state_dict())
                a, b = gathered(m_save.sharded_tensor), gathered(m_load.sharded_tensor)
                if rank == 0 and not torch.equal(a, b):
                    failures.append(f"different_shard_plan {i}->{j}")

        # test_load_rowwise_to_colwise (on the CPU)
        torch.manual_seed(7 + rank)
        m_save, m_load = Sharded(chunk(0, [0, 1])), Sharded(chunk(1, [0, 1]))
        save(m_save.state_dict())
        load(m_load.state_dict())
        a, b = gathered(m_save.sharded_tensor), gathered(m_load.sharded_tensor)
        if rank == 0 and not torch.equal(a, b):
            failures.append("rowwise_to_colwise")

        # test_save_load_bytes
        save({"bytes0": [1], "bytes1": "string"})
        got = {"bytes0": [2], "bytes1": "other"}
        load(got)
        if got != {"bytes0": [1], "bytes1": "string"}:
            failures.append(f"save_load_bytes {got}")

        # test_switch_between_sharded_tensor_to_tensor
        n = 32
        specs = [chunk(0, [0, 1]), chunk(0, [0, 1, 1, 0]), enum([(0, 8, 1), (8, n - 8, 0)]), enum([(0, 10, 0), (10, n - 10, 1)])]
        for i, save_spec in enumerate(specs):
            for j, load_spec in enumerate(specs):
                torch.manual_seed(1000 + 10 * i + j + rank)
                sd = {"sharded": sharded_tensor.rand(save_spec, n), "replicated": torch.rand(n)}
                dist.broadcast(sd["replicated"], src=0)
                save(sd)
                got = {"sharded": torch.zeros(n), "replicated": sharded_tensor.zeros(load_spec, n)}
                load(got)
                a, b = gathered(sd["sharded"]), gathered(got["replicated"])
                if rank == 0 and not (torch.equal(a, got["sharded"]) and torch.equal(sd["replicated"], b)):
                    failures.append(f"switch_sharded_tensor {i}->{j}")
    q.put((rank, failures))


def test_sharded_tensor_cases_of_the_file_system_checkpoint_tests(daemon):
    procs, results = ranks.spawn(sharded_cases, 2, daemon.run_dir, timeout=400)
    ranks.join(procs)
    assert [f for _, f in sorted(results)] == [[], []]


# --- DTensor resharding on four ranks (test_dtensor_resharding.py) -------------------------------

ONE_D = [("S0",), ("R",)]
TWO_D = [("R", "R"), ("R", "S0"), ("S0", "R"), ("S0", "S0")]


def reshard_cases(rank, world, rendezvous, q, run_dir):
    ranks.init_gloo(rank, world, rendezvous)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, zeros

    from ucpd_client import Checkpointer

    def places(names):
        return [Shard(0) if p == "S0" else Replicate() for p in names]

    mesh_1d = init_device_mesh("cpu", (world,))
    mesh_2d = init_device_mesh("cpu", (2, world // 2))
    global_tensor = torch.arange(16, dtype=torch.float).view(4, 4)
    failures = []
    step = [200]
    cases = [(ONE_D, a, ONE_D, b) for a in ONE_D for b in ONE_D if a != b]
    cases += [(TWO_D, a, TWO_D, b) for a in TWO_D for b in TWO_D if a != b]
    cases += [(ONE_D, a, TWO_D, b) for a in ONE_D for b in TWO_D]
    cases += [(TWO_D, a, ONE_D, b) for a in TWO_D for b in ONE_D]
    with Checkpointer(run_dir, embedded=False) as ckpt:
        for kind_a, a, kind_b, b in cases:
            mesh_a = mesh_1d if kind_a is ONE_D else mesh_2d
            mesh_b = mesh_1d if kind_b is ONE_D else mesh_2d
            saved = {"dtensor": distribute_tensor(global_tensor, mesh_a, places(a))}
            step[0] += 1
            dcp.save(saved, storage_writer=writer(ckpt, step[0]))
            loaded = {"dtensor": zeros([4, 4], device_mesh=mesh_b, placements=places(b))}
            dcp.load(loaded, storage_reader=reader(ckpt, step[0]))
            whole = loaded["dtensor"].redistribute(mesh_b, [Replicate()] * mesh_b.ndim).to_local()
            back = loaded["dtensor"].redistribute(mesh_a, places(a)).to_local() if mesh_a is mesh_b else None
            if not torch.equal(whole, global_tensor):
                failures.append(f"{a} -> {b}: {whole.tolist()}")
            if back is not None and not torch.equal(back, saved["dtensor"].to_local()):
                failures.append(f"{a} -> {b} -> {a}")
    q.put((rank, failures, step[0]))


def load_on_two_ranks(rank, world, rendezvous, q, run_dir, step):
    ranks.init_gloo(rank, world, rendezvous)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, zeros

    from ucpd_client import Checkpointer

    mesh = init_device_mesh("cpu", (world,))
    with Checkpointer(run_dir, embedded=False) as ckpt:
        loaded = {"dtensor": zeros([4, 4], device_mesh=mesh, placements=[Shard(1)])}
        dcp.load(loaded, storage_reader=reader(ckpt, step))
    whole = loaded["dtensor"].redistribute(mesh, [Replicate()]).to_local()
    q.put((rank, torch.equal(whole, torch.arange(16, dtype=torch.float).view(4, 4))))


def test_dtensor_resharding_cases_and_a_load_on_another_world_size(daemon):
    procs, results = ranks.spawn(reshard_cases, 4, daemon.run_dir, timeout=400)
    ranks.join(procs)
    assert [f for _, f, _ in sorted(results)] == [[], [], [], []]
    last = results[0][2]
    procs, results = ranks.spawn(load_on_two_ranks, 2, daemon.run_dir, last)  # saved by 4 ranks, loaded by 2
    ranks.join(procs)
    assert all(ok for _, ok in results)
