"""How a restart learns what the team holds, at scale: requests, bytes and time per node.

When a job restarts, each of its ranks asks its node's daemon for the latest step and then
restores it; the daemon learns what the live nodes hold (``team.sources``). Three ways are
modelled with the real code of ``team.directory`` (``upstreams``, ``groups``) and the real wire
size of what each node answers (msgpack of the HOLDING items a node of the restart model in
``sim.recovery`` holds, ``--replicas 1``):

- ``ask_all`` — no directory (``--commit-fanout 0``): every rank's ``latest`` and every rank's
  restore asks every live node (8 ranks a node: 16 rounds of N-1 requests per node);
- ``directory`` — what ``ucpd serve`` does with ``--commit-fanout K``: ``latest`` through the
  tree (holdings without manifests), the step's manifests asked of every node once a node;
- ``tree_manifests`` — the manifests through the tree as well (not built: why not). Every node
  still needs all of them, and the root sends the whole set once per node that asks it.

Time (model): each node's CPU for the messages it sends and receives (``NetModel.cpu_per_msg``
each) plus its bytes over its NIC, the larger of egress and ingress; the tree's three hops
(gather to the root, root to its askers, relays to theirs) one after the other. Decoding the
manifests in Python, the same in every scheme that ships them all, is left out.
"""

from __future__ import annotations

import math
from collections import Counter

import msgpack

from ..team.directory import PAGE_BYTES, groups, upstreams
from .network import NetModel
from .recovery import OPTIM_B, PARAMS, TP, WEIGHT_B, Layout

__all__ = ["node_bytes", "simulate"]

RANKS = 8
LAYERS = 80  # of the 70.6 B-parameter model; 12 saved tensors a layer and rank, TP-sharded
CHUNK = 4 << 20  # bytes per CRC32C in a manifest
KEEP = 2  # versions a node keeps (``--keep 2``), each held once more as a replica elsewhere


def _part(layout: Layout, rank: int) -> dict:
    """One rank's PART record of the restart model: its weight tensors and its ZeRO partition."""
    layers = LAYERS // layout.pp
    per_tensor = int(PARAMS * WEIGHT_B / (layout.pp * TP) / (layers * 12))
    shard = {"kind": "shard", "dim": 0, "index": rank % TP, "parts": TP}
    tensors = [{"name": f"model.layers.{i}.t{k}.weight", "dtype": "bfloat16", "shape": [1024, per_tensor // 2048],
                "placement": shard, "offset": (i * 12 + k) * per_tensor, "nbytes": per_tensor,
                "crcs": [0xFFFFFFFF] * math.ceil(per_tensor / CHUNK)} for i in range(layers) for k in range(12)]
    zero = int(PARAMS * OPTIM_B / (layout.pp * TP * layout.dp))
    tensors.append({"name": "optim.flat", "dtype": "float32", "shape": [zero // 4],
                    "placement": {"kind": "flat", "offset": rank * (zero // 4), "length": zero // 4},
                    "offset": 0, "nbytes": zero, "crcs": [0xFFFFFFFF] * math.ceil(zero / CHUNK)})
    return {"rank": rank, "tensors": tensors, "objects": b"\0" * 256, "used": per_tensor * layers * 12 + zero,
            "objects_crc": 0xFFFFFFFF}


def node_bytes(nodes: int) -> tuple[int, int]:
    """Bytes of what one node answers ``holdings``: (of one step, with manifests; of every step,
    without). It holds its own part and one replica of each kept step."""
    layout = Layout(nodes)
    world = nodes * RANKS
    item = {"origin": 3, "step": 1000, "world_size": world, "ranks": list(range(24, 32)), "run": "run-0123456789"}
    with_manifests = dict(item, parts=[_part(layout, r) for r in range(24, 32)])
    one = len(msgpack.packb(with_manifests, use_bin_type=True))
    bare = len(msgpack.packb(item, use_bin_type=True))
    return 2 * one, 2 * KEEP * bare  # own + replica; KEEP steps of each without manifests


def simulate(nodes: int, scheme: str, fanout: int = 32, model: NetModel | None = None) -> dict:
    """Requests, bytes and modelled time of one restart of ``nodes`` nodes (every node restoring
    its 8 ranks at once) under ``scheme``: ``ask_all``, ``directory`` or ``tree_manifests``."""
    m = model or NetModel()
    manifest, bare = node_bytes(nodes)
    live = range(nodes)
    served, sent = Counter(), Counter()  # requests a node answered / sent
    out_b, in_b = Counter(), Counter()  # bytes a node sent / received (answers only)

    def all_to_all(rounds: int, per_node: int) -> None:
        for x in live:
            sent[x] += rounds * (nodes - 1)
            served[x] += rounds * (nodes - 1)
            out_b[x] += rounds * (nodes - 1) * per_node
            in_b[x] += rounds * (nodes - 1) * per_node

    def snapshot():
        return tuple(Counter(c) for c in (sent, served, out_b, in_b))

    def slowest(before, nodes_) -> float:
        counters = (sent, served, out_b, in_b)
        return max((_time_of(m, tuple(a[x] - b[x] for b, a in zip(before, counters))) for x in nodes_), default=0.0)

    def tree(per_node: int) -> float:
        """One gather to the root and its answer to every node: the three hops, one after another."""
        ups = upstreams(live, fanout)
        parts = groups(live, fanout)
        whole = nodes * per_node
        pages = max(1, math.ceil(whole / PAGE_BYTES))
        before = snapshot()
        for g in parts:  # gather: relays ask their members, the root the relays and its own group
            relay = g[0]
            for x in g[1:]:
                sent[relay] += 1
                served[x] += 1
                out_b[x] += per_node
                in_b[relay] += per_node
            if relay != 0:
                sent[0] += 1
                served[relay] += 1
                out_b[relay] += len(g) * per_node
                in_b[0] += len(g) * per_node
        gather = slowest(before, [g[0] for g in parts[1:]]) + slowest(before, [0])
        before = snapshot()
        for x, up in ups.items():  # every node's answer, in pages, from its upstream
            if up is not None:
                sent[x] += pages
                served[up] += pages
                out_b[up] += whole
                in_b[x] += whole
        return gather + slowest(before, [0]) + slowest(before, [g[0] for g in parts[1:]])

    if scheme == "ask_all":
        before = snapshot()
        all_to_all(RANKS, bare)  # latest, once per rank
        all_to_all(RANKS, manifest)  # the restore's manifests, once per rank
        time_s = slowest(before, live)
    elif scheme == "directory":
        time_s = tree(bare)
        before = snapshot()
        all_to_all(1, manifest)
        time_s += slowest(before, live)
    elif scheme == "tree_manifests":
        time_s = tree(bare) + tree(manifest)
    else:
        raise ValueError(f"unknown scheme {scheme!r}")
    per = [sent[x] for x in live]
    return {
        "nodes": nodes, "scheme": scheme, "fanout": fanout if scheme != "ask_all" else None,
        "node_manifest_bytes": manifest, "node_bare_bytes": bare,
        "requests_total": sum(per), "requests_per_node_max": max(per), "requests_per_node_median": sorted(per)[nodes // 2],
        "served_max": max(served.values()), "in_bytes_max": max(in_b.values()), "out_bytes_max": max(out_b.values()),
        "time_s": time_s,
    }


def _time_of(m: NetModel, d: tuple[int, int, int, int]) -> float:
    """A node's CPU for its messages (a request and its answer each way) and its NIC's bytes."""
    sent, served, out_b, in_b = d
    return 2 * (sent + served) * m.cpu_per_msg + max(out_b, in_b) / m.nic_bw
