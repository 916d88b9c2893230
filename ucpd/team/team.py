"""The team of daemons as the node daemon sees it: the driver of the commit protocol.

``Team`` is the daemon's ``CommitPolicy`` when ``--nodes > 1``. Like raft's ``Ready`` loop it
feeds the pure state machines (the membership — ``membership.Membership`` from all-to-all
heartbeats, or ``gossip.Gossip`` with ``--membership gossip`` — and ``commit.CommitNode``) their
inputs — ticks of its clock, heartbeats or gossip, the peers' commit messages, versions protected
here, a new run of the job — and carries out what they output: ``Send`` goes to a peer, ``Commit``
to ``NodeStore.commit``, ``Fence`` abandons the fenced runs' undecided parts and replicas; gossip's
messages go to the peers they name. A new run of the job waits in ``join_run`` until the team
fenced the earlier runs.

The jobs around it are parts of their own, built here and given what they use: a read-only
``view.TeamView``, the store, the transport, their counters (``counters``), callables for what
they ask of a sibling; each registers what it answers with the ``serve.PeerServer``. Which part
gets what, and the threads and lock order: docs/ARCHITECTURE.md, "The team's parts".
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from types import MappingProxyType

from .. import faults, knobs, protocol
from ..daemon.leases import Leases
from ..daemon.versions import RESTORABLE, Version, VersionState
from . import commit_faults
from .commit import Commit, CommitNode, Decided, Fence, Send
from .config import TeamConfig
from .counters import TeamCounters
from .flush_lead import TeamFlush
from .flush_share import ShareWriter
from .holders import replica_holders
from .lane import DataLane
from .lane_keeper import LaneKeeper, NoLane
from .liveness import GossipThread, make_membership, node_ranges
from .parity_group import ParityGroup
from .parity_heal import ParityHealer
from .parts import run_of
from .replicas import ReplicaStore
from .replicate import Replicator
from .runs import wait_admitted
from .serve import PeerServer
from .serve_held import HeldServer
from .serve_parity import LaneDispatch, register_parity
from .settle import Settle
from .sources import FETCH_PREFIX, VersionSources
from .status import TeamStatus
from .transport import PeerTransport
from .view import TeamView

log = logging.getLogger("ucpd.team")

JOIN_TIMEOUT = 120.0  # seconds a new run's first request waits for the team to fence the earlier runs


class Team:
    """The daemon's commit policy and its link to the other daemons of the job."""

    local_parts = True

    def __init__(self, config: TeamConfig, shm_dir: str, link=None, clock=time.monotonic) -> None:
        """``link``: makes the transport to the peers, as ``PeerTransport`` (tests: ``helpers/fake_link.py``).
        ``clock``: the time of the team's timers (liveness, resends, peer leases, heal retries);
        a test passes one it advances itself, so no timer races the machine's load."""
        self.config = config
        self.rank = config.node_rank
        self.shm_dir = shm_dir
        self.flushes = config.node_rank == 0 and bool(config.flush_dir)
        self._lock = threading.Lock()
        self.incarnation = uuid.uuid4().hex[:16]
        self.clock = clock
        self.membership = make_membership(config, self.incarnation, clock())
        self.gossip = config.membership == "gossip"
        self._view_change: set[int] | None = None  # rejoined peers of the views since the last tick
        self._membership_thread: GossipThread | None = None
        self.commit: CommitNode | None = None  # made in attach(), knowing what was re-adopted
        self.domains: dict[int, str] = {self.rank: config.domain or f"node-{self.rank}"}
        self.view = TeamView(self.rank, config.nodes, MappingProxyType(self.domains), self.live, clock, self.current_run, self.is_committed)
        self.counters = TeamCounters()  # each part's, gathered
        self.store = None
        self.replicas: ReplicaStore | None = None
        self.parity: ParityGroup | None = None  # with --parity: made in attach(), reading the store and the replicas
        self.leases: Leases | None = None
        self.flush_storage_options: dict | None = None  # fsspec's, for an object-store --flush-dir (cli.compose)
        self.server = PeerServer(self.rank, self.counters.serve)  # each part registers what it answers
        self.server.register("commit", lambda src, b, frames: self.on_commit_message(src, b["m"]))
        self.server.register("gossip", lambda src, b, frames: self.on_gossip(src, b["m"]))
        self.server.register("hello", lambda src, b, frames: self.on_hello(src, b))
        self.transport = (link or PeerTransport)(
            self.rank,
            config.listen,
            config.secret,
            on_message=self.server.on_message,
            on_request=self.server.on_request,
            on_heartbeat=None if self.gossip else self._on_heartbeat,
            heartbeat_interval=None if self.gossip else config.heartbeat,
            net_limit=config.net_limit,
            incarnation=self.incarnation,
            schemas=protocol.PEER_REQUESTS,
        )
        # bulk bytes on a lane of their own; an in-process link (tests) keeps them on itself, where its faults reach them
        self.lanes = NoLane() if link is not None or config.data_transport == "zmq" else LaneKeeper(
            config, lambda src, b: self.lane_serves.put(src, b), lambda src, b: self.lane_serves.get(src, b),
            lambda also: set(replica_holders(self.rank, sorted(self.live() | {also}), max(1, config.replicas), self.domains)))
        if not config.fanout:
            self.server.refuse(("directory", "index", "pieces"), f"node {self.rank} keeps no directory or piece index "
                               "(started with --commit-fanout 0): ask every node with `holdings`")

    # --- life cycle ----------------------------------------------------------------------------

    def attach(self, store, leases: Leases | None = None) -> None:
        """Join: build the parts that need the store, bind the peer port, connect, start the threads.
        ``leases``: the node's, where a peer's pin on our RAM is one (None: the team's own)."""
        self.store = store
        held = store.versions_in((VersionState.COMPLETE, VersionState.PROTECTED, *RESTORABLE))
        self.commit = CommitNode(self.rank, self.config.nodes, committed=[v.step for v in held if v.state in RESTORABLE],
                                 fanout=self.config.fanout)
        self.replicas = ReplicaStore(self.shm_dir, store.atomic(), self.config.keep, self._room)
        self.leases = leases if leases is not None else Leases(store, clock=self.clock)
        self._build_parts(store)
        self.address = self.transport.bind()
        self.lanes.start()
        self.transport.start(self.config.peers)
        self.replicator.start()
        if self.gossip and self.clock is time.monotonic:  # a test's clock is driven through tick()
            self._membership_thread = GossipThread(self._step_membership, self._next_wakeup)
            self._membership_thread.start()
        for peer in range(self.config.nodes):
            if peer != self.rank:
                self.transport.send(peer, "hello", self.hello())
        for v in held:  # re-adopted versions not yet committed: protect them again
            if v.state in (VersionState.COMPLETE, VersionState.PROTECTED):
                self.replicator.protect(v.step)
        log.info("team: node %d of %d listening on %s", self.rank, self.config.nodes, self.address)

    def _build_parts(self, store) -> None:
        """The parts that read or hold the node's store, each given what it uses."""
        c, view = self.counters, self.view
        parity = self.parity = ParityGroup(view, *self.config.parity, store, self.replicas, self.transport, self.members_now,
                                           keep=self.config.keep, unit=knobs.parity_unit(), counters=c.parity,
                                           lane=lambda: self.lane) if self.config.parity else None
        register_parity(self.server, parity, self.rank)
        settle = Settle(view, lambda: self.membership.view.epoch, lambda: self.protocol_state()[3], self.config.dead_after,
                        self.config.heartbeat)
        src = self.sources = VersionSources(view, store, self.replicas, self.transport, self.server, c.fetch, self.shm_dir, settle,
                                            lambda: self.protocol_state()[3], lambda: self.lane, self.config.fanout, parity)
        c.add(*(p.counters for p in (src.directory, src.index) if p is not None))
        self.held_server = HeldServer(self.server, self.rank, store, self.replicas, self.leases, src.own_holdings, c.serve)
        self.lane_serves = LaneDispatch(self.rank, parity, self.held_server)  # a lane put or get: parity's or a replica's
        self.flush_share = ShareWriter(self.rank, self.config.flush_dir, self.shm_dir, store, self.replicas, src.fetch_ranges,
                                       c.flush, c.fetch, self.server, self.flush_storage_options)
        self.flush_lead = TeamFlush(self.view, self.transport, src.restore_sources, lambda b: self.flush_share.write(b), c.flush)
        self.replicator = Replicator(
            self.view, self.config.replicas, store, self.replicas, self.transport, lambda: self.lane, c.replicate,
            report_protected=self.report_protected, replica_sound=src.replica_sound, held_by_node=src.held_by_node,
            parity_protect=parity.protect if parity else None,
            parity_healer=(lambda yield_to: ParityHealer(view, parity, store, self.replicas, self.transport, yield_to))
            if parity else None)
        self._status = TeamStatus(self.config, self.view, store, self.replicas, self.replicator, parity, self.protocol_state,
                                  self.membership if self.gossip else None, self.transport.counters, lambda: self.lane, c)

    def close(self) -> None:
        if self._membership_thread is not None:
            self._membership_thread.stop()
        attached = self.store is not None
        if attached:
            self.replicator.stop()
            self.held_server.close()
            self.flush_share.close()
        if self.parity is not None:
            self.parity.close()
        self.transport.close()
        self.lanes.close()
        if attached:
            self.replicas.close()
        for name in os.listdir(self.shm_dir):
            if name.startswith(FETCH_PREFIX):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.shm_dir, name))

    def _room(self, nbytes: int) -> bool:
        spare = sum(sz for _, sz in self.replicas.spares)
        return self.store.used_bytes + self.replicas.nbytes - spare + nbytes <= self.store.mem_limit

    # --- the commit policy -----------------------------------------------------------------------

    def on_complete(self, version: Version) -> bool:
        """Every local rank sealed ``version``: protect it, then let the team decide (store lock held)."""
        self.replicator.protect(version.step)
        return False

    def tick(self) -> None:
        """Timers (the daemon's loop): liveness, the protocol's resends, peer leases, heals, the stall survey."""
        now = self.clock()
        if self._membership_thread is None:
            self._step_membership(now)
        with self._lock:
            out = self.commit.on_tick(now)
            rejoined, self._view_change = self._view_change, None
        self._apply(out)
        for node, _ in self.leases.end_expired_peers(self.live()):
            log.info("team: node %d's lease on our RAM ended without an unpin (expired or node dead)", node)
        self.replicator.on_tick(now, frozenset(rejoined) if rejoined is not None else None)
        self.sources.on_tick(now)

    def _step_membership(self, now: float) -> None:
        """Run the membership's timers; a new view goes to the commit protocol and the links."""
        with self._lock:
            view = self.membership.on_tick(now)
            sends = self.membership.take_sends() if self.gossip else []
            out = self.commit.on_view(view.live, now) if view is not None else []
            if view is not None:
                self._view_change = (self._view_change or set()) | set(view.rejoined)
        self._send_gossip(sends)
        self._apply(out)
        if view is None:
            return
        log.info("team: live nodes %s (epoch %d)", node_ranges(view.live), view.epoch)
        for peer in set(range(self.config.nodes)) - set(view.live):
            self.transport.fail_pending(peer, "was declared dead (silent for --dead-after)")
            self.lanes.forget(peer)
        for peer in view.rejoined:
            # its predecessor never answers: fail what we asked it now (a copy stuck on it holds up replication)
            self.transport.fail_pending(peer, "restarted (a new incarnation)")
            self.lanes.forget(peer)
            self.transport.send(peer, "hello", self.hello())

    @property
    def lane(self) -> DataLane | None:
        """The data lane bulk bytes move on (None: they go on the control lane)."""
        return self.lanes.lane

    def hello(self) -> dict:
        """What we tell a peer when we join or it rejoins: our failure domain, our data lane."""
        return {"domain": self.domains[self.rank], **self.lanes.hello()}

    def on_hello(self, src: int, body: dict) -> None:
        """A peer's ``hello`` (the I/O thread): its domain, and where its data lane listens."""
        self.domains[src] = body["domain"]
        self.lanes.on_hello(src, body.get("data"))

    def _next_wakeup(self) -> float:
        with self._lock:
            return self.membership.next_wakeup()

    def _send_gossip(self, sends: list) -> None:
        for dst, body in sends:  # a probe older than a period is worthless: drop it rather than queue it
            self.transport.send(dst, "gossip", {"m": body}, timeout=self.config.heartbeat)

    def _apply(self, outputs: list) -> None:
        """Carry out the protocol's outputs, in order."""
        commit_faults.before_apply(outputs, self.commit.coordinator == self.rank)
        sent: set[str] = set()
        for out in outputs:
            if faults.dying():
                return
            if isinstance(out, Send):
                self.transport.send(out.dest, "commit", {"m": out.msg})
                commit_faults.after_send(out.msg, sent)
            elif isinstance(out, Commit):
                self.sources.forget_asked()
                self.store.commit(out.step)
                log.debug("team: step %d committed", out.step)
            elif isinstance(out, Decided):
                log.debug("team: step %d decided, recorded", out.step)
            elif isinstance(out, Fence):
                log.info("team: run %r of the job is the current one; earlier runs are fenced off", out.run)
                self._drop_fenced(out)  # (a committed step's copies stay: the peers' answers about it hold)

    # --- inputs of the protocol --------------------------------------------------------------------

    def _on_heartbeat(self, src: int, incarnation: str) -> None:
        with self._lock:
            self.membership.on_heartbeat(src, incarnation, self.clock())

    def on_gossip(self, src: int, body: dict) -> None:
        """A peer's gossip message (the I/O thread); raises ProtocolError for a bad one."""
        if not self.gossip:
            raise protocol.ProtocolError(f"node {self.rank} uses heartbeats, not gossip: start every daemon of the "
                                         "team with the same --membership")
        with self._lock:
            self.membership.on_message(src, body, self.clock())
            sends = self.membership.take_sends()
        self._send_gossip(sends)

    def on_commit_message(self, src: int, msg: dict) -> None:
        """A peer's commit-protocol message (the I/O thread)."""
        with self._lock:
            out = self.commit.on_message(src, msg, self.clock())
        self._apply(out)

    def report_protected(self, step: int, ranks: tuple[int, ...], world_size: int, run: str) -> None:
        """Our part of ``step`` is held elsewhere too (the replication thread)."""
        with self._lock:
            out = self.commit.on_protected(step, ranks, world_size, self.clock(), run)
        self._apply(out)

    # --- runs of the job ------------------------------------------------------------------------

    def join_run(self, run: str | None, timeout: float = JOIN_TIMEOUT) -> None:
        """Block until ``run`` may read ``latest()`` and snapshot (``runs.wait_admitted``)."""
        wait_admitted(run or "", timeout, self._lock, lambda: self.commit, self._apply, self.clock, self.live)

    def run_ready(self, run: str | None) -> bool:
        with self._lock:
            return self.commit.run_ready(run or "") is True

    def decided(self, step: int) -> bool:
        """Whether the team decided ``step`` (committed, or recorded or being decided here): the store asks."""
        with self._lock:
            return self.commit.decided(step)

    def _drop_fenced(self, fence: Fence) -> None:
        """Abandon our parts and replicas of runs but ``fence.run`` the team never decided (a part a copy
        reads goes when the copy ends; a pinned replica when replaced or by ``--keep``: restores read one run)."""
        keep = lambda step: step in fence.keep or self.decided(step)  # noqa: E731
        job = self.store.team_job
        with self.store.atomic():
            gone = self.store.abandon_runs(job, fence.run, keep) if job is not None else []
            for (origin, step), rep in list(self.replicas.held.items()):
                if run_of(rep) != fence.run and not keep(step):
                    self.replicas.drop(origin, step)
        with self._lock:
            for step in gone:
                self.commit.forget(step)
        self.replicator.forget(gone)

    # --- what the others ask of the protocol ---------------------------------------------------------

    def live(self) -> frozenset[int]:
        with self._lock:
            return self.membership.view.live

    def drop_copies(self) -> int:
        """Free the copies this node holds for its peers (the team's job was dropped); the bytes."""
        return self.replicas.drop_all() if self.replicas is not None else 0

    def is_committed(self, step: int) -> bool:
        with self._lock:
            return self.commit.is_committed(step)

    def current_run(self) -> str:
        with self._lock:
            return self.commit.run

    def protocol_state(self) -> tuple:
        """(the membership view, the protocol's pending steps, its coordinator, its latest step)."""
        with self._lock:
            c = self.commit
            if c is None:
                return self.membership.view, {}, None, None
            return self.membership.view, c.pending(), c.coordinator, c.latest()

    def members_now(self, members) -> dict[int, str | None]:
        """The live ones of ``members`` and their incarnations (None: not heard from yet)."""
        with self._lock:
            live, m = self.membership.view.live, self.membership
            return {g: self.incarnation if g == self.rank else m.incarnation(g) for g in members if g in live}

    # --- the daemon's questions ---------------------------------------------------------------------

    def latest(self) -> int | None:
        """The newest committed step that the live nodes still hold whole (None: none)."""
        return self.sources.latest()

    def restore_sources(self, step: int | None, reader=None):
        """Where every rank's part of ``step`` is read from (``sources.TeamSources``; ``reader``: a ``decide.RestoreReader``)."""
        return self.sources.restore_sources(step, reader)

    def widen(self, why: str) -> None:
        """A restore planned from some ranks' parts needs every rank's (``VersionSources.widen``)."""
        self.sources.widen(why)

    def localize(self, sources, plan: protocol.RestorePlan) -> protocol.RestorePlan:
        """Bring the plan's bytes that live on peers here, checked (``VersionSources.localize``)."""
        return self.sources.localize(sources, plan)

    def gather_for_flush(self, version):
        """The flusher's ``gather`` (``VersionSources.gather_for_flush``)."""
        return self.sources.gather_for_flush(version)

    def flush_shared(self, version, root, progress, rate: float = 0.0) -> bool:
        """The flusher's ``shared``: every live node writes its share (``flush_lead.TeamFlush``; the lead's)."""
        return self.flush_lead.write(version, root, progress, rate)

    def seen_waiting(self, job: str, step: int) -> dict[int, dict]:
        """What the last survey found of ``step`` on the other nodes: {node: {ranks, local_size}}."""
        return self.replicator.seen_waiting(job, step)

    def status(self) -> dict:
        """The team as ``ucpd status`` shows it (``status.TeamStatus``)."""
        return self._status()

