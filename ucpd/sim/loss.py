"""Placement and the probability that a version is lost: closed form, checked by Monte Carlo.

Schemes (``--replicas R``, ``--parity K`` XOR, ``--parity K+M`` Reed-Solomon, with or without
``--domain`` racks) are placed by the real ``ucpd.team.holders`` code; Gemini's group
placement (SOSP'23: groups of ``m`` consecutive nodes holding each other's checkpoints) is
the comparison. Failure models: every node fails independently with probability ``p`` before
the version is replaced, or one whole rack fails.

A version is lost when some node's part has no live copy: for replicas, the node and its R
holders all failed; for a parity group, more than M members failed; for Gemini, a whole group.

Closed forms (independent failures, N nodes): replicas on a ring, ``1 - (1 - p^(R+1))^N``
(to first order: the R+1 consecutive ring nodes of one origin all fail; exact in the limit of
small p); a group of g members with M parity, ``1 - (1 - P[Bin(g, p) > M])^groups``; Gemini,
``1 - (1 - p^m)^(N/m)``. Under a rack failure the answer is 0 or 1 per rack, counted exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

import numpy as np

from ..team.holders import HolderRing, parity_groups
from .network import Topology

__all__ = ["Scheme", "holders_table", "evaluate"]

@dataclass(frozen=True)
class Scheme:
    name: str
    kind: str  # "replicas" | "parity" | "gemini"
    r: int = 0  # replicas
    k: int = 0  # parity data
    m: int = 0  # parity blocks, or Gemini's group size
    domain: bool = False

    @property
    def overhead(self) -> float:
        """Extra RAM per byte of state."""
        return {"replicas": float(self.r), "parity": self.m / max(self.k, 1), "gemini": float(self.m - 1)}[self.kind]


def holders_table(topo: Topology, r: int, domain: bool) -> np.ndarray:
    """``[N, r]`` replica holders with every node live: the real placement rule
    (``holders.HolderRing``, O(R) per origin) for every origin."""
    domains = topo.domains() if domain else None
    ring = HolderRing(range(topo.nodes), domains)
    return np.array([ring.holders(origin, r) for origin in range(topo.nodes)])


def _groups(topo: Topology, s: Scheme) -> list[tuple[int, ...]]:
    if s.kind == "parity":
        return [g.members for g in parity_groups(topo.nodes, s.k, s.m, topo.domains() if s.domain else None)]
    n, m = topo.nodes, s.m  # Gemini: consecutive groups of m; the remainder joins the last group
    starts = list(range(0, n - n % m, m))
    groups = [tuple(range(a, a + m)) for a in starts]
    if n % m:
        groups[-1] = groups[-1] + tuple(range(n - n % m, n))
    return groups


def closed_form(topo: Topology, s: Scheme, p: float, groups=None) -> float:
    n = topo.nodes
    if s.kind == "replicas":
        return 1 - (1 - p ** (s.r + 1)) ** n
    groups = groups if groups is not None else _groups(topo, s)
    keep = 1.0
    for g in groups:
        tol = s.m if s.kind == "parity" else len(g) - 1
        lost = sum(comb(len(g), j) * p**j * (1 - p) ** (len(g) - j) for j in range(tol + 1, len(g) + 1))
        keep *= 1 - lost
    return 1 - keep


def _lost(fail: np.ndarray, s: Scheme, table, groups_idx) -> np.ndarray:
    """Per trial (rows of ``fail``, a [T, N] bool array): whether the version is lost."""
    if s.kind == "replicas":
        all_gone = fail.copy()
        for c in range(table.shape[1]):
            all_gone &= fail[:, table[:, c]]
        return all_gone.any(axis=1)
    order, starts, tol = groups_idx
    counts = np.add.reduceat(fail[:, order].astype(np.int32), starts, axis=1)
    return (counts > tol[None, :]).any(axis=1)


def evaluate(topo: Topology, s: Scheme, *, p: float = 0.01, trials: int = 2000, seed: int = 0, chunk: int = 250) -> dict:
    """Loss probability of ``s`` under independent failures (closed form and Monte Carlo) and
    under one whole-rack failure (every rack tried), and its memory overhead."""
    rng = np.random.default_rng(seed)
    table = holders_table(topo, s.r, s.domain) if s.kind == "replicas" else None
    groups_idx = None
    groups = None
    if s.kind != "replicas":
        groups = _groups(topo, s)
        order = np.array([n for g in groups for n in g])
        starts = np.cumsum([0] + [len(g) for g in groups[:-1]])
        tol = np.array([s.m if s.kind == "parity" else len(g) - 1 for g in groups])
        groups_idx = (order, starts, tol)
    lost = 0
    for a in range(0, trials, chunk):
        t = min(chunk, trials - a)
        lost += int(_lost(rng.random((t, topo.nodes)) < p, s, table, groups_idx).sum())
    racks_lost = 0
    for rack in range(topo.racks):
        fail = np.zeros((1, topo.nodes), dtype=bool)
        fail[0, list(topo.rack_nodes(rack))] = True
        racks_lost += int(_lost(fail, s, table, groups_idx)[0])
    return {
        "scheme": s.name, "domain": s.domain, "overhead": s.overhead, "p": p,
        "independent_closed": closed_form(topo, s, p, groups), "independent_mc": lost / trials, "trials": trials,
        "rack_failure_lost": racks_lost / topo.racks,
    }
