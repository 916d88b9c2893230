"""Two ends of a data lane in one process (``ucpd.team.lane``): each a lane whose puts land in
``dst`` (every chunk named with the CRC of ``expect``) and whose gets read ``src``; step 404 is
one the peer does not hold. ``tests/team/test_lane.py`` (TCP) and ``test_lane_nixl.py`` (NIXL)."""

from __future__ import annotations

import numpy as np

from ucpd import native
from ucpd.errors import VersionNotFound
from ucpd.team.lane import DataLane, Landing

SECRET = b"a-job-secret-of-32-bytes-or-so!!"
C = native.CHUNK_BYTES


def chunks_of(expect: np.ndarray, off: int, n: int):
    """The (start, end, crc32c) chunks of bytes [off, off + n) of ``expect``, relative to off."""
    return [(s - off, e - off, native.crc32c(expect[s:e])) for s in range(off, off + n, C) for e in [min(s + C, off + n)]]


class Peer:
    """One end: a ``kind`` lane whose puts land in ``self.dst`` and whose gets read ``self.src``."""

    def __init__(self, rank: int, secret=SECRET, kind=DataLane, **kw):
        self.dst = np.zeros(8 * C, np.uint8)
        self.src = np.random.default_rng(rank).integers(0, 256, 8 * C, dtype=np.uint8)
        self.expect = np.zeros(8 * C, np.uint8)
        self.landed: list[tuple[list[int], list[int]]] = []
        self.lane = kind(rank, secret, "127.0.0.1:0", on_put=self.on_put, on_get=self.on_get, **kw)
        self.lane.start()

    def on_put(self, src, b):
        off, n = b["offset"], b["nbytes"]
        if b["step"] == 404:
            raise VersionNotFound("no replica_begin for step 404")
        return Landing(memoryview(self.dst)[off : off + n], chunks_of(self.expect, off, n),
                       lambda ok, bad: self.landed.append((ok, bad)))

    def on_get(self, src, b):
        if b["step"] == 404:
            raise VersionNotFound("node holds no step 404")
        return [memoryview(self.src)[o : o + n] for o, n in b["ranges"]]


def pair(**kw) -> tuple[Peer, Peer]:
    """Two peers, nodes 0 and 1, each told where the other's lane listens."""
    a, b = Peer(0, **kw), Peer(1, **kw)
    a.lane.set_peer(1, b.lane.address)
    b.lane.set_peer(0, a.lane.address)
    return a, b
