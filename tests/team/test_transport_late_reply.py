"""A reply that comes after its request was failed (the peer declared dead: ``fail_pending``) but
before the requester took it off the pending table is a late reply, counted as one, not an error
on the I/O thread (the team soak logged ``InvalidStateError`` tracebacks from nodes that flapped
under load)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from ucpd.errors import DaemonUnreachable

from helpers.waiting import wait_until

from .test_transport import team


class HeldPops(dict):
    """The pending table, whose ``pop`` on the requesting thread waits for ``go``: the reply
    reaches the I/O thread in that window."""

    def __init__(self, items, go: threading.Event):
        super().__init__(items)
        self.go = go

    def pop(self, key, default=None):
        if threading.current_thread().name == "requester":
            self.go.wait(10)
        return super().pop(key, default)


def test_a_reply_to_a_request_failed_meanwhile_is_counted_late_not_an_error(caplog):
    release, asked, go = threading.Event(), threading.Event(), threading.Event()

    def handler(src, msg_type, body, frames):
        f = Future()
        asked.set()
        threading.Thread(target=lambda: (release.wait(10), f.set_result(({"late": True}, [])))).start()
        return f

    with team(2, handler=handler) as (a, b):
        a.t._pending = HeldPops(a.t._pending, go)
        got: list = []
        waiter = threading.Thread(target=lambda: got.append(_request(a)), name="requester")
        waiter.start()
        wait_until(asked.is_set)
        assert a.t.fail_pending(1, "was declared dead") == 1
        release.set()  # node 1 answers while the requester has not yet taken its entry off
        wait_until(lambda: a.t.counters["late_replies"] + a.t.counters["callback_errors"] >= 1, "the reply handled")
        go.set()
        waiter.join(10)
        assert isinstance(got[0], DaemonUnreachable)
        assert a.t.counters["callback_errors"] == 0 and a.t.counters["late_replies"] == 1
        assert "InvalidStateError" not in caplog.text


def _request(node):
    try:
        return node.t.request(1, "slow", {})
    except DaemonUnreachable as exc:
        return exc
