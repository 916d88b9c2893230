"""The records of the commit protocol (``commit.CommitNode`` and its parts, ``run_fences`` and
``commit_groups``): what the node returns to its driver (``Send``, ``Decided``, ``Commit``,
``Fence``), what a node's parts read of it (``View``), and the acknowledgements a phase
collects (``Acks``). Pure data: no sockets, threads or clocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..protocol import MAX_PENDING

Report = tuple[int, frozenset[int], str]  # a node's report of a step: (world size, ranks, run)


@dataclass(frozen=True)
class Send:
    """Output: deliver ``msg`` (a msgpack-able dict, type in ``msg["t"]``) to node ``dest``."""

    dest: int
    msg: dict


@dataclass(frozen=True)
class Commit:
    """Output (action): make ``step`` visible as committed on this node."""

    step: int


@dataclass(frozen=True)
class Decided:
    """Output (action): this node recorded the decision to commit ``step``; not visible yet."""

    step: int


@dataclass(frozen=True)
class Fence:
    """Output (action): ``run`` is the job's current run on this node. Every part of another run
    that is not decided (not committed, not in ``keep``) is abandoned: it never commits, and the
    new run may snapshot its steps again."""

    run: str
    keep: frozenset[int] = frozenset()


@dataclass(frozen=True)
class View:
    """What a node's parts read of it: its rank, the live nodes in its view, the coordinator
    (the lowest of them), the coordinator's children (the nodes whose acks it waits for: every
    live node, or with aggregation the groups' aggregators and its own group) and the epoch its
    requests carry. The node makes a new one when the view or the epoch changes."""

    rank: int
    live: frozenset[int]
    coordinator: int
    children: frozenset[int]
    epoch: int


@dataclass
class Acks:
    """A phase the coordinator (or an aggregator, for its group) waits on: who acknowledged it,
    and when it was last sent to the rest."""

    phase: int  # 1: collecting "recorded" (or a fence's "fenced"); 2: collecting "committed"
    acked: set[int] = field(default_factory=set)
    sent_at: float = 0.0


def cap(table: dict, keep=()) -> list[int]:
    """Drop the oldest steps of ``table`` beyond MAX_PENDING (never those in ``keep``); return them."""
    dropped = []
    if len(table) > MAX_PENDING:
        for step in sorted(table)[: len(table) - MAX_PENDING]:
            if step not in keep:
                del table[step]
                dropped.append(step)
    return dropped
