"""A restore leases the version it reads (it stays in RAM meanwhile); the lease ends when the
reader releases it, when it expires, or as soon as the reader's process is gone."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time

import torch

from helpers import TEST_JOB
from ucpd_client import Checkpointer
from ucpd_client.errors import SnapshotRejected


def test_a_reader_killed_mid_restore_does_not_pin_the_version_for_the_lease_time(make_daemon, dirs):
    make_daemon("--keep", "2", flush=False)
    with Checkpointer(dirs["run"], rank=0, world_size=1, embedded=False) as ck:
        ck.snapshot(1, {"w": torch.arange(1024.0)}).wait()
        reader = textwrap.dedent(f"""
            import torch
            from ucpd_client import Checkpointer
            ck = Checkpointer({dirs['run']!r}, rank=0, world_size=1, embedded=False, job={TEST_JOB!r})
            ck.restore({{"w": torch.empty(1024)}})
        """)
        env = {**os.environ, "UCPD_FAULT": "client.restore"}  # SIGKILLs itself once the plan came
        proc = subprocess.run([sys.executable, "-c", reader], env=env, timeout=120)
        assert proc.returncode == -9
        deadline = time.monotonic() + 15
        while True:  # a pinned job cannot be dropped; the lease of a dead reader ends within ~1 s
            try:
                out = ck._conn().call("drop", job=TEST_JOB)
                break
            except SnapshotRejected:
                assert time.monotonic() < deadline, "the dead reader's lease still pins the version"
                time.sleep(0.2)
        assert out["steps"] == [1]


# --- the rules, without a daemon ------------------------------------------------------------------


class _Store:
    """The pins of ``NodeStore`` (pin / unpin a RAM version, a flushed step), and ``enforce_keep``."""

    def __init__(self):
        self.disk_readers = {}
        self.kept = 0

    def atomic(self):
        return contextlib.nullcontext()

    def pin(self, v):
        v.pins += 1

    def unpin(self, v):
        v.pins -= 1

    def pin_flushed(self, job, step):
        self.disk_readers[(job, step)] = self.disk_readers.get((job, step), 0) + 1

    def unpin_flushed(self, job, step):
        self.disk_readers[(job, step)] -= 1
        if not self.disk_readers[(job, step)]:
            del self.disk_readers[(job, step)]

    def enforce_keep(self):
        self.kept += 1


class _Version:
    pins = 0


def _found(version=None, step=3, team=None):
    from ucpd.daemon.locate import Found

    return Found(None, {}, step, "j", "ram" if version is not None or team is not None else "disk", version, team)


def test_a_lease_pins_a_ram_version_until_it_ends():
    from ucpd.daemon.leases import Leases

    store, v = _Store(), _Version()
    leases = Leases(store)
    a, b = leases.grant(_found(v)), leases.grant(_found(v))
    assert a != b and v.pins == 2
    leases.end(a)
    leases.end(a)  # twice: nothing more
    assert v.pins == 1 and store.kept == 1  # unpinned: --keep may evict it now
    leases.end(b)
    assert v.pins == 0


def test_a_lease_on_a_flushed_step_counts_its_readers():
    from ucpd.daemon.leases import Leases

    store = _Store()
    leases = Leases(store)
    a, b = leases.grant(_found(step=7)), leases.grant(_found(step=7))
    assert store.disk_readers == {("j", 7): 2}
    leases.end(a)
    assert store.disk_readers == {("j", 7): 1}
    leases.end(b)
    assert store.disk_readers == {}


def test_leases_end_on_expiry_or_when_their_reader_is_gone_in_our_pid_namespace():
    from ucpd.daemon import leases as L

    now = [100.0]
    alive = {11: True, 12: False, 13: False}
    leases = L.Leases(_Store(), clock=lambda: now[0], alive=lambda pid: alive[pid])
    live = leases.grant(_found(_Version(), 1), pid=11, pidns=L.PIDNS)
    dead = leases.grant(_found(_Version(), 1), pid=12, pidns=L.PIDNS)
    elsewhere = leases.grant(_found(_Version(), 1), pid=13, pidns="pid:[other]")  # cannot be checked
    assert leases.due() == [dead]
    now[0] += L.LEASE_SECONDS + 1
    assert sorted(leases.due()) == sorted([live, dead, elsewhere])


class _Sources:
    """A team restore's gathered sources: they hold their own pins until released."""

    released = 0

    def release(self):
        self.released += 1


def test_a_lease_on_a_team_restore_releases_its_gathered_sources_once():
    from ucpd.daemon.leases import Leases

    store, got = _Store(), _Sources()
    leases = Leases(store)
    a = leases.grant(_found(team=got))
    assert leases.get(a).kind.value == "team" and got.released == 0
    leases.end(a)
    leases.end(a)
    assert got.released == 1 and store.kept == 0  # nothing of this node's RAM was pinned by it


def test_a_peer_lease_pins_until_unpinned_expired_or_its_node_is_dead():
    from ucpd.daemon.leases import Leases

    now = [0.0]
    store, v, rep = _Store(), _Version(), _Sources()
    leases = Leases(store, clock=lambda: now[0])
    leases.grant_peer(1, "x", 5, 30.0, version=v)
    leases.grant_peer(1, "x", 5, 30.0, release=rep.release)  # a second pin under the same lease
    leases.grant_peer(2, "y", 5, 30.0, version=v)
    leases.grant_peer(3, "z", 5, 30.0, version=v)
    assert v.pins == 3
    leases.end_peer(1, "x")
    leases.end_peer(1, "x")  # twice: nothing more
    assert v.pins == 2 and rep.released == 1 and store.kept == 1
    assert leases.end_expired_peers(live={0, 2, 3}) == []
    assert leases.end_expired_peers(live={0, 2}) == [(3, "z")]  # node 3 is dead
    now[0] += 31
    assert leases.end_expired_peers(live={0, 2}) == [(2, "y")]  # expired
    assert v.pins == 0 and not leases
