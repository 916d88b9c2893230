"""A synchronous request/reply connection to a node daemon (used by the client and the CLI).

One ZeroMQ DEALER per connection; a connection is used by one thread at a time (the client
keeps one per thread). Replies are matched by request id, so a late reply to a request that
timed out is skipped rather than mistaken for the next one. Every reply is checked against its
request type's reply schema (``ucpd.protocol``): a malformed one is a ProtocolError naming the
type and the field, never a KeyError later.
"""

from __future__ import annotations

import itertools
import os
import time

import zmq

from . import protocol
from .errors import DaemonUnreachable

SOCKET_NAME = "ucpd.sock"


class Connection:
    def __init__(self, run_dir: str, timeout: float = 60.0):
        self.run_dir = run_dir
        self.timeout = timeout
        self.address = f"ipc://{os.path.join(run_dir, SOCKET_NAME)}"
        if not os.path.exists(os.path.join(run_dir, SOCKET_NAME)):
            raise DaemonUnreachable(
                f"no ucpd daemon at {run_dir} (no socket); start one with `ucpd serve --run-dir {run_dir}` "
                "or set UCPD_RUN_DIR to where yours runs"
            )
        self._ids = itertools.count(1)
        self._connect()

    def _connect(self) -> None:
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # no ZMQ_IMMEDIATE: with it, a reply still unread when the daemon closes the connection
        # (the shutdown reply) is dropped; a request to a daemon that is gone times out instead
        self._sock.connect(self.address)

    def _reconnect(self) -> None:
        self._sock.close(linger=0)
        self._connect()

    def call(self, msg_type: str, timeout: float | None = None, **body) -> dict:
        """Send one request and return its reply body as ``protocol.validate_reply`` decodes it
        (missing optional fields None; a restore's plan a ``RestorePlan`` under ``plan``); raises
        the typed error the daemon sent, ProtocolError for a malformed reply, or DaemonUnreachable
        when no reply comes within the timeout."""
        req_id = next(self._ids)
        frame = protocol.request(msg_type, req_id, **body)
        self._sock.setsockopt(zmq.SNDTIMEO, int(1000 * (self.timeout if timeout is None else timeout)))
        try:
            self._sock.send(frame)
        except zmq.Again:  # the send queue stayed full for the whole timeout: the daemon is not reading
            self._reconnect()
            raise DaemonUnreachable(
                f"cannot reach the daemon at {self.run_dir}; check `ucpd status --run-dir {self.run_dir}`"
            ) from None
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000) + 1):
                self._reconnect()  # drop the queued request: a restarted daemon must not replay it
                raise DaemonUnreachable(
                    f"the daemon at {self.run_dir} did not answer {msg_type!r} within "
                    f"{self.timeout if timeout is None else timeout:.0f} s; check `ucpd status --run-dir {self.run_dir}`"
                )
            rid, reply, err = protocol.decode_reply(self._sock.recv(), msg_type, req_id)
            if rid != req_id:
                continue  # a late reply to an earlier request (unchecked: it answers another type)
            if err is not None:
                raise err
            return reply

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
