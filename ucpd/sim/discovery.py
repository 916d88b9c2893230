"""How a restart learns what the team holds, at scale: requests, bytes and time per node.

When a job restarts, each of its ranks asks its node's daemon for the latest step and then
restores it; the daemon learns what the live nodes hold (``team.sources``): every node's
holdings of every step without manifests (for ``latest``), then of the step with manifests
(what a resharded restore plans from). Three ways, with the real wire size of what a node of
the restart model in ``sim.recovery`` answers (msgpack of its HOLDING items, ``--replicas 1``):

- ``ask_all`` — without the directory (``--commit-fanout 0``): every rank's ``latest`` and
  every rank's restore ask every live node (8 ranks a node: 16 rounds of N−1 requests a node);
- ``doubling`` — what ``ucpd serve`` does in a large team (``team.directory``, with its real
  ``levels``, ``span`` and ``partner``): one gather by recursive doubling for ``latest`` and one
  for the step, each shared by the node's 8 ranks: one request a level and ⌈log₂ N⌉ levels;
- ``holders`` — what ``ucpd serve`` does in a large team when the job restarts in the layout
  that saved it (a failed node replaced): the directory's gather without manifests for
  ``latest``, in which the items holding rank 0 (node 0's and its replica's) carry rank 0's
  manifest for each kept step (the plain values a rank lacks come from rank 0); its own ranks'
  parts are in its RAM, so nobody is asked for manifests. A node whose part was lost asks its
  part's copies once for its ranks (not modelled: a few nodes);
- ``hub`` — for comparison, a directory on one node (a metadata server): each node asks it
  once, it asks every node once and sends the whole set once per node.

Time (model): per round (a level, or an all-to-all round), the slowest node's CPU for the
messages it sends and receives (``NetModel.cpu_per_msg`` each, a request and its answer) plus
its bytes over its NIC (the larger of egress and ingress); rounds one after the other.
Decoding the manifests in Python, the same in every scheme that ships them all, is left out.
"""

from __future__ import annotations

import math
from collections import Counter

import msgpack

from ..team.directory import PAGE_BYTES, levels, partner, span
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
                    "placement": {"kind": "shard", "dim": 0, "index": rank // TP % layout.dp, "parts": layout.dp},
                    "offset": 0, "nbytes": zero, "crcs": [0xFFFFFFFF] * math.ceil(zero / CHUNK)})
    return {"rank": rank, "tensors": tensors, "objects": b"\0" * 256, "used": per_tensor * layers * 12 + zero,
            "objects_crc": 0xFFFFFFFF}


def rank_bytes(nodes: int) -> int:
    """Bytes of what a node answers ``holdings`` of one step for one rank's part (``ranks``)."""
    item = {"origin": 0, "step": 1000, "world_size": nodes * RANKS, "ranks": [0], "run": "run-0123456789",
            "parts": [_part(Layout(nodes), 0)]}
    return len(msgpack.packb(item, use_bin_type=True))


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


def simulate(nodes: int, scheme: str, model: NetModel | None = None, exact: bool = False) -> dict:
    """Requests, bytes and modelled time of one restart of ``nodes`` nodes (every node restoring
    its 8 ranks at once) under ``scheme``: ``ask_all``, ``doubling``, ``holders`` or
    ``hub``."""
    m = model or NetModel()
    manifest, bare = node_bytes(nodes)
    sent, served, out_b, in_b = Counter(), Counter(), Counter(), Counter()
    time_s = 0.0

    def round_time(before) -> float:
        """The slowest node's time for what it did since ``before``."""
        now = (sent, served, out_b, in_b)
        worst = 0.0
        for x in range(nodes):
            d = [a[x] - b[x] for b, a in zip(before, now)]
            worst = max(worst, 2 * (d[0] + d[1]) * m.cpu_per_msg + max(d[2], d[3]) / m.nic_bw)
        return worst

    def snapshot():
        return tuple(Counter(c) for c in (sent, served, out_b, in_b))

    def ask(x: int, y: int, nbytes: int) -> None:
        """Node x asks node y, which answers ``nbytes`` (in pages)."""
        pages = max(1, math.ceil(nbytes / PAGE_BYTES))
        sent[x] += pages
        served[y] += pages
        out_b[y] += nbytes
        in_b[x] += nbytes

    zero = KEEP * rank_bytes(nodes)  # rank 0's manifests, on node 0 and on its replica (node 1)
    for per_node in (bare, manifest):  # latest, then the restore's step
        if scheme == "holders" and per_node == manifest:
            continue  # (every manifest it reads is here)
        if scheme == "ask_all":  # symmetric: every node alike (``exact=True`` counts it pair by pair)
            for _ in range(RANKS):
                if exact:
                    before = snapshot()
                    for x in range(nodes):
                        for y in range(nodes):
                            if x != y:
                                ask(x, y, per_node)
                    time_s += round_time(before)
                    continue
                pages = max(1, math.ceil(per_node / PAGE_BYTES)) * (nodes - 1)
                for c in (sent, served):
                    c.update(dict.fromkeys(range(nodes), pages))
                for c in (out_b, in_b):
                    c.update(dict.fromkeys(range(nodes), per_node * (nodes - 1)))
                time_s += 4 * pages * m.cpu_per_msg + per_node * (nodes - 1) / m.nic_bw
        elif scheme in ("doubling", "holders"):
            for k in range(1, levels(nodes) + 1):
                before = snapshot()
                for x in range(nodes):
                    p = partner(x, k, nodes)
                    if p is not None:
                        block = span(p, k - 1, nodes)
                        extra = zero * len({0, 1} & set(block)) if scheme == "holders" else 0
                        ask(x, p, len(block) * per_node + extra)
                time_s += round_time(before)
        elif scheme == "hub":
            before = snapshot()
            for x in range(1, nodes):
                ask(0, x, per_node)  # the hub gathers
            time_s += round_time(before)
            before = snapshot()
            for x in range(1, nodes):
                ask(x, 0, nodes * per_node)  # and answers everyone
            time_s += round_time(before)
        else:
            raise ValueError(f"unknown scheme {scheme!r}")
    per = [sent[x] for x in range(nodes)]
    return {
        "nodes": nodes, "scheme": scheme, "node_manifest_bytes": manifest, "node_bare_bytes": bare,
        "requests_total": sum(per), "requests_per_node_max": max(per), "served_max": max(served.values()),
        "in_bytes_max": max(in_b.values()), "out_bytes_max": max(out_b.values()), "time_s": time_s,
    }
