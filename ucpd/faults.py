"""Fault injection at named points, for tests: inert unless ``$UCPD_FAULT`` names a point.

``UCPD_FAULT=NAME`` (or ``NAME@STEP``; several, comma-separated) arms points in the process
that reads it at import (a daemon, a trainer; ``arm()`` re-arms a forked child). A *crash*
point makes the process SIGKILL itself the first time the code passes ``faults.point(NAME,
step)`` (with that step): tests crash a daemon or a trainer at an exact instant — the
coordinator between recording a decision and announcing it, say — instead of racing a kill
against the code. Without the variable every function here is a no-op. ``POINTS`` lists every
point (``tests/faults/`` has a test per crash point; ``benchmarks/reliability/campaign.py``
draws them at random).

Crash points of the daemon (``ucpd serve``):

- ``slot.allocated``         a new slot's file is allocated, not yet lent or in the index
- ``snapshot.lent``          a slot is lent to a rank for a step, before the ``begin`` reply
- ``snapshot.sealed``        a rank's part is sealed (validated, slot held), before the commit rule runs
- ``commit.local``           one node: a version became committed in memory, before the index says so
- ``commit.indexed``         one node: the index lists the committed version, before any ``wait`` hears it
- ``index.tmp``              the index's temporary file is written and synced, not yet renamed
- ``flush.begin``            the flusher took a version (pinned), before reading a byte
- ``flush.write``            the flusher consolidated the first tensor into the temp folder
- ``flush.meta``             the writer wrote and synced ``ucp.json`` in the temp folder, before the rename
- ``flush.renamed``          ``step-N/`` is in place, ``LATEST`` not yet updated
- ``flush.done``             the version is on disk; the index does not say so yet
- ``restore.planned``        the daemon leased a restore and built its plan, before replying
- ``commit.decided``         team: the coordinator decided a step, before telling anyone
- ``commit.record_sent_one`` team: the coordinator sent the decision to one node only
- ``commit.recorded``        team: every live node recorded the decision; nobody made it visible yet
- ``commit.visible_one``     team: the coordinator sent the final commit to one node only
- ``replicate.mid``          team: a node sent half of its part to a replica holder
- ``replica.received``       team: a holder has every byte of a copy, before checking and keeping it
- ``parity.encode``          team: a node sent some of its units to the group's parity holders
- ``heal.push``              team: a node starts copying a part again after a loss (healing)
- ``flush.fetch.kill``       team: node 0's flush pinned other nodes' parts, before fetching them
- ``flush.share``            team: a node wrote one piece of its share of the flush, before answering the lead

Crash points of a trainer (``ucpd_client``):

- ``client.begin``           a slot was lent to this rank, nothing copied yet
- ``client.staged``          the tensors are copied into the slot, the commit not sent
- ``client.sealed``          the commit is sent and acknowledged, before ``wait``
- ``client.restore``         the restore plan and its lease arrived, nothing copied yet
- ``client.restored``        the restore copied every byte, before releasing the lease

Refusals (``once``): the daemon goes on, the operation fails once.

- ``replica.refuse``         a holder refuses a replica (no room, say) while staying live
- ``parity.flip``            a group member serves a data unit or parity block with one bit flipped

Errors (``fail``): every pass raises ``OSError`` (ENOSPC) as a full file system would.

- ``flush.enospc``           the flusher's writes into the flush dir

Stalls (``stall``): the code waits ``$UCPD_FAULT_SECONDS`` (default 3) once, as a slow or
hung disk or network would.

- ``flush.fetch``            node 0's flush waits between pinning other nodes' parts and fetching them
- ``flush.hang``             the flusher's write into the flush dir hangs (a file system that stops answering)
"""

from __future__ import annotations

import errno
import os
import signal

from . import knobs

# name -> (kind, where): kind "crash" | "once" | "fail" | "stall"; where "daemon" | "team" | "client"
POINTS: dict[str, tuple[str, str]] = {
    "slot.allocated": ("crash", "daemon"),
    "snapshot.lent": ("crash", "daemon"),
    "snapshot.sealed": ("crash", "daemon"),
    "commit.local": ("crash", "daemon"),
    "commit.indexed": ("crash", "daemon"),
    "index.tmp": ("crash", "daemon"),
    "flush.begin": ("crash", "daemon"),
    "flush.write": ("crash", "daemon"),
    "flush.meta": ("crash", "daemon"),
    "flush.renamed": ("crash", "daemon"),
    "flush.done": ("crash", "daemon"),
    "restore.planned": ("crash", "daemon"),
    "commit.decided": ("crash", "team"),
    "commit.record_sent_one": ("crash", "team"),
    "commit.recorded": ("crash", "team"),
    "commit.visible_one": ("crash", "team"),
    "replicate.mid": ("crash", "team"),
    "replica.received": ("crash", "team"),
    "parity.encode": ("crash", "team"),
    "heal.push": ("crash", "team"),
    "flush.fetch.kill": ("crash", "team"),
    "flush.share": ("crash", "team"),
    "client.begin": ("crash", "client"),
    "client.staged": ("crash", "client"),
    "client.sealed": ("crash", "client"),
    "client.restore": ("crash", "client"),
    "client.restored": ("crash", "client"),
    "replica.refuse": ("once", "team"),
    "parity.flip": ("once", "team"),
    "lane.cut.put": ("once", "team"),
    "lane.cut.get": ("once", "team"),
    "flush.enospc": ("fail", "daemon"),
    "flush.fetch": ("stall", "team"),
    "flush.hang": ("stall", "daemon"),
}

_armed: dict[str, str] = {}  # name -> step ("" = any step)
NAME = ""  # the first armed point (kept for callers that read it)
_dying = False
_fired: set[str] = set()


def arm(spec: str | None) -> None:
    """Arm the points ``spec`` names (``NAME[@STEP][,NAME[@STEP]...]``); empty disarms all."""
    global NAME
    _armed.clear()
    _fired.clear()
    for item in (spec or "").split(","):
        name, _, step = item.strip().partition("@")
        if name:
            _armed[name] = step
    NAME = next(iter(_armed), "")


arm(knobs.get("UCPD_FAULT", "") or "")


def _hit(name: str, step: int | None) -> bool:
    if not _armed or name not in _armed:
        return False
    want = _armed[name]
    return not want or str(step) == want


def point(name: str, step: int | None = None, settle: float = 0.0) -> None:
    """Crash here (SIGKILL, no clean-up) if ``$UCPD_FAULT`` names this point (and step).

    ``settle``: let what was already sent leave first (a send is asynchronous, and the caller
    may be the very thread that writes the socket): the kill comes ``settle`` seconds later
    from another thread, and from now on ``dying()`` tells callers to act no more."""
    global _dying
    if not _hit(name, step):
        return
    if settle:
        import threading

        _dying = True
        threading.Timer(settle, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return
    os.kill(os.getpid(), signal.SIGKILL)


def once(name: str, step: int | None = None) -> bool:
    """True the first time the code passes here if ``$UCPD_FAULT`` names this point (and step):
    the caller then fails the operation as it would for a real fault, and goes on."""
    if not _hit(name, step) or name in _fired:
        return False
    _fired.add(name)
    return True


def fail(name: str, step: int | None = None, code: int = errno.ENOSPC) -> None:
    """Raise ``OSError(code)`` each time the code passes here if ``$UCPD_FAULT`` names it."""
    if _hit(name, step):
        raise OSError(code, f"{os.strerror(code)} (fault injected at {name})")


def stall(name: str, step: int | None = None, seconds: float = 3.0) -> None:
    """Sleep the first time the code passes here if ``$UCPD_FAULT`` names it: ``seconds``, or
    ``$UCPD_FAULT_SECONDS`` when set (a long value plays a hung file system or peer)."""
    if once(name, step):
        import time

        time.sleep(float(knobs.get("UCPD_FAULT_SECONDS") or seconds))


def dying() -> bool:
    """A crash point fired with a settle time: the process is as good as dead."""
    return _dying


def armed() -> bool:
    return bool(_armed)
