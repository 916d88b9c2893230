"""The version table of a job: which steps exist in RAM, in which state, and what each rank gave.

Versions belong to a job (``Checkpointer(job=...)``): the store keeps one table per job, so
two jobs on a node number their steps independently and never see each other's versions.

A version moves through explicit states::

    WRITING -> COMPLETE [-> PROTECTED] -> COMMITTED -> FLUSHED -> EVICTED
       \\----------\\------------\\-> ABANDONED (it can never commit: a newer version committed
                                         first, its ranks disagree, or its job was dropped)

WRITING: some local ranks sealed their part. COMPLETE: every rank of the job on this node
sealed it. PROTECTED (a team of daemons): this node's part is also held by its replica holders
or in its group's parity; it waits for the team's decision. COMMITTED: the commit policy (one
node: complete is enough; a team: every node reported it protected) says it is restorable.
FLUSHED: also on disk in the universal format. EVICTED: its RAM was given back (it may still be
on disk).

``VersionTable`` owns every transition: one method each (``seal``, ``protect``, ``commit``,
``mark_flushed``, ``evict``, ``abandon``), which checks the state it leaves and clears the
caches a version keeps (``InvalidTransition`` otherwise: a bug, never a user's mistake). Nothing
else assigns ``Version.state``; ``NodeStore`` calls them and frees the slots.

What each part holds (its manifest, checked on arrival) is ``manifest.py``.

Thread-safety: callers hold the daemon's state lock.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..errors import UcpdError, VersionNotFound
from .coverage import GlobalTensor, check_covered, check_replicas_agree, check_skipped_covered, globals_of
from .manifest import RankPart

if TYPE_CHECKING:
    from ..team.decide import RestoreReader
    from .restore import SourceSet


class VersionState(enum.Enum):
    WRITING = "writing"
    COMPLETE = "complete"
    PROTECTED = "protected"
    COMMITTED = "committed"
    FLUSHED = "flushed"
    EVICTED = "evicted"
    ABANDONED = "abandoned"


RESTORABLE = (VersionState.COMMITTED, VersionState.FLUSHED)
# every local rank's part is here (a team may still be deciding): it can be copied, pinned, indexed
SEALED = (VersionState.COMPLETE, VersionState.PROTECTED, *RESTORABLE)
UNDECIDED = (VersionState.WRITING, VersionState.COMPLETE, VersionState.PROTECTED)


class InvalidTransition(RuntimeError):
    """A version was asked to leave a state it is not in: a bug in the daemon (the request that
    caused it gets an internal error; the daemon keeps serving)."""

DEFAULT_JOB = "default"  # the job of a client that names none (older clients)


@dataclass
class Version:
    step: int
    world_size: int
    state: VersionState = VersionState.WRITING
    parts: dict[int, RankPart] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    committed_at: float | None = None
    pins: int = 0  # restores, flushes and copies reading it right now (NodeStore.pin / unpin)
    incarnation: str | None = None  # the job run that writes it (a restarted job is another)
    local_size: int | None = None  # ranks that seal it on this node (None: all world_size, one node)
    job: str = DEFAULT_JOB
    ranks_sealed: tuple[int, ...] = ()  # the ranks whose parts it held when it left RAM
    # caches, cleared by the table when the parts change or go: the restore sources of the
    # committed parts (built at commit), and the parts' fragments by global tensor
    _source_set: "SourceSet | None" = None
    failure: Exception | None = None  # why it could not commit once every rank sealed it
    _globals: dict[str, GlobalTensor] | None = None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts.values())

    @property
    def on_disk(self) -> bool:
        """Flushed to the universal format (it stays FLUSHED until its RAM is evicted)."""
        return self.state is VersionState.FLUSHED

    @property
    def in_ram(self) -> bool:
        return self.state not in (VersionState.EVICTED, VersionState.ABANDONED) and bool(self.parts)

    def _forget_caches(self) -> None:
        self._globals = None
        self._source_set = None

    def source_set(self, build) -> "SourceSet":
        """The parts' ``SourceSet`` (what a restore plans on): ``build(self)`` once, kept until
        the parts change. (A restore's search for its sources is ``TeamFace.restore_sources``.)"""
        if self._source_set is None:
            self._source_set = build(self)
        return self._source_set

    def globals(self) -> dict[str, GlobalTensor]:
        """Index the parts' fragments by global tensor name (computed once per version).

        Source keys are ``(rank, tensor index)``. Raises PlacementMismatch when two ranks
        disagree on a global tensor's shape or dtype.
        """
        if self._globals is None:
            self._globals = globals_of(self)
        return self._globals


class CommitPolicy(Protocol):
    """Decides when a complete version becomes committed (the multi-node seam).

    ``local_parts``: False when one node holds every rank of a version (coverage is checked
    when it completes); True when a node holds only its local ranks' parts (a team of daemons:
    a version completes on a node when its ``local_size`` ranks sealed it, and coverage is
    checked across nodes when it is restored)."""

    local_parts: bool

    def on_complete(self, version: Version) -> bool:
        """Called once (holding the store lock) when a version is complete on this node; True
        commits it now, False leaves it COMPLETE (or PROTECTED) until ``NodeStore.commit``."""


class TeamSourcesFace(Protocol):
    """What the daemon reads of a restore's sources gathered across the team (``Found.team``;
    ``team.sources.TeamSources``): they hold pins on the peers until ``release``."""

    step: int
    sources: "SourceSet"  # what each global tensor is made of, and where its bytes are
    objects: dict  # rank -> (its non-tensor objects, their CRC32C)
    scope: str  # how wide it reads (``team.decide``: saved, indexed, all): a plan some ranks' parts do not cover reads wider

    def start_fetch(self, plan) -> object | None:
        """The plan's bytes held on peers: their local files made now, a ``PeerFetch`` to run that
        brings them (None: the plan reads nothing from peers)."""

    def release(self) -> None:
        """The pins on the peers go (the restore ended, or nobody reads them after all)."""


class TeamFace(CommitPolicy, Protocol):
    """What the daemon may use of the team of daemons (``team.Team``; ``Daemon.team``,
    ``Locator.team``, ``Pulls``): the commit policy, its life cycle, the runs of the job, and the
    questions a restore asks — never a part of the team (``tests/test_house.py`` refuses
    ``self.team.<part>.`` in ``ucpd/daemon/``). ``transport``, ``lane`` and ``counters`` are
    there for a pull's landing (``landing.land``), which fetches into a file of its own."""

    shm_dir: str
    transport: object  # team.transport.PeerTransport
    lane: object  # team.lane.DataLane | None
    counters: dict[str, int]

    def attach(self, store, leases) -> None:
        """Join the team: bind, connect, start the team's threads (the daemon's store and leases)."""

    def tick(self) -> None:
        """Timers (the daemon's loop)."""

    def close(self) -> None: ...

    def join_run(self, run: str | None) -> None:
        """Block until the team fenced the runs before ``run`` (a worker thread)."""

    def run_ready(self, run: str | None) -> bool: ...

    def latest(self) -> int | None:
        """The newest committed step that the live nodes still hold whole."""

    def restore_sources(self, step: int | None, reader: "RestoreReader | None" = None) -> TeamSourcesFace:
        """Where every rank's part of ``step`` is read from (with ``reader``: only the parts its scope reads)."""

    def widen(self, why: str) -> None:
        """A restore planned from some ranks' parts needs every rank's: the next gather asks for all."""

    def localize(self, sources: TeamSourcesFace, plan):
        """The plan's bytes that live on peers fetched here, checked; the plan that reads them here."""

    def drop_copies(self) -> int:
        """Free the copies held for the peers (the team's job was dropped); the bytes."""

    def seen_waiting(self, job: str, step: int) -> dict[int, dict]: ...

    def status(self) -> dict: ...


class SingleNodeCommit:
    """One node: a version every local rank sealed is committed."""

    local_parts = False

    def on_complete(self, version: Version) -> bool:
        return True


class VersionTable:
    RETIRED_MEMORY = 256  # how many dropped versions' final states are remembered for `wait`

    def __init__(self, policy: CommitPolicy | None = None, job: str = DEFAULT_JOB):
        self.job = job
        self.versions: dict[int, Version] = {}
        self.retired: dict[int, Version] = {}  # evicted or abandoned, parts gone; oldest first
        self.policy = policy or SingleNodeCommit()

    def find(self, step: int) -> Version | None:
        return self.versions.get(step) or self.retired.get(step)

    def get_or_create(self, step: int, world_size: int) -> Version:
        v = self.versions.get(step)
        if v is None:
            v = self.versions[step] = Version(step, world_size, job=self.job)
        return v

    # --- transitions: the only writers of Version.state ------------------------------------------

    @staticmethod
    def _leave(version: Version, allowed: tuple, to: VersionState) -> None:
        if version.state not in allowed:
            raise InvalidTransition(
                f"step {version.step} of job {version.job!r}: {version.state.value} -> {to.value} "
                f"(only from {', '.join(s.value for s in allowed)})"
            )
        version.state = to

    def seal(self, version: Version, part: RankPart) -> list[Version]:
        """WRITING: add a rank's sealed part. When every local rank sealed it, check it
        (agreement, coverage, replicas) and -> COMPLETE; then the policy may -> COMMITTED.
        Returns the versions that became committed. A part that fails the checks is taken out
        again (the caller gives its slot back) and the error raised."""
        self._leave(version, (VersionState.WRITING,), VersionState.WRITING)
        version.parts[part.rank] = part
        version._forget_caches()
        local = version.local_size if self.policy.local_parts and version.local_size else version.world_size
        if len(version.parts) < local:
            return []
        try:
            if self.policy.local_parts:
                version.globals()  # the node's ranks must agree on shapes; coverage spans nodes
            else:
                check_covered(version)  # agreement and coverage now, not at restore time
            check_skipped_covered(version)
            check_replicas_agree(version)
        except Exception:
            del version.parts[part.rank]
            version._forget_caches()
            raise
        version.state = VersionState.COMPLETE
        if self.policy.on_complete(version):
            self.commit(version)
            return [version]
        return []

    def protect(self, version: Version) -> bool:
        """COMPLETE -> PROTECTED: this node's part is held elsewhere too (a team's replicas or
        parity). False (nothing changes) when the version already moved on: committed, evicted."""
        if version.state is not VersionState.COMPLETE:
            return False
        version.state = VersionState.PROTECTED
        return True

    def commit(self, version: Version) -> None:
        """COMPLETE | PROTECTED -> COMMITTED (the only place a version becomes committed)."""
        self._leave(version, (VersionState.COMPLETE, VersionState.PROTECTED), VersionState.COMMITTED)
        version.committed_at = time.time()

    def mark_flushed(self, version: Version) -> None:
        """COMMITTED -> FLUSHED: its files are committed on disk. A version flushed again (after
        a restart) stays FLUSHED."""
        self._leave(version, RESTORABLE, VersionState.FLUSHED)

    def evict(self, version: Version) -> list[int]:
        """COMMITTED | FLUSHED -> EVICTED: its RAM goes (pins must be 0). Returns its slot ids,
        for the caller to give back."""
        self._leave(version, RESTORABLE, VersionState.EVICTED)
        return self._retire(version)

    def abandon(self, version: Version, failure: Exception | None = None) -> list[int]:
        """WRITING | COMPLETE | PROTECTED -> ABANDONED: it can never commit (``failure`` says why,
        to its waiters). Returns its slot ids, for the caller to give back."""
        self._leave(version, UNDECIDED, VersionState.ABANDONED)
        if failure is not None:
            version.failure = failure
        return self._retire(version)

    def _retire(self, version: Version) -> list[int]:
        if version.pins:
            raise InvalidTransition(f"step {version.step} of job {version.job!r} leaves RAM while {version.pins} readers pin it")
        sids = [p.slot for p in version.parts.values()]
        version.ranks_sealed = tuple(sorted(version.parts))
        version.parts = {}
        version._forget_caches()
        if self.versions.get(version.step) is version:  # (a detached one: the step is another's now)
            del self.versions[version.step]
        self.retired[version.step] = version
        while len(self.retired) > self.RETIRED_MEMORY:
            del self.retired[next(iter(self.retired))]
        return sids

    def detach(self, version: Version) -> None:
        """Take an undecided version out of the table while readers still pin it: its step is
        free for another run's version; the caller abandons it once the last reader is done."""
        if version.state not in UNDECIDED or self.versions.get(version.step) is not version:
            raise InvalidTransition(f"step {version.step} of job {version.job!r} ({version.state.value}) cannot be detached")
        del self.versions[version.step]

    def adopt(self, version: Version) -> None:
        """Take in a version re-adopted from the index after a restart, in the state it had."""
        if version.state not in SEALED:
            raise InvalidTransition(f"step {version.step}: a {version.state.value} version is never re-adopted")
        self.versions[version.step] = version

    # --- queries -------------------------------------------------------------------------------

    def outcome(self, step: int) -> VersionState | None:
        """How ``step`` ended, for a trainer waiting on it: COMMITTED / FLUSHED / EVICTED (it
        was committed), or None while it may still commit. Raises the version's failure, or
        VersionNotFound, when it never will."""
        v = self.find(step)
        if v is None:
            newest = self.latest_committed()
            if newest is not None and newest.step > step:
                raise VersionNotFound(f"step {step} was never sealed here and step {newest.step} is already committed")
            return None
        if v.state in RESTORABLE or (v.state is VersionState.EVICTED and v.committed_at is not None):
            return v.state
        if v.state is VersionState.ABANDONED and isinstance(v.failure, UcpdError):
            raise type(v.failure)(f"step {step} cannot commit: {v.failure}")
        if v.state is VersionState.ABANDONED:
            missing = sorted(set(range(v.world_size)) - set(v.ranks_sealed))
            raise VersionNotFound(f"step {step} was abandoned: ranks {missing} never committed it before a newer step did")
        return None

    def latest_committed(self) -> Version | None:
        ready = [v for v in self.versions.values() if v.state in RESTORABLE]
        return max(ready, key=lambda v: v.step) if ready else None

    def committed(self) -> list[Version]:
        return sorted((v for v in self.versions.values() if v.state in RESTORABLE), key=lambda v: v.step)

    def abandoned_before(self, step: int) -> list[Version]:
        """Incomplete versions older than a committed step: they can never commit now. (One a
        peer copy still reads stays until it is unpinned; ``NodeStore.enforce_keep`` takes it then.)"""
        return [v for v in self.versions.values() if v.step < step and v.state in UNDECIDED and not v.pins]


