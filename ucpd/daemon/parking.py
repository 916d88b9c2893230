"""Replies that wait: a ``begin`` whose slot is being allocated, a ``wait`` for a step that
is not decided yet, and a request answered from a worker thread.

The server parks such a request here and sends the frames these methods return when the
condition is met (the slot is ready, the step committed or failed, the wait timed out). No
sockets inside: the rules are testable on their own. ``Parking`` is the server loop's alone;
``Workers`` hands what a worker thread found back to the loop through its queue, a
``WakingQueue``: each put wakes the loop's poll at once (a worker's restore reply used to wait
for the poll's 10 ms timeout).
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .. import protocol
from ..errors import UcpdError, VersionNotFound
from .versions import VersionTable


class WakingQueue(queue.Queue):
    """A queue whose ``put`` of an item of a kind in ``wake_for`` (an item is a tuple, its kind
    first) also writes a byte to a pipe, so that a loop that polls ``fileno()`` beside its
    sockets wakes as soon as it is there (``clear`` empties the pipe). Other items wait for the
    loop's next turn: the daemon wakes for a worker's answer, not for a slot made ready (woken
    for those too, the next spare's warming may start under the trainer's copy: an idle loop's
    staged read 0.80x the memcpy floor against 0.70x before in one ``before_after.sh`` run,
    2026-12-01; without them 0.80 against 0.79)."""

    def __init__(self, wake_for: frozenset = frozenset({"reply", "then"})) -> None:
        super().__init__()
        self.wake_for = wake_for
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._fds = threading.Lock()  # a put never writes to a pipe closed meanwhile (its number reused)
        self._open = True

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        if not (isinstance(item, tuple) and item and item[0] in self.wake_for):
            return
        with self._fds:
            if self._open:
                try:
                    os.write(self._w, b"\0")
                except BlockingIOError:  # full: a wake-up is pending anyway
                    pass

    def fileno(self) -> int:
        return self._r

    def clear(self) -> None:
        """Read the wake-ups written so far (the items stay queued)."""
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._fds:
            if self._open:
                self._open = False
                os.close(self._r)
                os.close(self._w)


@dataclass
class Parked:
    """A request whose reply waits: who asked (ROUTER identity, request id) and for what."""

    ident: bytes
    req_id: int
    step: int
    job: str
    deadline: float = 0.0  # a wait: when to answer "pending" (monotonic seconds)
    rank: int = 0  # a begin: the rank that asked, and the tensors it may skip
    skip: list = field(default_factory=list)
    base: int | None = None  # a begin: the base step its references may point into, if usable


Reply = tuple[bytes, bytes]  # (ROUTER identity, reply frame)


def begin_reply(slot, skip: list, spares: list, base: int | None = None) -> dict:
    """The body of a ``begin`` reply: the slot lent, what the rank may skip, its ready spares,
    and the base step its references may point into (None: not usable, copy everything)."""
    return {"slot": slot.id, "path": slot.path, "size": slot.size, "skip": skip, "spares": spares, "base": base}


def wait_answer(table: VersionTable, step: int) -> dict | None:
    """The body of a ``wait`` reply for ``step`` now, or None while it may still commit. Raises
    the typed error of a step that never will."""
    state = table.outcome(step)
    return None if state is None else {"state": state.value, "step": step}


class Parking:
    def __init__(self) -> None:
        self.begins: dict[int, Parked] = {}  # slot id being allocated -> the begin waiting for it
        self.waits: list[Parked] = []

    def __bool__(self) -> bool:
        return bool(self.begins or self.waits)

    # --- begins --------------------------------------------------------------------------------

    def park_begin(self, sid: int, parked: Parked) -> None:
        self.begins[sid] = parked

    def take_begin(self, sid: int) -> Parked | None:
        """The begin waiting for slot ``sid`` (None: a spare nobody waits for)."""
        return self.begins.pop(sid, None)

    # --- waits ---------------------------------------------------------------------------------

    def park_wait(self, parked: Parked) -> None:
        self.waits.append(parked)

    def answer_waits(self, table_of, now: float, waiting=None) -> list[Reply]:
        """Replies for the waits whose step was decided (or failed), or whose time ran out;
        the others stay parked. ``table_of(job)``: that job's version table; ``waiting(job,
        step)``: why a step is still pending (a ``WAITING`` record, or None), sent with "pending"."""
        out, keep = [], []
        for w in self.waits:
            try:
                answer = wait_answer(table_of(w.job), w.step)
            except UcpdError as exc:
                out.append((w.ident, protocol.error(w.req_id, exc)))
                continue
            if answer is not None:
                out.append((w.ident, protocol.ok("wait", w.req_id, answer)))
            elif now >= w.deadline:
                body = {"state": "pending", "step": w.step}
                why = waiting(w.job, w.step) if waiting is not None else None
                if why is not None:
                    body["waiting"] = why
                out.append((w.ident, protocol.ok("wait", w.req_id, body)))
            else:
                keep.append(w)
        self.waits = keep
        return out

    def drop_job(self, job: str) -> list[Reply]:
        """``ucpd drop JOB``: every wait of the job is answered with VersionNotFound."""
        gone = [w for w in self.waits if w.job == job]
        self.waits = [w for w in self.waits if w.job != job]
        return [(w.ident, protocol.error(w.req_id, VersionNotFound(f"job {job!r} was dropped on this node"))) for w in gone]


class Workers:
    """Requests answered from a worker thread: ``work`` asks other daemons or downloads, which
    the server's loop must never wait for. What it returns goes to ``done`` (the loop's queue)
    as ``("reply", ident, req_id, msg_type, result, exc)``; with ``then``, as ``("then", ident,
    req_id, msg_type, then, None)``: the loop calls ``then()`` once ``work`` is done and answers
    with what it returns."""

    def __init__(self, done: queue.Queue, threads: int = 4) -> None:
        self.done = done
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None  # made on first use

    def defer(self, ident: bytes, req_id: int, msg_type: str, work, then=None) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ucpd-worker")

        def run():
            try:
                result = work()
                self.done.put(("reply", ident, req_id, msg_type, result, None) if then is None
                              else ("then", ident, req_id, msg_type, then, None))
            except Exception as exc:
                self.done.put(("reply", ident, req_id, msg_type, None, exc))

        self._pool.submit(run)
        return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
