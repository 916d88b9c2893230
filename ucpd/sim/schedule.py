"""Seeded random fault schedules for ``SimCluster``: jobs snapshot while nodes and racks crash
and restart on a lossy, reordering network; then the network heals and the checks run.

:func:`random_schedule` draws jobs of any world size on some of the live nodes, lossy and
duplicating links with per-link latency, node and whole-rack crashes, fresh restarts, steps
evicted from a node's RAM, (optionally) job restarts, and the real heartbeat membership. A
failure names its seed; replay it with ``random_schedule(seed, ...)``. The named cases of
tests/team/test_commit_protocol.py run on the same ``SimCluster``.
"""

from __future__ import annotations

import random

from .cluster import SimCluster
from .network import NetModel

__all__ = ["random_schedule"]


def random_schedule(seed: int, *, nodes: tuple[int, ...] = (3, 4, 5, 6, 8), membership: str = "oracle",
                    rounds: tuple[int, int] = (15, 35), cluster=SimCluster, runs: bool = False,
                    forgets: bool = False, fanout: int | None = None) -> SimCluster:
    """Run one schedule; returns the settled cluster (``check_settled`` passed). ``runs``: the
    job also restarts (a new run, fenced, that resumes after the newest committed step and
    snapshots the step numbers an earlier run may have left half done). ``forgets``: nodes also
    lose committed steps from RAM (``CommitNode.forget``: they must stay committed)."""
    rng = random.Random(seed)
    if runs:
        rounds = (rounds[0] * 3, rounds[1] * 3)  # a run first waits for its fence: give each time to commit
    n = rng.choice(nodes)
    rack = rng.choice((1, 2, 3, 4))
    hb = membership == "heartbeat"  # heartbeats must outrun the timeout, or views flap for ever
    net = NetModel(loss=rng.uniform(0.05, 0.3), dup=rng.uniform(0.0, 0.2), jitter=rng.uniform(0.001, 0.05 if hb else 0.3))
    c = cluster(n, seed=seed, rack_size=rack, net=net, membership=membership,
                detect_after=rng.uniform(0.8 if hb else 0.3, 1.5), rejoin_after=0.1, detect_spread=rng.uniform(0.0, 0.5),
                strict=membership == "oracle", fanout=fanout)  # heartbeats lost in a row break the timeout assumption P2 needs
    step, run = 0, ""
    if runs:
        run = "r0"
        c.begin_run(run)
    for _ in range(rng.randint(*rounds)):
        c.run_for(0.1)
        live, r = c.live, rng.random()
        if runs and r > 0.95 and live:  # the job restarts: a new run resumes after the newest committed step
            run = f"r{len(c.runs)}"
            c.begin_run(run, spread=rng.uniform(0.0, 0.5))
            step = max((max(c.visible[i], default=0) for i in live), default=0)
        elif r < 0.3 and live:  # a new version of a job on some of the live nodes
            step += 1
            job = rng.sample(live, rng.randint(1, len(live)))
            world = rng.randint(len(job), 2 * len(job))
            owner = job + [rng.choice(job) for _ in range(world - len(job))]
            for node in job:
                ranks = [k for k in range(world) if owner[k] == node]
                parts = [ranks] if len(ranks) == 1 or rng.random() < 0.7 else [ranks[:1], ranks[1:]]
                if rng.random() < 0.1:
                    parts.append(ranks)  # a report repeated
                for part in parts:
                    c.protect(node, step, part, world, at=c.t + rng.uniform(0, 0.8), run=run)
        elif r < 0.36 and len(live) > 1:
            c.kill(rng.choice(live))
        elif r < 0.39 and len(live) > rack:
            c.kill_rack(rng.randrange(c.topo.racks))
        elif r < 0.47 and len(live) < n:
            c.restart(rng.choice([i for i in range(n) if c.nodes[i] is None]))
        elif forgets and r < 0.50 and live:  # a node's RAM of a committed step goes (evicted): it stays committed
            i = rng.choice(live)
            if c.visible[i]:
                c.forget(i, rng.choice(sorted(c.visible[i])))
        if not c.live:
            c.restart(rng.randrange(n))
    c.settle(quiet_for=max(1.0, 2 * c.detect_after + 0.6))
    c.check_settled()
    return c
