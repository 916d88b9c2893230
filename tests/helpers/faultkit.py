"""Crash trials at the named points of ``ucpd.faults``: real daemons, real trainer processes,
real shm, then the checks every crash must pass. Used by ``tests/faults/`` (one trial per
point, a short seeded campaign) and by ``benchmarks/reliability/campaign.py`` (a long one).

One node (``node_trial``): a ``ucpd serve`` process and ``world`` trainer ranks (processes
forked from a forkserver that imported torch once), each snapshotting steps and appending every
step whose ``wait()`` returned to a journal. The point is armed in the daemon, or in one rank
(``victim``); once it fired (SIGKILL), the rest of the job is killed too, the daemon is started
again when it died, and the checks run:

1. *never backwards*: ``latest()`` >= every step a rank ever saw committed;
2. *bit for bit*: every rank restores ``latest()`` into empty tensors, equal to what it saved;
3. *flush dir*: no torn ``step-N/``; every complete one validates; no ``.tmp``/``.del`` folder is
   left once the flusher is idle (a killed flusher's too, without ``--flush-keep``); ``LATEST``
   names a complete version;
4. *leaks*: every ``slot-*`` file in the shm dir is a slot the daemon knows, every held slot
   belongs to a listed version, no index temp file or ``fetch-*`` file is left;
5. *goes on*: a new run of the job snapshots two more steps, commits and restores them, and over
   further rounds of snapshots and restores the daemon's fds and threads do not grow.

A team (``team_trial``): three or four daemons on loopback, one rank on each
(``--replicas 1``, or ``--parity 2`` for the parity point), the point armed in one node; the
node that crashed is lost (its RAM deleted); the survivors must agree on ``latest()``, never
below what a rank saw committed, and restore it bit for bit.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import shutil
import signal
import time
import uuid
from dataclasses import dataclass, field

import psutil

from .daemon_team import DaemonTeam
from .daemons import Daemon
from .waiting import eventually

JOB = "test"
ROWS, COLS = 48, 96  # each rank's shard of "w" (float32); "m" is 2x that; "b" replicated bf16


# --- the job's state -------------------------------------------------------------------------------

def state_of(step: int, rank: int, world: int):
    """(state, placements) of ``rank`` at ``step``: two sharded tensors, a replicated one, values."""
    import torch
    from ucpd_client import placement as P

    g = torch.Generator().manual_seed(1000 * step + 7)
    w = torch.randn(world * ROWS, COLS, generator=g)
    m = torch.rand(world * ROWS * 2, COLS, generator=g, dtype=torch.float64)
    b = torch.randn(COLS, generator=g).to(torch.bfloat16)
    state = {
        "w": w.chunk(world, 0)[rank].clone(),
        "m": m.chunk(world, 0)[rank].clone(),
        "b": b,
        "step": step,
        "loader": {"rank": rank, "pos": step * 10 + rank},
    }
    return state, {"w": P.Shard(0, rank, world), "m": P.Shard(0, rank, world)}


def differs(got: dict, want: dict) -> list[str]:
    import torch

    bad = []
    for k in ("w", "m", "b"):
        a, b = got[k], want[k]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            bad.append(k)
    for k in ("step", "loader"):
        if got[k] != want[k]:
            bad.append(f"{k}={got[k]!r}")
    return bad


def empty_like(state: dict) -> dict:
    import torch

    def blank(v):
        if isinstance(v, torch.Tensor):
            return torch.full_like(v, 0)
        return {k: blank(x) for k, x in v.items()} if isinstance(v, dict) else None

    return blank(state)


# --- trainer processes -----------------------------------------------------------------------------

def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "ucpd_client", "helpers.faultkit"])
    return ctx


def trainer(rank: int, world: int, run_dir: str, steps: list[int], journal: str, env: dict, restore_first: bool,
            local_world: int | None = None):
    """A rank: (restore the newest step first,) snapshot ``steps``, journal each committed one."""
    os.environ.update(env)
    from ucpd import faults

    faults.arm(env.get("UCPD_FAULT", ""))
    from ucpd_client import Checkpointer

    def note(line: str) -> None:
        with open(journal, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    try:
        ckpt = Checkpointer(run_dir, rank=rank, world_size=world, embedded=False, job=JOB,
                            job_id=env.get("UCPD_JOB_ID"), local_world_size=local_world)
        if restore_first:
            latest = ckpt.latest()
            if latest is not None:
                want, pl = state_of(latest, rank, world)
                got = empty_like(want)
                ckpt.restore(got, placements=pl)
                bad = differs(got, want)
                note(f"restored {latest} {'ok' if not bad else 'BAD ' + ','.join(bad)}")
        for step in steps:
            state, pl = state_of(step, rank, world)
            ckpt.snapshot(step, state, placements=pl).wait(timeout=float(env.get("FAULTKIT_WAIT", "20")))
            note(f"committed {step}")
            if env.get("FAULTKIT_FLUSH_EACH"):
                _until_flush_began(ckpt, step)
        note("done")
    except Exception as exc:  # the daemon died, or the step can no longer commit
        note(f"error {type(exc).__name__}: {str(exc)[:200]}")


def _until_flush_began(ckpt, step: int, timeout: float = 60.0) -> None:
    """Until this node's daemon began (or finished) flushing ``step``: a flush point of step N is
    reached however slow the machine, since step N+1's commit would otherwise replace step N in
    the flush queue (one version per job waits). A node that does not flush returns at once."""

    def began() -> bool:
        f = ckpt.status().get("flush")
        return not f or f["current_step"] == step or (f["last_flushed"] or 0) >= step or bool(f["last_error"])

    eventually(began, timeout, poll=0.02)


def start_trainers(run_dirs: list[str], world: int, steps: list[int], workdir: str, env: dict,
                   victim: int | None = None, fault: str | None = None, restore_first: bool = False,
                   local_world: int | None = None) -> list:
    ctx = _context()
    procs = []
    for r in range(world):
        e = dict(env)
        if r == victim and fault:
            e["UCPD_FAULT"] = fault
        p = ctx.Process(target=trainer, args=(r, world, run_dirs[r % len(run_dirs)], steps,
                                               os.path.join(workdir, f"journal-{r}"), e, restore_first, local_world),
                        daemon=True)
        p.start()
        procs.append(p)
    return procs


def journals(workdir: str) -> dict[int, list[str]]:
    out = {}
    for path in glob.glob(os.path.join(workdir, "journal-*")):
        with open(path) as f:
            out[int(path.rsplit("-", 1)[1])] = [line.strip() for line in f if line.strip()]
    return out


def reported_committed(workdir: str) -> int | None:
    """The newest step any rank ever saw committed (journals of every run so far)."""
    steps = [int(line.split()[1]) for lines in journals(workdir).values() for line in lines if line.startswith("committed ")]
    return max(steps, default=None)


def join(procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))


def kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)


# --- checks ----------------------------------------------------------------------------------------

class CheckFailed(AssertionError):
    pass


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise CheckFailed(what)


def restore_check(run_dirs: list[str], world: int, step: int, job_id: str) -> None:
    """Every rank restores ``step`` (here, in this process) bit for bit."""
    from ucpd_client import Checkpointer

    for r in range(world):
        want, pl = state_of(step, r, world)
        got = empty_like(want)
        with Checkpointer(run_dirs[r % len(run_dirs)], rank=r, world_size=world, embedded=False, job=JOB, job_id=job_id,
                          local_world_size=1 if len(run_dirs) > 1 else None) as ckpt:
            _require(ckpt.latest() == step, f"rank {r}: latest() is {ckpt.latest()}, expected {step}")
            got_step = ckpt.restore(got, placements=pl)
        _require(got_step == step, f"rank {r} restored step {got_step}, not {step}")
        bad = differs(got, want)
        _require(not bad, f"rank {r}: step {step} restored with different {bad}")


def wait_flush_idle(d: Daemon, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = d.status()
        f = st.get("flush")
        if f is None or f["current_step"] is None and all(v["on_disk"] for v in st["versions"] if v["state"] == "committed"
                                                          and v["step"] == st["latest_committed"]):
            return st
        _require(time.monotonic() < deadline, f"the flusher is still busy after {timeout} s: {f}")
        time.sleep(0.1)


def check_flush_dir(root: str, newest_committed: int | None) -> list[int]:
    """No torn version, every complete one valid, no temp folders, LATEST complete. Returns the steps."""
    from ucpd.format import list_versions, read_latest, validate

    if not os.path.isdir(root):
        return []
    versions = list_versions(root)
    torn = [v.step for v in versions if v.state == "torn"]
    _require(not torn, f"torn versions in the flush dir: {torn}")
    leftovers = [n for n in os.listdir(root) if n.startswith(".step-")]
    _require(not leftovers, f"temporary folders left in the flush dir: {leftovers}")
    steps = sorted(v.step for v in versions if v.state == "complete")
    for s in steps:
        problems = validate(root, s, full=True)
        _require(not problems, f"flushed step {s} does not validate: {problems[:3]}")
    latest = read_latest(root)
    if steps:
        _require(latest in steps, f"LATEST names {latest}, complete versions are {steps}")
    if newest_committed is not None and steps:
        _require(max(steps) <= newest_committed, f"flushed step {max(steps)} is newer than the newest committed {newest_committed}")
    return steps


def check_shm(d: Daemon, st: dict) -> None:
    """Every slot file is a slot the daemon knows, every held slot a version's, no temp file left.

    A daemon that is making a spare slot right now (the background warm-up) has a file it counts
    a moment later: the check is taken again from a fresh status until it holds (a leak stays),
    and fails with what it saw last."""
    seen: list[str] = []

    def consistent(st: dict) -> bool:
        names = set(os.listdir(d.shm_dir))
        slot_files = {n for n in names if n.startswith("slot-")}
        known = sum(st["slots"].values())
        held = sum(len(v["ranks"]) for v in st["versions"])
        stray = [n for n in names if n.startswith(("index.msgpack.tmp", "fetch-", "replica-"))]
        seen[:] = [f"{len(slot_files)} slot files in the shm dir, the daemon knows {known} slots: {sorted(slot_files)}"
                   if len(slot_files) != known else "",
                   f"{st['slots']['held']} held slots, versions hold {held}" if st["slots"]["held"] != held else "",
                   f"files left in the shm dir: {stray}" if stray else ""]
        return not any(seen)

    if consistent(st) or eventually(lambda: consistent(d.status()), 15, poll=0.1):
        return
    _require(False, "; ".join(x for x in seen if x))


def fds_threads(pid: int, shm_dir: str) -> tuple[int, int]:
    """The daemon's open fds other than its slot mappings (one each, bounded by the slots), and threads."""
    p = psutil.Process(pid)
    slots = sum(1 for f in os.listdir(shm_dir) if f.startswith("slot-"))
    return p.num_fds() - slots, p.num_threads()


# --- one node ---------------------------------------------------------------------------------------

@dataclass
class Trial:
    point: str
    where: str  # "daemon" | "client" | "team"
    step: int
    world: int
    victim: int | None
    seed: int
    fired: bool = False
    survived: bool = False
    latest: int | None = None
    reported: int | None = None
    seconds: float = 0.0
    error: str | None = None
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items()}


NO_STEP = {"slot.allocated"}  # points that know no step
DAEMON_ARGS = ["--mem-limit", "256M", "--keep", "2", "--flush-every", "1", "--log-level", "DEBUG"]


def node_trial(point: str, step: int, workdir: str, shm_prefix: str, world: int = 2, victim: int = 1,
               seed: int = 0, steps: int = 4) -> Trial:
    """One crash at ``point`` of ``step`` on one node, then every check (raises CheckFailed)."""
    from ucpd import faults

    kind, where = faults.POINTS[point]
    t = Trial(point, where, step, world, victim if where == "client" else None, seed)
    t0 = time.monotonic()
    os.makedirs(workdir, exist_ok=True)
    shm = f"{shm_prefix}-{uuid.uuid4().hex[:8]}"
    d = Daemon(os.path.join(workdir, "run"), shm, DAEMON_ARGS, os.path.join(workdir, "flush"))
    env = {"UCPD_RPC_TIMEOUT": "8", "UCPD_JOB_ID": "run-1", "FAULTKIT_WAIT": "15"}
    procs = []
    try:
        spec = point if point in NO_STEP else f"{point}@{step}"
        restore_point = point in ("client.restore", "client.restored", "restore.planned")
        if restore_point:  # a first run commits steps; the crash comes while a second run restores
            d.start()
            procs = start_trainers([d.run_dir], world, list(range(1, step + 1)), workdir, env)
            join(procs, 60)
            env["UCPD_JOB_ID"] = "run-2"
            if point == "restore.planned":
                d.stop()
                d.start(fault=spec)
            procs = start_trainers([d.run_dir], world, [step + 1], workdir, env, victim=victim,
                                   fault=spec if where == "client" else None, restore_first=True)
        else:
            if point.startswith(("flush.", "index.")):
                env["FAULTKIT_FLUSH_EACH"] = "1"
            d.start(fault=spec if where == "daemon" else None)
            procs = start_trainers([d.run_dir], world, list(range(1, steps + 1)), workdir, env,
                                   victim=victim, fault=spec if where == "client" else None)
        deadline, ended = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            if where == "client" and procs[victim].exitcode is not None:
                break
            if where == "daemon" and not d.alive():
                break
            if all(p.exitcode is not None for p in procs):
                ended = ended or time.monotonic()
                if time.monotonic() > ended + 2.0:  # a flush may still be on its way
                    break
            time.sleep(0.05)
        t.fired = (procs[victim].exitcode == -signal.SIGKILL) if where == "client" else d.killed()
        kill(procs)  # the rest of the job goes down with it
        procs = []
        if not t.fired:
            t.error = "point not reached"
            return t
        t.reported = reported_committed(workdir)
        # a trainer's crash leaves the daemon up; a daemon's crash is followed by a restart
        if not d.alive():
            d.start()
        env["UCPD_JOB_ID"] = "run-3"
        env.pop("FAULTKIT_FLUSH_EACH", None)
        st = wait_flush_idle(d)
        t.latest = st["latest_committed"]
        if t.latest is None:  # all in RAM was lost? then the flush dir must answer
            from ucpd_client import Checkpointer

            with Checkpointer(d.run_dir, rank=0, world_size=world, embedded=False, job=JOB, job_id="probe") as c:
                t.latest = c.latest()
        bad_restores = [line for lines in journals(workdir).values() for line in lines if "BAD" in line]
        _require(not bad_restores, f"a restore during the run differed: {bad_restores}")
        _require(t.reported is None or (t.latest is not None and t.latest >= t.reported),
                 f"a rank saw step {t.reported} committed, the daemon now says latest {t.latest}")
        if t.latest is not None:
            restore_check([d.run_dir], world, t.latest, "run-3")
        check_flush_dir(os.path.join(d.flush_dir, JOB), t.latest)
        check_shm(d, st)
        # the job goes on: two more steps commit and restore, and the daemon does not leak
        nxt = (t.latest or 0) + 1
        procs = start_trainers([d.run_dir], world, [nxt, nxt + 1], workdir, env)
        join(procs, 60)
        done = [lines[-1] if lines else "" for _, lines in sorted(journals(workdir).items())]
        _require(all(line == "done" for line in done), f"the next run did not commit: {done}")
        procs = []
        restore_check([d.run_dir], world, nxt + 1, "run-3")
        st = wait_flush_idle(d)
        check_flush_dir(os.path.join(d.flush_dir, JOB), nxt + 1)
        check_shm(d, st)
        before = fds_threads(d.proc.pid, d.shm_dir)
        for k in range(2, 5):
            procs = start_trainers([d.run_dir], world, [nxt + k], workdir, env)
            join(procs, 60)
            procs = []
            restore_check([d.run_dir], world, nxt + k, "run-3")
        wait_flush_idle(d)
        # a leak stays; a connection or flush file the daemon is still closing goes (under load,
        # it can take a while): wait for the counts to come back within bounds, then judge
        grown: list[tuple[int, int]] = []

        def settled() -> bool:
            grown[:] = [fds_threads(d.proc.pid, d.shm_dir)]
            return grown[0][0] <= before[0] + 4 and grown[0][1] <= before[1] + 2

        if not eventually(settled, 15, poll=0.1):
            _require(False, f"the daemon's fds (less slot mappings) / threads grew from {before} to {grown[0]} over three rounds")
        t.survived = True
        return t
    except Exception as exc:  # a check failed, or the daemon answered with an error
        t.error = str(exc) if isinstance(exc, CheckFailed) else f"{type(exc).__name__}: {exc}"
        t.notes.append(d.read_log()[-3000:])
        return t
    finally:
        kill(procs)
        d.stop()
        shutil.rmtree(shm, ignore_errors=True)
        t.seconds = round(time.monotonic() - t0, 2)


# --- a team of daemons -------------------------------------------------------------------------------

# point -> (nodes, extra serve args, victim node, node lost before the step (to make healing run))
TEAM_SETUPS = {
    "commit.decided": (3, ["--replicas", "1"], 0, None),
    "commit.record_sent_one": (3, ["--replicas", "1"], 0, None),
    "commit.recorded": (3, ["--replicas", "1"], 0, None),
    "commit.visible_one": (3, ["--replicas", "1"], 0, None),
    "replicate.mid": (3, ["--replicas", "1"], 1, None),
    "replica.received": (3, ["--replicas", "1"], 2, None),
    "parity.encode": (3, ["--parity", "2"], 1, None),
    "heal.push": (4, ["--replicas", "2"], 1, 3),
    "flush.fetch.kill": (3, ["--replicas", "1", "--flush-every", "1"], 0, None),
    "flush.share": (3, ["--replicas", "1", "--flush-every", "1"], 1, None),  # a writer lost mid-flush
}
# point -> the step the survivors must agree on after a crash there in step 2: the decision
# survives the coordinator exactly when some survivor recorded it (the rule is proven on the
# state machine in tests/team/test_commit_protocol.py; this is the same on real daemons)
TEAM_LATEST = {
    "commit.decided": 1,  # nobody heard of the decision
    "commit.record_sent_one": 2,  # node 1 recorded it and, coordinating next, adopts it
    "commit.recorded": 2,
    "commit.visible_one": 2,
    "replicate.mid": 1,  # the victim's part of step 2 never became protected
}


def team_trial(point: str, step: int, workdir: str, shm_prefix: str, seed: int = 0, steps: int = 3) -> Trial:
    """A crash at ``point`` of ``step`` in one node of a team, then the survivors' checks."""
    n, extra, victim, lose_first = TEAM_SETUPS[point]
    t = Trial(point, "team", step, n, victim, seed)
    t0 = time.monotonic()
    team = DaemonTeam(workdir, f"{shm_prefix}-{uuid.uuid4().hex[:6]}", n, ["--keep", "2", "--log-level", "DEBUG", *extra],
                      mem_limit="256M", flush_dir=os.path.join(workdir, "flush") if point.startswith("flush") else None,
                      flush_nodes={0})
    nodes = team.nodes
    env = {"UCPD_RPC_TIMEOUT": "10", "UCPD_JOB_ID": "run-1", "FAULTKIT_WAIT": "20"}
    procs = []
    run_dirs = [d.run_dir for d in nodes]  # one rank on each node
    try:
        spec = f"{point}@{step}"
        if point.startswith("flush"):
            env["FAULTKIT_FLUSH_EACH"] = "1"
        for i in range(n):
            team.start(i, fault=spec if i == victim else None)
        if lose_first is not None:  # the step before commits on every node, then a node is lost: healing
            procs = start_trainers(run_dirs, n, list(range(1, step + 1)), workdir, env, local_world=1)
            join(procs, 60)
            team.lose(lose_first)
            procs = []
        else:
            procs = start_trainers(run_dirs, n, list(range(1, steps + 1)), workdir, env, local_world=1)
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and nodes[victim].alive():
            if procs and all(p.exitcode is not None for p in procs) and time.monotonic() > deadline - 30:
                break
            time.sleep(0.05)
        t.fired = nodes[victim].killed()
        kill(procs)
        procs = []
        if not t.fired:
            t.error = "point not reached"
            return t
        t.reported = reported_committed(workdir)
        shutil.rmtree(nodes[victim].shm_dir, ignore_errors=True)  # the node is lost, its RAM too
        lost = {victim} | ({lose_first} if lose_first is not None else set())
        survivors = [i for i in range(n) if i not in lost]
        for i in survivors:
            _require(eventually(lambda i=i: not any(x["live"] for x in nodes[i].status()["team"]["nodes"] if x["node"] in lost),
                                20, poll=0.1), f"timed out waiting for node {i} to see nodes {sorted(lost)} dead")
        seen: list = []

        def agreed() -> bool:
            seen[:] = [nodes[i].status()["team"]["team_latest"] for i in survivors]
            return len(set(seen)) == 1

        _require(eventually(agreed, 15, poll=0.1), f"timed out waiting for the survivors to agree on the latest step ({seen})")
        from ucpd_client import Checkpointer

        with Checkpointer(nodes[survivors[0]].run_dir, rank=0, world_size=n, embedded=False, job=JOB,
                          job_id="probe", local_world_size=1) as c:
            t.latest = c.latest()
        _require(t.reported is None or (t.latest is not None and t.latest >= t.reported),
                 f"a rank saw step {t.reported} committed, the survivors say latest {t.latest} (team_latest {seen})")
        if step == 2 and point in TEAM_LATEST:
            _require(t.latest == TEAM_LATEST[point],
                     f"the survivors say latest {t.latest} after a crash at {point}, not {TEAM_LATEST[point]}")
        if t.latest is not None:
            restore_check([nodes[i].run_dir for i in survivors], n, t.latest, "run-2")
        if nodes[0].flush_dir and 0 in survivors:
            wait_flush_idle(nodes[0])  # a writer's unfinished pieces are being written by the others
            check_flush_dir(os.path.join(nodes[0].flush_dir, JOB), t.latest)
        elif nodes[0].flush_dir:
            root = os.path.join(nodes[0].flush_dir, JOB)
            from ucpd.format import list_versions

            torn = [v.step for v in list_versions(root) if v.state == "torn"] if os.path.isdir(root) else []
            _require(not torn, f"torn versions in the flush dir: {torn}")
        for i in survivors:
            left = [f for f in os.listdir(nodes[i].shm_dir) if f.startswith(("fetch-", "index.msgpack.tmp"))]
            _require(not left, f"node {i} left {left} in its shm dir")
        t.survived = True
        return t
    except Exception as exc:  # a check failed, or a daemon answered with an error
        t.error = str(exc) if isinstance(exc, CheckFailed) else f"{type(exc).__name__}: {exc}"
        t.notes.append(team.logs(1500))
        return t
    finally:
        kill(procs)
        team.stop()
        t.seconds = round(time.monotonic() - t0, 2)


def trial(point: str, step: int, workdir: str, shm_prefix: str, seed: int = 0) -> Trial:
    from ucpd import faults

    if faults.POINTS[point][1] == "team":
        return team_trial(point, step, workdir, shm_prefix, seed)
    return node_trial(point, step, workdir, shm_prefix, seed=seed)


CRASH_POINTS = [p for p, (kind, _) in __import__("ucpd.faults", fromlist=["POINTS"]).POINTS.items() if kind == "crash"]
