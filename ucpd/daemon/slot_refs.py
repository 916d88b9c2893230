"""Who reads the bytes of which slot: the references of incremental snapshots.

An incremental snapshot does not copy a tensor that did not change since the rank's previous
snapshot: its manifest entry is a *reference* to the previous version's entry, and its bytes
stay in the slot that holds them (the *holder*). A reference to a reference names the slot that
holds the bytes, so a chain of unchanged tensors never grows.

A holder slot is given back only once nothing reads it: its own version left RAM *and* no
*referrer* reads it. Referrers are a sealed part's slot (the part's references) and a rank's
snapshot being written (between its ``begin`` and its commit, every slot of its base part).
Pure bookkeeping; ``NodeStore`` calls it holding its lock and decides what to release.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


class SlotRefs:
    """Referrer -> the holder slots it reads, and holder -> its referrers."""

    def __init__(self) -> None:
        self._reads: dict[Hashable, frozenset[int]] = {}
        self._readers: dict[int, set[Hashable]] = {}

    def set(self, referrer: Hashable, holders: Iterable[int]) -> list[int]:
        """``referrer`` reads exactly ``holders`` from now on (nothing: forgotten). Returns the
        slots that it read before and nobody reads any more."""
        new = frozenset(holders)
        old = self._reads.pop(referrer, frozenset())
        if new:
            self._reads[referrer] = new
        for sid in new - old:
            self._readers.setdefault(sid, set()).add(referrer)
        unread = []
        for sid in old - new:
            readers = self._readers.get(sid)
            if readers is not None:
                readers.discard(referrer)
                if not readers:
                    del self._readers[sid]
                    unread.append(sid)
        return unread

    def drop(self, referrer: Hashable) -> list[int]:
        """``referrer`` reads nothing any more; returns the slots nobody reads now."""
        return self.set(referrer, ())

    def referenced(self, sid: int) -> bool:
        """Whether some referrer reads slot ``sid``."""
        return sid in self._readers

    def readers(self, sid: int) -> frozenset:
        return frozenset(self._readers.get(sid, ()))

    def reads(self, referrer: Hashable) -> frozenset[int]:
        return self._reads.get(referrer, frozenset())
