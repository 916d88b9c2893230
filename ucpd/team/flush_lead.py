"""The lead's side of a flush every node writes (``ucpd serve --flush-writers all``, the default).

Node 0's flusher calls ``TeamFlush.write`` for a committed version. It:

1. finds where every rank's part is (``VersionSources.restore_sources``: each part pinned on its
   holders until the flush ends);
2. lays out the version's files (``format.shares.plan_files``: exactly ``write_version``'s) and
   creates them, pre-sized, in the temporary folder of the shared flush dir;
3. cuts every tensor into row blocks (``flush_plan.row_blocks``) and lets ``flush_plan.ShareFlush``
   assign them: balanced, each to a node that holds its bytes where it can;
4. sends each writer its batches (``flush_share`` requests; its own run here), one at a time,
   with the manifest entries the pieces read; follows the answers, the failures and the
   membership: a node declared dead, or one that cannot see the flush dir, has its unfinished
   pieces rewritten by others;
5. once every piece is written, fsynced and read back, joins the pieces' CRCs per tensor and
   commits the version: objects, ``ucp.json``, rename, ``LATEST`` (``format.shares.commit_files``).

A crash of the lead at any point leaves no visible version (the rename is the commit point); its
next flusher removes the temporary folder (``format.root.clean_temp``). ``write`` returns False
when this version must be written by the lead alone (a part rebuilt from parity on this node,
which no peer can read; an object store other than S3): the flusher then gathers and writes it
as with ``--flush-writers one``.

An object-store flush dir (``root`` an ``ObjectRoot``: S3) follows the same plan with the parts
of one multipart upload per file as its pieces (``format.shares.plan_parts``: whole rows, at
least ``$UCPD_OBJECT_PART_BYTES``): each writer fills its parts in RAM and uploads them
(``flush_share``), so no node's uplink carries the version. Once every part is in, the lead
completes each file's upload, checking that the store holds every planned part at its size and
that the store's checksum of the parts is the one the writers' CRC32Cs give; then it uploads
``objects.bin`` and ``ucp.json`` and writes the commit marker, last, then ``LATEST``
(``format.multipart.SharedUpload``). A crash before the marker leaves an unmarked (partial)
version: the next flush of the step aborts its uploads and deletes its objects
(``SharedUpload.clear``) and the last committed version stays whole.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from .. import faults
from ..daemon.flush import layout_of, objects_of
from ..errors import ProtocolError, StorageError, UcpdError
from ..format import spec
from ..format.multipart import SharedUpload
from ..format.objstore import ObjectRoot, join
from ..format.shares import (
    FileLayout, FilePart, commit_files, create_files, grid_count, join_crcs, part_crc, plan_files, plan_parts, remote_meta,
)
from ..ucl.geometry import GBox, intersect, volume
from ..ucl.plan import plan_consolidate
from ..dtypes import dtype as lookup_dtype
from .counters import FlushCounters
from .flush_plan import Batch, Piece, ShareFlush, row_blocks
from .parts import with_run
from .sources import LocalRead
from .view import TeamView

log = logging.getLogger("ucpd.team")

BLOCK_MIN = spec.CHUNK_BYTES  # bytes: the smallest row block worth a piece of its own
BLOCK_MAX = 256 << 20  # bytes: the largest (a writer's RAM window is about one piece)
BATCH_BYTES = 256 << 20  # bytes of pieces per request to a writer, at most
SHARE_TIMEOUT = 600.0  # seconds one batch may take on its writer
WORKERS = 32  # batches in flight at once from the lead


def block_bytes(total: int, nodes: int) -> int:
    """The row-block bound: about a quarter of a node's mean share, within [BLOCK_MIN, BLOCK_MAX],
    so that the shares can be balanced and a window stays small."""
    return max(BLOCK_MIN, min(BLOCK_MAX, total // max(1, 16 * nodes)))


def batch_bytes(total: int, nodes: int) -> int:
    """Bytes of pieces a writer is sent at once: about a quarter of its share (so a writer lost
    mid-batch costs a quarter of its share again, and progress shows), at most BATCH_BYTES."""
    return max(block_bytes(total, nodes), min(BATCH_BYTES, total // max(1, 4 * nodes)))


def cut(globals_: dict, files: FileLayout, block: int) -> list[Piece]:
    """Every non-empty tensor as row blocks of at most ``block`` bytes, with the bytes of each
    that every rank's part holds."""
    out: list[Piece] = []
    for name in sorted(globals_):
        g, place = globals_[name], files.tensors[name]
        if place.end == place.begin:
            continue
        for r0, r1 in row_blocks(place.rows, place.row_bytes, block):
            held: dict[int, int] = {}
            _add_held(held, g, r0, r1)
            out.append(Piece(len(out), name, r0, r1, (r1 - r0) * place.row_bytes, tuple(sorted(held.items()))))
    return out


def cut_parts(globals_: dict, parts: list[FilePart]) -> list[Piece]:
    """Every part of the files' uploads as a piece (``part``: its number), with the bytes of it
    that every rank's part holds."""
    out: list[Piece] = []
    for i, part in enumerate(parts):
        held: dict[int, int] = {}
        for seg in part.segments:
            _add_held(held, globals_[seg.name], seg.r0, seg.r1)
        out.append(Piece(i, part.file, part.offset, part.offset + part.size, part.size, tuple(sorted(held.items())),
                         part=part.number))
    return out


def checksums_of(parts: list[FilePart], done: dict[int, list[int]], files: FileLayout, globals_) -> tuple[dict, dict]:
    """From each part's grid CRCs (``done``: by part index, its segments' in order): each file's
    parts as ``[(size, crc32c)]`` (what the store must hold) and each tensor's chunk CRCs."""
    segs: dict[str, list] = {}  # tensor -> [(r0, grid CRCs, nbytes)]
    per_file: dict[str, list] = {}
    for i, part in enumerate(parts):
        flat, grids = list(done[i]), []
        for s in part.segments:
            n = grid_count(s.r0 * files.tensors[s.name].row_bytes, s.nbytes, spec.CHUNK_BYTES)
            grids.append(flat[:n])
            segs.setdefault(s.name, []).append((s.r0, flat[:n], s.nbytes))
            flat = flat[n:]
        head = files.files[part.file][2]
        per_file.setdefault(part.file, []).append((part.size, part_crc(part, head, grids, files, spec.CHUNK_BYTES)))
    crcs = {n: join_crcs(((c, nb) for _, c, nb in sorted(segs.get(n, []), key=lambda x: x[0])), spec.CHUNK_BYTES)
            for n in globals_}
    return per_file, crcs


def _add_held(held: dict[int, int], g, r0: int, r1: int) -> None:
    """Add to ``held`` the bytes of rows ``[r0, r1)`` of global tensor ``g`` each rank holds."""
    isz = lookup_dtype(g.dtype).itemsize
    box = GBox((r0,) + (0,) * (len(g.shape) - 1), (r1 - r0,) + tuple(g.shape[1:])) if g.shape else GBox((), ())
    for s in g.sources:
        hit = intersect(box, s.box)
        if hit is not None:
            held[s.key[0]] = held.get(s.key[0], 0) + volume(hit) * isz


class TeamFlush:
    """Node 0's flush of a version, written by every live node. ``view``: the team's (rank, live
    nodes); ``transport``: where the other nodes' shares are asked; ``restore_sources(step)``:
    where each part is read (``VersionSources.restore_sources``: pinned on its holders);
    ``write_own(body)``: this node's share (``flush_share.ShareWriter.write``); ``counters``: the
    flush's."""

    def __init__(self, view: TeamView, transport, restore_sources: Callable[[int], object],
                 write_own: Callable[[dict], list[list[int]]], counters: FlushCounters) -> None:
        self.view, self.transport = view, transport
        self.restore_sources, self.write_own = restore_sources, write_own
        self.counters = counters

    def write(self, version, root: Path | ObjectRoot, progress, rate: float = 0.0) -> bool:
        """Write ``version`` into ``root`` (``step-<N>``; a folder, or an ``ObjectRoot``) with every
        live node; False when the lead must write it alone (see the module). ``progress(done,
        total)`` as bytes land; ``rate``: each writer's ceiling in bytes/s (``--flush-rate``; 0: none)."""
        view, step = self.view, version.step
        if isinstance(root, ObjectRoot) and not root.s3:
            log.info("team: %s is not S3 (no multipart uploads to share); node %d writes step %d alone", root.url,
                     view.rank, step)
            return False
        got = self.restore_sources(step)  # pins every part on its holders
        try:
            faults.stall("flush.fetch", step)
            faults.point("flush.fetch.kill", step)
            if any(isinstance(w, LocalRead) and w.origin is None for w in got.where.values()):
                log.info("team: step %d has a part rebuilt from parity on this node; node %d writes it alone", step, view.rank)
                return False
            origin = {r: w.origin for r, w in got.where.items()}
            holders = {r: got.holders.get(r) or ((view.rank,) if isinstance(w, LocalRead) else w.nodes)
                       for r, w in got.where.items()}
            globals_ = got.version.globals()
            files = plan_files([(g.name, g.dtype, g.shape, g.pattern) for g in (globals_[n] for n in sorted(globals_))])
            live = sorted(view.live())
            if isinstance(root, ObjectRoot):
                self._upload(root, step, got, origin, holders, globals_, files, live, progress, rate)
                return True
            pieces = cut(globals_, files, block_bytes(files.total_bytes, len(live)))
            sm = ShareFlush(pieces, holders, live, batch_bytes=batch_bytes(files.total_bytes, len(live)))
            root.mkdir(parents=True, exist_ok=True)
            root = root.resolve()  # the writers open the files by this path: the flush dir's, on every node
            tmp = root / spec.tmp_dirname(step, os.getpid())
            if tmp.exists():
                shutil.rmtree(tmp)
            try:
                create_files(tmp, files)
                t0 = time.monotonic()
                self._drive(sm, step, lambda b: self._body(b.node, [(p.name, p.r0, p.r1) for p in b.pieces], sm, step,
                                                           got, origin, globals_, files, str(tmp)), self._send, progress, rate)
                crcs = {n: join_crcs(((c, p.nbytes) for p, c in sm.crcs_of(n)), spec.CHUNK_BYTES) for n in globals_}
                commit_files(tmp, root, step, files, crcs, source_layout=layout_of(got.version.world_size, got.parts),
                             objects=objects_of(got.parts))
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            writers = sorted(set(sm.written_by.values()))
            log.info("team: step %d written by nodes %s in %.2f s (%d pieces)", step, writers, time.monotonic() - t0, len(pieces))
            return True
        finally:
            got.release()

    def _upload(self, root: ObjectRoot, step: int, got, origin: dict, holders: dict, globals_: dict, files: FileLayout,
                live: list[int], progress, rate: float) -> None:
        """The version as parts of one multipart upload per file, each uploaded by the node that
        fills it; then each upload completed and checked, and the version committed (see the module)."""
        t0 = time.monotonic()
        if root.committed(step):  # a lead before us committed it and died before its index said so
            root.point_latest(step)
            return
        parts = plan_parts(files, max(root.part_bytes, block_bytes(files.total_bytes, len(live))))
        sm = ShareFlush(cut_parts(globals_, parts), holders, live, batch_bytes=batch_bytes(files.total_bytes, len(live)))
        up = SharedUpload(root, step)
        up.clear()
        uploads: dict[str, str] = {}
        finished: set[str] = set()
        url = join(root.url, spec.step_dirname(step))

        def body(b: Batch) -> dict:
            mine = [parts[p.id] for p in b.pieces]
            out = self._body(b.node, [(s.name, s.r0, s.r1) for part in mine for s in part.segments], sm, step, got, origin,
                             globals_, files, url)
            out["parts"] = [{"file": part.file, "upload": uploads[part.file], "number": part.number, "offset": part.offset,
                             "size": part.size, "pieces": len(part.segments), "head": files.files[part.file][2][: part.head]}
                            for part in mine]
            return out

        def send(b: Batch, body: dict) -> list:
            """The writer's grid CRCs per segment, joined per part (``ShareFlush`` counts parts)."""
            flat, out = self._send(b, body), []
            for p in b.pieces:
                segs = parts[p.id].segments
                grids, flat = flat[: len(segs)], flat[len(segs):]
                for s, g in zip(segs, grids):
                    if len(g) != grid_count(s.r0 * files.tensors[s.name].row_bytes, s.nbytes, spec.CHUNK_BYTES):
                        raise ProtocolError(f"node {b.node} answered {len(g)} checksums for rows [{s.r0}, {s.r1}) of {s.name!r}")
                out.append([c for g in grids for c in g])
            if flat:
                raise ProtocolError(f"node {b.node} answered checksums for {len(flat)} pieces more than it was sent")
            return out

        try:
            for fname in sorted(files.files):
                uploads[fname] = up.open(fname)
            self._drive(sm, step, body, send, progress, rate)
            per_file, crcs = checksums_of(parts, sm.done, files, globals_)
            for fname, done in per_file.items():
                up.finish(fname, uploads[fname], done)
                finished.add(fname)
            meta, blob = remote_meta(step, files, crcs, source_layout=layout_of(got.version.world_size, got.parts),
                                     objects=objects_of(got.parts))
            sent = up.commit(meta, blob, {f: size for f, (size, _, _) in files.files.items()})
        except BaseException:
            for fname in set(uploads) - finished:
                up.abort(fname, uploads[fname])
            raise
        self.counters.flush_uploaded_bytes += sent
        writers = sorted(set(sm.written_by.values()))
        log.info("team: step %d uploaded to %s by nodes %s in %.2f s (%d parts)", step, root.url, writers,
                 time.monotonic() - t0, len(parts))

    def _drive(self, sm: ShareFlush, step: int, body_of, send, progress, rate: float) -> None:
        """Send every writer its batches (``body_of(batch)``, through ``send(batch, body)``) and
        follow the answers, the failures and the losses until every piece is done."""
        pool = ThreadPoolExecutor(min(WORKERS, len(sm.writers)), thread_name_prefix="ucpd-flush-lead")
        futures: dict = {}
        try:
            while not sm.complete:
                if sm.error:
                    raise StorageError(f"step {step}: the team's flush failed: {sm.error}")
                for b in sm.ready():
                    body = body_of(b)
                    if rate:
                        body["rate"] = int(rate)
                    futures[pool.submit(send, b, body)] = b
                if not futures:  # (only when an error is about to be raised)
                    time.sleep(0.05)
                done, _ = wait(list(futures), timeout=0.25, return_when=FIRST_COMPLETED)
                for f in done:
                    b = futures.pop(f)
                    if b.id not in sm.flight:  # its node was declared lost meanwhile: others have its pieces
                        continue
                    try:
                        sm.on_done(b.id, f.result())
                    except StorageError as exc:  # this node cannot write there: the others do
                        log.warning("team: node %d cannot write step %d's flush: %s", b.node, step, exc)
                        sm.on_refused(b.id, str(exc))
                    except UcpdError as exc:
                        log.warning("team: node %d failed pieces of step %d's flush: %s; they go to another node", b.node, step, exc)
                        sm.on_failed(b.id, str(exc))
                    progress(sm.bytes_done, sm.total_bytes)
                live = self.view.live()
                for node in sorted({n for ns in sm.holders.values() for n in ns} | sm.writers):
                    if node not in live:
                        log.warning("team: node %d was lost during step %d's flush; its unfinished pieces go to others", node, step)
                        sm.on_lost(node)
            if sm.error:
                raise StorageError(f"step {step}: the team's flush failed: {sm.error}")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _send(self, b: Batch, body: dict) -> list:
        if b.node == self.view.rank:
            return self.write_own(body)  # our own share, on this thread
        reply, _ = self.transport.request(b.node, "flush_share", body, timeout=SHARE_TIMEOUT)
        return reply["crcs"]

    def _body(self, node: int, rows: list[tuple[str, int, int]], sm: ShareFlush, step: int, got, origin: dict,
              globals_: dict, files: FileLayout, where: str) -> dict:
        """The ``flush_share`` request to ``node`` for ``rows`` (tensor, r0, r1), written into
        ``where`` (the temporary folder, or the version's URL): the pieces, and the entries of
        exactly the rank tensors they read when ``node`` prefers what it holds (it plans the
        same way)."""
        mine = lambda key: node not in sm.holders.get(key[0], ())  # noqa: E731  (False sorts first)
        keys: set = set()
        pieces = []
        for name, r0, r1 in rows:
            g, place = globals_[name], files.tensors[name]
            srcs = sorted(g.sources, key=lambda s: mine(s.key))
            plan = plan_consolidate(name, g.shape, srcs, (r0, r1) if g.shape else None)
            keys.update(c.src_key for c in plan.copies if c.src_view.numel)
            pieces.append({"name": name, "dtype": g.dtype, "shape": list(g.shape), "file": place.file,
                           "begin": place.begin, "end": place.end, "r0": r0, "r1": r1})
        sources = [{"rank": r, "idx": i, "t": got.parts[r].tensors[i].to_wire(), "origin": origin[r],
                    "nodes": list(sm.holders.get(r, ()))}
                   for r, i in sorted(keys, key=lambda k: (mine(k), k))]
        return with_run({"step": step, "dir": where, "chunk": spec.CHUNK_BYTES, "pieces": pieces, "sources": sources}, got.run)
