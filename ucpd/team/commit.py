"""Global commit protocol (draft): a pure state machine; events in, messages and actions out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..errors import ProtocolError

KEEP = 64


@dataclass(frozen=True)
class Send:
    dest: int
    msg: dict


@dataclass(frozen=True)
class Commit:
    step: int


@dataclass(frozen=True)
class Record:
    step: int


def _check(msg) -> dict:
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ProtocolError("commit message must be a map with a type")
    t = msg["t"]
    def ints(v):
        return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
    step_ok = isinstance(msg.get("step"), int) and not isinstance(msg.get("step"), bool) and msg.get("step") >= 0
    if t == "protected":
        if not (step_ok and ints(msg.get("ranks")) and isinstance(msg.get("world"), int) and msg["world"] > 0):
            raise ProtocolError("malformed protected message")
    elif t in ("record", "recorded", "commit"):
        if not step_ok:
            raise ProtocolError(f"malformed {t} message")
    elif t == "state_req":
        pass
    elif t in ("state", "sync"):
        if not (ints(msg.get("recorded", [])) and ints(msg.get("committed", []))):
            raise ProtocolError(f"malformed {t} message")
        for p in msg.get("protected", []):
            if not (isinstance(p, list) and len(p) == 3 and isinstance(p[0], int) and ints(p[1]) and isinstance(p[2], int)):
                raise ProtocolError("malformed state message")
    else:
        raise ProtocolError(f"unknown commit message type {t!r}")
    return msg


class CommitNode:
    def __init__(self, rank: int, nodes: int, *, resend_after: float = 0.5, committed: Iterable[int] = ()):
        self.rank, self.nodes, self.resend_after = rank, nodes, resend_after
        self.live = frozenset(range(nodes))
        self.committed: set[int] = set(committed)
        self.recorded: set[int] = set()
        self.mine: dict[int, tuple[frozenset, int]] = {}  # my protected reports
        self.reports: dict[int, dict[int, tuple[frozenset, int]]] = {}  # coordinator: step -> node -> (ranks, world)
        self.deciding: dict[int, set[int]] = {}  # coordinator: step -> nodes yet to ack RECORD
        self._sent_at: dict[tuple, float] = {}

    @property
    def coordinator(self) -> int:
        return min(self.live)

    def is_committed(self, step: int) -> bool:
        return step in self.committed

    def latest(self):
        return max(self.committed) if self.committed else None

    def committed_steps(self):
        return sorted(self.committed)

    def pending(self) -> dict:
        return {"coordinator": self.coordinator, "protected": sorted(self.mine), "recorded": sorted(self.recorded - self.committed),
                "deciding": sorted(self.deciding)}

    def forget(self, step: int) -> None:
        self.mine.pop(step, None)
        self.reports.pop(step, None)

    # --- events -------------------------------------------------------------------------------

    def on_protected(self, step, ranks, world_size, now) -> list:
        self.mine[step] = (frozenset(ranks), world_size)
        return self._report(step, now)

    def _report(self, step, now) -> list:
        if step in self.committed:
            return []
        ranks, world = self.mine[step]
        msg = {"t": "protected", "step": step, "ranks": sorted(ranks), "world": world}
        self._sent_at[("p", step)] = now
        if self.coordinator == self.rank:
            return self._on_protected_report(self.rank, msg, now)
        return [Send(self.coordinator, msg)]

    def on_message(self, src, msg, now) -> list:
        msg = _check(msg)
        t = msg["t"]
        if t == "protected":
            return self._on_protected_report(src, msg, now)
        if t == "record":
            return self._on_record(src, msg["step"])
        if t == "recorded":
            return self._on_recorded(src, msg["step"], now)
        if t == "commit":
            return self._make_visible(msg["step"])
        if t == "state_req":
            return [Send(src, {"t": "state", "recorded": sorted(self.recorded - self.committed)[-KEEP:],
                               "committed": sorted(self.committed)[-KEEP:],
                               "protected": [[s, sorted(r), w] for s, (r, w) in self.mine.items() if s not in self.committed]})]
        if t == "state":
            out = []
            for s in msg.get("committed", []):
                out += self._make_visible(s)
            for s in msg.get("recorded", []):
                if s not in self.committed:
                    out += self._decide(s, now)
            for s, r, w in msg.get("protected", []):
                out += self._on_protected_report(src, {"step": s, "ranks": r, "world": w}, now)
            return out
        if t == "sync":
            out = []
            for s in msg.get("committed", []):
                out += self._make_visible(s)
            return out
        return []

    def on_view(self, live, now) -> list:
        old_coord, old_live = self.coordinator, self.live
        self.live = frozenset(live) | {self.rank}
        out = []
        for step in list(self.deciding):
            self.deciding[step] &= self.live
            out += self._maybe_commit(step, now)
        if self.coordinator == self.rank:
            if old_coord != self.rank:  # take over: learn what the others know
                for n in self.live - {self.rank}:
                    out.append(Send(n, {"t": "state_req"}))
                for s in list(self.recorded - self.committed):
                    out += self._decide(s, now)
            joined = self.live - old_live
            for n in joined:
                if n != self.rank:
                    out.append(Send(n, {"t": "sync", "committed": sorted(self.committed)[-KEEP:]}))
        elif old_coord != self.coordinator:
            for step in list(self.mine):
                out += self._report(step, now)
        return out

    def on_tick(self, now) -> list:
        out = []
        for step in list(self.mine):
            if step not in self.committed and now - self._sent_at.get(("p", step), 0) > self.resend_after:
                out += self._report(step, now)
        for step, waiting in self.deciding.items():
            if now - self._sent_at.get(("r", step), 0) > self.resend_after:
                self._sent_at[("r", step)] = now
                out += [Send(n, {"t": "record", "step": step}) for n in waiting if n != self.rank]
        return out

    # --- coordinator ---------------------------------------------------------------------------

    def _on_protected_report(self, src, msg, now) -> list:
        step = msg["step"]
        if step in self.committed:
            return [Send(src, {"t": "commit", "step": step})] if src != self.rank else []
        if self.coordinator != self.rank:
            return []
        got = self.reports.setdefault(step, {})
        got[src] = (frozenset(msg["ranks"]), msg["world"])
        world = msg["world"]
        covered = set().union(*(r for r, w in got.values() if w == world))
        if covered >= set(range(world)) and step not in self.deciding:
            return self._decide(step, now)
        return []

    def _decide(self, step, now) -> list:
        if step in self.deciding or step in self.committed:
            return []
        self.recorded.add(step)
        self.deciding[step] = set(self.live) - {self.rank}
        self._sent_at[("r", step)] = now
        out = [Record(step)]
        out += [Send(n, {"t": "record", "step": step}) for n in sorted(self.deciding[step])]
        return out + self._maybe_commit(step, now)

    def _on_record(self, src, step) -> list:
        out = []
        if step not in self.recorded and step not in self.committed:
            self.recorded.add(step)
            out.append(Record(step))
        return out + [Send(src, {"t": "recorded", "step": step})]

    def _on_recorded(self, src, step, now) -> list:
        if step in self.deciding:
            self.deciding[step].discard(src)
            return self._maybe_commit(step, now)
        return []

    def _maybe_commit(self, step, now) -> list:
        if self.deciding.get(step):
            return []
        self.deciding.pop(step, None)
        out = [Send(n, {"t": "commit", "step": step}) for n in sorted(self.live - {self.rank})]
        return out + self._make_visible(step)

    def _make_visible(self, step) -> list:
        if step in self.committed:
            return []
        self.committed.add(step)
        self.recorded.discard(step)
        self.mine.pop(step, None)
        self.reports.pop(step, None)
        return [Commit(step)]
