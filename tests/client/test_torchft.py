"""The torchft ``CheckpointTransport`` (``ucpd_client.integrations.torchft``) through the real
torchft 0.2.0 (its ``CheckpointTransport`` base class, its ``Manager`` with an in-process
``LighthouseServer`` and gloo process groups on CPU, and its ``HTTPTransport`` as the fallback)
and real daemons. Skipped where torchft does not import (it is not in the test extra: its wheel
requires torch, so it is installed by hand with ``pip install --no-deps torchft`` plus the
opentelemetry packages it imports)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch

torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install --no-deps torchft)")

from torchft.checkpointing import CheckpointTransport, HTTPTransport  # noqa: E402

from ucpd_client import Checkpointer  # noqa: E402
from ucpd_client.errors import VersionNotFound  # noqa: E402
from ucpd_client.integrations.torchft import UcpdTransport  # noqa: E402

T = timedelta(seconds=30)


def manager_state(seed: int) -> dict:
    """The shape torchft's Manager sends: {"user": {key: state_dict()}, "torchft": {...}}."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return {"user": {"default": {"model": model.state_dict(), "optim": opt.state_dict(),
                                 "loader": {"epoch": 1, "offset": seed}}},
            "torchft": {"step": seed, "batches_committed": 2 * seed}}


def clone(sd):
    return torch.utils._pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, sd)


def test_is_a_torchft_transport(daemon):
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, job="tft-r0") as ck:
        t = UcpdTransport(ck)
        assert isinstance(t, CheckpointTransport)
        meta = json.loads(t.metadata())
        assert meta["job"] == "tft-r0" and meta["run_dir"] == daemon.run_dir and meta["world_size"] == 1


@pytest.mark.parametrize("template", [False, True])
def test_send_then_recv_from_the_daemon(daemon, template):
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, job="tft-r0") as c0, \
         Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, job="tft-r1") as c1:
        live = manager_state(7)
        want = clone(live)
        sender = UcpdTransport(c0)
        sender.send_checkpoint([1], 7, live, T)
        # staged: the live replica may train on; the receiver must see step 7's values
        for p in live["user"]["default"]["model"].values():
            p.add_(100.0)
        sender.disallow_checkpoint()
        mine = manager_state(3)  # the recovering replica's own (stale) state: the template
        recv = UcpdTransport(c1, state_dict=(lambda: mine) if template else None)
        got = recv.recv_checkpoint(0, sender.metadata(), 7, T)
        torch.testing.assert_close(got, want)  # structure, int keys, dtypes, plain values
        assert recv.received == [(7, "ucpd")]
        w = got["user"]["default"]["model"]["0.weight"]
        assert (w is mine["user"]["default"]["model"]["0.weight"]) == template  # in place into the template
        assert c1.latest() is None  # the receiver's own job got nothing
        # the same step asked for again (a second recovering replica): not snapshotted twice
        sender.send_checkpoint([2], 7, live, T)
        assert c0.latest() == 7
        sender.shutdown()
        recv.shutdown()


def test_recv_waits_for_the_commit_and_times_out(daemon):
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, job="tft-r0") as c0, \
         Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, job="tft-r1") as c1:
        sender, recv = UcpdTransport(c0), UcpdTransport(c1)
        out = {}
        th = threading.Thread(target=lambda: out.setdefault("sd", recv.recv_checkpoint(0, sender.metadata(), 4, T)))
        th.start()
        time.sleep(0.5)  # the receiver asks before the live replica snapshots
        assert th.is_alive()
        sd = manager_state(4)
        sender.send_checkpoint([1], 4, sd, T)
        th.join(30)
        torch.testing.assert_close(out["sd"], sd)
        t0 = time.monotonic()
        with pytest.raises(VersionNotFound, match="not committed"):
            recv.recv_checkpoint(0, sender.metadata(), 9, timedelta(seconds=1))
        assert time.monotonic() - t0 < 10


def test_unreachable_daemon_uses_the_fallback_transport(daemon):
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, job="tft-r0") as c0, \
         Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, job="tft-r1") as c1:
        sender = UcpdTransport(c0, fallback=HTTPTransport(timeout=T, num_chunks=0))
        sd = manager_state(5)
        sender.send_checkpoint([1], 5, sd, T)
        meta = json.loads(sender.metadata())
        meta["run_dir"] = "/nonexistent/ucpd-run"  # the sender's daemon as seen from another node
        recv = UcpdTransport(c1, fallback=HTTPTransport(timeout=T, num_chunks=0))
        got = recv.recv_checkpoint(0, json.dumps(meta), 5, T)
        torch.testing.assert_close(got, sd)
        assert recv.received == [(5, "fallback")]
        sender.disallow_checkpoint()
        for t in (sender, recv):
            t.shutdown(wait=False)


# -- the real Manager: a replica group crashes and is healed from the daemon ---------------------

STEPS = 5


def _replica(replica_id, lighthouse, run_dir, fail_at, log):
    """One replica group of one rank, restarted after an injected failure (as torchft's own
    integration tests do, in threads). Its model starts from another seed on every attempt,
    so only healing makes it equal to the live replica."""
    from torchft.ddp import DistributedDataParallel
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    for attempt in range(2):
        store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        ckpt = Checkpointer(run_dir, rank=0, world_size=1, embedded=False, job=f"tft-replica{replica_id}")
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        with torch.no_grad():
            g = torch.Generator().manual_seed(100 * replica_id + attempt)
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        opt = torch.optim.Adam(model.parameters())

        def state_dict():
            return {"model": model.state_dict(), "optim": opt.state_dict()}

        def load_state_dict(sd):
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])

        transport = UcpdTransport(ckpt)
        manager = Manager(pg=ProcessGroupGloo(), min_replica_size=2, load_state_dict=load_state_dict,
                          state_dict=state_dict, replica_id=str(replica_id), store_addr="localhost",
                          store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
                          port=0, checkpoint_transport=transport, timeout=T, quorum_timeout=T)
        try:
            ddp = DistributedDataParallel(manager, model)
            optim = OptimizerWrapper(manager, opt)
            while manager.current_step() < STEPS:
                step = manager.current_step()
                if attempt == 0 and fail_at is not None and step == fail_at:
                    raise RuntimeError("injected failure")
                g = torch.Generator().manual_seed(step)
                x, y = torch.rand(4, 3, generator=g), torch.randint(4, (4,), generator=g)
                optim.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                optim.step()
            log[replica_id] = {"received": list(transport.received), "attempt": attempt}
            return clone(state_dict())
        except RuntimeError as exc:
            if "injected failure" not in str(exc):
                raise
        finally:
            manager.shutdown(wait=False)
            transport.shutdown(wait=False)
            ckpt.close()
    raise AssertionError("unreachable")


@pytest.mark.slow
def test_manager_heals_a_restarted_replica_from_the_daemon(daemon):
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    log: dict = {}
    try:
        with ThreadPoolExecutor(max_workers=2) as ex:
            futs = [ex.submit(_replica, r, lighthouse.address(), daemon.run_dir, 2 if r == 1 else None, log)
                    for r in (0, 1)]
            results = [f.result(timeout=240) for f in futs]
    finally:
        lighthouse.shutdown()
    torch.testing.assert_close(results[1], results[0])
    # replica 1 came back at step 0 and was healed through ucpd at replica 0's step (2)
    assert log[1]["attempt"] == 1
    assert (2, "ucpd") in log[1]["received"], log
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, job="tft-replica0") as c:
        assert c.latest() is not None and c.latest() >= 2  # what replica 0 sent is in its daemon


def test_torchfts_own_transport_conformance_helpers_pass(daemon):
    """torchft's published helper (``torchft/checkpointing/transport_test.py``, shipped in the
    torchft 0.2.0 wheel), run as its HTTP and process-group transports run it: three replica
    groups in threads, 3- and 2-way recovery, a receive that times out, a send nobody receives.
    Its state dict holds a DTensor on ``DeviceMesh("cpu", 1)``: a mesh of rank 1 only, which
    this process (rank 0) is not on; it must come back with the same local tensor and spec."""
    import unittest

    transport_test = pytest.importorskip("torchft.checkpointing.transport_test")
    checkpointers = []

    def init_transport(rank: int, world_size: int) -> UcpdTransport:
        ck = Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, job=f"conformance-r{rank}")
        checkpointers.append(ck)
        return UcpdTransport(ck)

    try:
        transport_test.run_multi_recovery_test(unittest.TestCase(), init_transport, torch.device("cpu"))
    finally:
        for ck in checkpointers:
            ck.close()


def test_a_dtensor_off_this_processs_mesh_travels_as_it_is(daemon):
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, distribute_tensor

    dist.init_process_group(backend="gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        off = distribute_tensor(torch.arange(6.0).reshape(2, 3), DeviceMesh("cpu", 1), [])  # a mesh of rank 1 only
        on = distribute_tensor(torch.arange(4.0), DeviceMesh("cpu", [0]), [torch.distributed.tensor.Shard(0)])
        with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, job="tft-off") as c0, \
             Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, job="tft-off-r1") as c1:
            sender, receiver = UcpdTransport(c0), UcpdTransport(c1)
            sender.send_checkpoint([1], 3, {"user": {"off": off, "on": on, "n": 1}}, T)
            sender.last_handle.wait()
            assert any(n.endswith("off@rank0") for n in c0.describe(3)["tensors"])
            got = receiver.recv_checkpoint(0, sender.metadata(), 3, T)
        assert type(got["user"]["off"]) is type(off) and got["user"]["off"]._spec == off._spec
        assert torch.equal(got["user"]["off"]._local_tensor, off._local_tensor)
        assert got["user"]["on"]._spec == on._spec and torch.equal(got["user"]["on"].to_local(), on.to_local())
        assert got["user"]["n"] == 1
    finally:
        dist.destroy_process_group()
