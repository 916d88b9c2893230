"""Fault injection at named points, for tests: inert unless ``$UCPD_FAULT`` names a point.

``UCPD_FAULT=NAME`` (or ``NAME@STEP``) makes the process SIGKILL itself the first time the code
passes ``faults.point(NAME, step)`` (with that step). Tests set it in a daemon's environment to
crash it at an exact instant — the coordinator between recording a decision and announcing
it, say — instead of racing a kill against the code. Without the variable ``point`` is a no-op.

Named points (each crash is covered by a test in ``tests/team/``):

- ``commit.decided``         the coordinator decided a step, before telling anyone
- ``commit.record_sent_one`` the coordinator sent the decision to one node only
- ``commit.recorded``        every live node recorded the decision; nobody made it visible yet
- ``commit.visible_one``     the coordinator sent the final commit to one node only
- ``replicate.mid``          a node sent half of its part to a replica holder

And one refusal (``once``): the daemon goes on, the operation fails once.

- ``replica.refuse``         a holder refuses a replica (no room, say) while staying live
- ``parity.flip``            a group member serves a data unit or parity block with one bit flipped

And one stall (``stall``): the code waits a few seconds once, as a slow disk or network would.

- ``flush.fetch``            node 0's flush waits between pinning other nodes' parts and fetching them
"""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("UCPD_FAULT", "")
NAME, _, _STEP = _SPEC.partition("@")


_dying = False


def point(name: str, step: int | None = None, settle: float = 0.0) -> None:
    """Crash here (SIGKILL, no clean-up) if ``$UCPD_FAULT`` names this point (and step).

    ``settle``: let what was already sent leave first (a send is asynchronous, and the caller
    may be the very thread that writes the socket): the kill comes ``settle`` seconds later
    from another thread, and from now on ``dying()`` tells callers to act no more."""
    global _dying
    if not NAME or name != NAME or (_STEP and str(step) != _STEP):
        return
    if settle:
        import threading

        _dying = True
        threading.Timer(settle, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return
    os.kill(os.getpid(), signal.SIGKILL)


_fired: set[str] = set()


def once(name: str, step: int | None = None) -> bool:
    """True the first time the code passes here if ``$UCPD_FAULT`` names this point (and step):
    the caller then fails the operation as it would for a real fault, and goes on."""
    if not NAME or name != NAME or (_STEP and str(step) != _STEP) or name in _fired:
        return False
    _fired.add(name)
    return True


def stall(name: str, step: int | None = None, seconds: float = 3.0) -> None:
    """Sleep ``seconds`` the first time the code passes here if ``$UCPD_FAULT`` names it."""
    if once(name, step):
        import time

        time.sleep(seconds)


def dying() -> bool:
    """A crash point fired with a settle time: the process is as good as dead."""
    return _dying


def armed() -> bool:
    return bool(NAME)
