"""One node's share of a flush every node writes: the ``flush_share`` request's work.

The lead node (``flush_lead``) sends a batch of pieces: rows of consolidated tensors, where each
goes in the version's files (already created in the shared flush dir's temporary folder), and
the manifest entries of the rank tensors they are read from, with the nodes holding each rank's
part. For each piece this node:

1. plans the rows from the sources, the ones it holds first (``ucpd.ucl.plan_consolidate``);
2. brings the source chunks it does not hold from a holder into a private shm window (the
   chunks the plan reads, each crossing the network once: the next piece reuses nothing);
3. consolidates the rows through the staging buffer into the file (``format.shares.write_rows``:
   pwrite in place, fsync, read back, checked), every source chunk checked against the CRC its
   rank recorded (``checked.ConsolidatingCopier``);
4. drops the window, so the RAM a share takes is one piece's remote bytes, not the version's.

With an object-store flush dir (the batch carries ``parts``) there are no files to write in
place: the pieces are the rows of parts of the files' multipart uploads, each part filled in RAM
(the file's header first in part 1) and uploaded with its CRC32C (``format.multipart.SharedUpload.put_part``),
which S3 checks on receipt; the lead completes the uploads and checks them. The uploads run
while the next parts are filled, ``$UCPD_OBJECT_CONCURRENCY`` parts in flight (at most
``UPLOAD_BYTES`` of them). Bytes sent to the store are counted in ``flush_uploaded_bytes``.

A source chunk that fails its check (a damaged copy, here or on the holder it came from): the
tensors that fail are read again from each other copy in turn, alone, until one passes, and the
rows written again (the restore's rule, ``VersionSources.check_fetched``); only when none does
does the piece fail (and the lead gives it to another node).

It answers the pieces' grid CRCs. The parts it reads here are pinned while it reads them.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import faults, knobs
from ..checked import CheckedSource, ConsolidatingCopier, bad_chunks, view_chunks
from ..daemon.manifest import TensorEntry
from ..daemon.slot_prep import yield_to_snapshots
from ..dtypes import dtype as lookup_dtype
from ..errors import ChecksumMismatch, ProtocolError, StorageError, UcpdError, VersionNotFound
from ..format import spec
from ..format.multipart import SharedUpload
from ..format.objstore import ObjectRoot
from ..format.roots import as_root
from ..format.shares import TensorPlace, grid_crcs, write_rows
from ..native import CHUNK_BYTES
from ..ucl.plan import SourcePiece, plan_consolidate
from .counters import FetchCounters, FlushCounters
from .parts import run_of
from .replicas import ReplicaStore
from .serve import PeerServer
from .shmfiles import close_map, open_reserved, remove
from .sources import FETCH_PREFIX, PeerRead, unpin_local

log = logging.getLogger("ucpd.team")

UPLOAD_BYTES = 1 << 30  # bytes of filled parts a writer holds in flight to the object store, at most


@dataclass(frozen=True)
class Source:
    """A rank tensor a piece reads: its entry, whose part it is (``origin``) and who holds it."""

    rank: int
    idx: int
    entry: TensorEntry
    origin: int
    nodes: tuple[int, ...]

    @property
    def key(self) -> tuple[int, int]:
        return (self.rank, self.idx)


def pieces_of(name: str, sources: list[Source]) -> list[SourcePiece]:
    """What ``sources`` hold of global tensor ``name``, in their order (``coverage.globals_of``'s rule)."""
    out = []
    for s in sources:
        t = s.entry
        shared = t.shared if t.shared is not None else t.geometry()
        for frag in shared or t.fragments():
            if (t.name if shared else frag.name) != name:
                continue
            gs = tuple(frag.global_shape)
            out.extend(SourcePiece(s.key, p.local, p.box, gs) for p in frag.pieces)
    return out


class ShareWriter:
    """Writes the batches the lead sends this node. ``rank``: this node's; ``flush_dir``: its own
    ``--flush-dir`` (a peer's batch is written under it only); ``shm_dir``: where fetch windows go;
    ``store`` / ``replicas``: the parts and copies held here; ``fetch_ranges``: reads ranges of a
    part from its holders (``VersionSources.fetch_ranges``); ``counters`` / ``fetched``: this
    part's and the fetch path's counters; ``server``: the node's peer server, where it answers
    ``flush_share``; ``storage_options``: fsspec's, for an object-store ``--flush-dir``."""

    def __init__(self, rank: int, flush_dir: str | None, shm_dir: str, store, replicas: ReplicaStore,
                 fetch_ranges: Callable[..., None], counters: FlushCounters, fetched: FetchCounters,
                 server: PeerServer, storage_options: dict | None = None) -> None:
        self.rank, self.flush_dir, self.shm_dir = rank, flush_dir, shm_dir
        self.store, self.replicas = store, replicas
        self.fetch_ranges = fetch_ranges
        self.counters, self.fetched = counters, fetched
        self.storage_options = storage_options
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ucpd-flush-share")
        server.register("flush_share", self.serve)

    def serve(self, src: int, body: dict, frames: list) -> Future:
        """A ``flush_share`` request: the lead hands us pieces of a flush to write, one batch at a
        time, on a thread of our own (the transport goes on meanwhile); the reply has their CRCs."""
        return self._writer.submit(lambda: ({"crcs": self.write(body)}, []))

    def close(self) -> None:
        self._writer.shutdown(wait=False, cancel_futures=True)

    def write(self, body: dict) -> list[list[int]]:
        """Write every piece of a ``flush_share`` body; each piece's grid CRCs, in order."""
        step, run, chunk = body["step"], body.get("run") or "", body["chunk"]
        parts = body.get("parts")
        tmp = self._checked_dir(body) if not parts else None
        store = self._checked_store(body) if parts else None
        sources = [Source(s["rank"], s["idx"], TensorEntry.from_wire(s["t"]), s["origin"], tuple(s["nodes"]))
                   for s in body["sources"]]
        mine = [s for s in sources if self.rank in s.nodes]
        others = [s for s in sources if self.rank not in s.nodes]
        local = _LocalParts(self.rank, self.store, self.replicas, step, run)
        pace = _Pace(body.get("rate") or 0, self.store)
        try:
            if parts:
                return self._upload(step, chunk, body["pieces"], parts, store, mine + others, local, pace)
            out = []
            for p in body["pieces"]:
                place = _place(p)

                def put(fill, place=place, p=p) -> list[int]:
                    return write_rows(tmp / place.file, place, p["r0"], p["r1"], fill, chunk, throttle=pace)

                out.append(self._piece(step, chunk, place, p["r0"], p["r1"], mine + others, local, put))
                _fault_points(step)
            return out
        except OSError as exc:  # a full or failing flush dir: the lead gives our pieces to others
            raise StorageError(f"node {self.rank} could not write step {step}'s flush share: {exc}") from None
        finally:
            local.release()

    def _checked_dir(self, body: dict) -> Path:
        """The version's temporary folder, refused unless it is one (``.step-<N>.tmp-<pid>``, under
        our own flush dir if we have one) and every piece names one of its shard files: a peer
        makes us write into the flush's files, nowhere else."""
        tmp = Path(os.path.normpath(body["dir"]))
        m = spec.TMP_RE.match(tmp.name)
        if not tmp.is_absolute() or m is None or int(m.group(1)) != body["step"]:
            raise ProtocolError(f"flush_share: {body['dir']!r} is not the temporary folder of step {body['step']}")
        mine = self.flush_dir
        if mine and not as_root(mine, self.storage_options).contains(str(tmp)):
            raise StorageError(f"{body['dir']} is outside this node's --flush-dir {mine}: give every node the same "
                               "--flush-dir, mounted at the same path")
        for p in body["pieces"]:
            if not spec.SHARD_RE.match(p["file"]) or not 0 <= p["r0"] <= p["r1"] or not 0 <= p["begin"] <= p["end"]:
                raise ProtocolError(f"flush_share: piece {p['name']!r} names file {p['file']!r} rows "
                                    f"[{p['r0']}, {p['r1']}) bytes [{p['begin']}, {p['end']})")
        return tmp

    def _checked_store(self, body: dict) -> SharedUpload:
        """The job's root in the object store, refused unless ``dir`` is step ``<N>``'s folder of a
        job under our own ``--flush-dir`` and every part and piece names one of its shard files."""
        url, mine = body["dir"].rstrip("/"), (self.flush_dir or "").rstrip("/")
        if not mine or not as_root(mine, self.storage_options).contains(url):
            raise StorageError(f"{body['dir']} is outside this node's --flush-dir {mine or '(none)'}: give every node "
                               "the same --flush-dir")
        job_url, _, last = url.rpartition("/")
        if spec.parse_step_dirname(last) != body["step"] or "/" in job_url[len(mine) + 1:] or job_url == mine:
            raise ProtocolError(f"flush_share: {body['dir']!r} is not a job's folder of step {body['step']}")
        for p in [*body["parts"], *body["pieces"]]:
            if not spec.SHARD_RE.match(p["file"]):
                raise ProtocolError(f"flush_share: {p['file']!r} is not a shard file of the version")
        return SharedUpload(ObjectRoot(job_url, self.storage_options), body["step"])

    def _upload(self, step: int, chunk: int, pieces: list[dict], parts: list[dict], store: SharedUpload,
                sources: list[Source], local: "_LocalParts", pace: "_Pace") -> list[list[int]]:
        """Each part: its header bytes and its pieces' rows filled in RAM, then uploaded as that
        part of its file's upload; each piece's grid CRCs, in order."""
        out: list[list[int]] = []
        k = 0
        inflight: deque = deque()  # (future, bytes) of parts on their way up, oldest first
        limit = max(1, min(knobs.object_concurrency(), UPLOAD_BYTES // max(p["size"] for p in parts)))
        pool = ThreadPoolExecutor(limit, thread_name_prefix="ucpd-flush-upload")
        try:
            for part in parts:
                raw = self._fill_part(step, chunk, part, pieces[k : k + part["pieces"]], sources, local, pace, out)
                k += part["pieces"]
                while len(inflight) >= limit:
                    self._landed(step, *inflight.popleft())
                inflight.append((pool.submit(store.put_part, part["file"], part["upload"], part["number"], raw), len(raw)))
            while inflight:
                self._landed(step, *inflight.popleft())
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        if k != len(pieces):
            raise ProtocolError(f"flush_share: {len(pieces) - k} pieces are in no part")
        return out

    def _landed(self, step: int, upload, nbytes: int) -> None:
        """A part's upload is over: raise its error, or count its bytes."""
        upload.result()
        self.counters.flush_uploaded_bytes += nbytes
        _fault_points(step)

    def _fill_part(self, step: int, chunk: int, part: dict, mine: list[dict], sources: list[Source],
                   local: "_LocalParts", pace: "_Pace", out: list) -> bytearray:
        """Part ``part``'s bytes: the header bytes it carries, then its pieces' rows (``mine``,
        each piece's grid CRCs appended to ``out``)."""
        off, size, head = part["offset"], part["size"], part["head"]
        if len(mine) != part["pieces"] or (head and off != 0) or len(head) > size:
            raise ProtocolError(f"flush_share: part {part['number']} of {part['file']} names pieces or a header it lacks")
        raw = bytearray(size)  # what the S3 client sends as it is
        buf = np.frombuffer(raw, np.uint8)
        buf[: len(head)] = np.frombuffer(head, np.uint8)
        pos = off + len(head)
        for p in mine:
            place = _place(p)
            at, n = place.begin + p["r0"] * place.row_bytes, (p["r1"] - p["r0"]) * place.row_bytes
            if p["file"] != part["file"] or at != pos or at + n > place.end or at + n > off + size:
                raise ProtocolError(f"flush_share: piece {p['name']!r} rows [{p['r0']}, {p['r1']}) is not next in "
                                    f"part {part['number']} of {part['file']}")
            view = buf[at - off : at - off + n]

            def put(fill, view=view, p=p) -> list[int]:
                crcs = fill(view, p["r0"], p["r1"], chunk)
                pace(view.nbytes)
                return crcs

            out.append(self._piece(step, chunk, place, p["r0"], p["r1"], sources, local, put))
            pos += n
        if pos != off + size:
            raise ProtocolError(f"flush_share: part {part['number']} of {part['file']}: its pieces end at byte {pos}, "
                                f"the part at {off + size}")
        return raw

    def _piece(self, step: int, chunk: int, place: TensorPlace, r0: int, r1: int, sources: list[Source],
               local: "_LocalParts", put) -> list[int]:
        """Rows ``[r0, r1)`` of ``place``'s tensor consolidated from ``sources``; ``put(fill_rows)``
        writes them where they go (``shares.write_rows``' contract) and returns their grid CRCs."""
        name, shape = place.name, place.shape
        storage = lookup_dtype(place.dtype).storage
        pieces = pieces_of(name, sources)
        rows_of = (lambda a, b: None) if not shape else (lambda a, b: (a, b))
        plan = plan_consolidate(name, shape, pieces, rows_of(r0, r1))
        by_key = {s.key: s for s in sources}
        windows: list[tuple[str, object]] = []
        reads = {key: [c.src_view for c in plan.copies if c.src_key == key] for key in {c.src_key for c in plan.copies
                                                                                      if c.src_view.numel}}
        try:
            arrays = {}
            remote: dict[int, list] = {}  # rank -> the sources of it to fetch
            for key, views in reads.items():
                s = by_key[key]
                buf = local.buffer(s)
                if buf is None:
                    remote.setdefault(s.rank, []).append((s, views))
                else:
                    arrays[key] = buf
            for rank, wanted in remote.items():
                arrays.update(self._fetch_window(step, rank, wanted, windows))

            def checked_of(key, buf) -> CheckedSource:
                t = by_key[key].entry
                arr = np.frombuffer(buf, dtype=storage, count=t.nbytes // storage.itemsize, offset=t.offset)
                return CheckedSource(arr, t.crcs, CHUNK_BYTES, f"step {step}, rank {key[0]}, tensor {t.name!r}:",
                                     recorded="the rank's snapshot",
                                     remedy="the copy is damaged; the lead node has this piece written from another")

            def write() -> list[int]:
                copier = ConsolidatingCopier({key: checked_of(key, buf) for key, buf in arrays.items()})
                row_bytes = place.row_bytes

                def fill_rows(out: np.ndarray, a: int, b: int, c: int) -> list[int]:
                    block = plan if (a, b) == (r0, r1) else plan_consolidate(name, shape, pieces, rows_of(a, b))
                    crcs = copier.block(block.copies, out.view(storage), a * row_bytes, c)
                    return crcs if crcs is not None else grid_crcs(out, a * row_bytes, c)

                crcs = put(fill_rows)
                copier.finish()
                return crcs

            try:
                crcs = write()
            except ChecksumMismatch as exc:  # a copy it read is damaged: read those tensors from each other copy
                self._reread_damaged(step, exc, reads, by_key, arrays, checked_of, windows, storage)
                crcs = write()  # the rows again, in place
            self.counters.flush_written_bytes += \
                (r1 - r0) * place.row_bytes
            return crcs
        finally:
            for path, mm in windows:
                close_map(mm)
                remove(path)

    def _reread_damaged(self, step: int, exc: ChecksumMismatch, reads: dict, by_key: dict, arrays: dict, checked_of,
                        windows: list, storage) -> None:
        """The restore's rule (``VersionSources.check_fetched``) for a flush share: find the
        source tensors whose chunks fail, and read each from every other copy in turn (alone,
        not in shares) until one passes; ``arrays`` then holds it. Raises ChecksumMismatch
        naming the copies tried when none does (the lead then gives the piece to another node)."""
        self.counters.flush_checksum_errors += 1
        bad = [key for key, buf in arrays.items()
               if bad_chunks(checked_of(key, buf), _chunks(reads[key], storage.itemsize))]
        if not bad:
            raise exc
        for key in bad:
            s = by_key[key]
            tried = []
            for node in [n for n in s.nodes if n != self.rank] or [s.origin]:
                tried.append(node)
                try:
                    got = self._fetch_window(step, s.rank, [(s, reads[key])], windows, only=node)[key]
                    if bad_chunks(checked_of(key, got), _chunks(reads[key], storage.itemsize)):
                        raise ChecksumMismatch(f"damaged on node {node} too")
                except UcpdError as err:
                    log.warning("team: flush of step %d: rank %d's tensor %r from node %d: %s; trying the next copy",
                                step, s.rank, s.entry.name, node, err)
                    continue
                log.warning("team: flush of step %d: rank %d's tensor %r failed its check; node %d's copy passes",
                            step, s.rank, s.entry.name, node)
                arrays[key] = got
                break
            else:
                raise ChecksumMismatch(f"{exc}; no other copy passes either (nodes {tried} tried)") from None

    def _fetch_window(self, step: int, rank: int, wanted: list, windows: list, only: int | None = None) -> dict:
        """The source chunks the plan reads of ``rank``'s tensors, fetched from its holders (in
        shares; ``only``: from that node alone) into a new private shm file at their slot
        offsets; {key: the file's bytes}."""
        ranges = []
        for s, views in wanted:
            t = s.entry
            isz = lookup_dtype(t.dtype).storage.itemsize
            for c in _chunks(views, isz):
                lo, hi = t.offset + c * CHUNK_BYTES, t.offset + min((c + 1) * CHUNK_BYTES, t.nbytes)
                if ranges and ranges[-1][0] + ranges[-1][1] == lo:
                    ranges[-1] = (ranges[-1][0], ranges[-1][1] + hi - lo)
                else:
                    ranges.append((lo, hi - lo))
        s0 = wanted[0][0]
        size = max(s.entry.offset + s.entry.nbytes for s, _ in wanted)
        path = os.path.join(self.shm_dir, f"{FETCH_PREFIX}{uuid.uuid4().hex[:12]}")
        mm = open_reserved(path, size, ranges)
        windows.append((path, mm))
        first, *rest = [only] if only is not None else [n for n in s0.nodes if n != self.rank] or [s0.origin]
        self.fetch_ranges(PeerRead(first, s0.origin, rank, path, tuple(rest)), step, ranges, mm)
        nbytes = sum(n for _, n in ranges)
        self.fetched.fetched_bytes += nbytes
        self.counters.flush_fetched_bytes += nbytes
        return {s.key: mm for s, _ in wanted}


def _place(p: dict) -> TensorPlace:
    return TensorPlace(p["name"], p["dtype"], tuple(p["shape"]), None, p["file"], p["begin"], p["end"])


def _fault_points(step: int) -> None:
    """Test-only crash, error and stall points after a piece (a part) is written (``ucpd.faults``)."""
    if faults.armed():
        faults.point("flush.share", step)
        faults.point("flush.write", step)
        faults.stall("flush.hang", step)


def _chunks(views, itemsize: int) -> list[int]:
    """The chunks of a tensor that ``views`` (element windows of it) read."""
    return sorted(set().union(*(view_chunks(v, itemsize, CHUNK_BYTES) for v in views)))


class _Pace:
    """Between a writer's blocks: step aside while a trainer copies a snapshot into a slot, and
    keep under ``rate`` bytes/s (the lead's ``--flush-rate``; 0: no ceiling)."""

    def __init__(self, rate: float, store) -> None:
        self.rate, self.store = rate, store
        self.t0, self.done = time.monotonic(), 0

    def __call__(self, nbytes: int) -> None:
        yield_to_snapshots(self.store)
        self.done += nbytes
        if self.rate:
            ahead = self.done / self.rate - (time.monotonic() - self.t0)
            if ahead > 0:
                time.sleep(ahead)


class _LocalParts:
    """The parts of one step this node holds (its own ranks', replicas it keeps), pinned while
    a batch reads them."""

    def __init__(self, rank: int, store, replicas: ReplicaStore, step: int, run: str) -> None:
        self.rank, self.store, self.replicas, self.step, self.run = rank, store, replicas, step, run
        self.pins: list = []
        self.bufs: dict[tuple[int, int], object] = {}  # (origin, rank) -> the part's bytes, or None

    def buffer(self, s: Source):
        """The bytes of ``s``'s rank part (its slot's, from offset 0) if this node holds them."""
        if self.rank not in s.nodes:
            return None
        k = (s.origin, s.rank)
        if k not in self.bufs:
            self.bufs[k] = self._open(s)
        return self.bufs[k]

    def _open(self, s: Source):
        store, replicas = self.store, self.replicas
        with store.atomic():
            if s.origin == self.rank and replicas.get(s.origin, self.step) is None:  # (else: rebuilt from parity)
                v = store.sealed(self.step)
                part = v.parts.get(s.rank) if v is not None else None
                if part is None or run_of(v) != self.run:
                    raise VersionNotFound(f"node {self.rank} no longer holds rank {s.rank} of step {self.step}")
                store.pin(v)
                self.pins.append(v)
                return np.frombuffer(store.slot_view(part.slot), np.uint8)
            rep = replicas.get(s.origin, self.step)
            if rep is None or s.rank not in rep.parts or run_of(rep) != self.run:
                raise VersionNotFound(f"node {self.rank} holds no copy of rank {s.rank} of step {self.step}")
            replicas.pin(rep)
            self.pins.append(rep)
            base = rep.bases[s.rank]
            return np.frombuffer(rep.mapping(), np.uint8)[base:]

    def release(self) -> None:
        self.bufs.clear()
        unpin_local(self.store, self.replicas, self.pins)
        self.pins = []
