"""Control-plane cost of the commit protocol at a given team size, measured on ``SimCluster``.

:func:`measure` runs ``versions`` versions of a job with ``ranks_per_node`` ranks on every node
(each one after the previous has settled), then a view change (a non-coordinator node dies) and
a coordinator takeover (node 0 dies), and returns what one version and one view change cost:
messages (total, per node, at the coordinator), bytes on the wire (the real msgpack messages in
the transport's header), the coordinator's CPU in the state machine per decision (real seconds,
this machine), the time from the last rank's snapshot to ``Commit`` on every node under the
modelled network and per-message CPU, and each node's protocol state in bytes
(:func:`deep_sizeof` of its ``CommitNode``; the view's live set counted apart).
"""

from __future__ import annotations

import statistics
import sys
import time
from array import array

from .cluster import SimCluster
from .network import NetModel

__all__ = ["deep_sizeof", "measure"]


def deep_sizeof(obj, seen: set | None = None) -> int:
    """Bytes of ``obj`` and everything it holds (containers, ``__dict__``), each object once."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, (str, bytes, int, float, bool, type(None), array)):
        return size
    if isinstance(obj, dict):
        return size + sum(deep_sizeof(k, seen) + deep_sizeof(v, seen) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return size + sum(deep_sizeof(v, seen) for v in obj)
    if hasattr(obj, "__dict__"):
        return size + deep_sizeof(vars(obj), seen)
    return size


def node_state(node) -> tuple[int, int]:
    """(protocol state without the view, the view's live set) of one CommitNode, in bytes."""
    view = deep_sizeof(node.live)
    seen = {id(node.live)}
    return deep_sizeof(node, seen), view


def _idle(c: SimCluster) -> bool:
    """Nothing in flight, and no coordinator waiting on a node (its timers would send more)."""
    if not c.quiet():
        return False
    coords = {c.nodes[i].coordinator for i in c.live[:1]} | {c.live[0]}
    return all(c.nodes[k] is None or not (c.nodes[k].syncing or c.nodes[k].deciding) for k in coords)


def _run_until_quiet(c: SimCluster, limit: float, sample=None, chunk: float = 0.02) -> None:
    end = c.t + limit
    c.run_for(c.tick_every + chunk)  # at least one tick: what is due on a timer goes out
    while c.t < end:
        if sample is not None:
            sample()
        if _idle(c):
            return
        c.run_for(chunk)
    raise RuntimeError(f"{c.n} nodes: not quiet after {limit} s: {c.pending_summary()}")


def _msgs(c: SimCluster) -> dict:
    st = c.stats
    per_node = [s + r for s, r in zip(st.sent, st.recv)]
    others = per_node[1:] if len(per_node) > 1 else per_node
    return {
        "messages": st.msgs,
        "bytes": st.bytes,
        "per_node_mean": statistics.fmean(per_node),
        "per_node_max_noncoord": max(others),
        "coordinator": per_node[0],
        "coordinator_bytes": st.sent_bytes[0] + st.recv_bytes[0],
        "by_type": {k: {"messages": v[0], "bytes": v[1]} for k, v in sorted(st.by_type.items())},
    }


def measure(n: int, *, versions: int = 3, ranks_per_node: int = 8, seed: int = 0, net: NetModel | None = None,
            tick: float = 0.1, spread: float = 0.01, samples: int = 8, fanout: int | None = None) -> dict:
    """Cost of one version and of view changes in a team of ``n`` nodes; see the module docstring.
    ``fanout``: reports and acks go through an aggregator per group of that many nodes."""
    c = SimCluster(n, seed=seed, net=net, tick=tick, measure=True, fanout=fanout)
    _run_until_quiet(c, 10.0)  # the coordinator's start-up state exchange
    watch = sorted({1 % n, n // 2, n - 1} | set(range(1, min(n, samples))))
    peak = {"coord": 0, "coord_view": 0, "node": 0, "node_view": 0}

    def sample() -> None:
        s, v = node_state(c.nodes[0])
        peak["coord"], peak["coord_view"] = max(peak["coord"], s), max(peak["coord_view"], v)
        for i in watch:
            if c.nodes[i] is not None:
                s, v = node_state(c.nodes[i])
                peak["node"], peak["node_view"] = max(peak["node"], s), max(peak["node_view"], v)

    per_version, latency, decide, cpu, wall = [], [], [], [], []
    for k in range(1, versions + 1):
        c.reset_stats()
        t0 = time.perf_counter()
        c.snapshot(k, ranks_per_node=ranks_per_node, spread=spread)
        _run_until_quiet(c, 60.0, sample)
        wall.append(time.perf_counter() - t0)
        got = c.visible_at[k]
        assert len(got) == n, f"step {k} visible on {len(got)} of {n} nodes"
        latency.append(max(got.values()) - c.protected_at[k])
        decide.append(c.decided_at[k] - c.protected_at[k])
        cpu.append(c.stats.cpu[0])
        per_version.append(_msgs(c))
    rest = [node_state(c.nodes[i])[0] for i in watch]
    c.check_settled()

    # a non-coordinator dies: every survivor installs a view; the coordinator re-syncs everyone
    c.reset_stats()
    c.kill(n - 1)
    _run_until_quiet(c, 60.0)
    view_change = _msgs(c)
    # the coordinator dies: node 1 takes over, then a version on the survivors
    c.reset_stats()
    c.kill(0)
    _run_until_quiet(c, 60.0)
    takeover = _msgs(c)
    takeover["cpu_new_coordinator"] = c.stats.cpu[1]
    c.reset_stats()
    k = versions + 1
    c.snapshot(k, ranks_per_node=ranks_per_node, spread=spread)
    _run_until_quiet(c, 60.0)
    after = max(c.visible_at[k].values()) - c.protected_at[k]
    c.check_settled()
    v = per_version[-1]
    return {
        "nodes": n, "fanout": fanout, "ranks": n * ranks_per_node, "versions": versions,
        "version": v,
        "messages_per_version": statistics.median(p["messages"] for p in per_version),
        "bytes_per_version": statistics.median(p["bytes"] for p in per_version),
        "commit_latency_s": statistics.median(latency),
        "decide_latency_s": statistics.median(decide),
        "coordinator_cpu_s": statistics.median(cpu),
        "state_bytes": {"coordinator_peak": peak["coord"], "node_peak": peak["node"], "node_rest": max(rest),
                        "view_live_set": peak["node_view"]},
        "view_change": view_change,
        "takeover": takeover,
        "commit_latency_after_takeover_s": after,
        "heartbeats_per_s": {"per_node": (n - 1) / 0.25, "total": n * (n - 1) / 0.25},
        "sim_wall_s_per_version": statistics.median(wall),
        "events": c.stats.events,
    }
