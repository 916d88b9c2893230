"""A reply that comes after its request was failed (the peer declared dead: ``fail_pending``) is
a late reply, counted as one, not an error on the I/O thread (the team soak logged
``InvalidStateError`` tracebacks from nodes that flapped under load)."""

from __future__ import annotations

import threading

from ucpd.errors import DaemonUnreachable

from helpers.waiting import wait_until

from .test_transport import team


def test_a_reply_to_a_request_failed_meanwhile_is_counted_late_not_an_error(caplog):
    release = threading.Event()
    asked = threading.Event()

    def handler(src, msg_type, body, frames):
        from concurrent.futures import Future

        f = Future()
        asked.set()
        threading.Thread(target=lambda: (release.wait(5), f.set_result(({"late": True}, [])))).start()
        return f

    with team(2, handler=handler) as (a, b):
        got: list = []
        waiter = threading.Thread(target=lambda: got.append(_request(a)))
        waiter.start()
        wait_until(asked.is_set)
        assert a.t.fail_pending(1, "was declared dead") == 1
        waiter.join(5)
        assert isinstance(got[0], DaemonUnreachable)
        release.set()  # node 1 answers now
        wait_until(lambda: a.t.counters["late_replies"] >= 1, "the reply counted late")
        assert a.t.counters["callback_errors"] == 0
        assert "InvalidStateError" not in caplog.text


def _request(node):
    try:
        return node.t.request(1, "slow", {})
    except DaemonUnreachable as exc:
        return exc
