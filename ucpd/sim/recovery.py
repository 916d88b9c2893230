"""Restart planning at scale: a job that lost nodes restarts on the survivors with another layout.

The saved job: ``nodes`` x 8 ranks, TP=8 inside a node, PP=``pp`` stages, DP over the rest
(node ``i`` holds stage ``i % pp``, data-parallel index ``i // pp``). Each (stage, TP rank) has
its bf16 weights (held by every DP replica) and its optimizer state sharded ZeRO-1 across DP
(one flat fp32 buffer per (stage, TP rank), cut in DP equal ranges). The new job: the
survivors, renumbered densely, the same TP and PP, a smaller DP, so every ZeRO partition moves.

- source choice: per saved part, the team's own choice (``ucpd.team.decide.best_copy``) over its
  copies — the old owner's RAM if it survived, else the live replica holders it was copied to
  (``holders.HolderRing`` of the view it was protected in, O(R) per part); ``balance=True``
  passes the bytes already assigned per node, so the least-loaded candidate of equal cost wins
  instead of the lowest rank; ``split=True`` reads each part that crosses the network from all
  its live copies in equal shares (the owner's RAM and its holders), as ``team.sources`` does
  (``PeerRead.spread``): a lost node's holders split its part, and a holder busy with one sends
  its own slivers from its copies too; ``split="pull"`` models what ``team/fetch.py`` does (each
  reader pulls from every copy at once, a copy shared equally by the reads open on it: a fluid
  model); ``split="best"`` splits each part's reads over its copies
  as unevenly as it takes to make the busiest source the least loaded any split can (an oracle
  that knows every node's load: the bound for any choice of sources).
- :func:`plan_rank` — one new rank's plan with the real ``ucpd.ucl.resolve`` + ``plan_restore``;
  ``indexed=True`` hands the planner only the saved pieces that overlap the target (a sorted
  index, ``numpy.searchsorted``), ``False`` every piece of the tensor (what
  ``daemon/restore.plan`` does with a ``SourceSet``).
- :func:`simulate` — bytes per source node, per destination node and per rack uplink for the
  whole restart, the most loaded node and link against the average, and the time the bandwidth
  model gives (the slowest of NIC egress, NIC ingress and rack uplinks).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..team.decide import Copy, best_copy
from ..team.holders import HolderRing
from ..ucl.placements import Box
from ..ucl.plan import SourcePiece, plan_restore
from ..ucl.resolve import resolve
from ..ucl.geometry import GBox, View
from .network import NetModel, Topology

__all__ = ["Layout", "copies_of", "plan_rank", "simulate"]

TP = 8
PARAMS = 70.6e9
WEIGHT_B = 2  # bf16 weights, held by every DP replica (stored once per node)
OPTIM_B = 14  # fp32 master + Adam m, v (12 B) and 2 B more: 16 B/param in all, 1.13 TB at 70.6 B params


@dataclass(frozen=True)
class Layout:
    nodes: int  # node count of the job
    pp: int = 8

    @property
    def dp(self) -> int:
        return self.nodes // self.pp

    def stage(self, node: int) -> int:
        return node % self.pp

    def dp_index(self, node: int) -> int:
        return node // self.pp

    def optim_elems(self) -> int:
        """fp32-equivalent elements of one (stage, TP rank) optimizer buffer (4-byte units)."""
        return int(PARAMS * OPTIM_B / 4 / (self.pp * TP))

    def weight_bytes(self) -> int:
        return int(PARAMS * WEIGHT_B / (self.pp * TP))

    def bounds(self) -> np.ndarray:
        """ZeRO partition edges over DP of one optimizer buffer (dp + 1 offsets), computed once."""
        return _bounds(self.optim_elems(), self.dp)


@lru_cache(maxsize=16)
def _bounds(elems: int, dp: int) -> np.ndarray:
    return np.arange(dp + 1, dtype=np.int64) * elems // dp


def copies_of(origin: int, live: set[int], placed_on: HolderRing, replicas: int) -> list[Copy]:
    """The live copies of saved node ``origin``'s part: its own RAM if it is live, and the holders
    it was copied to when the version was protected (``placed_on``: the ring of the view then)."""
    own = [Copy(origin, origin)] if origin in live else []
    return own + [Copy(h, origin) for h in placed_on.holders(origin, replicas) if h in live]


def _pieces(old: Layout, stage: int, src_of: dict[int, int], lo: int, hi: int, indexed: bool, bounds: np.ndarray) -> list[SourcePiece]:
    """Saved pieces of one optimizer buffer: all DP ranges, or only those overlapping [lo, hi)."""
    if indexed:
        first = int(np.searchsorted(bounds, lo, side="right")) - 1
        last = int(np.searchsorted(bounds, hi, side="left"))
        ks = range(max(first, 0), min(last, old.dp))
    else:
        ks = range(old.dp)
    e = int(bounds[-1])
    out = []
    for k in ks:
        a, b = int(bounds[k]), int(bounds[k + 1])
        origin = k * old.pp + stage
        out.append(SourcePiece((src_of.get(origin), origin), View(0, (b - a,), (1,)), GBox((a,), (b - a,)), (e,)))
    return out


def plan_rank(old: Layout, new: Layout, new_node: int, tp: int, src_of: dict[int, int], *, indexed: bool = True):
    """Plan one new rank's optimizer partition with the real UCL planner; returns the CopyPlan."""
    stage = new.stage(new_node)
    nb = new.bounds()
    k = new.dp_index(new_node)
    lo, hi = int(nb[k]), int(nb[k + 1])
    e = new.optim_elems()
    name = f"optim.pp{stage}.tp{tp}"
    frags = resolve(name, Box((lo,), (hi - lo,), (e,)), (hi - lo,))
    srcs = {name: _pieces(old, stage, src_of, lo, hi, indexed, old.bounds())}
    return plan_restore(frags, srcs)


def _pull(sent: np.ndarray, demand: dict[tuple[int, int], float], shares: dict[int, list[int]], bw: float) -> None:
    """Add to ``sent`` what each copy serves when every reader pulls its bytes of a part from all
    the part's copies at once (``team/fetch.py``), in a fluid model: a copy sends at ``bw``,
    shared equally by the reads open on it, and a read ends when its bytes are in. A copy many
    reads share serves each slowly, so the reads' other copies serve more of them."""
    pairs = list(demand.items())
    rem = np.array([d for _, d in pairs])
    sp = np.array([i for i, ((_, o), _) in enumerate(pairs) for _ in shares[o]])
    sn = np.array([c for (_, o), _ in pairs for c in shares[o]])
    n = len(sent)
    while True:
        open_ = rem > 1e-3
        if not open_.any():
            break
        on = open_[sp]
        per_node = np.bincount(sn[on], minlength=n)
        rate = np.where(on, bw / np.maximum(per_node[sn], 1), 0.0)
        pair_rate = np.bincount(sp, weights=rate, minlength=len(pairs))
        dt = float(np.min(rem[open_] / pair_rate[open_]))  # until the next read ends
        rem = np.where(open_, rem - pair_rate * dt, 0.0)
        rem[rem < 1e-3 * np.maximum(1.0, pair_rate * dt)] = 0.0
        sent += np.bincount(sn, weights=rate * dt, minlength=n)


def _water_fill(sent: np.ndarray, demand: dict[int, float], shares: dict[int, list[int]], rounds: int = 60) -> None:
    """Add to ``sent`` each origin's ``demand`` split over its copies (``shares``) so that the
    busiest source is as little loaded as any split can make it: each origin in turn pours its
    bytes into its least-loaded copies up to one level, until no origin moves its share (the
    least-squares split, which for divisible loads is also the min-max one)."""
    split = {o: np.full(len(shares[o]), d / len(shares[o])) for o, d in demand.items()}
    for o, x in split.items():
        np.add.at(sent, shares[o], x)
    for _ in range(rounds):
        moved = 0.0
        for o, d in demand.items():
            nodes = shares[o]
            np.subtract.at(sent, nodes, split[o])
            base = sent[nodes]
            order = np.sort(base)
            level = order[0] + d
            for k in range(1, len(order) + 1):  # the level where the poured bytes fill the lowest k
                level = (d + order[:k].sum()) / k
                if k == len(order) or level <= order[k]:
                    break
            x = np.maximum(0.0, level - base)
            moved = max(moved, float(np.abs(x - split[o]).max()))
            split[o] = x
            np.add.at(sent, nodes, x)
        if moved < 1.0:
            break


def simulate(nodes: int, *, lost: str = "random", fraction: float = 0.01, rack_size: int = 32, replicas: int = 1,
             domain: bool = True, balance: bool = False, split: bool = False, seed: int = 0, net: NetModel | None = None,
             sample_ranks: int = 16, pp: int = 8, keep_stage: bool = True) -> dict:
    """One restart of ``nodes`` nodes after losing ``fraction`` of them (``lost="random"``) or
    one whole rack (``lost="rack"``); see the module docstring."""
    net = net or NetModel()
    topo = Topology(nodes, rack_size)
    rng = random.Random(seed)
    if lost == "rack":
        dead = set(topo.rack_nodes(rng.randrange(topo.racks)))
    else:
        dead = set(rng.sample(range(nodes), max(1, round(nodes * fraction))))
    survivors = [i for i in range(nodes) if i not in dead]
    domains = topo.domains() if domain else None
    live, placed_on = set(survivors), HolderRing(range(nodes), domains)  # protected while every node was live
    old = Layout(nodes, pp)
    if keep_stage:  # the launcher gives each survivor the stage it saved: weights stay put
        by_stage = [[i for i in survivors if old.stage(i) == s] for s in range(pp)]
        new = Layout(pp * min(map(len, by_stage)), pp)
        place = [by_stage[j % pp][j // pp] for j in range(new.nodes)]
    else:  # survivors renumbered densely: most nodes change stage
        new = Layout(len(survivors) - len(survivors) % pp, pp)
        place = survivors[: new.nodes]  # new node j runs on physical node place[j]

    # --- source choice, per saved node part ----------------------------------------------------
    t0 = time.perf_counter()
    load = np.zeros(nodes) if balance else None
    src_of: dict[int, int] = {}
    shares: dict[int, list[int]] = {}  # origin -> the nodes that serve its part, in equal shares
    part_bytes = old.optim_elems() * 4 // old.dp * TP  # a node's optimizer part (8 TP ranks)
    unrecoverable = []
    for origin in range(nodes):
        copies = copies_of(origin, live, placed_on, replicas)
        best = best_copy(copies, None, load)
        s = best.node if best is not None else None
        if s is None or (s in dead):
            unrecoverable.append(origin)
            continue
        src_of[origin] = s
        shares[origin] = [c.node for c in copies] if split else [s]
        if load is not None:
            for n in shares[origin]:
                load[n] += part_bytes / len(shares[origin])
    choose_s = time.perf_counter() - t0

    # --- bytes moved: optimizer partitions (interval overlaps) and weights ---------------------
    sent = np.zeros(nodes)
    recv = np.zeros(nodes)
    ob, nb = old.bounds(), new.bounds()
    demand: dict = {}  # origin (``split="best"``) or (reader, origin) (``"pull"``) -> bytes read of its part
    unit = 4 * TP  # bytes per element, all 8 TP ranks of a node move together
    for j in range(new.nodes):
        dst = place[j]
        stage, k = new.stage(j), new.dp_index(j)
        lo, hi = int(nb[k]), int(nb[k + 1])
        first = int(np.searchsorted(ob, lo, side="right")) - 1
        for q in range(first, old.dp):
            a, b = max(lo, int(ob[q])), min(hi, int(ob[q + 1]))
            if a >= b:
                if int(ob[q]) >= hi:
                    break
                continue
            origin = q * old.pp + stage
            srcs = shares.get(origin)
            if srcs is None or dst in srcs:
                continue  # lost (counted above), or already in this node's RAM
            if split in ("best", "pull"):
                demand[(dst, origin) if split == "pull" else origin] = \
                    demand.get((dst, origin) if split == "pull" else origin, 0.0) + (b - a) * unit
            else:
                for src in srcs:
                    sent[src] += (b - a) * unit / len(srcs)
            recv[dst] += (b - a) * unit
    if demand and split == "best":
        _water_fill(sent, demand, shares)
    elif demand:
        _pull(sent, demand, shares, net.nic_bw)
    # weights: a node that runs another stage than it saved reads the stage's weights (all TP
    # ranks) from a live node that saved that stage, spread round robin over them
    holders_of = {s: [i for i in survivors if old.stage(i) == s] for s in range(pp)}
    turn = dict.fromkeys(range(pp), 0)
    wbytes = old.weight_bytes() * TP
    for j in range(new.nodes):
        dst = place[j]
        stage = new.stage(j)
        if old.stage(dst) == stage:
            continue
        hs = holders_of[stage]
        src = hs[turn[stage] % len(hs)]
        turn[stage] += 1
        sent[src] += wbytes
        recv[dst] += wbytes

    # --- links: NIC egress/ingress per node, uplinks per rack -----------------------------------
    racks = np.arange(nodes) // rack_size
    # traffic leaving a rack = bytes sent by its nodes to other racks; approximated by the bytes
    # its nodes send times the share of destinations outside the rack (all-to-all spread)
    out_share = 1.0 - rack_size / nodes
    up = np.bincount(racks, weights=sent, minlength=topo.racks) * out_share
    down = np.bincount(racks, weights=recv, minlength=topo.racks) * out_share
    active_src = sent[sent > 0]
    t_egress = sent.max() / net.nic_bw
    t_ingress = recv.max() / net.nic_bw
    t_uplink = max(up.max(), down.max()) / net.uplink_bw

    # --- planning per rank, real planner, sampled ranks -----------------------------------------
    times = {"indexed": [], "all_pieces": []}
    copies = []
    for _ in range(sample_ranks):
        j, tp = rng.randrange(new.nodes), rng.randrange(TP)
        for mode in ("indexed", "all_pieces"):
            t0 = time.perf_counter()
            plan = plan_rank(old, new, j, tp, src_of, indexed=mode == "indexed")
            times[mode].append(time.perf_counter() - t0)
        copies.append(len(plan.copies))
    total = PARAMS * (WEIGHT_B + OPTIM_B)
    return {
        "nodes": nodes, "lost": lost, "dead": len(dead), "survivors": len(survivors), "new_nodes": new.nodes,
        "replicas": replicas, "domain": domain, "balance": balance, "split": split, "keep_stage": keep_stage,
        "unrecoverable_parts": len(unrecoverable),
        "state_bytes": total,
        "moved_bytes": float(sent.sum()),
        "busiest_source": int(sent.argmax()),
        "source_max_bytes": float(sent.max()), "source_mean_bytes": float(active_src.mean()) if active_src.size else 0.0,
        "source_max_over_mean": float(sent.max() / active_src.mean()) if active_src.size else 0.0,
        "dest_max_bytes": float(recv.max()), "dest_mean_bytes": float(recv[recv > 0].mean()) if (recv > 0).any() else 0.0,
        "uplink_max_bytes": float(max(up.max(), down.max())), "uplink_mean_bytes": float(up.mean()),
        "uplink_max_over_mean": float(up.max() / up.mean()) if up.mean() else 0.0,
        "time_s": float(max(t_egress, t_ingress, t_uplink)),
        "time_parts_s": {"egress": float(t_egress), "ingress": float(t_ingress), "uplink": float(t_uplink)},
        "choose_sources_s": choose_s,
        "plan_rank_s": {k: float(np.median(v)) for k, v in times.items()},
        "copies_per_rank": float(np.median(copies)),
    }
