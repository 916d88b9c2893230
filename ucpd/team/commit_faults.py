"""The commit protocol's test-only crash points, where the driver carries out its outputs
(``ucpd.faults``: inert unless a test armed one): ``commit.decided`` and ``commit.recorded`` on
the coordinator before it carries out a decision or a commit, ``commit.record_sent_one`` and
``commit.visible_one`` once the first node was sent the decision or the commit."""

from __future__ import annotations

from .. import faults
from .commit import Commit, Decided


def before_apply(outputs: list, coordinator: bool) -> None:
    """The coordinator's points for ``outputs``, before any is carried out."""
    if not faults.armed() or not coordinator:
        return
    for out in outputs:
        if isinstance(out, Decided):
            faults.point("commit.decided", out.step)
        if isinstance(out, Commit):
            faults.point("commit.recorded", out.step)


def after_send(msg: dict, sent: set) -> None:
    """A commit message ``msg`` went to one node: the point of its kind, the first time in a batch
    (``sent``: the kinds already sent)."""
    kind = msg.get("t")
    if faults.armed() and kind in ("record", "commit") and kind not in sent:
        sent.add(kind)
        faults.point("commit.record_sent_one" if kind == "record" else "commit.visible_one", msg.get("step"), settle=0.3)
