"""A new run of the job joining the team: it waits until every live node fenced the earlier runs
(their undecided parts never commit) and the steps decided before are visible here
(docs/PROTOCOL.md, "Runs of the job"). The protocol (``commit.CommitNode``) decides; this is the
wait, with the errors a run that cannot join gets."""

from __future__ import annotations

import time
from typing import Callable

from ..errors import SnapshotRejected


def wait_admitted(run: str, timeout: float, lock, commit_of: Callable, apply: Callable, clock: Callable,
                  live: Callable) -> None:
    """Block until ``run`` may read ``latest()`` and snapshot. ``lock``: the protocol's lock;
    ``commit_of()``: the ``CommitNode``; ``apply(outputs)`` carries its outputs out; ``clock()``
    its time; ``live()`` the live nodes. Raises SnapshotRejected for a run a later one
    superseded, or when the team cannot fence it in ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with lock:
        out = commit_of().on_run(run, clock())  # asks once: the protocol's ticks ask again
    apply(out)
    while True:
        with lock:
            commit = commit_of()
            ready = commit.run_ready(run)
        if ready:
            return
        if ready is None:
            raise SnapshotRejected(
                f"run {run!r} of this job was superseded by a later run ({commit.run!r}) that the team "
                "fenced: a restarted job's processes replace the old ones; stop this process"
            )
        if time.monotonic() > deadline:
            raise SnapshotRejected(
                f"the team did not admit run {run!r} in {timeout:.0f} s (coordinator: node "
                f"{commit.coordinator}, live: {sorted(live())}): check that every daemon of the team "
                "is up and reachable, then retry"
            )
        time.sleep(0.001)  # (a fence is a round trip: a restarting rank waits on it before its first byte)
