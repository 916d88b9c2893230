"""The coordinator's decisions in the commit protocol (``Decisions``, a part ``commit.CommitNode``
owns; raft keeps its ``ProgressTracker`` so): each decided step goes through two phases, sent to
the coordinator's children in its view (every live node, or with ``--commit-fanout`` the groups'
aggregators and its own group): ``record`` until every child recorded it, then ``commit`` until
every child made it visible. Pure: no sockets, threads or clocks."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .commit_records import Acks, Send, View


class Decisions:
    """The steps being decided (``steps``: step -> the current phase and who acknowledged it).
    ``make_visible(step)``: the node makes ``step`` visible here (its outputs), when phase 1 ends."""

    def __init__(self, rank: int, make_visible: Callable[[int], list]) -> None:
        self.rank, self._make_visible = rank, make_visible
        self.steps: dict[int, Acks] = {}

    def __contains__(self, step: int) -> bool:
        return step in self.steps

    def __len__(self) -> int:
        return len(self.steps)

    def keys(self):
        return self.steps.keys()

    def clear(self) -> None:
        """Another node coordinates now: it adopts our decisions from our state."""
        self.steps.clear()

    def start(self, step: int, now: float, v: View) -> list:
        """Phase 1 of ``step`` (the coordinator recorded it)."""
        d = self.steps[step] = Acks(1, {self.rank})
        return self.advance(step, d, now, v)

    def spread(self, step: int, now: float, v: View, have: Iterable[int] = (), to: int | None = None) -> list:
        """``step`` is committed here; see that every child commits it (phase 2, ``have`` known
        to have it already). Starting phase 2 sends ``commit`` to every child that lacks it; once
        it runs, a node ``to`` found lacking it gets one ``commit`` now and the rest wait for
        ``resend``: a burst of N ``state`` replies during phase 2 must not cost N messages each
        (N^2)."""
        d = self.steps.get(step)
        if d is None or d.phase == 1:
            d = self.steps[step] = Acks(2, {self.rank})
            d.acked.update(have)
            return self.advance(step, d, now, v)
        d.acked.update(have)
        out = self.advance(step, d, now, v, send=False)
        if to is not None and step in self.steps and to in v.live and to not in d.acked:
            out.append(Send(to, {"t": "commit", "step": step, "e": v.epoch}))
        return out

    def advance(self, step: int, d: Acks, now: float, v: View, send: bool = True) -> list:
        """Move to phase 2 once every child recorded, finish once every child has it visible.
        Sends the current phase to the children that have not acked it if ``send`` or the phase
        just changed."""
        out: list = []
        if d.phase == 1 and d.acked >= v.children:
            d.phase, d.acked, send = 2, {self.rank}, True
            out += self._make_visible(step)
        if d.phase == 2 and d.acked >= v.children:
            del self.steps[step]
            return out
        return out + self._send(step, d, now, v) if send else out

    def ack(self, phase: int, src: int, m: dict, now: float, v: View) -> list:
        """A child's ``recorded`` (phase 1) or ``committed`` (phase 2)."""
        d = self.steps.get(m["step"])
        if d is None or d.phase != phase or m["e"] != v.epoch or src not in v.children:
            return []  # stale, duplicated, or from before the current view
        d.acked.add(src)
        return self.advance(m["step"], d, now, v, send=False)

    def restart(self, now: float, v: View) -> list:
        """A new view: the acks of every decision restart (the children may have changed)."""
        out: list = []
        for step, d in sorted(self.steps.items()):
            d.acked = {self.rank}
            out += self.advance(step, d, now, v)
        return out

    def resend(self, now: float, v: View, resend_after: float) -> list:
        """Each phase again to the children that did not acknowledge it in ``resend_after`` seconds."""
        out: list = []
        for step, d in self.steps.items():
            if now - d.sent_at >= resend_after:
                out += self._send(step, d, now, v)
        return out

    def summary(self, v: View) -> list[dict]:
        """The decisions in flight, for ``ucpd status``."""
        return [{"step": s, "phase": "record" if d.phase == 1 else "commit", "waiting": sorted(v.children - d.acked)}
                for s, d in sorted(self.steps.items())]

    def _send(self, step: int, d: Acks, now: float, v: View) -> list:
        d.sent_at = now
        t = "record" if d.phase == 1 else "commit"
        return [Send(n, {"t": t, "step": step, "e": v.epoch}) for n in sorted(v.children - d.acked)]
