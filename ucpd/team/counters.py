"""The team's counters, one dataclass per part that counts (``ucpd status --json`` ``team.counters``
and the ``ucpd_team_<name>`` Prometheus counters show them by field name).

Each part is given its own and is the only writer of it: the peer server ``ServeCounters``, the
replicator ``ReplicateCounters``, the restore and fetch path ``FetchCounters``, the shared flush
``FlushCounters``, the parity group ``ParityCounters``, the directory and the piece index theirs.
``team.status`` gathers them (``gather``). A field marked ``shown_when_counted`` is left out of the
gathered counters while it is 0 (they appeared once a part first counted them, and still do).
``TeamCounters`` is ``Team.counters``: it makes the parts' dataclasses, and is the gathered
counters as a mapping; a write by name goes to the one part's field (for the writers not yet
given their part's: the daemon's landing, through ``TeamFace.counters``).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field, fields

__all__ = ["Counters", "DirectoryCounters", "FetchCounters", "FlushCounters", "IndexCounters", "ParityCounters",
           "ReplicateCounters", "ServeCounters", "TeamCounters", "gather"]


def _when_counted() -> int:
    return field(default=0, metadata={"shown_when_counted": True})


class Counters:
    """A part's counters (a dataclass of ints); read by name too (``counters["name"]``)."""

    def __getitem__(self, name: str) -> int:
        if name not in self.names():
            raise KeyError(name)
        return getattr(self, name)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def shown(self) -> dict[str, int]:
        """The counters as status shows them."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if not f.metadata.get("shown_when_counted") or getattr(self, f.name)}


@dataclass
class ServeCounters(Counters):
    """What the peer server answered (``serve.PeerServer``, ``serve_held.HeldServer``)."""

    peer_bad_messages: int = 0  # messages that failed their schema (logged; a request's sender gets the error)
    holdings_answered: int = 0  # ``holdings`` without a step: every step's ranks
    manifests_answered: int = 0  # ``holdings`` of one step: with manifests


@dataclass
class ReplicateCounters(Counters):
    """The replicator's copies of parts to their holders (``replicate.Replicator``)."""

    replicated_bytes: int = 0
    push_failures: int = 0


@dataclass
class FetchCounters(Counters):
    """Restores and the bytes fetched here from peers (``sources``, the daemon's landing, the flush share)."""

    fetched_bytes: int = 0
    restores_from_holders: int = 0
    restores_widened: int = 0
    fetch_checksum_errors: int = _when_counted()


@dataclass
class FlushCounters(Counters):
    """This node's share of the team's flushes (``flush_lead``, ``flush_share``)."""

    flush_uploaded_bytes: int = _when_counted()
    flush_written_bytes: int = _when_counted()
    flush_fetched_bytes: int = _when_counted()
    flush_checksum_errors: int = _when_counted()


@dataclass
class ParityCounters(Counters):
    """The parity group's (``parity_group.ParityGroup``, ``--parity``)."""

    parity_checksum_errors: int = 0
    parity_bytes_sent: int = _when_counted()
    parity_rebuilt_bytes: int = _when_counted()


@dataclass
class DirectoryCounters(Counters):
    """The directory's gathers (``directory.Directory``, ``--commit-fanout``)."""

    directory_gathers: int = 0
    directory_requests: int = 0
    directory_fallbacks: int = 0


@dataclass
class IndexCounters(Counters):
    """The piece index's (``piece_index.PieceIndex``, ``--commit-fanout``)."""

    index_gathers: int = 0
    index_requests: int = 0
    index_queries: int = 0
    index_fallbacks: int = 0


def gather(*parts: Counters | None) -> dict[str, int]:
    """The parts' counters as one mapping, as status shows them (None: a part not kept here)."""
    out: dict[str, int] = {}
    for p in parts:
        if p is not None:
            out.update(p.shown())
    return out


class TeamCounters(MutableMapping):
    """The team's counters (``Team.counters``): the parts' dataclasses, made here and handed to
    each part (``serve``, ``replicate``, ``fetch``, ``flush``, ``parity``; a part that makes its
    own is ``add``-ed), and by name the gathered mapping status shows. Only names a part declares
    exist; a write by name sets that part's field."""

    def __init__(self) -> None:
        self.serve = ServeCounters()
        self.replicate = ReplicateCounters()
        self.fetch = FetchCounters()
        self.flush = FlushCounters()
        self.parity = ParityCounters()
        self._parts: list[Counters] = [self.replicate, self.fetch, self.serve, self.parity, self.flush]
        self._owner = {name: p for p in self._parts for name in p.names()}

    def add(self, *parts: Counters | None) -> None:
        """Gather ``parts`` too (None: a part not kept here)."""
        for p in parts:
            if p is not None:
                self._parts.append(p)
                self._owner.update({name: p for name in p.names()})

    def __getitem__(self, name: str) -> int:
        return getattr(self._owner[name], name)

    def __setitem__(self, name: str, value: int) -> None:
        setattr(self._owner[name], name, value)

    def __delitem__(self, name: str) -> None:
        raise TypeError("a team counter cannot be removed")

    def __iter__(self) -> Iterator[str]:
        return iter(gather(*self._parts))

    def __len__(self) -> int:
        return len(gather(*self._parts))
