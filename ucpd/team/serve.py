"""The peer request server: what this node answers the other daemons of its team.

Every message is checked against its schema (``protocol.validate_peer``: the table in
``protocol/peer.py`` says what each type carries and whether it is one-way) and handed to the
handler the part that answers it registered (``register``) when it was built: the driver its
one-way ``commit``, ``gossip`` and ``hello``; ``serve_held.HeldServer`` the copies held and read
here (``replica_*``, ``pin``/``unpin``, ``fetch``, ``holdings``, ``waiting``); the directory,
the piece index, the flush share writer and the parity group theirs. A part this node does not
keep has its types refused with a reason (``refuse``: started without ``--parity``, ...).

A handler is called ``handler(src, body, frames)``. One-way messages return nothing; requests
return ``(reply body, payload frames)``, or a future whose result is that (a part that copies
or writes runs it on threads of its own, so that the transport's I/O thread goes on receiving).

Threads: the transport's I/O thread calls ``on_message`` and ``on_request``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from .. import protocol
from ..errors import UcpdError
from .counters import ServeCounters

log = logging.getLogger("ucpd.team")

Handler = Callable[[int, dict, list], Any]


class PeerServer:
    """Answers the peers with the handlers registered. ``rank``: this node's (for the errors);
    ``counters``: where bad messages are counted."""

    def __init__(self, rank: int, counters: ServeCounters) -> None:
        self.rank = rank
        self.counters = counters
        self.handlers: dict[str, Handler] = {}

    def register(self, msg_type: str, handler: Handler) -> None:
        """``handler`` answers ``msg_type`` (a type of ``protocol.PEER_REQUESTS``), once."""
        if msg_type not in protocol.PEER_REQUESTS:
            raise ValueError(f"{msg_type!r} is not a peer message type (protocol.PEER_REQUESTS)")
        if msg_type in self.handlers:
            raise ValueError(f"peer message {msg_type!r} already has a handler")
        self.handlers[msg_type] = handler

    def refuse(self, msg_types: Iterable[str], why: str) -> None:
        """Requests of ``msg_types`` are answered with a ProtocolError saying ``why`` (a part
        this node does not keep)."""
        def refused(src: int, body: dict, frames: list):
            raise protocol.ProtocolError(why)

        for t in msg_types:
            self.register(t, refused)

    def on_message(self, src: int, msg_type: str, body: dict, frames: list) -> None:
        """A one-way message; a bad one is counted and logged (there is no one to answer)."""
        try:
            b = protocol.validate_peer(msg_type, body)
            if _one_way(msg_type):
                self._handler(msg_type)(src, b, frames)
        except UcpdError as exc:
            self.counters.peer_bad_messages += 1
            log.warning("team: bad %s message from node %d: %s", msg_type, src, exc)

    def on_request(self, src: int, msg_type: str, body: dict, frames: list):
        """A request: its reply ``(body, frames)``, or a future of it. Raises a typed error the
        transport sends back."""
        try:
            b = protocol.validate_peer(msg_type, body)
        except UcpdError:
            self.counters.peer_bad_messages += 1
            raise
        if _one_way(msg_type):
            raise protocol.ProtocolError(f"peer message {msg_type!r} is not a request")
        return self._handler(msg_type)(src, b, frames)

    def _handler(self, msg_type: str) -> Handler:
        h = self.handlers.get(msg_type)
        if h is None:
            raise protocol.ProtocolError(f"node {self.rank} does not answer {msg_type!r} (no part of it registered one)")
        return h


def _one_way(msg_type: str) -> bool:
    return protocol.PEER_REQUESTS[msg_type].reply is None
