"""Executing a restore plan on the trainer side: verify the source chunks, copy, fill, release.

The daemon answers a restore with a plan (``ucpd.protocol.RestorePlan``, made by
``ucpd.daemon.restore``): a table of source tensors (a file, an offset, a dtype, chunk CRCs)
and per target tensor a list of strided copies and padding fills. The client maps each source
file read-only once, checks the CRC of every chunk any copy touches, and copies straight into
the target tensors — one copy from the daemon's RAM to the trainer's memory, with no staging
in between for CPU targets; CUDA targets are filled by DMA straight from the registered
source (``ucpd_client.device_restore``). The copying and verifying (fused copy+CRC where the
windows allow) is ``ucpd.checked.CheckedCopier``: by default one pass that checksums each chunk
as it copies it (``UCPD_RESTORE_VERIFY=window``: windows of ``UCPD_RESTORE_WINDOW`` bytes, each
chunk checked just before it is copied; ``all``: every chunk checked before the first byte).

A restore runs in a ``DaemonSession`` (``ucpd_client.session``): its connection, its mappings
of the sources, its CUDA backend; it records where the data came from in the session
(``last_restore``, ``last_device_restore``).
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
from typing import Any, Mapping

import numpy as np
import torch

from ucpd import faults, gcpause, knobs, native
from ucpd.dtypes import dtype as lookup_dtype
from ucpd.checked import CheckedCopier, CheckedSource
from ucpd.errors import ChecksumMismatch, ProtocolError
from ucpd.protocol import PlanSource, RestorePlan

from . import state as state_mod
from .device_restore import DeviceRestore
from .lane_restore import LaneRestore, LaneUnreachable
from .session import DaemonSession
from .staging import dtype_name, entry_of

log = logging.getLogger("ucpd.client")

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    """A flat numpy view of a contiguous CPU tensor's bytes as the unsigned int of its width."""
    flat = t.view(-1).view(_INT_OF_SIZE[t.element_size()])
    return flat.numpy().view(f"u{t.element_size()}")


class _SourceName:
    """How an error names a plan's source (formatted only for an error)."""

    __slots__ = ("path", "offset")

    def __init__(self, path: str, offset: int):
        self.path, self.offset = path, offset

    def __str__(self) -> str:
        return f"restore source {self.path} (bytes from {self.offset}):"


_STORAGE: dict[str, np.dtype] = {}


def _storage(dtype: str) -> np.dtype:
    got = _STORAGE.get(dtype)
    if got is None:
        got = _STORAGE[dtype] = lookup_dtype(dtype).storage
    return got


def merged_values(objects: Mapping[int, bytes], rank: int, crcs: Mapping[int, int | None] | None = None) -> dict[str, Any]:
    """The plain values of a version for ``rank``: its own rank's first, then any name it
    lacks from the other source ranks the daemon sent, lowest first (a new rank gets rank 0's
    loader state). A large team's restore in the layout that saved it sends only rank 0's and
    those of the rank's node part. Each rank's pickle is checked against its CRC32C before it is unpickled."""
    out: dict[str, Any] = {}
    for r in sorted(objects, key=lambda r: (r != rank, r)):
        want = (crcs or {}).get(r)
        if want is not None and native.crc32c(objects[r]) != want:
            raise ChecksumMismatch(f"the plain values (step, RNG, loader state) saved by rank {r} are damaged")
        if objects[r]:
            for name, value in pickle.loads(objects[r]).items():
                out.setdefault(name, value)
    return out


def restore(session: DaemonSession, target_state: Mapping[str, Any], step: int | None,
            placements: Mapping[str, Any] | None) -> int:
    """Fill the tensors of a nested state in place and put its plain values back."""
    with gcpause.paused():
        tensors, _ = state_mod.split(dict(target_state))
        entries = [entry_of(name, t, (placements or {}).get(name)) for name, t in tensors.items()]
        step, values = restore_entries(session, entries, step)
    state_mod.assign_values(target_state, values)  # type: ignore[arg-type]
    return step


def process_id() -> dict:
    """This process as the daemon can check it is alive: its pid, in its pid namespace."""
    try:
        return {"pid": os.getpid(), "pidns": os.readlink("/proc/self/ns/pid")}
    except OSError:
        return {}


MAX_SOURCES_TRIED = 4  # a restore whose source fails its checksums asks the daemon for the next one


def restore_entries(session: DaemonSession, entries: list, step: int | None) -> tuple[int, dict[str, Any]]:
    """``_restore_entries`` with the cyclic garbage collector paused (``ucpd.gcpause``): the plan
    of 10^5 tensors is millions of short-lived objects."""
    with gcpause.paused():
        return _restore_entries(session, entries, step)


def _restore_entries(session: DaemonSession, entries: list, step: int | None) -> tuple[int, dict[str, Any]]:
    """Fill each entry's tensor (any view: strided ones go through a staging copy) with the
    global elements its placement names. Returns (step, the version's plain values).

    Every chunk a plan reads is checked against its CRC32C (``knobs.restore_verify``: by default
    as it is copied, in one pass; ``window``: just before it is copied; ``all``: every chunk
    before the first target byte). A damaged source (a flipped byte in a slot or a flushed file)
    is met as ``ChecksumMismatch``: the client tells the daemon (``release`` with ``damaged``), which counts it
    (``ucpd_checksum_failures_total``), and asks again naming the damaged copies (``avoid``):
    the daemon answers from the next source, the same step from the flush dir, or (no step
    asked) the previous version, and that source rewrites every target. When no other source
    is left, ChecksumMismatch is raised, saying whether the targets are partly written or,
    with ``all``, unchanged."""
    targets = [
        {"name": e.name, "dtype": dtype_name(e.tensor), "shape": list(e.tensor.shape), "placement": e.placement}
        for e in entries
    ]
    conn = session.conn()
    body = {"rank": session.rank, "world_size": session.world_size, "targets": targets, **process_id()}
    if (knobs.restore_lane() and session.lane_off is None and knobs.restore_verify() == "fused"
            and all(session.cuda.device_of(e.tensor) < 0 for e in entries)):
        body["lane"] = True  # on a team, the sources held on peers are got here on the data lane, landing in the targets
    if step is not None:
        body["step"] = step
    tried: list[tuple[int, str]] = []
    first: ChecksumMismatch | None = None  # what the first damaged source said
    while True:
        try:
            reply = conn.call("restore", **body)
        except ChecksumMismatch as exc:  # the daemon has no sound copy left
            if first is None:
                raise
            raise ChecksumMismatch(f"{first}; then: {exc}{_targets_left()}") from None
        damaged = False
        try:
            faults.point("client.restore", reply["step"])  # test-only crash points (inert in production)
            values = _apply_plan(session, entries, reply["plan"], reply)
            faults.point("client.restored", reply["step"])
        except ChecksumMismatch as exc:
            damaged = True
            first = first or exc
            if (reply["step"], reply["where"]) in tried or len(tried) + 1 >= MAX_SOURCES_TRIED:
                raise ChecksumMismatch(f"{exc}{_targets_left()}") from None
            tried.append((reply["step"], reply["where"]))
            body["avoid"] = [list(t) for t in tried]
            continue
        except LaneUnreachable as exc:  # this rank cannot reach a holder's lane: its daemon fetches (and rewrites all)
            body.pop("lane", None)
            session.lane_off = str(exc)
            log.warning("rank %d: %s; this session's restores have the daemon fetch the peers' bytes instead",
                        session.rank, exc)
            continue
        finally:
            conn.call("release", lease=reply["lease"], **({"damaged": True} if damaged else {}))
        break
    session.last_restore = {"step": reply["step"], "where": reply["where"]}
    if tried:
        session.last_restore["damaged"] = tried  # (step, where) of each source that failed its checksums
    return reply["step"], values


def _targets_left() -> str:
    """What a restore that found no sound source left in its targets, in the words of its error."""
    mode = knobs.restore_verify()
    if mode == "all":
        return "; the targets are unchanged"
    what = "the windows before the damaged chunk" if mode == "window" else "the damaged chunk among them"
    return (f"; the targets may be partly written ({what}): restore another step before training on them "
            "(UCPD_RESTORE_VERIFY=all leaves them unchanged instead)")


def apply_plan(session: DaemonSession, entries: list, plan: RestorePlan, verify: str | None = None) -> None:
    """Fill ``entries`` by ``plan`` (its tensors in their order), verified: a receiver's pull
    (``ucpd_client.weights``), which reads tensors only, under a lease it releases itself.
    ``verify``: ``"all"`` or ``"window"`` (None: ``knobs.restore_verify()``), or ``"fused"``: one
    pass, each chunk checksummed as it is copied (fastest; a damaged chunk's bytes have landed
    when the error is raised)."""
    _apply_plan(session, entries, plan, {"objects": {}, "objects_crcs": {}}, verify)


def _apply_plan(session: DaemonSession, entries: list, plan: RestorePlan, reply: dict,
                verify: str | None = None) -> dict[str, Any]:
    """Verify the source chunks the plan reads and the plain values, then copy and fill.

    ``knobs.restore_verify()``: ``fused`` (default) copies in one pass that checksums each
    chunk as it copies it; ``window`` runs the plan in windows of ``knobs.restore_window()``
    bytes, each checked and then copied while in cache (no byte of a damaged chunk is written;
    earlier windows are); ``all`` checks every chunk before the first target byte is written, so
    a damaged source leaves every target as it was. CUDA targets:
    ``ucpd_client.device_restore`` (straight from the registered slot to the device)."""
    if len(plan.tensors) != len(entries) or any(e.name != t.name for e, t in zip(entries, plan.tensors)):
        raise ProtocolError(
            f"the daemon's restore plan answers {len(plan.tensors)} tensors, not the {len(entries)} targets asked for "
            "in their order; client and daemon disagree (different ucpd releases?)"
        )
    mode, window = verify or knobs.restore_verify(), knobs.restore_window()
    on = session.cuda.device_of
    # sources the daemon still fetches from peers (``pending``): copied once ``fetched`` says they
    # are here, after the rest; "all" (nothing written before every chunk is checked) and device
    # targets wait for them first
    pending = frozenset(reply.get("pending") or ())
    if pending and (mode == "all" or any(on(e.tensor) >= 0 for e in entries)):
        _wait_fetched(session, reply)
        pending = frozenset()
    threads = knobs.copy_threads()
    cuda = [on(e.tensor) >= 0 for e in entries]
    host_of = [None if dev else e.tensor if e.tensor.is_cpu and e.tensor.is_contiguous()
               else torch.empty(e.tensor.shape, dtype=e.tensor.dtype) for e, dev in zip(entries, cuda)]
    lane = None
    if reply.get("remote"):  # the peers' rows: got here on the data lane, beside the copies below
        lane = LaneRestore(session.lane_pull(), reply["step"], plan, reply["remote"], host_of, _add_copies, threads)
    sources, hosts = _sources(session, plan.sources, lane.rows if lane is not None else frozenset())
    cpu = _Windows(sources, window if mode == "window" else 0, threads, fused=mode == "fused")
    later = _Windows(sources, window if mode == "window" else 0, threads, fused=mode == "fused")
    device = None
    finish = []  # (target, host buffer, fills) where a fill or a staging copy is left to do
    for e, t, dev, host in zip(entries, plan.tensors, cuda, host_of):
        target = e.tensor
        if dev:
            if device is None:
                device = DeviceRestore(session.cuda, session.restore_streams(), sources, hosts, session.pin_source, window,
                                       mode, threads)
            device.add(target, t.copies, t.fills, lambda host, copies: _add_copies(cpu, host, copies))
            continue
        if lane is not None:
            copies = [c for c in t.copies if c.src_key not in lane.rows]
            if copies:
                _add_copies(cpu, host, copies)
        elif t.copies:
            if pending:
                _add_copies(cpu, host, [c for c in t.copies if c.src_key not in pending])
                _add_copies(later, host, [c for c in t.copies if c.src_key in pending])
            else:
                _add_copies(cpu, host, t.copies)
        if t.fills or host is not target:
            finish.append((target, host, t.fills))
    values = merged_values(reply["objects"], session.rank, reply["objects_crcs"])  # checked before any write
    if mode == "all":  # every chunk the copies read, before the first byte lands in a target
        cpu.verify_all()
        if device is not None:
            device.verify_all()
    if device is not None:
        device.start()  # queued window by window; the CPU copies below overlap the DMAs
    try:
        if lane is None:
            cpu.run()
        else:  # this node's bytes copied on a thread (native: the GIL let go) while the peers' land here
            local = _Started(cpu.run)
            try:
                lane.run()
            finally:
                local.join()
            session.last_lane_restore = dict(lane.stats)
    except BaseException:
        if device is not None:
            device.drain()
        raise
    if pending:
        _wait_fetched(session, reply)
        later.run()
    if device is not None:
        device.finish()
        session.last_device_restore = dict(device.stats)
    for target, host, fills in finish:
        flat = host.view(-1)
        for view, value in fills:
            torch.as_strided(flat, view.shape, view.strides, view.offset).fill_(value)
        if host is not target:
            target.copy_(host)
    return values


class _Started:
    """``work()`` on a thread of its own; ``join`` waits for it and raises what it raised."""

    def __init__(self, work):
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name="ucpd-restore-local", daemon=True)
        self._thread.start()

    def _run(self, work) -> None:
        try:
            work()
        except BaseException as exc:
            self._error = exc

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _wait_fetched(session: DaemonSession, reply: dict) -> None:
    """Until the daemon has the restore's sources it fetches from peers here, checked (raises the
    error that stopped their fetch: the restore then fails as one that read a damaged or lost copy)."""
    session.conn().call("fetched", lease=reply["lease"])


class _Windows:
    """The CPU copies of a restore as a sequence of ``CheckedCopier`` windows of about
    ``window`` source bytes each (0: one window, the whole plan). A contiguous copy larger than
    a window is cut at source chunk bounds; other copies go whole into the current window."""

    def __init__(self, sources: list[CheckedSource], window: int, threads: int, fused: bool = False):
        self.sources, self.window, self.threads, self.fused = sources, window, threads, fused
        self.copiers: list[CheckedCopier] = []
        self._size = 0

    def _take(self, nbytes: int) -> CheckedCopier:
        if not self.copiers or (self.window and self._size and self._size + nbytes > self.window):
            self.copiers.append(CheckedCopier(self.sources, threads=self.threads))
            self._size = 0
        self._size += nbytes
        return self.copiers[-1]

    def add_range(self, key, lo: int, hi: int, ptr: int, size: int, dst_lo: int, isz: int) -> None:
        if not self.window or hi - lo <= self.window:
            self._take(hi - lo).add_range(key, lo, hi, ptr, size, dst_lo, isz)
            return
        chunk = self.sources[key].chunk
        step = max(chunk, self.window // chunk * chunk)
        at = lo
        while at < hi:
            end = min(hi, (at // step + 1) * step)
            self._take(end - at).add_range(key, at, end, ptr, size, dst_lo + at - lo, isz)
            at = end

    def add(self, c, ptr: int, size: int, isz: int, view) -> None:
        self._take(c.src_view.numel * isz).add(c, ptr, size, isz, view)

    def verify_all(self) -> None:
        for run in self.copiers:
            run.verify()

    def run(self) -> None:
        for run in self.copiers:
            if run.verified or self.fused:
                run.run()  # checked already (mode "all"), or not (mode "fused"): checked as it is copied
            else:
                run.run_verified()  # each chunk checked, then copied while in cache


def _sources(session: DaemonSession, rows: tuple[PlanSource, ...], skip: frozenset = frozenset()
             ) -> tuple[list, dict[int, tuple[str, np.ndarray]]]:
    """The plan's source table over the mapped files, each file mapped once (every tensor of
    a slot names the same one); arrays are made only where a copy needs one. Also, per source,
    the path and array of the file it lies in (a GPU restore registers the file). The rows of
    ``skip`` (read on the data lane) are None."""
    session.maps.forget_missing()
    files: dict[str, tuple[np.ndarray, int]] = {}
    out: list = []
    hosts: dict[int, tuple[str, np.ndarray]] = {}
    for i, s in enumerate(rows):
        if i in skip:
            out.append(None)
            continue
        path = s.path
        got = files.get(path)
        if got is None:
            try:
                whole = session.maps.get(path, writable=False)
            except (OSError, ValueError) as exc:  # gone, or truncated to nothing (mmap refuses 0 bytes)
                raise ChecksumMismatch(f"restore source {path} cannot be read ({exc})") from None
            got = files[path] = (whole, whole.ctypes.data)
        whole, address = got
        offset, nbytes = s.offset, s.nbytes
        if offset + nbytes > whole.nbytes:
            raise ChecksumMismatch(f"restore source {path} is shorter than the plan says (truncated?)")
        out.append(CheckedSource.within(
            whole, offset, nbytes, _storage(s.dtype), s.crcs, s.chunk, _SourceName(path, offset),
            recorded="the restore plan", buffer_address=address,
        ))
        hosts[i] = (path, whole)
    return out, hosts


def _add_copies(run: "_Windows", host: torch.Tensor, copies) -> None:
    """Add one target's copies (``PlanCopy``, the ucl ``Copy`` the copier takes): contiguous
    windows by their byte ranges, others as views."""
    ptr, isz = host.data_ptr(), host.element_size()
    size = host.numel() * isz
    for c in copies:
        sv, dv = c.src_view, c.dst_view
        n = sv.shape
        if len(n) == 1 and tuple(sv.strides) == (1,) and tuple(dv.strides) == (1,) and tuple(dv.shape) == tuple(n):
            lo = sv.offset * isz  # the planner makes runs 1-D
            run.add_range(c.src_key, lo, lo + n[0] * isz, ptr, size, dv.offset * isz, isz)
        else:
            run.add(c, ptr, size, isz, lambda h=host: _numpy_view(h))
