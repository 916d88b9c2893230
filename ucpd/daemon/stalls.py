"""Versions that wait for ranks, said out loud.

A version completes on a node when the node's *local size* ranks sealed it (one node: every
rank of the job), and commits when every node's part is complete. A rank that never snapshots
the step — it died, it hangs, it snapshots other steps — or a node told the wrong local size (a
launcher that sets none, so each rank assumed the whole world runs on its node) would leave the
version, its waiters and the trainers waiting with nothing said. This module names what is
missing, in one text that the daemon logs and the client's ``CommitTimeout`` carries:

    job 'j' step 3 has waited 12 s on node 0: it holds ranks [0] of 3 and was told a local
    size of 3 (waits for 2 more: of ranks [1-2]); the team has seen [0] on node 0, [1] on
    node 1, [2] on node 2. The local size is wrong: ...

Pure functions over versions and the team's survey (``Team.survey``, the peer request
``waiting``); callers hold the store lock. ``StallLog`` decides when to log again.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable, Mapping

if TYPE_CHECKING:  # the client imports this module for ``describe``: no daemon imports at load
    from .versions import Version


def waiting_versions(versions: Iterable["Version"]) -> list["Version"]:
    """The versions of ``versions`` that some ranks sealed here and that are not decided yet."""
    from .versions import UNDECIDED

    return [v for v in versions if v.state in UNDECIDED and v.parts]


def local_size_of(v: "Version") -> int:
    """The ranks this node waits for: what its ranks said (a team), else the world size."""
    return min(v.local_size or v.world_size, v.world_size)


def survey_item(v: "Version") -> dict:
    """What a node tells the team about a waiting version (peer ``waiting`` item)."""
    return {"job": v.job, "step": v.step, "world_size": v.world_size, "local_size": local_size_of(v),
            "ranks": sorted(v.parts)}


def ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    out: list[str] = []
    rs = sorted(set(ranks))
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(out)


LOCAL_SIZE_HOWTO = (
    "launch with torchrun (it sets LOCAL_WORLD_SIZE), srun or mpirun (ucpd reads Slurm's, Open MPI's and "
    "PMI's variables: ucpd_client.launchers), or pass Checkpointer(local_world_size=<ranks of the job on each node>)"
)


def record(v: "Version", node: int, seen: Mapping[int, dict] | None = None, now: float | None = None) -> dict:
    """The ``wait`` reply's ``waiting`` record of ``v`` (protocol ``WAITING``). ``seen``: the
    team's last survey of this step, ``{node: {"ranks", "local_size"}}`` (None: one node)."""
    world, local = v.world_size, local_size_of(v)
    sealed = sorted(v.parts)
    nodes = {int(n): {"ranks": sorted(s["ranks"]), "local_size": s["local_size"]} for n, s in (seen or {}).items()}
    nodes[node] = {"ranks": sealed, "local_size": local}
    everywhere = set().union(*(set(s["ranks"]) for s in nodes.values()))
    missing = sorted(set(range(world)) - everywhere)
    age = max(0.0, (time.time() if now is None else now) - v.created)
    rec = {"world_size": world, "local_size": local, "sealed": sealed, "node": node, "age": round(age, 1),
           "missing": missing, "advice": advice(v.step, world, nodes, missing)}
    if seen is not None:
        rec["seen"] = {n: s["ranks"] for n, s in sorted(nodes.items()) if s["ranks"]}
    return rec


def advice(step: int, world: int, nodes: Mapping[int, dict], missing: list[int]) -> str:
    """What to do about a step that waits, from what each node has seen of it."""
    with_ranks = sorted(n for n, s in nodes.items() if s["ranks"])
    told_world = [n for n in with_ranks if nodes[n]["local_size"] >= world]
    if world > 1 and len(with_ranks) > 1 and told_world:
        return (f"the local size is wrong: ranks of this job seal on nodes {with_ranks}, but node(s) {told_world} "
                f"were told a local size of {world}, the whole world size, so each waits for ranks that run on "
                f"other nodes. {LOCAL_SIZE_HOWTO}")
    if missing:
        return (f"rank(s) {ranges(missing)} have not snapshotted step {step}: a rank that died, hangs, snapshots "
                "other steps" + (", or talks to a daemon outside this team" if len(nodes) > 1 else ""))
    short = [n for n in with_ranks if len(nodes[n]["ranks"]) < nodes[n]["local_size"]]
    if short:
        return (f"every rank sealed step {step} somewhere, but node(s) {short} wait for more ranks than they hold: "
                f"the local sizes they were told do not add up to the world size {world}. {LOCAL_SIZE_HOWTO}")
    return "every node holds its ranks: the team is protecting and committing it (peers slow or unreachable?)"


def describe(job: str, step: int, rec: Mapping) -> str:
    """The one text for a waiting step: which ranks of which job, the local size assumed, the fix."""
    sealed, local, world = rec["sealed"], rec["local_size"], rec["world_size"]
    node = rec.get("node", 0)
    wants = max(0, local - len(sealed))
    here = f"holds rank(s) [{ranges(sealed)}] of {world} and was told a local size of {local}"
    if wants:
        absent = sorted(set(range(world)) - set(sealed))
        here += f" (waits for {wants} more: of ranks [{ranges(absent)}])"
    text = f"job {job!r} step {step} has waited {rec.get('age', 0):.0f} s on node {node}: it {here}"
    seen = rec.get("seen")
    if seen:
        text += "; the team has seen " + ", ".join(f"[{ranges(r)}] on node {n}" for n, r in sorted(seen.items()))
    if rec.get("missing"):
        text += f"; no node has seen rank(s) [{ranges(rec['missing'])}]"
    advice = rec.get("advice") or ""
    return f"{text}. {advice[:1].upper()}{advice[1:]}".rstrip()


class StallLog:
    """When to log a waiting version: after ``warn_after`` seconds, then every 6 times as long.
    A team's daemon may hold a due version back while the team's survey has not answered yet
    (``logged`` is what moves it on), so the log names what the other nodes hold, not only this
    node's view; ``patience`` bounds that wait."""

    def __init__(self, warn_after: float) -> None:
        self.warn_after = warn_after
        self.patience = 2 * warn_after
        self._next: dict[tuple[str, int, float], float] = {}

    def due(self, versions: list["Version"], now: float) -> list["Version"]:
        """The versions to log now (``now``: wall-clock seconds, as ``Version.created``)."""
        out, keep = [], {}
        for v in versions:
            key = (v.job, v.step, v.created)
            at = self._next.get(key, v.created + self.warn_after)
            if now >= at:
                out.append(v)
            keep[key] = at
        self._next = keep
        return out

    def logged(self, v: "Version", now: float) -> None:
        """``v`` was logged at ``now``: the next time is 6 times the warning's delay later."""
        self._next[(v.job, v.step, v.created)] = now + 6 * self.warn_after

    def may_wait(self, v: "Version", now: float) -> bool:
        """Whether a due ``v`` may still wait for the team's survey (not past ``patience``)."""
        return now < v.created + self.warn_after + self.patience
