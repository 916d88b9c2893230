"""The runs of the job as one node of the commit protocol knows them (``RunFences``, a part
``commit.CommitNode`` owns): a restarted job is a new run, and before its trainers snapshot, the
coordinator fences the earlier runs on every live node (their undecided parts never commit; a
straggler's report of one is refused). Pure: events in, outputs out, like the node it serves."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..protocol import MAX_PENDING, RETIRED
from .commit_records import Acks, Fence, Send, View


class RunFences:
    """This node's runs: the current one (``run``, numbered ``fence``), the ones it superseded
    (``retired``), the one its trainers begin (``want``) and, on the coordinator, the fence being
    acknowledged. Knows of its node only what it is given: its rank, ``resend_after``, and three
    callables — ``is_committed(step)``, ``decided()`` (the steps decided, committed or not) and
    ``drop_other_runs(run)`` (the node forgets the reports of every other run, when a fence
    makes ``run`` current). Every event takes the node's ``View`` and returns outputs."""

    def __init__(self, rank: int, resend_after: float, *, is_committed: Callable[[int], bool],
                 decided: Callable[[], Iterable[int]], drop_other_runs: Callable[[str], None]) -> None:
        self.rank, self.resend_after = rank, resend_after
        self._is_committed, self._decided, self._drop_other_runs = is_committed, decided, drop_other_runs
        self.run: str | None = None  # the job's current run as this node knows it (None: none fenced yet)
        self.fence = 0  # the number the coordinator gave ``run``; a later run gets a larger one
        self.retired: list[str] = []  # runs superseded by a later one, newest last (at most RETIRED)
        self.want: str | None = None  # the run this node's trainers begin (on_run), until it is current here
        self._want_sent = float("-inf")
        self._awaiting: frozenset[int] = frozenset()  # steps decided before ``want``'s fence: visible first
        self._granted = 0  # the fence of the run_ok this node got (its run may begin once current)
        self._granting: Acks | None = None  # coordinator: the fence being acknowledged
        self._requesters: set[int] = set()  # coordinator: nodes waiting for run_ok

    # --- queries -------------------------------------------------------------------------------

    def ready(self, run: str) -> bool | None:
        """Whether ``run`` is the job's current run here, with every step decided before its fence
        visible (its trainers may read ``latest()`` and snapshot); None: a later run superseded it."""
        if run in self.retired:
            return None
        return self.run == run and self._granted == self.fence and all(self._is_committed(s) for s in self._awaiting)

    def current(self, run: str) -> bool:
        """Whether a part of ``run`` may still count: the current run, or any before the first fence."""
        return run == self.run if self.run is not None else run not in self.retired

    # --- events --------------------------------------------------------------------------------

    def on_run(self, run: str, now: float, v: View, syncing: bool) -> list:
        """Trainers of ``run`` begin here: unless it is current already (or asked for lately), ask
        the coordinator to fence the earlier runs. ``syncing``: a coordinator that is still
        learning the team's state (it grants nothing yet)."""
        if self.ready(run) is not False or (self.want == run and now - self._want_sent < self.resend_after):
            return []  # (asked already: resend_ask asks again)
        self.want = run
        return self._ask(now, v, syncing)

    def on_view(self, now: float, v: View, syncing: bool) -> list:
        """A new view: a coordinator asks every live node to acknowledge its fence in progress
        again; any other node forgets a grant of its own and asks its coordinator (again)."""
        if v.coordinator != self.rank:
            self._granting, self._requesters = None, set()  # their nodes ask the new coordinator
            return self._ask(now, v, syncing) if self.want is not None else []
        if self._granting is None:
            return []
        self._granting.acked = {self.rank}
        self._requesters &= v.live
        return self._advance_grant(now, v)

    def resend_ask(self, now: float, v: View, syncing: bool) -> list:
        """``on_tick``: ask again for the run wanted here, until it is current (or superseded)."""
        if self.want is None:
            return []
        if self.ready(self.want) is not False:
            self.want = None  # current here (or superseded): nothing more to ask
            return []
        return self._ask(now, v, syncing) if now - self._want_sent >= self.resend_after else []

    def resend_grant(self, now: float, v: View) -> list:
        """``on_tick``: the coordinator sends its fence again to the nodes that did not acknowledge it."""
        if self._granting is not None and now - self._granting.sent_at >= self.resend_after:
            return self._advance_grant(now, v)
        return []

    def adopt(self, run: str, f: int, old: Iterable[str]) -> list:
        """Fence ``f`` makes ``run`` current: earlier runs retire, their undecided reports go (here
        and, on the coordinator, from every node), and the driver abandons their parts (``Fence``)."""
        if f < self.fence or (f == self.fence and (run != self.run or f == 0)):
            return []  # an older fence, or the same number given to another run by a dead coordinator
        for r in old:
            if r != run and r not in self.retired:
                self.retired.append(r)
        if f == self.fence:
            return []
        if self.run is not None and self.run != run and self.run not in self.retired:
            self.retired.append(self.run)
        del self.retired[:-RETIRED]
        self.run, self.fence = run, f
        self._granting = None  # a grant of ours in progress was for an earlier run
        self._drop_other_runs(run)
        return [Fence(run, frozenset(self._decided()))]

    def fence_msg(self, dest: int, v: View) -> Send:
        """The current fence, for ``dest`` (which missed it, or sent a part of a run fenced off)."""
        return Send(dest, {"t": "fence", "run": self.run or "", "f": self.fence, "old": self.retired[-RETIRED:],
                           "e": v.epoch})

    # --- messages ------------------------------------------------------------------------------

    MESSAGES = frozenset({"fence_req", "fence", "fenced", "run_ok"})

    def on_message(self, src: int, m: dict, now: float, v: View, syncing: bool) -> list:
        """A fence message (one of ``MESSAGES``) from peer ``src``."""
        t = m["t"]
        if t == "fence_req":
            return self._on_fence_req(src, m, now, v, syncing)
        if t == "fence":
            return self._on_fence(src, m, v)
        if t == "fenced":
            return self._on_fenced(src, m, now, v)
        return self._on_run_ok(m)

    def _on_fence_req(self, src: int, m: dict, now: float, v: View, syncing: bool) -> list:
        if v.coordinator != self.rank or syncing:
            return []  # not ours to grant, or we first learn the team's fence: the node asks again
        return self._grant(m["run"], now, src, v)

    def _on_fence(self, src: int, m: dict, v: View) -> list:
        if m["f"] < self.fence:
            return [self.fence_msg(src, v)]  # the sender missed a later fence: pass it on
        return self.adopt(m["run"], m["f"], m["old"]) + [Send(src, {"t": "fenced", "f": m["f"], "e": m["e"]})]

    def _on_fenced(self, src: int, m: dict, now: float, v: View) -> list:
        g = self._granting
        if g is None or m["f"] != self.fence or m["e"] != v.epoch or src not in v.live:
            return []  # stale, duplicated, or from before the current view
        g.acked.add(src)
        return self._advance_grant(now, v, send=False)

    def _on_run_ok(self, m: dict) -> list:
        out = self.adopt(m["run"], m["f"], ()) if m["f"] > self.fence else []
        if m["run"] == self.want and m["run"] == self.run:  # (a fence we hold for it may be numbered apart)
            self._granted, self._awaiting = self.fence, frozenset(m["steps"])
        return out

    def on_state(self, src: int, m: dict, v: View) -> list:
        """Coordinator: a node's ``state`` names its fence: adopt a later one, tell it of ours if it lags."""
        if m["fence"] > self.fence:  # a fence we missed (handed out by an earlier coordinator)
            return self.adopt(m["run"], m["fence"], m["old"])
        if m["fence"] < self.fence:
            return [self.fence_msg(src, v)]
        return []

    # --- the coordinator's grant ---------------------------------------------------------------

    def _ask(self, now: float, v: View, syncing: bool) -> list:
        """Ask the coordinator to make ``want`` the current run (we are it: grant it ourselves)."""
        self._want_sent = now
        if v.coordinator == self.rank:
            return [] if syncing else self._grant(self.want, now, self.rank, v)
        return [Send(v.coordinator, {"t": "fence_req", "run": self.want, "e": v.epoch})]

    def _grant(self, run: str, now: float, src: int, v: View) -> list:
        """Coordinator: ``run`` begins at node ``src``. A run we know as superseded is told so (the
        current fence); a new run gets the next fence, which every live node must acknowledge
        before ``src`` hears ``run_ok``; the current run, once acknowledged, gets ``run_ok`` now."""
        if run in self.retired:
            return [] if src == self.rank else [self.fence_msg(src, v)]
        out: list = []
        if run != self.run:
            out += self.adopt(run, self.fence + 1, ())
            self._granting = Acks(1, {self.rank})
            self._requesters = set()
        self._requesters.add(src)
        if self._granting is None:
            return out + self._run_ok(v)
        return out + self._advance_grant(now, v, send=run != self.run or src == self.rank)

    def _advance_grant(self, now: float, v: View, send: bool = True) -> list:
        """Coordinator: once every live node adopted the fence, the nodes that asked hear ``run_ok``."""
        g = self._granting
        if g.acked >= v.live:
            self._granting = None
            return self._run_ok(v)
        if not send:
            return []
        g.sent_at = now
        return [self.fence_msg(n, v) for n in sorted(v.live - g.acked)]

    def _run_ok(self, v: View) -> list:
        """Coordinator: tell the nodes that asked that the current run may begin, after the steps
        decided before its fence (they become visible: the new run's ``latest()`` includes them)."""
        decided = sorted(self._decided())[-MAX_PENDING:]
        out = []
        for n in sorted(self._requesters):
            if n == self.rank:
                self._granted, self._awaiting = self.fence, frozenset(decided)
            else:
                out.append(Send(n, {"t": "run_ok", "run": self.run, "f": self.fence, "steps": decided, "e": v.epoch}))
        self._requesters = set()
        return out
