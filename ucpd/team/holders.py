"""Who holds a node's redundancy: its replica holders and its parity group (pure, failure-domain aware).

- :func:`replica_holders` — the R nodes that keep full copies of a node's part: the next live
  nodes on a ring, preferring other failure domains (rack, switch); :class:`HolderRing` answers
  it for many origins of one view in O(R) each.
- :func:`parity_groups` / :func:`group_of` — a partition of the nodes into erasure-coding groups
  of ``k + m`` members, one member per failure domain where possible.
- :func:`parse_parity` — the ``--parity`` option: ``"K"`` (XOR, m=1) or ``"K+M"`` (Reed-Solomon).

A domain map ``{node: label}`` names each node's failure domain; ``None`` (or a node missing from
the map) makes a node its own domain. Everything here is deterministic: every daemon computes the
same answer from the same inputs, so none of it needs to be agreed on over the wire.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Group", "HolderRing", "group_of", "parity_groups", "parse_parity", "replica_holders", "MAX_GROUP"]

MAX_GROUP = 256
"""Most blocks a Reed-Solomon codeword can have over GF(2^8) (k + m <= 256)."""


def _domain_key(node: int, domains: Mapping[int, str] | None) -> Hashable:
    if domains is None or node not in domains:
        return ("node", node)
    return ("domain", domains[node])


def interleaved(nodes: Iterable[int], domains: Mapping[int, str] | None) -> list[int]:
    """``nodes`` in ring order: sorted without domains, else round-robin over the domains.

    Domains are taken in order of their smallest node, and nodes in increasing order within a
    domain (racks A={0,1}, B={2,3} give 0, 2, 1, 3), so that consecutive nodes on the ring sit in
    different domains whenever the domains allow it.
    """
    ordered = sorted(set(nodes))
    if domains is None:
        return ordered
    by_domain: dict[Hashable, list[int]] = {}
    for n in ordered:
        by_domain.setdefault(_domain_key(n, domains), []).append(n)
    lists = list(by_domain.values())
    return [lst[i] for i in range(max(map(len, lists), default=0)) for lst in lists if i < len(lst)]


def replica_holders(
    origin: int, live: Sequence[int], replicas: int, domains: Mapping[int, str] | None = None
) -> list[int]:
    """The nodes that hold copies of ``origin``'s part, first choice first.

    Walks the ring after ``origin`` (without domains: origin+1, origin+2, ... over the sorted
    ``live`` nodes, wrapping around; with domains: the domain-interleaved order of the live nodes
    and of every node in ``domains``, dead ones skipped), taking first nodes whose domain differs
    from origin's and from those already chosen, then nodes outside origin's domain, then any.
    ``origin`` itself is never a holder. Without domains and with all nodes live, every node holds
    exactly ``replicas`` parts (balanced); with equal-sized domains and ``replicas`` below the
    number of domains too.

    O(N log N) per call (it builds the ring): a caller asking for many origins over one view
    keeps a :class:`HolderRing`, O(R) per origin.

    Returns:
        Up to ``replicas`` distinct live nodes; fewer when not enough are live (the caller reports
        the part as degraded).

    Raises:
        ValueError: ``replicas`` is negative.
    """
    return HolderRing(live, domains).holders(origin, replicas)


class HolderRing:
    """:func:`replica_holders` over one view (``live``, ``domains``), for any number of origins:
    the ring is built once, and each :meth:`holders` walks it from the origin, stopping at the
    R-th holder — O(R) when consecutive ring nodes sit in different domains (the interleaving
    makes them so wherever the domains allow), instead of O(N log N) per call."""

    def __init__(self, live: Iterable[int], domains: Mapping[int, str] | None = None) -> None:
        self.live = frozenset(live)
        self.domains = domains
        self._ring = interleaved(self.live | set(domains or ()), domains)
        self._at = {n: i for i, n in enumerate(self._ring)}

    def holders(self, origin: int, replicas: int) -> list[int]:
        """The nodes that hold copies of ``origin``'s part, first choice first (see
        :func:`replica_holders`)."""
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        ring, at = self._ring, self._at.get(origin)
        if at is not None:
            start, span = at + 1, len(ring) - 1
        elif self.domains is None:  # the ring is sorted: origin's place in it is where it would go
            start, span = bisect.bisect_right(ring, origin), len(ring)
        else:  # a dead origin outside the domain map changes the interleaving: build its own ring
            return HolderRing(self.live | {origin}, self.domains).holders(origin, replicas)
        return self._choose(origin, replicas, start, span)

    def _choose(self, origin: int, replicas: int, start: int, span: int) -> list[int]:
        ring, live, domains = self._ring, self.live, self.domains
        n = len(ring)
        alive = len(live) - (origin in live)

        def candidates():
            for i in range(start, start + span):
                node = ring[i % n]
                if node in live and node != origin:
                    yield node

        chosen: list[int] = []
        home = _domain_key(origin, domains)
        avoid = {home}
        while len(chosen) < min(replicas, alive):
            picked = False
            for node in candidates():
                key = _domain_key(node, domains)
                if node not in chosen and key not in avoid:
                    chosen.append(node)
                    avoid.add(key)
                    picked = True
                    if len(chosen) == replicas:
                        break
            if not picked:
                # Every remaining node shares a domain already used: allow repeats outside origin's
                # domain first, then origin's own domain.
                avoid = {home} if avoid != {home} else set()
        return chosen


@dataclass(frozen=True)
class Group:
    """One erasure-coding group: ``members`` (sorted) with ``k`` data and ``m`` parity per codeword."""

    index: int
    members: tuple[int, ...]
    k: int
    m: int


def _check_km(k: int, m: int) -> None:
    if not isinstance(k, int) or not isinstance(m, int) or k < 1 or m < 1:
        raise ValueError(f"parity needs k >= 1 data and m >= 1 parity blocks, got k={k}, m={m}")
    if m >= 2 and k + m > MAX_GROUP:
        raise ValueError(f"Reed-Solomon groups hold at most {MAX_GROUP} nodes, got k+m={k + m}")


def _group_sizes(nodes: int, k: int, m: int) -> list[int]:
    width = k + m
    full, rest = divmod(nodes, width)
    sizes = [width] * full
    if rest >= m + 1:
        sizes.append(rest)  # its own group, with k' = rest - m
    else:
        for i in range(rest):  # too few for a group of their own: join existing ones
            sizes[i % full] += 1
    return sizes


def _fill(sizes: Sequence[int], domains: Mapping[int, str] | None, nodes: int) -> list[list[int]]:
    """Deal ``range(nodes)`` into groups of ``sizes``, spreading each group over the domains.

    Each slot takes the smallest remaining node of the domain with the most remaining nodes
    among those not yet in the group (among all, when every remaining domain already is).
    """
    if domains is None:
        out, start = [], 0
        for s in sizes:
            out.append(list(range(start, start + s)))
            start += s
        return out
    pools: dict[Hashable, list[int]] = {}
    for n in range(nodes):
        pools.setdefault(_domain_key(n, domains), []).append(n)
    order = list(pools)  # domains by their smallest node: the tie-break
    out = []
    for s in sizes:
        members: list[int] = []
        used: set[Hashable] = set()
        for _ in range(s):
            live = [d for d in order if pools[d]]
            fresh = [d for d in live if d not in used] or live
            best = max(fresh, key=lambda d: len(pools[d]))  # first of the largest on ties
            members.append(pools[best].pop(0))
            used.add(best)
        out.append(sorted(members))
    return out


def parity_groups(nodes: int, k: int, m: int, domains: Mapping[int, str] | None = None) -> list[Group]:
    """Partition ``range(nodes)`` into parity groups of ``k + m`` members.

    A remainder ``r = nodes % (k + m)`` forms its own group (``k' = r - m``) when ``r >= m + 1``;
    otherwise its nodes join the first groups, one each (raising their ``k``). With ``domains``,
    each group's members are in distinct domains where possible (racks of 4 nodes and groups of
    4 take one node per rack). Without, groups are consecutive ranges.

    Raises:
        ValueError: ``nodes < m + 1``, ``k < 1``, ``m < 1``, or a Reed-Solomon group over 256.
    """
    _check_km(k, m)
    if not isinstance(nodes, int) or nodes < m + 1:
        raise ValueError(
            f"{nodes} node(s) cannot carry {m} parity block(s) per group: need at least {m + 1} "
            f"nodes (lower m, or use replicas instead)"
        )
    sizes = _group_sizes(nodes, k, m)
    if m >= 2 and max(sizes) > MAX_GROUP:
        raise ValueError(f"Reed-Solomon groups hold at most {MAX_GROUP} nodes; use a smaller k")
    return [
        Group(index=i, members=tuple(members), k=len(members) - m, m=m)
        for i, members in enumerate(_fill(sizes, domains, nodes))
    ]


def group_of(groups: Sequence[Group], node: int) -> Group:
    """The group that ``node`` belongs to.

    Raises:
        KeyError: ``node`` is in none of ``groups``.
    """
    for g in groups:
        if node in g.members:
            return g
    covered = sum(len(g.members) for g in groups)
    raise KeyError(f"node {node} is in no parity group (the groups cover {covered} nodes)")


_PARITY = re.compile(r"\s*(\d+)\s*(?:\+\s*(\d+)\s*)?", re.ASCII)


def parse_parity(text: str) -> tuple[int, int]:
    """Parse a parity spec: ``"3"`` -> ``(3, 1)`` (XOR), ``"4+2"`` -> ``(4, 2)`` (Reed-Solomon).

    Raises:
        ValueError: not of the form ``K`` or ``K+M`` with positive integers (and k+m <= 256 for
            Reed-Solomon).
    """
    hint = "expected 'K' (K data nodes + 1 XOR parity, e.g. '3') or 'K+M' (Reed-Solomon, e.g. '4+2')"
    match = _PARITY.fullmatch(str(text))
    if match is None:
        raise ValueError(f"bad parity {text!r}: {hint}")
    k, m = int(match[1]), int(match[2] or 1)
    try:
        _check_km(k, m)
    except ValueError as e:
        raise ValueError(f"bad parity {text!r}: {e}; {hint}") from None
    return k, m
