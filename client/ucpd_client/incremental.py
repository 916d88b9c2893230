"""Incremental snapshots, the trainer's side: which tensors did not change since this rank's last
sealed snapshot, so that they are sent as references to it instead of being copied again.

For every tensor it wrote, the rank remembers what its last sealed snapshot held: dtype, shape,
placement, storage address, version counter (``t._version``) and chunk CRC32Cs. At the next
snapshot a CPU tensor whose version counter moved is copied, as always. One whose counter did
not move is only a *candidate*: the counter misses writes through ``t.data`` and through numpy
views, so its chunks are checksummed again, read-only (``native.crc32c_chunks_match``: every
chunk of every candidate on the copy's threads, a tensor given up at its first chunk that
differs), and it is a reference only when every chunk's CRC32C equals the remembered one. A
tensor of more than one chunk is first probed: the CRC32C of its first ``PROBE_BYTES``, taken
as each snapshot reads it, must equal the last one's, so parameters that an optimizer rewrites
without moving their counter (views into a flat buffer, as ZeRO keeps them) cost a few KiB, not
a chunk, to tell changed. CUDA tensors, non-contiguous ones and those under ``MIN_BYTES`` are
always copied: the check and the bookkeeping cost a few microseconds per tensor, what copying
64 KiB costs (a rank of 10^5 small expert tensors would pay more than it saves); a device-side
checksum is a later step.
"""

from __future__ import annotations

import torch

from ucpd import native

from .staging import Entry

PROBE_BYTES = 4096
MIN_BYTES = 64 << 10  # smaller tensors are always copied


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter: checked by CRC every time
        return None


class Tracker:
    """One rank's memory of its last sealed snapshot (``base``: its step, None: nothing to
    refer to). Used by the snapshot worker thread only. Per tensor it keeps a plain tuple
    (dtype, shape, placement, address, version counter, probe, chunk CRCs): ranks of
    mixture-of-experts models hold 10^5 tensors, and this runs on every snapshot."""

    def __init__(self) -> None:
        self.base: int | None = None
        self._held: dict[str, tuple] = {}

    def observe(self, entries: list[Entry]) -> list[tuple | None]:
        """Each entry's storage address, version counter and probe (the CRC32C of the first
        ``PROBE_BYTES`` of a contiguous tensor of more than one chunk, else None) as this
        snapshot reads it, before its check and its copy; None for a tensor always copied (CUDA,
        under ``MIN_BYTES``)."""
        out = []
        for e in entries:
            t = e.tensor
            if t.nbytes < MIN_BYTES or t.is_cuda:
                out.append(None)
                continue
            ptr = t.data_ptr()
            probe = native.crc32c_ptr(ptr, PROBE_BYTES) if t.nbytes > native.CHUNK_BYTES and t.is_contiguous() else None
            out.append((ptr, _version(t), probe))
        return out

    def unchanged(self, entries: list[Entry], seen: list, threads: int, skip=frozenset()) -> dict[str, tuple[int, ...]]:
        """The entries (but ``skip``) whose bytes are the base's, with their chunk CRCs. Only
        candidates (same dtype, shape, placement, address, version counter and probe,
        contiguous) are read; a chunk whose CRC differs means the tensor changed."""
        if self.base is None:
            return {}
        held, candidates = self._held, []
        for e, now in zip(entries, seen):
            h = held.get(e.name)
            if h is None or now is None or e.name in skip:
                continue
            t = e.tensor
            if (now[0] == h[3] and (now[1] is None or now[1] == h[4]) and now[2] == h[5] and t.dtype is h[0]
                    and t.shape == h[1] and (e.placement is h[2] or e.placement == h[2]) and t.is_contiguous()):
                candidates.append((e, h[6]))
        if not candidates:
            return {}
        same = native.crc32c_chunks_match([(e.tensor.data_ptr(), e.nbytes, crcs) for e, crcs in candidates],
                                          native.CHUNK_BYTES, threads)
        return {e.name: crcs for (e, crcs), ok in zip(candidates, same) if ok}

    def sealed(self, step: int, entries: list[Entry], seen: list, crcs: dict[str, list[int]]) -> None:
        """The snapshot of ``step`` is sealed: it is the base of the next one. ``crcs``: the
        chunk CRCs of every tensor it wrote or referred to (CPU ones are remembered)."""
        self.base = step
        self._held = {
            e.name: (e.tensor.dtype, e.tensor.shape, e.placement, *now, tuple(c))
            for e, now in zip(entries, seen) if now is not None and (c := crcs.get(e.name)) is not None
        }

    def forget(self) -> None:
        """A snapshot failed: the next one copies everything."""
        self.base = None
        self._held = {}
