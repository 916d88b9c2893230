"""A chaos trial: the fault it draws from the seed, what it found, and the table of a campaign's
trials (by fault kind, failures by category)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

KINDS = ("node_lost", "daemon_restart", "daemon_pause", "trainer_killed")
PARTITION = "partition"  # with partitions=True (root, ``ip netns``): a node's link taken down, then up


@dataclass
class Trial:
    index: int
    kind: str
    params: dict
    runs: list = field(default_factory=list)
    injected: bool = False
    failures: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    latest: int | None = None
    reported: int | None = None
    checked_steps: list = field(default_factory=list)
    phases: dict = field(default_factory=dict)  # seconds each part of the trial took
    seconds: float = 0.0
    restores: dict = field(default_factory=dict)  # the team's restore counters at the trial's end

    @property
    def passed(self) -> bool:
        return self.injected and not self.failures

    def as_dict(self) -> dict:
        return {**{k: v for k, v in vars(self).items()}, "passed": self.passed}


def draw(rng: random.Random, index: int, order: list[str], nodes: int, per_node: int,
         kinds: tuple[str, ...] = KINDS) -> tuple[str, dict]:
    """The trial's fault and its parameters, from ``rng`` alone, always drawn in the same order.
    Kinds come in seeded rounds of every kind (any len(kinds) trials in a row cover them all)."""
    if index % len(kinds) == 0:
        order[:] = list(kinds)
        rng.shuffle(order)
    kind = order[index % len(kinds)]
    world = nodes * per_node
    params = {
        "node": rng.randrange(nodes),
        "rank": rng.randrange(world),
        "trigger_rank": rng.randrange(world),
        "trigger": rng.choice(["begin", "committed"]),  # mid-step, or right after a step committed
        "at": rng.randint(1, 3),  # the n-th step of the run
        "delay_ms": rng.randint(0, 150),
        "replace_after_dead": rng.random() < 0.5,  # node_lost: the replacement starts after the others saw it dead
        "job_kill_delay_ms": rng.randint(0, 400),  # the rest of the job is killed this much later
    }
    return kind, params


CATEGORIES = [
    ("stitched", r"read back as run|mixes runs"),
    ("SnapshotRejected", r"SnapshotRejected"),
    ("ProtocolError", r"ProtocolError"),
    ("ChecksumMismatch", r"ChecksumMismatch"),
    ("VersionNotFound", r"VersionNotFound"),
    ("latest backwards", r"saw step \d+ committed"),
    ("parity rebuild", r"rs_decode|parity unit|rebuild"),
    ("wrong values", r"decode to no|holds step|zeros|never snapshotted|plain values"),
    ("status degraded", r"status"),
    ("ranks disagree", r"disagree"),
    ("did not commit", r"did not commit|Timeout|timed out"),
]


def category(msg: str) -> str:
    for name, pat in CATEGORIES:
        if re.search(pat, msg):
            return name
    return "other"



def table(trials: list[Trial]) -> tuple[str, dict]:
    per: dict[str, dict] = {}
    for t in trials:
        row = per.setdefault(t.kind, {"trials": 0, "injected": 0, "passed": 0, "failed": 0, "failures": {}})
        row["trials"] += 1
        row["injected"] += int(t.injected)
        row["passed"] += int(t.passed)
        row["failed"] += int(t.injected and not t.passed)
        for m in t.failures:
            c = row["failures"].setdefault(category(m), {"count": 0, "example": m})
            c["count"] += 1
    lines = [f"{'fault':16s} {'trials':>6s} {'injected':>9s} {'passed':>7s} {'failed':>7s}"]
    for k in KINDS + (PARTITION,):
        if k in per:
            r = per[k]
            lines.append(f"{k:16s} {r['trials']:6d} {r['injected']:9d} {r['passed']:7d} {r['failed']:7d}")
    tot = {c: sum(r[c] for r in per.values()) for c in ("trials", "injected", "passed", "failed")}
    lines.append(f"{'total':16s} {tot['trials']:6d} {tot['injected']:9d} {tot['passed']:7d} {tot['failed']:7d}")
    fails = [(k, c, v) for k, r in per.items() for c, v in r["failures"].items()]
    if fails:
        lines.append("failing checks (fault / check: count, an example):")
        for k, c, v in sorted(fails):
            lines.append(f"  {k} / {c}: {v['count']}  e.g. {v['example'][:300]}")
    return "\n".join(lines), per
