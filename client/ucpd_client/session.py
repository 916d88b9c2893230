"""``DaemonSession``: what a trainer rank's calls to its node daemon share.

A session is this rank (rank, world size) of a job (its name and this run's id) talking to the
daemon at a run directory: a connection per thread (``conn()``, each call about versions naming
the job), the mappings of the daemon's files (slots and restore sources, shared by the threads
of the rank), the CUDA backend and the device-side state of restores (their streams, the
page-locked restore sources), and what the last restore did. The ``Checkpointer`` makes one
and snapshots through it; a restore (``ucpd_client.restore``), the DCP reader and the
framework integrations take it (``Checkpointer.session``) instead of the Checkpointer's insides.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ucpd import knobs
from ucpd.rpc import Connection

from . import launchers
from .errors import LocalSizeWrong
from .mapping import Mappings
from .streams import TORCH_CUDA, DeviceStreams


class DaemonConn:
    """A connection to the daemon whose calls about versions name the session's job (and,
    for the reads a team fences, its run). ``call`` takes a message type of
    ``ucpd.protocol`` and its fields; both ends check them against the message's schema."""

    JOB_SCOPED = frozenset({"begin", "commit", "abort", "wait", "latest", "restore", "describe"})
    RUN_SCOPED = frozenset({"latest", "restore", "describe"})  # a team fences earlier runs before answering

    def __init__(self, conn: Connection, job: str, run: str | None = None):
        self.connection = conn
        self._job = job
        self._run = run

    def call(self, msg_type: str, **body: Any) -> dict:
        if msg_type in self.JOB_SCOPED:
            body.setdefault("job", self._job)
        if self._run and msg_type in self.RUN_SCOPED:
            body.setdefault("incarnation", self._run)
        return self.connection.call(msg_type, **body)

    def call_wait(self, step: int, timeout: float) -> dict:
        """``wait`` for ``step`` up to ``timeout`` seconds (the socket waits that long more).
        Raises ``LocalSizeWrong`` as soon as the team's answer shows the step can never commit."""
        reply = self.connection.call("wait", timeout=timeout + knobs.rpc_timeout(), step=step, seconds=timeout, job=self._job)
        waiting = reply.get("waiting") if reply.get("state") == "pending" else None
        if waiting and never_commits(waiting):
            from ucpd.daemon.stalls import describe

            raise LocalSizeWrong(f"step {step} can never commit: {describe(self._job, step, waiting)} "
                                 f"(this rank's local size {waiting['local_size']}: {local_size_said(waiting)})")
        return reply


def never_commits(waiting: dict) -> bool:
    """Whether a pending step's ``WAITING`` record (``ucpd.daemon.stalls.record``) shows that it
    can never commit: this node was told the whole world seals here, yet the team has seen ranks
    of the step sealed on other nodes too (a rank seals on one node only)."""
    world = waiting["world_size"]
    nodes = [n for n, ranks in (waiting.get("seen") or {}).items() if ranks]
    return world > 1 and waiting["local_size"] >= world and len(nodes) > 1


def local_size_said(waiting: dict) -> str:
    """Where this rank's local size came from, as the Checkpointer chose it."""
    place = launchers.detect(world_size=waiting["world_size"])
    if place.local_size:
        return place.describe("local_size")
    if waiting["local_size"] >= waiting["world_size"]:
        return launchers.NO_LOCAL_SIZE
    return "Checkpointer(local_world_size=...)"


class DaemonSession:
    """One rank of one job talking to the daemon at ``run_dir`` (see the module docstring).

    ``conn``: the connection the caller opened (its ``hello`` answered), kept for this
    thread; other threads open their own. ``on_drop(path)``: called before a writable
    mapping (a slot) goes, so that its CUDA registration goes first."""

    def __init__(self, run_dir: str, rank: int, world_size: int, job: str, job_id: str | None, conn: Connection,
                 on_drop: Callable[[str], None] | None = None):
        self.run_dir, self.rank, self.world_size, self.job, self.job_id = run_dir, rank, world_size, job, job_id
        self._local = threading.local()
        self._local.conn = conn
        self._conns = [conn]
        self._on_drop = on_drop
        self.maps = Mappings(on_drop=self._dropped)
        self.cuda = TORCH_CUDA  # the CUDA backend (tests without a GPU put a model of streams here)
        self._restore_streams: DeviceStreams | None = None
        self._pinned: dict[str, int | None] = {}  # restore sources registered (address), or that refused (None)
        # the last restore's {"step", "where"}: "ram" (this node's or the team's) or "disk" (the flush dir)
        self.last_restore: dict | None = None
        self.last_device_restore: dict | None = None  # the last restore into CUDA tensors: windows, bytes, pieces
        self.last_lane_restore: dict | None = None  # the last restore's bytes got on the data lane: in place, windowed
        self._lane_pull = None  # the data lane and window of restores that read peers' bytes here (made on first use)
        self.lane_off: str | None = None  # why this rank's restores stopped getting peers' bytes themselves

    def conn(self) -> DaemonConn:
        """This thread's connection (opened on its first call)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = Connection(self.run_dir, timeout=knobs.rpc_timeout())
            self._conns.append(conn)
        return DaemonConn(conn, self.job, self.job_id)

    def describe(self, step: int | None = None) -> dict:
        """``Checkpointer.describe``: what committed version ``step`` (None: the newest) holds."""
        return self.conn().call("describe", **({} if step is None else {"step": step}))

    def restore_streams(self) -> DeviceStreams:
        """One restore stream per device, made when a restore first fills a CUDA tensor."""
        if self._restore_streams is None:
            self._restore_streams = DeviceStreams(self.cuda)
        return self._restore_streams

    def pin_source(self, path: str, whole) -> bool:
        """Page-lock a restore source's read-only mapping once (kept while it is mapped): True,
        or False when the driver refuses (a file on disk; its copies then come from pageable
        memory, piece by piece)."""
        if path not in self._pinned:
            try:
                self.cuda.host_register(whole.ctypes.data, whole.nbytes, read_only=True)
                self._pinned[path] = whole.ctypes.data
            except Exception:
                self._pinned[path] = None
        return self._pinned[path] is not None

    def _dropped(self, path: str, writable: bool) -> None:
        """A mapping goes: its CUDA registration first (a slot's, or a restore source's)."""
        if writable:
            if self._on_drop is not None:
                self._on_drop(path)
            return
        address = self._pinned.pop(path, None)
        if address is not None:
            self.cuda.host_unregister(address)

    def lane_pull(self):
        """The ``lane_pull.LanePull`` (the receiver's data lane, its window) of this session's restores."""
        if self._lane_pull is None:
            from .lane_pull import LanePull

            self._lane_pull = LanePull(self.maps)
        return self._lane_pull

    def close(self) -> None:
        """Drop the connections, the data lane and the mappings (the daemon keeps running)."""
        if self._lane_pull is not None:
            self._lane_pull.close()
            self._lane_pull = None
        for c in self._conns:
            c.close()
        self.maps.close()
