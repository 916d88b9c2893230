"""Incremental snapshots, the trainer's side: which tensors did not change since this rank's last
sealed snapshot, so that they are sent as references to it instead of being copied again.

For every tensor it wrote, the rank remembers what its last sealed snapshot held: dtype, shape,
placement, storage address, version counter (``t._version``) and chunk CRC32Cs. At the next
snapshot a CPU tensor whose version counter moved is copied, as always. One whose counter did
not move is only a *candidate*: the counter misses writes through ``t.data`` and through numpy
views, so its chunks are checksummed again, read-only (``native.crc32c_chunks_match``: every
chunk of every candidate on the copy's threads, a tensor given up at its first chunk that
differs), and it is a reference only when every chunk's CRC32C equals the remembered one. CUDA
tensors and non-contiguous ones are always copied (a device-side checksum is a later step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ucpd import native

from .staging import Entry


@dataclass(frozen=True)
class Held:
    """What the last sealed snapshot held of one tensor."""

    signature: tuple  # dtype, shape, placement (Entry.signature)
    ptr: int
    version: int | None
    crcs: tuple[int, ...]


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter: checked by CRC every time
        return None


class Tracker:
    """One rank's memory of its last sealed snapshot (``base``: its step, None: nothing to
    refer to). Used by the snapshot worker thread only."""

    def __init__(self) -> None:
        self.base: int | None = None
        self._held: dict[str, Held] = {}

    def observe(self, entries: list[Entry]) -> dict[str, tuple[int, int | None]]:
        """The storage address and version counter of each CPU tensor as this snapshot reads it
        (before its check and its copy)."""
        return {e.name: (e.tensor.data_ptr(), _version(e.tensor)) for e in entries if not e.tensor.is_cuda}

    def unchanged(self, entries: list[Entry], seen: dict, threads: int) -> dict[str, tuple[int, ...]]:
        """The entries whose bytes are the base's, with their chunk CRCs. Only candidates (same
        signature, address and version counter) are read; a CRC that differs anywhere means
        the tensor changed."""
        if self.base is None:
            return {}
        candidates = []
        for e in entries:
            held = self._held.get(e.name)
            if held is None or e.tensor.is_cuda or not e.tensor.is_contiguous() or held.signature != e.signature:
                continue
            ptr, version = seen[e.name]
            if ptr == held.ptr and (version is None or version == held.version):
                candidates.append((e, held))
        if not candidates:
            return {}
        same = native.crc32c_chunks_match([(e.tensor.data_ptr(), e.nbytes, held.crcs) for e, held in candidates],
                                          native.CHUNK_BYTES, threads)
        return {e.name: held.crcs for (e, held), ok in zip(candidates, same) if ok}

    def sealed(self, step: int, entries: list[Entry], crcs: dict[str, list[int]], seen: dict) -> None:
        """The snapshot of ``step`` is sealed: it is the base of the next one. ``crcs``: the
        chunk CRCs of every tensor it wrote or referred to (CPU ones are remembered)."""
        self.base = step
        self._held = {
            e.name: Held(e.signature, *seen[e.name], tuple(crcs[e.name])) for e in entries if e.name in crcs and e.name in seen
        }

    def forget(self) -> None:
        """A snapshot failed: the next one copies everything."""
        self.base = None
        self._held = {}
