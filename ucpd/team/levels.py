"""The level engine of the team's two recursive gathers: ``team.directory`` (what every node
holds, by doubling) and ``team.piece_index`` (which ranks hold which pieces, by halving).

Both build a step's levels the same way: a level is made once per view, on a thread of its own
(levels are asked only of lower levels, so no two nodes wait on each other), shared by every
asker while it is on its way and ``TTL`` seconds after, dropped at ``2 × TTL`` (manifests are
large); a level too large for one reply goes in pages. What a level holds, how it is built and
how a page is cut are the gather's own: :class:`Levels` takes a ``build`` callable.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..errors import UcpdError

__all__ = ["ASK_TIMEOUT", "TTL", "Level", "Levels", "ask_pages", "reply_when_done"]

TTL = 5.0  # seconds an answer serves the requests that follow it (a restart's storm of them)
ASK_TIMEOUT = 10.0  # seconds to wait for a node's answer, and as much more per level it gathers first


@dataclass
class Level:
    """One level of one step's gather as this node knows it."""

    view: tuple[int, ...]  # the sorted live nodes it was gathered in
    wave: int
    fresh: bool = False  # made for a wave that renews answers: its lower levels and partners renew too
    future: Future = field(default_factory=Future)
    at: float | None = None  # when it was done (None: on its way)
    pages: list[int] | None = None  # where each page of it starts (the gather cuts them on the first request)

    def usable(self, view: tuple[int, ...], now: float, wave: int | None) -> bool:
        """Whether it answers a request in ``view`` (``wave``: of that wave only, however old)."""
        if self.view != view or (wave is not None and wave != self.wave):
            return False
        if self.future.done():
            return self.future.exception() is None and (wave is not None or now - self.at < TTL)
        return True  # on its way: share it


class Levels:
    """The levels of one node's gather, by ``(step, level)``.

    ``build(step, level, got)`` makes level ``level`` of ``step`` for the :class:`Level` ``got``
    (its view, wave); it runs on a thread named ``ucpd-<name>-<level>``, or on the asker's own
    for the levels in ``inline`` (those that ask nobody). ``clock``: the team's. ``new_wave``: the
    wave of a level made for no particular wave."""

    def __init__(self, build: Callable[[Any, int, Level], Any], clock: Callable[[], float], *, name: str,
                 new_wave: Callable[[], int], inline: tuple[int, ...] = ()) -> None:
        self._build, self._clock, self._name = build, clock, name
        self._new_wave, self._inline = new_wave, inline
        self._lock = threading.Lock()
        self._levels: dict[tuple[Any, int], Level] = {}

    def kept(self, step, level: int) -> Level | None:
        """The level kept for ``(step, level)``, whatever its state."""
        with self._lock:
            return self._levels.get((step, level))

    def get(self, step, level: int, view: tuple[int, ...], wave: int | None = None) -> Level:
        """Level ``level`` of ``step`` in ``view``: the one kept, or a new one being built;
        ``wave``: a wave that renews answers, whose level only will do."""
        now = self._clock()
        with self._lock:
            got = self._levels.get((step, level))
            if got is not None and got.usable(view, now, wave):
                return got
            for key, old in list(self._levels.items()):  # answers past their time go
                if old.at is not None and now - old.at > 2 * TTL:
                    del self._levels[key]
            fresh = wave is not None
            got = self._levels[(step, level)] = Level(view, wave if fresh else self._new_wave(), fresh)
        if level in self._inline:
            self._finish(got, step, level)
        else:
            threading.Thread(target=self._finish, args=(got, step, level),
                             name=f"ucpd-{self._name}-{level}", daemon=True).start()
        return got

    def _finish(self, got: Level, step, level: int) -> None:
        try:
            out = self._build(step, level, got)
            got.at = self._clock()
            got.future.set_result(out)
        except BaseException as exc:  # its askers get it; the next one starts again
            got.at = self._clock()
            got.future.set_exception(exc)


def ask_pages(request, node: int, msg_type: str, body: dict, timeout: float,
              later: Callable[[dict], dict] = lambda first: {}) -> Iterator[dict]:
    """A level asked of ``node``, page by page: each reply in turn, while one names a ``next``
    page (asked with ``first`` and what ``later`` takes from the first reply)."""
    reply, _ = request(node, msg_type, body, timeout=timeout)
    yield reply
    more = later(reply)
    while reply.get("next") is not None:
        reply, _ = request(node, msg_type, dict(body, **more, first=reply["next"]), timeout=ASK_TIMEOUT)
        yield reply


def reply_when_done(source: Future, make: Callable[[Any], dict], what: str) -> Future:
    """A future of the peer reply ``make`` makes from ``source``'s result, once it is done; any
    error (``source``'s or ``make``'s) as a UcpdError that names ``what``."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            if f.exception() is not None:
                exc = f.exception()
                raise exc if isinstance(exc, UcpdError) else UcpdError(f"{what}: {exc}")
            out.set_result((make(f.result()), []))
        except BaseException as e:
            out.set_exception(e if isinstance(e, UcpdError) else UcpdError(f"{what}: {e}"))

    source.add_done_callback(done)
    return out
