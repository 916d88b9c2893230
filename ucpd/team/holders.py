"""Who holds a node's redundancy: its replica holders and its parity group (pure, failure-domain aware).

- :func:`replica_holders` — the R nodes that keep full copies of a node's part: the next live
  nodes on a ring, preferring other failure domains (rack, switch).
- :func:`parity_groups` / :func:`group_of` — a partition of the nodes into erasure-coding groups
  of ``k + m`` members, one member per failure domain where possible.
- :func:`parse_parity` — the ``--parity`` option: ``"K"`` (XOR, m=1) or ``"K+M"`` (Reed-Solomon).

A domain map ``{node: label}`` names each node's failure domain; ``None`` (or a node missing from
the map) makes a node its own domain. Everything here is deterministic: every daemon computes the
same answer from the same inputs, so none of it needs to be agreed on over the wire.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Group", "group_of", "parity_groups", "parse_parity", "replica_holders", "MAX_GROUP"]

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

    Returns:
        Up to ``replicas`` distinct live nodes; fewer when not enough are live (the caller reports
        the part as degraded).

    Raises:
        ValueError: ``replicas`` is negative.
    """
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas}")
    alive = set(live)
    alive.discard(origin)
    ring = interleaved(alive | {origin} | set(domains or ()), domains)
    at = ring.index(origin)
    candidates = [n for n in ring[at + 1 :] + ring[:at] if n in alive]

    chosen: list[int] = []
    home = _domain_key(origin, domains)
    avoid = {home}
    while len(chosen) < min(replicas, len(candidates)):
        picked = False
        for n in candidates:
            key = _domain_key(n, domains)
            if n not in chosen and key not in avoid:
                chosen.append(n)
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
