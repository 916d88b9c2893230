"""The team of daemons as the node daemon sees it: the glue between the store and the peers.

``Team`` is the daemon's ``CommitPolicy`` when ``--nodes > 1``. When a version is complete on
this node it copies the node's part to its replica holders (``placement.replica_holders``),
then reports it protected to the commit protocol (``commit.CommitNode``), whose decisions
come back as ``Commit`` actions that ``NodeStore.commit`` applies. It answers the
peers' requests (hold a replica, list what we hold, send bytes), finds the sources of a
restore across the team (local RAM, a local replica, a peer's RAM), and heals: when the
membership changes, parts whose copies were on a lost node are copied again. A new run of the
job waits in ``join_run`` until the team fenced the earlier runs (their undecided parts and
replicas are abandoned on ``Fence``); parts, replicas and holdings carry their run, and a
restore reads a step from one run's parts.

Threads: the transport's I/O thread runs the peer callbacks; one replication thread pushes
copies; the daemon's loop calls ``tick``; the daemon's worker threads call ``latest`` and
``restore_sources``. Lock order: the store lock, then ``self._lock`` (the protocol's); peer
requests are never made holding either.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from .. import faults, knobs, native, protocol
from ..daemon import stalls
from ..daemon.restore import SourceSet, tensor_signature
from ..daemon.manifest import RankPart, TensorEntry
from ..daemon.versions import RESTORABLE, SEALED, Version, VersionState
from ..errors import ChecksumMismatch, DaemonUnreachable, SnapshotRejected, UcpdError, VersionNotFound
from ..native import CHUNK_BYTES
from . import placement
from .commit import Commit, CommitNode, Decided as Record, Fence, Send
from .config import TeamConfig
from .membership import Membership
from .replicas import ReplicaStore, verify_part_crcs

log = logging.getLogger("ucpd.team")

DATA_BATCH = 32 << 20  # bytes per replica_data message (split into transport frames)
PUSH_IN_FLIGHT = 4  # replica_data batches a push keeps unacknowledged
FETCH_PREFIX = "fetch-"
HEAL_RETRY = 2.0  # seconds between retries of a version left with fewer copies than wanted
PIN_LEASE = 600.0  # seconds a peer's pin (a flush or restore reading our RAM) lasts at most
JOIN_TIMEOUT = 120.0  # seconds a new run's first request waits for the team to fence the earlier runs


def run_of(v) -> str:
    """The run (the job's incarnation) that wrote a version or replica; "" when unnamed."""
    return getattr(v, "incarnation", None) or getattr(v, "run", None) or ""


def _with_run(body: dict, run: str) -> dict:
    """``body`` naming the run of the job that wrote its parts (an unnamed run: no field)."""
    if run:
        body["run"] = run
    return body


def used_bytes(part: RankPart) -> int:
    """Bytes of a rank's slot that its tensors occupy."""
    return max((t.offset + t.nbytes for t in part.tensors if not t.skipped), default=0)


@dataclass
class _Pushed:
    """What this node knows of the copies of one of its own versions."""

    ranks: tuple[int, ...]
    world_size: int
    run: str = ""  # the run of the job that wrote it: another run's step of that number is another version
    holders: set[int] = field(default_factory=set)
    protected: bool = False


class Team:
    """The daemon's commit policy and its link to the other daemons of the job."""

    local_parts = True

    def __init__(self, config: TeamConfig, shm_dir: str, link=None, clock=time.monotonic) -> None:
        """``link``: makes the transport to the peers, called as ``PeerTransport`` is (tests pass
        an in-process one: ``tests/helpers/fake_link.py``). ``clock``: the time of the team's
        timers (liveness, the protocol's resends, peer leases, heal retries); a test passes one it
        advances itself, so no timer races the machine's load."""
        from .transport import PeerTransport

        self.config = config
        self.rank = config.node_rank
        self.shm_dir = shm_dir
        self.flushes = config.node_rank == 0 and bool(config.flush_dir)
        self._lock = threading.Lock()
        self.incarnation = uuid.uuid4().hex[:16]
        self.clock = clock
        now = clock()
        self.membership = Membership(self.rank, config.nodes, config.dead_after, now)
        self.commit: CommitNode | None = None  # made in attach(), knowing what was re-adopted
        self.domains: dict[int, str] = {self.rank: config.domain or f"node-{self.rank}"}
        self.pushed: dict[int, _Pushed] = {}
        self.healing = {"pending": 0, "done": 0, "bytes": 0, "failed": 0}
        self._heal_due = 0.0  # the next retry of an under-protected version (monotonic)
        self._leases: dict[tuple[int, str], tuple[float, list]] = {}  # (node, lease) -> (expires, pinned)
        self._heal_queued = False
        self._survey_due = 0.0  # when tick() next looks for versions waiting for ranks (monotonic)
        self._seen_waiting: dict[tuple[str, int], dict[int, dict]] = {}  # the last survey: (job, step) -> {node: item}
        self.counters = {"replicated_bytes": 0, "fetched_bytes": 0, "push_failures": 0, "peer_bad_messages": 0,
                         "parity_checksum_errors": 0}
        self.store = None
        self.replicas: ReplicaStore | None = None
        self.parity = None
        if config.parity:
            from .parity_group import ParityGroup

            self.parity = ParityGroup(self, *config.parity, unit=knobs.parity_unit())
        self._work: queue.Queue = queue.Queue()
        self._pushers = ThreadPoolExecutor(PUSH_IN_FLIGHT, thread_name_prefix="ucpd-push")
        self._receivers = ThreadPoolExecutor(2, thread_name_prefix="ucpd-receive")
        self._stopping = False
        self.transport = (link or PeerTransport)(
            self.rank,
            config.listen,
            config.secret,
            on_message=self._on_message,
            on_request=self._on_request,
            on_heartbeat=self._on_heartbeat,
            heartbeat_interval=config.heartbeat,
            net_limit=config.net_limit,
            incarnation=self.incarnation,
            schemas=protocol.PEER_REQUESTS,
        )

    # --- life cycle ----------------------------------------------------------------------------

    def attach(self, store) -> None:
        """Join: bind the peer port, connect to the peers, start the replication thread."""
        self.store = store
        with store.lock:
            committed = [v.step for v in store.table.versions.values() if v.state in RESTORABLE]
        self.commit = CommitNode(self.rank, self.config.nodes, committed=committed)
        self.replicas = ReplicaStore(self.shm_dir, store.lock, self.config.keep, self._room)
        self.address = self.transport.bind()
        self.transport.start(self.config.peers)
        self._thread = threading.Thread(target=self._run, name="ucpd-replicate", daemon=True)
        self._thread.start()
        for peer in range(self.config.nodes):
            if peer != self.rank:
                self.transport.send(peer, "hello", {"domain": self.domains[self.rank]})
        with store.lock:  # re-adopted versions not yet committed: protect them again
            for v in store.table.versions.values():
                if v.state in (VersionState.COMPLETE, VersionState.PROTECTED):
                    self._work.put(("protect", v.step))
        log.info("team: node %d of %d listening on %s", self.rank, self.config.nodes, self.address)

    def close(self) -> None:
        self._stopping = True
        self._work.put(("stop", 0))
        self._pushers.shutdown(wait=False, cancel_futures=True)
        self._receivers.shutdown(wait=False, cancel_futures=True)
        self.transport.close()
        if self.replicas is not None:
            self.replicas.close()
        for name in os.listdir(self.shm_dir):
            if name.startswith(FETCH_PREFIX):
                _unlink(os.path.join(self.shm_dir, name))

    def _room(self, nbytes: int) -> bool:
        s = self.store.slots
        return s.used_bytes + self.replicas.nbytes - sum(sz for _, sz in self.replicas.spares) + nbytes <= s.mem_limit

    # --- the commit policy -----------------------------------------------------------------------

    def on_complete(self, version: Version) -> bool:
        """Every local rank sealed ``version``: protect it, then let the team decide (store lock held)."""
        self._work.put(("protect", version.step))
        return False

    def tick(self) -> None:
        """Timers: liveness, the protocol's resends. Called by the daemon's loop."""
        now = self.clock()
        with self._lock:
            view = self.membership.on_tick(now)
            out = self.commit.on_view(view.live, now) if view is not None else []
            out += self.commit.on_tick(now)
        self._apply(out)
        self._expire_leases(now)
        if now >= self._survey_due:
            self._survey_due = now + max(1.0, knobs.stall_warn() / 2)
            if self._stalled(time.time()):
                self._work.put(("survey", None))
        if view is not None:
            log.info("team: live nodes %s (epoch %d)", sorted(view.live), view.epoch)
            for peer in set(range(self.config.nodes)) - set(view.live):
                self.transport.fail_pending(peer, "was declared dead (silent for --dead-after)")
            for peer in view.rejoined:
                # its predecessor never answers what we asked it: fail those requests now, not at
                # their timeout (a copy stuck on it would hold up the replication thread)
                self.transport.fail_pending(peer, "restarted (a new incarnation)")
                self.transport.send(peer, "hello", {"domain": self.domains[self.rank]})
            if view.rejoined:  # a new incarnation holds none of the copies its predecessor held
                for rec in list(self.pushed.values()):
                    rec.holders -= view.rejoined
            self._queue_heal(now)
        elif now >= self._heal_due and self._under_protected(self.live()):
            self._queue_heal(now)  # a copy that failed while its holder stayed live: try again

    def _queue_heal(self, now: float) -> None:
        self._heal_due = now + HEAL_RETRY
        if not self._heal_queued:
            self._heal_queued = True
            self._work.put(("heal", 0))

    def _under_protected(self, live: frozenset[int]) -> bool:
        """Whether one of our protected versions has fewer live copies than the view allows."""
        can = min(self.config.replicas, len(live) - 1)
        with self.store.lock:  # committed ones only: healing copies nothing else
            committed = {s for s, v in self.store.table.versions.items() if v.state in RESTORABLE}
        return any(rec.protected and len(rec.holders & live) < can
                   for step, rec in list(self.pushed.items()) if step in committed)

    def _apply(self, outputs: list) -> None:
        if faults.armed():
            self._fault_points(outputs, before=True)
        sent = set()
        for out in outputs:
            if faults.dying():
                return
            if isinstance(out, Send):
                self.transport.send(out.dest, "commit", {"m": out.msg})
                kind = out.msg.get("t")
                if faults.armed() and kind in ("record", "commit") and kind not in sent:
                    sent.add(kind)
                    point = "commit.record_sent_one" if kind == "record" else "commit.visible_one"
                    faults.point(point, out.msg.get("step"), settle=0.3)
            elif isinstance(out, Commit):
                with self.store.lock:
                    self.store.commit(out.step)
                log.debug("team: step %d committed", out.step)
            elif isinstance(out, Record):
                log.debug("team: step %d decided, recorded", out.step)
            elif isinstance(out, Fence):
                log.info("team: run %r of the job is the current one; earlier runs are fenced off", out.run)
                self._drop_fenced(out)

    # --- runs of the job ------------------------------------------------------------------------

    def join_run(self, run: str | None, timeout: float = JOIN_TIMEOUT) -> None:
        """Block until ``run`` (a run of the team's job) may read ``latest()`` and snapshot: every
        live node fenced the earlier runs (their undecided parts never commit) and the steps
        decided before are visible here. Raises SnapshotRejected for a run a later one superseded,
        or when the team cannot fence it in ``timeout`` seconds."""
        run = run or ""
        deadline = time.monotonic() + timeout
        with self._lock:
            out = self.commit.on_run(run, self.clock())  # asks once: the protocol's ticks ask again
        self._apply(out)
        while True:
            with self._lock:
                ready = self.commit.run_ready(run)
            if ready:
                return
            if ready is None:
                raise SnapshotRejected(
                    f"run {run!r} of this job was superseded by a later run ({self.commit.run!r}) that the team "
                    "fenced: a restarted job's processes replace the old ones; stop this process"
                )
            if time.monotonic() > deadline:
                raise SnapshotRejected(
                    f"the team did not admit run {run!r} in {timeout:.0f} s (coordinator: node "
                    f"{self.commit.coordinator}, live: {sorted(self.live())}): check that every daemon of the team "
                    "is up and reachable, then retry"
                )
            time.sleep(0.005)

    def run_ready(self, run: str | None) -> bool:
        with self._lock:
            return self.commit.run_ready(run or "") is True

    def decided(self, step: int) -> bool:
        """Whether the team decided ``step`` (committed, or recorded or being decided here): its
        parts must stay (the store asks, holding its lock)."""
        with self._lock:
            c = self.commit
            return c.is_committed(step) or step in c.recorded or step in c.deciding

    def _drop_fenced(self, fence: Fence) -> None:
        """Abandon this node's parts and replicas of runs other than ``fence.run`` that the team
        never decided (a part a copy still reads goes when the copy ends; a replica a reader
        pins stays until it is replaced or leaves with ``--keep``: restores read one run)."""
        keep = lambda step: step in fence.keep or self.decided(step)  # noqa: E731
        job = self.store.team_job
        with self.store.lock:
            gone = self.store.abandon_runs(job, fence.run, keep) if job is not None else []
            for (origin, step), rep in list(self.replicas.held.items()):
                if run_of(rep) != fence.run and not keep(step):
                    self.replicas.drop(origin, step)
        with self._lock:
            for step in gone:
                self.commit.forget(step)
        for step in gone:
            self.pushed.pop(step, None)

    def _fault_points(self, outputs: list, before: bool) -> None:
        """Test-only crash points of the coordinator (``ucpd.faults``; inert in production)."""
        if self.commit.coordinator != self.rank:
            return
        for out in outputs:
            if isinstance(out, Record):
                faults.point("commit.decided", out.step)
            if isinstance(out, Commit):
                faults.point("commit.recorded", out.step)

    def live(self) -> frozenset[int]:
        with self._lock:
            return self.membership.view.live

    # --- replication (the replication thread) ----------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            kind, step = self._work.get()
            try:
                if kind == "protect":
                    self._protect(step)
                elif kind == "heal":
                    self._heal()
                elif kind == "survey":
                    self.survey()
            except Exception:
                log.exception("team: %s of step %s failed", kind, step)

    def _protect(self, step: int) -> None:
        """Copy our part of ``step`` to its holders, then report it protected."""
        with self.store.lock:
            v = self.store.table.versions.get(step)
            if v is None or v.state not in SEALED or not v.parts:
                return
            ranks = tuple(sorted(v.parts))
            run = run_of(v)
            rec = self.pushed.get(step)
            if rec is None or rec.run != run:  # (the copies of another run's part of the step hold other bytes)
                rec = self.pushed[step] = _Pushed(ranks, v.world_size, run)
        wanted = self.config.replicas
        tried: set[int] = set()
        if self.parity is not None:
            from .parity_group import DEGRADED, FAILED

            got = self.parity.protect(step)
            if got == FAILED:
                # an error, not a dead member: the parity does not hold our part, so it is not
                # reported protected; tried again (by then a member that died is known dead)
                log.warning("team: step %d is not in its group's parity yet; trying again in %.0f s", step, HEAL_RETRY)
                retry = threading.Timer(HEAL_RETRY, self._work.put, (("protect", step),))
                retry.daemon = True
                retry.start()
                return
            if got == DEGRADED:
                log.warning("team: step %d is in its group's parity without its dead members: degraded", step)
        while len(rec.holders) < wanted:
            live = sorted(self.live())
            candidates = [h for h in placement.replica_holders(self.rank, live, wanted + len(tried), self.domains)
                          if h not in rec.holders and h not in tried]
            if not candidates:
                break
            h = candidates[0]
            tried.add(h)
            if self._push_own(h, step):
                rec.holders.add(h)
        if len(rec.holders) < wanted:
            log.warning(
                "team: step %d protected by %d of %d replicas (%d live nodes): degraded",
                step, len(rec.holders), wanted, len(self.live()),
            )
        rec.protected = True
        with self.store.lock:
            self.store.protect(step, v)
        with self._lock:
            out = self.commit.on_protected(step, ranks, rec.world_size, self.clock(), run)
        self._apply(out)
        self._forget_old_pushes()

    def _push_own(self, holder: int, step: int) -> bool:
        with self.store.lock:
            v = self.store.table.versions.get(step)
            if v is None or not v.parts or v.state not in SEALED:
                return False
            self.store.pin(v)
            parts = list(v.parts.values())
            views = {p.rank: memoryview(self.store.slots.slots[p.slot].mapping()) for p in parts}
            world, run = v.world_size, run_of(v)
        try:
            return self._push(holder, self.rank, step, world, parts, lambda r, off, n: views[r][off : off + n], run)
        finally:
            del views
            with self.store.lock:
                self.store.unpin(v)
                self.store.enforce_keep()

    def _push(self, holder: int, origin: int, step: int, world: int, parts: list[RankPart], read, run: str) -> bool:
        """Send origin's parts of step (written by the job's run ``run``) to ``holder``; True once
        it verified and kept them."""
        t0 = time.monotonic()
        try:
            self.transport.request(
                holder, "replica_begin",
                _with_run({"origin": origin, "step": step, "world_size": world,
                           "parts": [protocol.part_to_wire(p, used_bytes(p)) for p in parts]}, run),
            )
            batches = [(p, off, min(DATA_BATCH, used_bytes(p) - off)) for p in parts for off in range(0, used_bytes(p), DATA_BATCH)]
            total = sum(n for _, _, n in batches)
            frames = len(batches)
            half = len(batches) // 2

            def put(i_batch):
                i, (p, off, n) = i_batch
                if i == half:
                    faults.point("replicate.mid", step)
                self.transport.request(
                    holder, "replica_data", {"origin": origin, "step": step, "rank": p.rank, "offset": off},
                    [read(p.rank, off, n)], timeout=60.0,
                )

            # PUSH_IN_FLIGHT batches in flight: the holder copies some while others are on the wire; each
            # is acknowledged, so replica_end (a small message that may overtake queued bulk
            # frames) is sent only after every byte arrived
            for _ in self._pushers.map(put, enumerate(batches)):
                pass
            self.transport.request(holder, "replica_end", {"origin": origin, "step": step, "frames": frames}, timeout=120.0)
        except UcpdError as exc:
            self.counters["push_failures"] += 1
            log.warning("team: copying node %d's step %d to node %d failed: %s", origin, step, holder, exc)
            return False
        self.counters["replicated_bytes"] += total
        log.debug("team: node %d step %d -> node %d: %d bytes in %.3f s", origin, step, holder, total, time.monotonic() - t0)
        return True

    def _forget_old_pushes(self) -> None:
        with self.store.lock:
            held = set(self.store.table.versions)
        for step in [s for s in self.pushed if s not in held]:
            del self.pushed[step]

    # --- healing ----------------------------------------------------------------------------------

    def _heal(self) -> None:
        """Bring every part we are responsible for back to ``replicas`` live copies.

        Our own versions: copy to the holders the current view designates. A part whose origin
        is gone and that we hold: the lowest live holder copies it to more nodes."""
        self._heal_queued = False
        self._survey_due = 0.0  # when tick() next looks for versions waiting for ranks (monotonic)
        self._seen_waiting: dict[tuple[str, int], dict[int, dict]] = {}  # the last survey: (job, step) -> {node: item}
        wanted = self.config.replicas
        if not wanted:
            return
        live = sorted(self.live())
        with self.store.lock:
            own = [s for s, v in self.store.table.versions.items() if v.state in RESTORABLE and v.parts]
        for step in own:
            rec = self.pushed.get(step)
            if rec is None:
                continue
            rec.holders &= set(live)
            targets = [h for h in placement.replica_holders(self.rank, live, wanted, self.domains) if h not in rec.holders]
            for h in targets[: max(0, wanted - len(rec.holders))]:
                self._heal_push(h, step, lambda: self._push_own(h, step), rec.holders)
        with self._lock:  # a dead origin's committed steps only (a dead run's undecided ones are not healed)
            orphans = [(o, s) for (o, s), r in list(self.replicas.held.items())
                       if r.whole and o not in live and self.commit.is_committed(s)]
        if not orphans:
            return
        holdings = self._gather_summary(live)
        for origin, step in orphans:
            holders = {n for n, items in holdings.items() if any(i["origin"] == origin and i["step"] == step for i in items)}
            holders.add(self.rank)
            if min(holders) != self.rank:
                continue  # the lowest live holder heals it
            ring = [n for n in placement.replica_holders(origin, live + [origin], len(live), self.domains) if n != origin]
            # the origin is gone: R + 1 copies again, so that R more losses are survived
            for h in [n for n in ring if n not in holders][: max(0, wanted + 1 - len(holders))]:
                self._heal_push(h, step, lambda h=h, o=origin, s=step: self._push_replica(h, o, s), holders)

    def _heal_push(self, holder: int, step: int, push, holders: set) -> None:
        faults.point("heal.push", step)
        self.healing["pending"] += 1
        try:
            if push():
                holders.add(holder)
                self.healing["done"] += 1
            else:
                self.healing["failed"] += 1
        finally:
            self.healing["pending"] -= 1

    def _push_replica(self, holder: int, origin: int, step: int) -> bool:
        with self.store.lock:
            rep = self.replicas.get(origin, step)
            if rep is None:
                return False
            self.replicas.pin(rep)
        try:
            return self._push(holder, origin, step, rep.world_size, list(rep.parts.values()), rep.view, run_of(rep))
        finally:
            self.replicas.unpin(rep)

    # --- peer callbacks (the transport's I/O thread) -----------------------------------------------

    def _on_heartbeat(self, src: int, incarnation: str) -> None:
        with self._lock:
            self.membership.on_heartbeat(src, incarnation, self.clock())

    def _on_message(self, src: int, msg_type: str, body: dict, frames: list) -> None:
        try:
            if msg_type == "commit":
                b = protocol.validate_peer(msg_type, body)
                with self._lock:
                    out = self.commit.on_message(src, b["m"], self.clock())
                self._apply(out)
            elif msg_type == "hello":
                self.domains[src] = protocol.validate_peer(msg_type, body)["domain"]
            elif msg_type == "unpin":
                self._end_lease((src, protocol.validate_peer(msg_type, body)["lease"]))
            else:
                protocol.validate_peer(msg_type, body)
        except UcpdError as exc:
            self.counters["peer_bad_messages"] += 1
            log.warning("team: bad %s message from node %d: %s", msg_type, src, exc)

    def _on_request(self, src: int, msg_type: str, body: dict, frames: list) -> tuple[dict, list]:
        try:
            b = protocol.validate_peer(msg_type, body)
        except UcpdError:
            self.counters["peer_bad_messages"] += 1
            raise
        if msg_type == "replica_begin":
            if faults.once("replica.refuse", b["step"]):
                raise UcpdError(f"node {self.rank} refuses the copy of step {b['step']} (fault injected)")
            self.replicas.begin(b["origin"], b["step"], b["world_size"], b["parts"], b.get("run", ""))
            return {}, []
        # the copy into the replica file and the final check of every chunk run on the holder's
        # workers, so that the I/O thread goes on receiving the next batches meanwhile
        if msg_type == "replica_data":
            return self._receivers.submit(self._replica_write, b, frames)
        if msg_type == "replica_end":
            faults.point("replica.received", b["step"])
            return self._receivers.submit(self._replica_finish, b)
        if msg_type.startswith("parity_") or msg_type == "blob_unit":
            if self.parity is None:
                raise protocol.ProtocolError(f"node {self.rank} keeps no parity (started without --parity)")
            if msg_type == "parity_manifest":
                self.parity.on_manifest(src, b)
                return {}, []
            if msg_type == "parity_manifest_of":
                return self.parity.manifest_of(b["origin"], b["step"]), []
            if msg_type == "parity_unit":
                self.parity.on_unit(b, frames)
                return {}, []
            if msg_type == "parity_block":
                return {}, self.parity.on_block(b)
            return {}, self.parity.on_blob_unit(b)
        if msg_type == "pin":
            self._pin_for(src, b["lease"], b["origin"], b["step"])
            return {}, []
        if msg_type == "holdings":
            return {"node": self.rank, "items": self._holdings(b.get("step"))}, []
        if msg_type == "waiting":
            with self.store.lock:
                items = [stalls.survey_item(v) for v in stalls.waiting_versions(self.store.versions())]
            return {"node": self.rank, "items": items}, []
        if msg_type == "fetch":
            return {}, self._serve_fetch(b["origin"], b["step"], b["rank"], b["ranges"])
        raise protocol.ProtocolError(f"peer message {msg_type!r} is not a request")

    def _replica_write(self, b: dict, frames: list) -> tuple[dict, list]:
        self.replicas.write(b["origin"], b["step"], b["rank"], b["offset"], frames)
        return {}, []

    def _replica_finish(self, b: dict) -> tuple[dict, list]:
        self.replicas.finish(b["origin"], b["step"], b["frames"])
        return {}, []

    # --- leases: a peer reading our RAM keeps it from eviction ---------------------------------------

    def _pin_for(self, src: int, lease: str, origin: int, step: int) -> None:
        with self.store.lock:
            if origin == self.rank:
                obj = self.store.table.versions.get(step)
                if obj is None or not obj.parts or obj.state not in SEALED:
                    raise VersionNotFound(f"node {self.rank} no longer holds its part of step {step}")
            else:
                obj = self.replicas.get(origin, step)
                if obj is None:
                    raise VersionNotFound(f"node {self.rank} holds no copy of node {origin}'s step {step}")
            if isinstance(obj, Version):
                self.store.pin(obj)
            else:
                self.replicas.pin(obj)
            _, pinned = self._leases.setdefault((src, lease), (self.clock() + PIN_LEASE, []))
            pinned.append(obj)

    def _end_lease(self, key: tuple[int, str]) -> None:
        with self.store.lock:
            _, pinned = self._leases.pop(key, (0.0, []))
            for obj in pinned:
                if isinstance(obj, Version):
                    self.store.unpin(obj)
                else:
                    self.replicas.unpin(obj)
            if pinned:
                self.store.enforce_keep()  # what waited for the reader goes now

    def _expire_leases(self, now: float) -> None:
        live = self.live()
        for key in [k for k, (expires, _) in list(self._leases.items()) if expires < now or k[0] not in live]:
            log.info("team: node %d's lease on our RAM ended without an unpin (expired or node dead)", key[0])
            self._end_lease(key)

    # --- versions waiting for ranks (ucpd.daemon.stalls) --------------------------------------------

    def _stalled(self, now: float) -> bool:
        """Some version has waited here for half of $UCPD_STALL_WARN: time to ask the team."""
        with self.store.lock:
            waiting = stalls.waiting_versions(self.store.versions())
        return any(now - v.created >= knobs.stall_warn() / 2 for v in waiting)

    def survey(self) -> None:
        """Ask every live peer which ranks of which undecided versions it holds (the replication
        thread): what the daemon logs and a pending ``wait`` reply tell about a stuck step."""
        seen: dict[tuple[str, int], dict[int, dict]] = {}
        for node, reply in self._ask_all(self.live(), "waiting", {}).items():
            for item in reply.get("items", []):
                seen.setdefault((item["job"], item["step"]), {})[node] = item
        with self._lock:
            self._seen_waiting = seen

    def seen_waiting(self, job: str, step: int) -> dict[int, dict]:
        """What the last survey found of ``step`` on the other nodes: {node: {ranks, local_size}}."""
        with self._lock:
            return dict(self._seen_waiting.get((job, step), {}))

    # --- what we hold ------------------------------------------------------------------------------

    def _holdings(self, step: int | None) -> list[dict]:
        """Our own parts and whole replicas (all steps, or one step with manifests)."""
        items = []
        with self.store.lock:
            for v in self.store.table.versions.values():
                if (step is None or v.step == step) and v.parts and v.state in SEALED:
                    item = _with_run({"origin": self.rank, "step": v.step, "world_size": v.world_size,
                                      "ranks": sorted(v.parts)}, run_of(v))
                    if step is not None:
                        item["parts"] = [protocol.part_to_wire(p, used_bytes(p)) for p in v.parts.values()]
                    items.append(item)
            for (origin, s), rep in self.replicas.held.items():
                if rep.whole and (step is None or s == step):
                    item = _with_run({"origin": origin, "step": s, "world_size": rep.world_size,
                                      "ranks": sorted(rep.parts)}, run_of(rep))
                    if step is not None:
                        item["parts"] = [protocol.part_to_wire(p, rep.used[r]) for r, p in rep.parts.items()]
                    items.append(item)
        if self.parity is not None:
            for item in self.parity.holdings(step):
                man = self.parity.manifests.get((item["origin"], item["step"]), {})
                items.append(_with_run(item, "" if man.get("inc", "-") == "-" else man["inc"]))
        return items

    def _serve_fetch(self, origin: int, step: int, rank: int, ranges: list) -> list:
        with self.store.lock:
            if origin == self.rank:
                v = self.store.table.versions.get(step)
                part = v.parts.get(rank) if v is not None else None
                if part is None or v.state not in SEALED:
                    raise VersionNotFound(f"node {self.rank} no longer holds rank {rank} of step {step}")
                mm = memoryview(self.store.slots.slots[part.slot].mapping())
                limit = used_bytes(part)
                views = []
                for off, n in ranges:
                    if off + n > limit:
                        raise protocol.ProtocolError(f"fetch of rank {rank} step {step}: {off}+{n} is outside its part")
                    views.append(mm[off : off + n])
                return views
            rep = self.replicas.get(origin, step)
            if rep is None or rank not in rep.parts:
                raise VersionNotFound(f"node {self.rank} holds no copy of rank {rank} of step {step}")
            return [rep.view(rank, off, n) for off, n in ranges]

    def _ask_all(self, live, msg_type: str, body: dict) -> dict[int, dict]:
        """A request to every other live node, in parallel; nodes that fail to answer are left out."""
        replies: dict[int, dict] = {}

        def ask(node):
            try:
                replies[node], _ = self.transport.request(node, msg_type, body, timeout=10.0)
            except UcpdError as exc:
                log.warning("team: node %d did not answer %s: %s", node, msg_type, exc)

        threads = [threading.Thread(target=ask, args=(n,)) for n in live if n != self.rank]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return replies

    def _gather_summary(self, live) -> dict[int, list[dict]]:
        out = {n: protocol.validate_peer("holdings", {}) and r.get("items", []) for n, r in self._ask_all(live, "holdings", {}).items()}
        out[self.rank] = self._holdings(None)
        return out

    # --- restore --------------------------------------------------------------------------------

    def latest(self) -> int | None:
        """The newest committed step that the live nodes still hold whole (None: none)."""
        live = sorted(self.live())
        summary = self._gather_summary(live)
        ranks: dict[tuple[int, int, str], set[int]] = {}  # (step, world, run) -> ranks held
        for items in summary.values():
            for i in items:
                ranks.setdefault((i["step"], i["world_size"], i.get("run", "")), set()).update(i["ranks"])
        with self._lock:  # one run's parts must hold every rank: a version is never read from two runs
            for step, world, _run in sorted(ranks, reverse=True):
                if self.commit.is_committed(step) and ranks[(step, world, _run)] >= set(range(world)):
                    return step
        return None

    def restore_sources(self, step: int | None) -> "TeamSources":
        """Where every rank's part of ``step`` (None: the newest whole) can be read from, best
        first: our RAM, a replica we hold, a live peer; what is read from peers is pinned there
        (a lease) until released. Raises VersionNotFound naming what is lost."""
        for attempt in range(3):
            got = self._plan_sources(step)
            try:
                self._lease_peers(got)
                return got
            except VersionNotFound as exc:  # a peer evicted it since it told us: plan again
                with self.store.lock:
                    got.release()
                if attempt == 2:
                    raise
                log.info("team: step %s moved while planning its restore (%s); planning again", got.step, exc)
        raise AssertionError("unreachable")

    def _lease_peers(self, got: "TeamSources") -> None:
        lease = uuid.uuid4().hex[:16]
        for node, origin in sorted({(w[1], w[2]) for w in got.where.values() if w[0] == "peer"}):
            try:
                self.transport.request(node, "pin", {"lease": lease, "origin": origin, "step": got.step}, timeout=10.0)
            except VersionNotFound:
                raise
            except UcpdError as exc:
                raise VersionNotFound(f"step {got.step}: node {node} did not pin node {origin}'s part: {exc}") from None
            finally:
                if (node, lease) not in got.leases:
                    got.leases.append((node, lease))  # unpinned on release, even if this pin failed midway

    def _plan_sources(self, step: int | None) -> "TeamSources":
        if step is None:
            step = self.latest()
            if step is None:
                raise VersionNotFound("no committed version is held whole by the live nodes of the team")
        with self._lock:
            if not self.commit.is_committed(step):
                raise VersionNotFound(f"step {step} is not committed by the team")
        live = sorted(self.live())
        candidates: dict[int, list[tuple[int, int, int, dict]]] = {}  # rank -> [(cost, holder, origin, PART)]
        world = None
        mine = self._holdings(step)
        replies = self._ask_all(live, "holdings", {"step": step})
        mine = [protocol.HOLDING("holding", item) for item in mine]  # the peers' were checked on receipt
        held = [(self.rank, mine)] + sorted((n, r["items"]) for n, r in replies.items())
        run = self._run_of_step(held)
        for node, items in held:
            for item in items:
                if item.get("run", "") != run:
                    continue  # a part of another run of the job: a version is read from one run only
                world = item["world_size"]
                # cheapest first: our RAM, then a peer's own RAM, then a peer's replica
                cost = 0 if node == self.rank else 1 if node == item["origin"] else 2
                if item.get("via") == "parity":
                    cost = 3  # rebuilt here from the group's data units and parity blocks
                for p in item["parts"] or []:
                    candidates.setdefault(p["rank"], []).append((cost, node, item["origin"], p))
        if world is None or set(candidates) != set(range(world)):
            lost = sorted(set(range(world or 0)) - set(candidates))
            raise VersionNotFound(
                f"step {step} is lost: no live node holds ranks {lost or 'any'} (more nodes failed than "
                "the redundancy survives); restore an older step, or from the flush dir"
            )
        found = {}
        rebuild: set[int] = set()
        for rank, cands in candidates.items():
            for cost, node, origin, p in sorted(cands, key=lambda c: c[:3]):
                if cost == 3:
                    rebuild.add(origin)
                    found[rank] = (self.rank, origin, p)
                    break
                if node == self.rank and origin != self.rank and not self._replica_sound(origin, step):
                    continue  # damaged: dropped; the next copy serves
                found[rank] = (node, origin, p)
                break
            else:
                raise VersionNotFound(f"step {step}: every copy of rank {rank} that is left is damaged")
        files: list[str] = []
        rebuilt = {}
        try:
            for origin in sorted(rebuild):
                rebuilt[origin] = self._rebuild(origin, step, files)
            out = self._sources(step, world, found, rebuilt)
        except BaseException:
            for f in files:
                _unlink(f)
            raise
        out.files += files
        return out

    def _run_of_step(self, held: list) -> str:
        """The run whose parts a restore reads, from every node's holdings of one step: one whose
        parts hold every rank, the job's current run first (a node that rejoined may still hold
        another run's parts of the step until it hears the fence)."""
        ranks: dict[tuple[str, int], set[int]] = {}
        for _node, items in held:
            for item in items:
                ranks.setdefault((item.get("run", ""), item["world_size"]), set()).update(
                    p["rank"] for p in item.get("parts") or ())
        with self._lock:
            current = self.commit.run
        # the current run if it holds every rank, else the run that holds most (a lost step's error
        # then names the ranks that run lacks)
        best = max(ranks.items(), key=lambda kv: (kv[1] >= set(range(kv[0][1])), kv[0][0] == current, len(kv[1]), kv[0][0]),
                   default=(("", 0), set()))
        return best[0][0]

    def _rebuild(self, origin: int, step: int, files: list) -> tuple[str, dict[int, int]]:
        """Rebuild a lost node's part of ``step`` from parity into a local file: (path, bases)."""
        from .parity_group import check_rebuilt

        with self.store.lock:
            man = self.parity.manifests.get((origin, step))
        if man is None:  # (we replaced the lost node: its manifests were in its RAM) a member has it
            man = self.parity.fetch_manifest(origin, step)
        holder = TeamSources(step, None, {}, [], self)
        mm = self._cache_file(holder, man["size"])
        files += holder.files
        t0 = time.monotonic()
        parts = {p["rank"]: RankPart(p["rank"], -1, [TensorEntry.from_wire(t) for t in p["tensors"]], p["objects"])
                 for p in man["parts"]}
        try:
            try:
                bases = self.parity.rebuild(origin, step, mm)
                check_rebuilt(parts, mm, bases, f"node {origin} step {step}")
            except ChecksumMismatch as exc:
                # a damaged unit or parity block on some member: where the code has a block to
                # spare, rebuild without each other member in turn until the checksums hold
                self.counters["parity_checksum_errors"] += 1
                for suspect in sorted(set(self.parity.stripes.members) - {origin}):
                    try:
                        bases = self.parity.rebuild(origin, step, mm, distrust=frozenset({suspect}))
                        check_rebuilt(parts, mm, bases, f"node {origin} step {step}")
                    except (ChecksumMismatch, VersionNotFound):
                        continue
                    log.warning("team: node %d's part of step %d rebuilt without node %d, whose parity data "
                                "failed the checksums", origin, step, suspect)
                    break
                else:
                    raise ChecksumMismatch(f"{exc}; no rebuild without one other member passes either: restore "
                                           "an older step or from the flush dir") from None
        finally:
            mm.close()
        log.info("team: rebuilt node %d's part of step %d from parity (%d bytes) in %.3f s",
                 origin, step, man["size"], time.monotonic() - t0)
        return holder.files[-1], bases

    def _replica_sound(self, origin: int, step: int) -> bool:
        """Check a replica we hold (once) before serving from it; a damaged one is dropped."""
        rep = self.replicas.get(origin, step)
        if rep is None:
            return False
        if rep.verified:
            return True
        try:
            verify_part_crcs(rep, f"replica of node {origin} step {step} on node {self.rank}")
        except ChecksumMismatch as exc:
            log.error("team: %s; using another copy", exc)
            self.replicas.checksum_errors += 1
            self.replicas.drop(origin, step)
            return False
        rep.verified = True
        return True

    def _sources(self, step: int, world: int, found: dict, rebuilt: dict | None = None) -> "TeamSources":
        parts: dict[int, RankPart] = {}
        where: dict[int, tuple] = {}
        pins: list = []
        with self.store.lock:
            for rank, (node, origin, p) in found.items():
                part = RankPart(rank, -1, [TensorEntry.from_wire(t) for t in p["tensors"]], p["objects"], p.get("layout"), p.get("objects_crc"))
                parts[rank] = part
                if rebuilt and origin in rebuilt:  # (our own part too: a replacement node lost it)
                    path, bases = rebuilt[origin]
                    where[rank] = ("local", path, bases[rank])
                elif node == self.rank and origin == self.rank:
                    v = self.store.table.versions.get(step)
                    own = v.parts.get(rank) if v is not None else None
                    if own is None:
                        raise VersionNotFound(f"step {step} left this node while restoring; ask again")
                    if v not in pins:
                        self.store.pin(v)
                        pins.append(v)
                    where[rank] = ("local", self.store.slots.slots[own.slot].path, 0)
                elif node == self.rank:
                    rep = self.replicas.get(origin, step)
                    if rep is None:
                        raise VersionNotFound(f"step {step}: the replica of node {origin} left this node; ask again")
                    self.replicas.pin(rep)
                    pins.append(rep)
                    where[rank] = ("local", rep.path, rep.bases[rank])
                else:
                    where[rank] = ("peer", node, origin)
        version = Version(step, world, VersionState.COMMITTED, parts)
        tensors, same = {}, {}
        for rank, part in parts.items():
            kind, a, b = where[rank]
            for idx, t in enumerate(part.tensors):
                if t.skipped:
                    continue
                path, off = (a, b + t.offset) if kind == "local" else (f"peer:{a}:{b}:{rank}", t.offset)
                tensors[(rank, idx)] = protocol.PlanSource(path, off, t.nbytes, t.dtype, t.crcs, CHUNK_BYTES)
                same.setdefault(tensor_signature(t.name, t.dtype, t.shape, t.placement), (rank, idx))
        globals_ = {name: (g.dtype, g.shape, g.sources) for name, g in version.globals().items()}
        objects = {r: (p.objects, p.objects_crc if p.objects_crc is not None else native.crc32c(p.objects)) for r, p in parts.items()}
        out = TeamSources(step, SourceSet(globals_, tensors, same), objects, pins, self)
        out.parts, out.where, out.version = parts, where, version
        return out

    def gather_for_flush(self, version):
        """The flusher's ``gather``: every rank's part of a committed version, the other nodes'
        fetched whole into one local file (each byte crosses the network once)."""
        got = self.restore_sources(version.step)  # pins on the peers what is read from them
        try:
            faults.stall("flush.fetch", version.step)
            faults.point("flush.fetch.kill", version.step)
            remote = {r: w for r, w in got.where.items() if w[0] == "peer"}
            sizes = {r: used_bytes(got.parts[r]) for r in remote}
            bases, total = {}, 0
            for r, n in sizes.items():
                bases[r], total = total, total + (n + 63) // 64 * 64
            mm = self._cache_file(got, total) if remote else None
            for r, (_, node, origin) in remote.items():
                at = 0
                while at < sizes[r]:
                    n = min(DATA_BATCH, sizes[r] - at)
                    _, frames = self.transport.request(
                        node, "fetch", {"origin": origin, "step": got.step, "rank": r, "ranges": [[at, n]]}, timeout=120.0
                    )
                    (buf,) = _split(frames, [n])
                    native.copy(memoryview(mm)[bases[r] + at : bases[r] + at + n], buf)
                    at += n
                self.counters["fetched_bytes"] += sizes[r]
            got.unpin_peers()
            maps: dict = {}
            for r, (kind, a, b) in got.where.items():
                if kind == "local":
                    maps[r] = (a, b)
        except BaseException:
            with self.store.lock:
                got.release()
            raise

        import mmap as mmap_mod

        opened: dict = {}

        def buffer_of(rank):
            if rank in remote:
                return memoryview(mm)[bases[rank] : bases[rank] + sizes[rank]]
            path, base = maps[rank]
            if path not in opened:
                fd = os.open(path, os.O_RDONLY)
                try:
                    opened[path] = mmap_mod.mmap(fd, 0, mmap_mod.MAP_SHARED, mmap_mod.PROT_READ)
                finally:
                    os.close(fd)
            return memoryview(opened[path])[base:]

        def release():
            opened.clear()
            with self.store.lock:
                got.release()

        return got.version.globals(), got.parts, buffer_of, release

    def _cache_file(self, got: "TeamSources", nbytes: int):
        """A private shm file for bytes fetched from peers, deleted when ``got`` is released."""
        import mmap as mmap_mod

        path = os.path.join(self.shm_dir, f"{FETCH_PREFIX}{uuid.uuid4().hex[:12]}")
        got.files.append(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 64))
            return mmap_mod.mmap(fd, max(nbytes, 64), mmap_mod.MAP_SHARED, mmap_mod.PROT_READ | mmap_mod.PROT_WRITE)
        finally:
            os.close(fd)

    def localize(self, sources: "TeamSources", plan: protocol.RestorePlan) -> protocol.RestorePlan:
        """Bring the plan's sources that live on peers into a local file, checked on arrival;
        the plan again, reading them there."""
        table = list(plan.sources)
        remote: dict[tuple[int, int, int], list[int]] = {}
        for i, s in enumerate(table):
            if s.path.startswith("peer:"):
                _, node, origin, rank = s.path.split(":")
                remote.setdefault((int(node), int(origin), int(rank)), []).append(i)
        if not remote:
            return plan
        total = sum((table[i].nbytes + 63) // 64 * 64 for idx in remote.values() for i in idx)
        mm = self._cache_file(sources, total)
        path = sources.files[-1]
        try:
            at = 0
            for (node, origin, rank), idx in remote.items():
                for batch in _batches(idx, table, DATA_BATCH):
                    ranges = [[table[i].offset, table[i].nbytes] for i in batch]
                    _, frames = self.transport.request(
                        node, "fetch", {"origin": origin, "step": sources.step, "rank": rank, "ranges": ranges}, timeout=120.0
                    )
                    got = _split(frames, [n for _, n in ranges])
                    for i, buf in zip(batch, got):
                        s = table[i]
                        dst = memoryview(mm)[at : at + s.nbytes]
                        native.copy(dst, buf)
                        crcs = native.crc32c_chunks(dst, s.chunk)
                        if list(crcs) != list(s.crcs):
                            self.counters["fetch_checksum_errors"] = self.counters.get("fetch_checksum_errors", 0) + 1
                            raise ChecksumMismatch(
                                f"bytes of rank {rank} step {sources.step} from node {node} fail their checksum; "
                                "restore again (another copy will be used if this one stays bad)"
                            )
                        del dst
                        table[i] = s._replace(path=path, offset=at)
                        at += (s.nbytes + 63) // 64 * 64
                        self.counters["fetched_bytes"] += s.nbytes
            sources.unpin_peers()  # all here: the peers may evict it again
        finally:
            mm.close()
        return replace(plan, sources=tuple(table))

    # --- status ---------------------------------------------------------------------------------

    def status(self) -> dict:
        """The team as ``ucpd status`` shows it (caller holds the store lock)."""
        with self._lock:
            view = self.membership.view
            pending = self.commit.pending() if self.commit is not None else {}
            coordinator = self.commit.coordinator if self.commit is not None else None
            latest = self.commit.latest() if self.commit is not None else None
        nodes = []
        for n in range(self.config.nodes):
            nodes.append({
                "node": n,
                "address": self.config.peers[n] if n < len(self.config.peers) else None,
                "live": n in view.live,
                "domain": self.domains.get(n),
                "coordinator": n == coordinator,
            })
        own_bytes = sum(v.nbytes for v in self.store.table.versions.values() if v.parts)
        rep_bytes = sum(r.size for r in self.replicas.held.values()) if self.replicas else 0
        par_bytes = self.parity.nbytes if self.parity is not None else 0
        # health is about committed versions only (one protected but never committed — a dead
        # run's — is neither healed nor counted), replicas and parity alike: healthy while each
        # level configured survives as many more losses as configured (R live replica holders;
        # the group's parity held by all its members), degraded otherwise
        versions = []
        for step, rec in sorted(self.pushed.items()):
            v = self.store.table.versions.get(step)
            if v is None:
                continue  # evicted here
            live_holders = rec.holders & set(view.live)
            row = {"step": step, "holders": sorted(live_holders)}
            survives = self.parity.survives(step) if self.parity is not None else None
            if self.parity is not None:
                row["parity_survives"] = survives
            if not rec.protected:
                health = "protecting"
            elif v.state not in RESTORABLE:
                health = "uncommitted"
            elif len(live_holders) >= self.config.replicas and (
                self.parity is None or (survives is not None and survives >= self.parity.stripes.m)
            ):
                health = "healthy"
            else:
                health = "degraded"
            versions.append(dict(row, health=health))
        held = sorted([o, s] for (o, s), r in self.replicas.held.items() if r.whole) if self.replicas else []
        degraded = any(v["health"] == "degraded" for v in versions) or len(view.live) < self.config.nodes
        return {
            "node_rank": self.rank,
            "nodes": nodes,
            "epoch": view.epoch,
            "coordinator": coordinator,
            "team_latest": latest,
            "level": (
                f"L1 (parity {self.parity.stripes.k}+{self.parity.stripes.m} over nodes {list(self.parity.stripes.members)})"
                if self.parity is not None
                else f"L1 ({self.config.replicas} replica(s))" if self.config.replicas else "L0 (no copies on other nodes)"
            ),
            "health": "degraded" if degraded else "healthy",
            "bytes": {"own": own_bytes, "replicas": rep_bytes, "parity": par_bytes},
            "overhead": round((own_bytes + rep_bytes + par_bytes) / own_bytes, 3) if own_bytes else None,
            "versions": versions,
            "replicas_held": held,
            "healing": dict(self.healing),
            "protocol": pending,
            "transport": dict(self.transport.counters),
            "counters": dict(self.counters, replica_checksum_errors=self.replicas.checksum_errors if self.replicas else 0),
        }


class TeamSources:
    """A restore's sources across the team, with what they pin until the lease ends."""

    def __init__(self, step, sources, objects, pins, team) -> None:
        self.step, self.sources, self.objects, self.pins, self.team = step, sources, objects, pins, team
        self.files: list[str] = []
        self.leases: list[tuple[int, str]] = []  # (peer, lease) pinning what we read from peers

    def unpin_peers(self) -> None:
        """Everything needed from the peers is here: let them evict it again."""
        for node, lease in self.leases:
            self.team.transport.send(node, "unpin", {"lease": lease})
        self.leases = []

    def release(self) -> None:
        """The client finished reading: unpin, delete fetched copies (caller holds the store lock)."""
        self.unpin_peers()
        for p in self.pins:
            if isinstance(p, Version):
                self.team.store.unpin(p)
            else:
                self.team.replicas.unpin(p)
        self.pins = []
        for f in self.files:
            _unlink(f)
        self.files = []


def _batches(idx: list[int], sources: list, limit: int):
    batch, size = [], 0
    for i in idx:
        if batch and size + sources[i].nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(i)
        size += sources[i].nbytes
    if batch:
        yield batch


def _split(frames: list, sizes: list[int]) -> list[memoryview]:
    """The reply's frames as one buffer per requested range (the transport may cut a buffer
    into several frames, or send one frame per range)."""
    frames = [memoryview(f).cast("B") for f in frames]
    if len(frames) == len(sizes) and all(f.nbytes == n for f, n in zip(frames, sizes)):
        return frames
    whole = bytearray(b"".join(frames))
    out, at = [], 0
    for n in sizes:
        out.append(memoryview(whole)[at : at + n])
        at += n
    if at != len(whole):
        raise DaemonUnreachable(f"a fetch reply carried {len(whole)} bytes, {at} were asked for")
    return out


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
