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
- ``index`` — what ``ucpd serve`` does in a large team when the job restarts in *another*
  layout (the survivors of a 1% random loss, each keeping its pipeline stage, a smaller DP:
  every ZeRO range moves): the gather without manifests for ``latest``, then the piece index
  (``team.piece_index``, its real ``owners``, ``owner``, ``partner``, ``folded``, ``buckets``
  and the wire size of its records): the fold and ⌈log₂ P⌉ halving levels, each node receiving
  the pieces of the keys it keeps from its partner's block; then each rank's queries for the
  boxes no part of its node holds whole (its ZeRO range: its weights are its own), one request
  an owner; then the manifests of the ranks named, asked of every live copy of each (one
  request a rank and copy, as ``holder_answers`` asks per restore), and of the rank of its own
  number in the saved world. Its own part's replicas are not counted as local (a slight
  overcount of requests);
- ``hub`` — for comparison, a directory on one node (a metadata server): each node asks it
  once, it asks every node once and sends the whole set once per node.

Time (model): per round (a level, or an all-to-all round), the slowest node's CPU for the
messages it sends and receives (``NetModel.cpu_per_msg`` each, a request and its answer) plus
its bytes over its NIC (the larger of egress and ingress); rounds one after the other.
Decoding the manifests in Python, the same in every scheme that ships them all, is left out.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import msgpack

import numpy as np

from ..team import piece_index as pi
from ..team.directory import PAGE_BYTES, levels, partner, span
from ..team.holders import HolderRing
from .network import NetModel, Topology
from .recovery import OPTIM_B, PARAMS, TP, WEIGHT_B, Layout, copies_of

__all__ = ["index_wire", "node_bytes", "simulate"]

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


def _weight_names(layout: Layout, stage: int) -> list[str]:
    layers = LAYERS // layout.pp
    return [f"model.layers.{stage * layers + i}.t{k}.weight" for i in range(layers) for k in range(12)]


def index_wire() -> tuple[int, int]:
    """Bytes of a piece-index record on the wire: (a key with one piece, each piece more)."""
    key = ("model.layers.41.t7.weight", 5)
    one = {key: ("bfloat16", (8192, 4311), {(1234567, (2048, 0), (1024, 4311))})}
    two = {key: ("bfloat16", (8192, 4311), {(1234567, (2048, 0), (1024, 4311)), (7654321, (2048, 0), (1024, 4311))})}
    a, b = (len(msgpack.packb(pi.to_wire(e)[0], use_bin_type=True)) for e in (one, two))
    return a, b - a


def _index_restart(nodes: int, ask, snapshot, round_time, seed: int = 0, replicas: int = 1) -> float:
    """The index's rounds of a restart in another layout (``scheme="index"``): its modelled time."""
    old = Layout(nodes)
    pp, dp = old.pp, old.dp
    key_b, piece_b = index_wire()
    elems = old.optim_elems()
    ob = old.bounds()
    p = pi.owners(nodes)
    # every key and the saved nodes that add a piece to it: a weight key (name, bucket) gets one
    # piece from each node of its stage; an optimizer key (stage, TP rank, bucket) one from each
    # node of its stage whose ZeRO range lies in the bucket
    w_owner = {s: np.array([pi.owner((n, b), p) for n in _weight_names(old, s) for b in range(pi.BUCKETS)])
               for s in range(pp)}
    o_keys = []  # (owner, stage, first DP index, last + 1)
    for s in range(pp):
        for t in range(TP):
            for b in range(pi.BUCKETS):
                ds = [d for d in range(dp) if b in pi.buckets((elems,), (int(ob[d]),), (int(ob[d + 1] - ob[d]),))]
                if ds:
                    o_keys.append((pi.owner((f"optim.s{s}.tp{t}", b), p), s, ds[0], ds[-1] + 1))
    idx = np.arange(p)

    def stage_count(lo, hi, s, dlo=0, dhi=None):
        """Nodes y = s + pp*d in [lo, hi) with dlo <= d < dhi, for arrays lo, hi."""
        first = np.maximum(-(-(lo - s) // pp), dlo)
        last = np.minimum(-(-(hi - s) // pp), dp if dhi is None else dhi)
        return np.maximum(0, last - first)

    time_s = 0.0
    before = snapshot()  # level 0: the nodes past the owners fold into them
    for i in range(p):
        if pi.folded(i, nodes) is not None:
            ask(i, pi.folded(i, nodes), TP * (len(w_owner[0]) // pi.BUCKETS * 2 * piece_b + 2 * key_b))
    time_s += round_time(before)
    for k in range(1, p.bit_length()):
        before = snapshot()
        m = 1 << k
        partner_lo = (pi.partner(idx, k) >> (k - 1)) << (k - 1)  # the partner's block at level k - 1
        lo = partner_lo
        hi = partner_lo + (1 << (k - 1))
        hi2 = np.where(hi >= p, nodes, hi)  # (its folded nodes count with the owners they fold into)
        pieces = np.zeros(p)
        keys = np.zeros(p)
        for s in range(pp):
            hist = np.bincount(w_owner[s] % m, minlength=m)[idx % m]
            c = stage_count(lo, hi, s) + stage_count(lo + p, np.minimum(hi2 + p, nodes), s)
            pieces += c * hist
            keys += (c > 0) * hist
        for o, s, dlo, dhi in o_keys:
            c = (stage_count(lo, hi, s, dlo, dhi) + stage_count(lo + p, np.minimum(hi2 + p, nodes), s, dlo, dhi))
            hit = (o % m == idx % m)
            pieces += hit * c
            keys += hit * (c > 0)
        for i in range(p):
            nbytes = int(keys[i] * key_b + max(0, pieces[i] - keys[i]) * piece_b)
            for _ in range(max(1, -(-int(pieces[i]) // pi.PAGE_PIECES))):
                ask(i, pi.partner(i, k), nbytes // max(1, -(-int(pieces[i]) // pi.PAGE_PIECES)))
        time_s += round_time(before)

    # the restart: 1% random loss, survivors keep their stage, DP = the fewest survivors of a stage
    rng = random.Random(seed)
    topo = Topology(nodes, 32)
    dead = set(rng.sample(range(nodes), max(1, round(nodes * 0.01))))
    survivors = [i for i in range(nodes) if i not in dead]
    live, ring = set(survivors), HolderRing(range(nodes), topo.domains())
    by_stage = [[i for i in survivors if old.stage(i) == s] for s in range(pp)]
    new = Layout(pp * min(map(len, by_stage)), pp)
    nb = new.bounds()
    before = snapshot()  # each rank asks the owners of the buckets of its ZeRO range
    reads: list[tuple[int, set[int]]] = []  # (node, saved nodes whose parts a rank reads)
    for j in range(new.nodes):
        x = by_stage[j % pp][j // pp]
        s, lo, hi = j % pp, int(nb[j // pp]), int(nb[j // pp + 1])
        d_own = old.dp_index(x)
        for t in range(TP):
            need = {q * pp + s for q in range(dp) if ob[q] < hi and lo < ob[q + 1]}
            if not (ob[d_own] <= lo and hi <= ob[d_own + 1]):
                for b in pi.buckets((elems,), (lo,), (hi - lo,)):
                    ask(x, pi.owner((f"optim.s{s}.tp{t}", b), p), 120)
            need.discard(x)
            need.add(j)  # the part of its own rank number in the saved world (saved node j)
            reads.append((x, need - {x}))
    time_s += round_time(before)
    before = snapshot()  # then the manifests of the parts named, from every live copy
    one = rank_bytes(nodes)
    for x, origins in reads:
        for origin in origins:
            for c in copies_of(origin, live, ring, replicas):
                if c.node != x:
                    ask(x, c.node, one)
    time_s += round_time(before)
    return time_s


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
        if scheme in ("holders", "index") and per_node == manifest:
            if scheme == "index":
                time_s += _index_restart(nodes, ask, snapshot, round_time)
            continue  # (every manifest it reads is here, or named by the index)
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
        elif scheme in ("doubling", "holders", "index"):
            for k in range(1, levels(nodes) + 1):
                before = snapshot()
                for x in range(nodes):
                    p = partner(x, k, nodes)
                    if p is not None:
                        block = span(p, k - 1, nodes)
                        extra = zero * len({0, 1} & set(block)) if scheme != "doubling" else 0
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
