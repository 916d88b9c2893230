"""A seeded chaos campaign on a team of real daemons, with a job restarted after every fault.

Used by ``benchmarks/reliability/team_chaos.py`` (a long run) and ``tests/faults/test_team_chaos.py``
(a short seed per redundancy kind in CI).

The team: N ``ucpd serve`` processes on loopback (``--nodes N --node-rank I --listen ... --peers
...``), each with its own run dir and shm dir, ``--replicas R`` or ``--parity K[+M]``. The job:
``ranks_per_node`` trainer processes per node (TP = ranks per node, DP = nodes), each told who it is
by the environment a launcher sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``UCPD_RUN_DIR`` of its node's daemon, ``UCPD_JOB``, and ``UCPD_JOB_ID`` naming the run) and
using ``Checkpointer()`` with no arguments. A run reads ``latest()``, restores it (if any) and
snapshots the next steps, waiting for each to commit, as the README's loop does.

The state's values encode the step *and the run*: every element of every tensor is
``code * 10**8 + i`` (``code = run * 10000 + step``, ``i`` the element's index in the global tensor,
so a shard restored in the wrong place is seen too), a replicated tensor holds ``code`` itself,
and plain values hold the step and the run. A version stitched from two runs cannot restore
into one run's values on every rank.

A trial: a run of the job (run A) meets a fault at a seeded moment —

* ``node_lost``: a node's daemon and trainers are SIGKILLed, its shm dir deleted, a fresh daemon
  started at its node rank (before or after the others declared it dead);
* ``daemon_restart``: a daemon is SIGKILLed and started again on its run and shm dirs;
* ``daemon_pause``: a daemon is SIGSTOPped until its peers declare it dead, then SIGCONTed;
* ``trainer_killed``: one rank is SIGKILLed mid-run;

— then the rest of the job is killed (a job restart), the team is left to form again, and a new
run (run B, a new job id) resumes at ``latest() + 1`` and commits a few steps. Checks:

1. every committed step still held (any node's status) is read back whole by every rank
   (``restore(state, step=s)`` into zeroed tensors), each tensor decodes to that step and to one
   run, the same run on every rank and node (a version stitched from two runs fails, naming
   the ranks, nodes and runs), and a run that did snapshot that step;
2. ``latest()`` is never below a step some rank saw committed (its ``wait()`` returned);
3. a run's snapshots are never refused (``SnapshotRejected``, ``ProtocolError``), and a run
   started on a formed team commits every step; its ranks agree on ``latest()`` at start;
4. the newest committed version (``latest()``) restores whole;
5. ``ucpd status`` of every node comes back to ``healthy`` (bounded wait).

Draws (fault kind, victim, moment, replacement timing, delays) come from ``random.Random(seed)``
only, in a fixed order: the same seed draws the same trials (timings differ, so a time-bounded
campaign may stop at another trial).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field

from .faultkit import Daemon
from .waiting import eventually

KINDS = ("node_lost", "daemon_restart", "daemon_pause", "trainer_killed")
HEALTHY_WITHIN = 20.0  # seconds after a trial's last run within which status must say healthy again
PARTITION = "partition"  # with partitions=True (root, ``ip netns``): a node's link taken down, then up
JOB = "chaos"
CODE = 10_000  # code = run * CODE + step
SCALE = 10 ** 8  # an element = code * SCALE + its global index
TP_GLOBAL_ROWS, TP_COLS = 256, 512  # the TP-split weight (float64), 1 MiB: 512 KiB a rank at TP 2
ZERO_N = 128 * 1024  # each rank's ZeRO partition of a flat optimizer buffer (int64): 1 MiB
REP_N = 128 * 1024  # a replicated tensor (float32): 512 KiB
STEPS_A, STEPS_B = 4, 2  # steps of the faulted run, of the run after it


# --- the job's state --------------------------------------------------------------------------------

def job_state(step: int, run: int, rank: int, world: int, tp: int):
    """(state, placements) of ``rank`` at ``step`` of ``run``."""
    import torch
    from ucpd_client import placement as P

    code = run * CODE + step
    tp_rank, rows = rank % tp, TP_GLOBAL_ROWS // tp
    w = torch.arange(rows * TP_COLS, dtype=torch.float64).view(rows, TP_COLS)
    w += tp_rank * rows * TP_COLS + code * SCALE
    z = torch.arange(ZERO_N, dtype=torch.int64) + rank * ZERO_N + code * SCALE
    r = torch.full((REP_N,), float(code), dtype=torch.float32)
    state = {
        "model": {"tp.weight": w, "norm.weight": r},
        "optim": {"zero.exp_avg": z},
        "step": step,
        "meta": {"run": run, "rank": rank},
    }
    return state, {"model.tp.weight": P.Shard(0, tp_rank, tp), "optim.zero.exp_avg": P.Shard(0, rank, world)}


def zero_state(rank: int, world: int, tp: int):
    """The same structure, zeroed (plain values -1): what a restore fills."""
    import torch

    state, pl = job_state(1, 0, rank, world, tp)
    state["model"] = {k: torch.zeros_like(v) for k, v in state["model"].items()}
    state["optim"] = {k: torch.zeros_like(v) for k, v in state["optim"].items()}
    state["step"], state["meta"] = -1, {"run": -1, "rank": -1}
    return state, pl


def decode(state: dict, rank: int, world: int, tp: int) -> dict:
    """{tensor name: {"codes": [[code, count], ...], "garbled": n}, "values": {...}} of a restored state."""
    import torch

    out = {}
    tp_rank, rows = rank % tp, TP_GLOBAL_ROWS // tp
    expect = {
        "model.tp.weight": torch.arange(rows * TP_COLS, dtype=torch.int64).view(rows, TP_COLS) + tp_rank * rows * TP_COLS,
        "optim.zero.exp_avg": torch.arange(ZERO_N, dtype=torch.int64) + rank * ZERO_N,
        "model.norm.weight": None,
    }
    tensors = {"model.tp.weight": state["model"]["tp.weight"], "model.norm.weight": state["model"]["norm.weight"],
               "optim.zero.exp_avg": state["optim"]["zero.exp_avg"]}
    for name, t in tensors.items():
        as_int = t.to(torch.int64)
        integral = as_int.to(t.dtype) == t
        if expect[name] is None:
            codes, ok = as_int, integral
        else:
            rest = as_int - expect[name]
            ok = integral & (rest % SCALE == 0) & (rest >= 0)
            codes = rest // SCALE
        codes = codes[ok]
        u, n = torch.unique(codes, return_counts=True)
        out[name] = {"codes": [[int(a), int(b)] for a, b in zip(u.tolist(), n.tolist())], "garbled": int((~ok).sum())}
    out["values"] = {"step": state["step"], "run": state["meta"]["run"], "rank": state["meta"]["rank"]}
    return out


def flushed_codes(root: str, step: int) -> set:
    """The codes (run * CODE + step) the flushed version's global tensors decode to; one element
    in the wrong place or from another run or step adds another (or -1: garbled)."""
    import numpy as np

    from ucpd.format import open_version

    codes: set = set()
    with open_version(root, step) as v:
        def values(name):  # the reader gives the storage bits: view them as the tensor's dtype
            return np.asarray(v.array(name)).reshape(-1).view(np.dtype(v.tensors[name].dtype)).astype(np.int64)

        for name in ("model.tp.weight", "optim.zero.exp_avg"):
            rest = values(name) - np.arange(values(name).size, dtype=np.int64)
            codes |= set(np.unique(np.where(rest % SCALE == 0, rest // SCALE, -1)).tolist())
        codes |= set(np.unique(values("model.norm.weight")).tolist())
    return codes


# --- trainer processes --------------------------------------------------------------------------------

def _note(journal: str, **rec) -> None:
    rec["t"] = time.time()
    with open(journal, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def rank_main(mode: str, env: dict, journal: str, args: dict) -> None:
    """One trainer rank. ``mode`` "train": latest(), restore it, snapshot ``args['steps']`` steps;
    "verify": read back ``args['check']`` steps (and latest()). Everything goes to the journal."""
    os.environ.update(env)
    from ucpd_client import Checkpointer

    tp = int(args["tp"])
    ckpt = None
    step = None
    try:
        ckpt = Checkpointer(embedded=False)
        rank, world, run = ckpt.rank, ckpt.world_size, int(args["run"])
        latest = ckpt.latest()
        _note(journal, e="latest", step=latest)
        if mode == "verify":
            for s in args["check"]:
                target, pl = zero_state(rank, world, tp)
                try:
                    got = ckpt.restore(target, step=s, placements=pl)
                    _note(journal, e="read", step=s, got=got, where=(ckpt.last_restore or {}).get("where"),
                          dec=decode(target, rank, world, tp))
                except Exception as exc:
                    _note(journal, e="read", step=s, error=f"{type(exc).__name__}: {str(exc)[:400]}")
            _note(journal, e="done")
            return
        if latest is not None:
            target, pl = zero_state(rank, world, tp)
            step = latest
            got = ckpt.restore(target, placements=pl)
            _note(journal, e="restored", step=got, dec=decode(target, rank, world, tp))
        start = (latest or 0) + 1
        for step in range(start, start + int(args["steps"])):
            state, pl = job_state(step, run, rank, world, tp)
            _note(journal, e="begin", step=step)
            ckpt.snapshot(step, state, placements=pl).wait(timeout=float(args["wait"]))
            _note(journal, e="committed", step=step)
        _note(journal, e="done")
    except BaseException as exc:  # the daemon died, the step can no longer commit, a refusal
        _note(journal, e="error", step=step, type=type(exc).__name__, msg=str(exc)[:500])
    finally:
        if ckpt is not None:
            try:
                ckpt.close()
            except Exception:
                pass


_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "ucpd_client", "helpers.team_chaos"])
    return _CTX


def read_journal(path: str) -> list[dict]:
    try:
        with open(path) as f:
            out = []
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line cut by SIGKILL
            return out
    except OSError:
        return []


# --- the team --------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redundancy_args(redundancy: str, nodes: int) -> list[str]:
    """``replicas`` -> --replicas 1; ``xor`` -> --parity (nodes-1); ``rs`` -> --parity 2+2 (4+ nodes),
    else 1+2 ... or an explicit ``--replicas N`` / ``--parity K[+M]`` string."""
    if redundancy == "replicas":
        return ["--replicas", "1"]
    if redundancy == "xor":
        return ["--parity", str(nodes - 1)]
    if redundancy == "rs":
        return ["--parity", f"{nodes - 2}+2"]
    return redundancy.split()


def redundancy_tolerance(redundancy: str, nodes: int) -> int:
    """How many lost nodes every committed version survives."""
    a = redundancy_args(redundancy, nodes)
    if a[0] == "--replicas":
        return int(a[1])
    return int(a[1].split("+")[1]) if "+" in a[1] else 1


class Net:
    """Each node in a network namespace of its own, its veth on one bridge (``ip netns``, root
    only): a partition takes a node's link down, and up again. Trainers still reach their daemon
    through its ``ipc://`` socket (a file: every namespace sees it)."""

    def __init__(self, nodes: int) -> None:
        tag = f"{os.getpid() % 100000:05d}"
        self.bridge, self.subnet = f"ucbr{tag}", f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
        self.ns = [f"ucpd-{tag}-n{i}" for i in range(nodes)]
        self.veth = [f"uc{tag}n{i}" for i in range(nodes)]
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i in range(nodes):
                _ip("netns", "add", self.ns[i])
                _ip("link", "add", self.veth[i], "type", "veth", "peer", "name", "eth0", "netns", self.ns[i])
                _ip("link", "set", self.veth[i], "master", self.bridge, "up")
                _ip("-n", self.ns[i], "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
                _ip("-n", self.ns[i], "link", "set", "eth0", "up")
                _ip("-n", self.ns[i], "link", "set", "lo", "up")
        except Exception:
            self.close()
            raise

    def ip(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[i]]

    def cut(self, i: int) -> None:
        _ip("link", "set", self.veth[i], "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self.veth[i], "up")

    def close(self) -> None:
        for name in self.veth + [self.bridge]:
            subprocess.run(["ip", "link", "del", name], capture_output=True)
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def partitions_available() -> str | None:
    """None when this machine can build the namespaces (root, ``ip netns``), else why not."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "partitions need root and iproute2's ip"
    probe = f"ucpd-probe-{os.getpid()}"
    out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if out.returncode == 0 else f"ip netns add failed: {out.stderr.strip()}"


class Team:
    def __init__(self, workdir: str, shm_prefix: str, nodes: int, extra: list[str], dead_after: float, log,
                 partitions: bool = False):
        self.workdir, self.shm_prefix, self.n, self.extra, self.dead_after, self.log = workdir, shm_prefix, nodes, extra, dead_after, log
        self.generation = 0
        self.daemons: list[Daemon] = []
        self.paused: set[int] = set()
        self.net = Net(nodes) if partitions else None
        self.secret_file = None
        if self.net is not None:  # peers off loopback must prove the job secret
            self.secret_file = os.path.join(workdir, "secret")
            with open(self.secret_file, "w") as f:
                f.write(uuid.uuid4().hex)
            os.chmod(self.secret_file, 0o600)

    def _make(self) -> None:
        self.generation += 1
        host = [self.net.ip(i) if self.net else "127.0.0.1" for i in range(self.n)]
        self.addresses = [f"tcp://{host[i]}:{_free_port()}" for i in range(self.n)]
        self.daemons = []
        for i in range(self.n):
            w = os.path.join(self.workdir, f"g{self.generation}", f"node{i}")
            os.makedirs(w, exist_ok=True)
            extra = list(self.extra)
            if "--flush-dir" in extra:  # each team (generation) flushes into a folder of its own
                extra[extra.index("--flush-dir") + 1] = self.flush_dir()
            args = ["--nodes", str(self.n), "--node-rank", str(i), "--listen", self.addresses[i],
                    "--peers", ",".join(self.addresses), "--heartbeat", "0.1", "--dead-after", str(self.dead_after),
                    "--mem-limit", "1G", "--keep", "3", "--log-level", "INFO", *extra]
            if self.secret_file:
                args += ["--secret-file", self.secret_file]
            d = Daemon(w, f"{self.shm_prefix}-g{self.generation}-n{i}-{uuid.uuid4().hex[:6]}", args, None)
            d.prefix = self.net.prefix(i) if self.net else []
            self.daemons.append(d)

    def flush_dir(self) -> str | None:
        """This generation's ``--flush-dir`` (the one given, a folder per generation), or None."""
        if "--flush-dir" not in self.extra:
            return None
        return os.path.join(self.extra[self.extra.index("--flush-dir") + 1], f"g{self.generation}")

    def start(self) -> None:
        """A fresh team (new dirs, new ports), every node started; a port taken meanwhile: new ports."""
        for attempt in range(4):
            self.stop()
            self._make()
            try:
                for d in self.daemons:
                    d.start()
                return
            except RuntimeError as exc:
                if "Address already in use" not in str(exc) or attempt == 3:
                    raise

    def restart(self, i: int) -> None:
        self.daemons[i].start()

    def kill(self, i: int) -> None:
        self.resume(i)
        self.daemons[i].kill()

    def lose(self, i: int) -> None:
        self.kill(i)
        shutil.rmtree(self.daemons[i].shm_dir, ignore_errors=True)

    def pause(self, i: int) -> None:
        os.kill(self.daemons[i].proc.pid, signal.SIGSTOP)
        self.paused.add(i)

    def resume(self, i: int) -> None:
        if i in self.paused:
            self.paused.discard(i)
            if self.daemons[i].alive():
                os.kill(self.daemons[i].proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        for i, d in enumerate(self.daemons):
            self.resume(i)
            if self.net is not None:
                self.net.heal(i)
            d.stop()
            shutil.rmtree(d.shm_dir, ignore_errors=True)

    def close(self) -> None:
        self.stop()
        if self.net is not None:
            self.net.close()

    def status(self, i: int, timeout: float = 5.0) -> dict | None:
        if i in self.paused or not self.daemons[i].alive():
            return None
        from ucpd.rpc import Connection

        try:
            with Connection(self.daemons[i].run_dir, timeout=timeout) as c:
                return c.call("status")
        except Exception:
            return None

    def up(self) -> list[int]:
        return [i for i, d in enumerate(self.daemons) if d.alive() and i not in self.paused]

    def sees_dead(self, i: int, dead: int) -> bool:
        st = self.status(i)
        return st is not None and not st["team"]["nodes"][dead]["live"]

    def formed(self) -> bool:
        """Every node is up and sees every node live, with one coordinator."""
        coords = set()
        for i in range(self.n):
            st = self.status(i)
            if st is None or not all(x["live"] for x in st["team"]["nodes"]):
                return False
            coords.add(st["team"]["coordinator"])
        return len(coords) == 1

    def logs(self, nbytes: int = 1500) -> str:
        return "\n".join(f"--- node {i}\n{d.read_log()[-nbytes:]}" for i, d in enumerate(self.daemons))


def wait_until(cond, timeout: float, poll: float = 0.1) -> bool:
    return eventually(cond, timeout, poll)


# --- a trial ---------------------------------------------------------------------------------------------

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


class Campaign:
    def __init__(self, seed: int, nodes: int = 4, per_node: int = 2, redundancy: str = "replicas",
                 dead_after: float = 1.5, workdir: str | None = None, log=print, fresh_after_failure: bool = True,
                 partitions: bool = False, kinds: tuple[str, ...] = KINDS, reshard: bool = False):
        """``kinds``: the faults drawn from (all of them by default; a short test may pick some).
        ``reshard``: odd runs use TP 1 (DP over every rank) and even runs TP = ranks per node, so
        every restart restores the steps of a run of the other layout."""
        import tempfile

        self.seed, self.nodes, self.per_node, self.redundancy = seed, nodes, per_node, redundancy
        self.world = nodes * per_node
        self.reshard = reshard
        self.fresh_after_failure = fresh_after_failure
        self.dead_after = dead_after
        self.rng = random.Random(seed)
        self.order: list[str] = []
        self.log = log
        self.base = workdir or tempfile.mkdtemp(prefix="ucpd-team-chaos-")
        self.kinds = tuple(kinds) + ((PARTITION,) if partitions else ())
        self.team = Team(self.base, f"/dev/shm/ucpd-team-chaos-{os.getpid()}-{uuid.uuid4().hex[:6]}", nodes,
                         redundancy_args(redundancy, nodes), dead_after, log, partitions)
        self.run = 0
        self.procs: list = []
        self.reported: int | None = None  # newest step any rank saw committed (this team generation)
        self.snapshotted: dict[int, set[int]] = {}  # step -> runs that began it
        self.trials: list[Trial] = []
        self.current: Trial | None = None
        self.bad_steps: dict[int, int] = {}  # step -> the trial that found it bad
        self.first_seen: dict[int, float] = {}  # step -> when a rank first began it (its commit is later)
        self.losses: list[float] = []  # when nodes were lost (their RAM deleted)
        self.tolerance = redundancy_tolerance(redundancy, nodes)

    # --- jobs -----------------------------------------------------------------------------------

    def env(self, rank: int, run: int) -> dict:
        node = rank // self.per_node
        return {
            "RANK": str(rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(rank % self.per_node),
            "LOCAL_WORLD_SIZE": str(self.per_node), "UCPD_RUN_DIR": self.team.daemons[node].run_dir,
            "UCPD_JOB": JOB, "UCPD_JOB_ID": f"chaos-run-{run}", "UCPD_RPC_TIMEOUT": "10",
        }

    def start_job(self, mode: str, workdir: str, run: int, **args) -> list:
        os.makedirs(workdir, exist_ok=True)
        ctx = _context()
        procs = []
        for r in range(self.world):
            a = {"tp": 1 if self.reshard and run % 2 else self.per_node, "run": run, "wait": 10, **args}
            p = ctx.Process(target=rank_main, args=(mode, self.env(r, run), os.path.join(workdir, f"rank{r}.jsonl"), a),
                            daemon=True)
            p.start()
            procs.append(p)
        self.procs += procs
        return procs

    def kill(self, procs) -> None:
        for p in procs:
            if p.exitcode is None:
                p.kill()
        for p in procs:
            p.join(5)
        self.procs = [p for p in self.procs if p.exitcode is None]

    def join(self, procs, timeout: float, workdir: str | None = None, grace: float = 1.0) -> bool:
        """Wait for the ranks to end, as a launcher does: once one rank failed (an ``error`` in its
        journal), the others get ``grace`` seconds, then the job is torn down. True: all ended."""
        deadline = time.monotonic() + timeout
        failed_at = None
        while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
            if workdir is not None and failed_at is None and any(
                    rec["e"] == "error" for recs in self.journals(workdir).values() for rec in recs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() > failed_at + grace:
                break
            time.sleep(0.05)
        done = all(p.exitcode is not None for p in procs) or failed_at is not None
        self.kill(procs)
        return done

    def journals(self, workdir: str) -> dict[int, list[dict]]:
        return {r: read_journal(os.path.join(workdir, f"rank{r}.jsonl")) for r in range(self.world)}

    def absorb(self, run: int, j: dict[int, list[dict]]) -> None:
        """What a run's journals say: steps begun (by which run), steps seen committed."""
        for recs in j.values():
            for rec in recs:
                if rec["e"] == "begin":
                    self.snapshotted.setdefault(rec["step"], set()).add(run)
                    self.first_seen[rec["step"]] = min(self.first_seen.get(rec["step"], rec["t"]), rec["t"])
                elif rec["e"] == "committed":
                    self.reported = max(self.reported or 0, rec["step"])

    # --- checks ---------------------------------------------------------------------------------

    def where(self, rank: int) -> str:
        return f"rank {rank} on node {rank // self.per_node}"

    def ranks_text(self, ranks) -> str:
        """"ranks 2, 3 on node 1 and rank 4 on node 2"."""
        by_node: dict[int, list[int]] = {}
        for r in sorted(set(ranks)):
            by_node.setdefault(r // self.per_node, []).append(r)
        return " and ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} on node {n}"
                            for n, rs in sorted(by_node.items()))

    def check_read(self, step: int, reads: dict[int, dict], fail, newest: bool = False, what: str = "committed step") -> None:
        """One step read back by every rank: whole, that step, one run everywhere."""
        runs_at: dict[int, set[int]] = {}  # run -> ranks that read it back as that run
        errors: dict[str, list[int]] = {}
        for rank, rec in sorted(reads.items()):
            if rec is None:
                errors.setdefault("no answer", []).append(rank)
                continue
            if "error" in rec:
                errors.setdefault(re.sub(r"\brank \d+", "rank N", rec["error"]), []).append(rank)
                continue
            if rec["got"] != step:
                fail(f"restore(step={step}) by {self.where(rank)} returned step {rec['got']}")
            dec = dict(rec["dec"])
            vals = dec.pop("values")
            if vals["step"] != step or vals["rank"] != rank:
                fail(f"{what} {step}: {self.where(rank)} read back plain values {vals}")
            mine: dict[int, list[str]] = {vals["run"]: ["plain values"]}
            for name, d in dec.items():
                if d["garbled"]:
                    fail(f"{what} {step}: {self.where(rank)}'s {name} has {d['garbled']} elements that decode "
                         f"to no run and step (damaged or misplaced bytes)")
                for code, count in d["codes"]:
                    run, s = divmod(code, CODE)
                    if code == 0:
                        fail(f"{what} {step}: {self.where(rank)}'s {name} has {count} zeros (not restored)")
                        continue
                    if s != step:
                        fail(f"{what} {step}: {self.where(rank)}'s {name} holds step {s} of run {run} ({count} elements)")
                    mine.setdefault(run, []).append(name)
            if len(mine) > 1:
                fail(f"{what} {step}: {self.where(rank)} mixes runs: "
                     + ", ".join(f"run {r} in {', '.join(n)}" for r, n in sorted(mine.items())))
            for run in mine:
                runs_at.setdefault(run, set()).add(rank)
        if errors:
            kinds = {category(e) for e in errors}
            # losses since the step was first begun (an upper bound on those since it committed)
            lost = sum(1 for t in self.losses if t > self.first_seen.get(step, 0.0))
            if newest or kinds - {"VersionNotFound"} or lost <= self.tolerance:
                fail(f"{what} {step}{' (the newest, latest())' if newest else ''} could not be read back"
                     f"{f' after {lost} node loss(es) (redundancy {self.tolerance})' if not newest else ''}: "
                     + "; ".join(f"{self.ranks_text(rs)}: {e}" for e, rs in errors.items()))
            else:
                self.note(f"{what} {step} is lost: " + "; ".join(f"{self.ranks_text(rs)}: {e}" for e, rs in errors.items()))
        if len(runs_at) > 1 and len(set().union(*runs_at.values())) > 1:  # one rank alone: "mixes runs" said it
            fail(f"{what} {step} read back " + ", but ".join(
                f"as run {run} by {self.ranks_text(rs)}" for run, rs in sorted(runs_at.items())))
        for run in runs_at:
            if run not in self.snapshotted.get(step, {run}):
                fail(f"{what} {step} read back as run {run}, a run that never snapshotted it "
                     f"(runs that did: {sorted(self.snapshotted.get(step, ()))})")

    def check_flush_dir(self, fail, newest: int | None) -> None:
        """With ``--flush-dir`` (every node writes its share): no torn version, every complete one
        whole (each chunk of each file against its ``ucp.json``), none newer than the newest
        committed step."""
        if self.team.flush_dir() is None:
            return
        from ucpd.format import list_versions, validate

        root = os.path.join(self.team.flush_dir(), JOB)
        if not os.path.isdir(root):
            return
        versions = list_versions(root)
        torn = [v.step for v in versions if v.state == "torn"]
        if torn:
            fail(f"torn versions in the flush dir: {torn}")
        for v in versions:
            if v.state == "complete":
                problems = validate(root, v.step, full=True)
                if problems:
                    fail(f"flushed step {v.step} does not validate: {problems[:2]}")
                if newest is not None and v.step > newest:
                    fail(f"flushed step {v.step} is newer than the newest committed {newest}")
                codes = flushed_codes(root, v.step)
                if len(codes) != 1 or next(iter(codes)) % CODE != v.step:
                    fail(f"flushed step {v.step} holds the values of runs/steps {sorted(codes)}: stitched or misplaced")

    def check_run(self, run: int, j: dict[int, list[dict]], fail, clean: bool, injected_at: float | None,
                  reported: int | None) -> None:
        """A run's journals: refusals are failures; a clean run (no fault during it) commits every step;
        ``reported``: the newest step a rank saw committed before this run began."""
        starts = {}
        errors: dict[tuple, list[int]] = {}
        unfinished = []
        restored: dict[int, dict] = {}  # step -> {rank: its restore at the start of the run}
        for rank, recs in sorted(j.items()):
            for rec in recs:
                if rec["e"] == "latest":
                    starts[rank] = rec["step"]
                    if reported is not None and (rec["step"] is None or rec["step"] < reported) and (
                            injected_at is None or rec["t"] < injected_at):
                        fail(f"run {run}: {self.where(rank)} read latest() {rec['step']} at start, "
                             f"but a rank saw step {reported} committed")
                elif rec["e"] == "restored":
                    restored.setdefault(rec["step"], {})[rank] = {**rec, "got": rec["step"]}
                elif rec["e"] == "error":
                    before = injected_at is None or rec["t"] < injected_at
                    msg = re.sub(r"\brank \d+", "rank N", rec["msg"])
                    errors.setdefault((rec["step"], rec["type"], msg, before), []).append(rank)
            if clean and (not recs or recs[-1]["e"] != "done") and not any(r["e"] == "error" for r in recs):
                unfinished.append(rank)
        for (step, typ, msg, before), rs in sorted(errors.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1])):
            text = f"run {run}: {self.ranks_text(rs)} at step {step}: {typ}: {msg}"
            if typ in ("SnapshotRejected", "ProtocolError", "ChecksumMismatch", "PlacementMismatch") or before:
                fail(text)
            else:
                self.note(text)
        for step, reads in sorted(restored.items()):
            self.check_read(step, reads, fail, newest=True, what=f"run {run}'s restore of the newest committed step,")
        if unfinished:  # torn down after another rank failed: that failure is the one to tell
            (self.note if errors else fail)(f"run {run}: {self.ranks_text(unfinished)} did not commit every step")
        if len(set(starts.values())) > 1:
            fail(f"run {run}: ranks disagree on latest() at start: {starts}")

    def forget(self) -> None:
        """A fresh team: what the last one held is gone."""
        self.reported, self.snapshotted, self.bad_steps, self.first_seen, self.losses = None, {}, {}, {}, []

    def note(self, msg: str) -> None:
        if self.current is not None:
            self.current.notes.append(msg)

    def held_steps(self) -> list[int]:
        steps = set()
        for i in range(self.nodes):
            st = self.team.status(i)
            for v in (st or {}).get("versions", []):
                if v.get("job") == JOB and v["state"] == "committed":
                    steps.add(v["step"])
        return sorted(steps)

    # --- one trial ------------------------------------------------------------------------------

    def trial(self, index: int) -> Trial:
        kind, params = draw(self.rng, index, self.order, self.nodes, self.per_node, self.kinds)
        t = self.current = Trial(index, kind, params)
        t0 = time.monotonic()
        fails: list[str] = []

        def fail(msg: str) -> None:
            m = re.match(r"committed step (\d+)", msg)
            if m and self.bad_steps.get(int(m.group(1)), index) < index:  # found by an earlier trial: still there
                self.note(f"again: {msg}")
                return
            if m:
                self.bad_steps[int(m.group(1))] = index
            if msg not in fails:
                fails.append(msg)

        work = os.path.join(self.base, f"trial{index:04d}")
        mark = [time.monotonic()]

        def lap(name: str) -> None:
            now = time.monotonic()
            t.phases[name] = round(now - mark[0], 2)
            mark[0] = now

        try:
            if not self.team.daemons or not self.team.formed():
                if not wait_until(self.team.formed, 30):
                    self.note("the team did not form again: started afresh")
                    self.team.start()
                    self.forget()
                    if not wait_until(self.team.formed, 30):
                        raise RuntimeError("a fresh team did not form in 30 s")
            # run A, and the fault at its moment
            self.run += 1
            run_a = self.run
            t.runs.append(run_a)
            wa = os.path.join(work, f"run{run_a}")
            lap("form")
            procs = self.start_job("train", wa, run_a, steps=STEPS_A)
            trig_path = os.path.join(wa, f"rank{params['trigger_rank'] if kind != 'trainer_killed' else params['rank']}.jsonl")

            def reached() -> bool:  # the moment, or the run already failed or ended without it
                n = sum(1 for rec in read_journal(trig_path) if rec["e"] == params["trigger"])
                return (n >= params["at"] or all(p.exitcode is not None for p in procs)
                        or any(rec["e"] == "error" for recs in self.journals(wa).values() for rec in recs))

            wait_until(reached, 60, poll=0.01)
            lap("run_a")
            time.sleep(params["delay_ms"] / 1000)  # a seeded offset from the trigger, not a wait for anything
            injected_at = time.time()
            self.inject(kind, params, procs, fail)
            t.injected = True
            lap("inject")
            ja = self.journals(wa)
            before = self.reported
            self.absorb(run_a, ja)
            self.check_run(run_a, ja, fail, clean=False, injected_at=injected_at, reported=before)
            t.reported = self.reported
            if not wait_until(self.team.formed, 30):
                fail(f"the team did not form again within 30 s of the {kind} (nodes up {self.team.up()})")
            lap("reform")
            # run B: a new run resumes where the team says
            self.run += 1
            run_b = self.run
            t.runs.append(run_b)
            wb = os.path.join(work, f"run{run_b}")
            procs = self.start_job("train", wb, run_b, steps=STEPS_B)
            if not self.join(procs, 90, wb):
                fail(f"run {run_b} did not finish in 90 s")
            jb = self.journals(wb)
            before = self.reported
            self.absorb(run_b, jb)
            self.check_run(run_b, jb, fail, clean=True, injected_at=None, reported=before)
            lap("run_b")
            # every committed step still held, read back by every rank
            held = self.held_steps()
            t.checked_steps = held
            wv = os.path.join(work, "verify")
            self.run += 1  # a reading run is a run of the job too
            procs = self.start_job("verify", wv, self.run, check=held)
            if not self.join(procs, 90):
                fail(f"the read-back of steps {held} did not finish in 90 s")
            jv = self.journals(wv)
            lap("verify")
            latests = {r: next((x["step"] for x in recs if x["e"] == "latest"), "?") for r, recs in jv.items()}
            t.latest = max((v for v in latests.values() if isinstance(v, int)), default=None)
            if len(set(latests.values())) > 1:
                fail(f"ranks disagree on latest() after the trial: {latests}")
            if self.reported is not None and (t.latest is None or t.latest < self.reported):
                fail(f"latest() is {t.latest} after the trial, but a rank saw step {self.reported} committed")
            for s in held:
                reads = {r: next((x for x in recs if x["e"] == "read" and x["step"] == s), None) for r, recs in jv.items()}
                self.check_read(s, reads, fail, newest=(s == t.latest))
            if t.latest is not None and t.latest not in held:
                fail(f"latest() is {t.latest}, which no node lists as a committed version")
            self.check_flush_dir(fail, t.latest)
            # status comes back to healthy: every version run B committed after the fault, and the
            # older ones too, replicas and parity alike (healing copies them again; a parity group
            # rebuilds a lost member's share onto its replacement and encodes its blocks again)
            bad: dict = {}

            def healthy() -> bool:
                bad.clear()
                for i in range(self.nodes):
                    st = self.team.status(i)
                    team = (st or {}).get("team") or {}
                    if st is None:
                        bad[i] = "no answer"
                        continue
                    wrong = [v for v in team.get("versions", []) if v.get("health") not in ("healthy", "uncommitted")]
                    if wrong or team.get("health") != "healthy":
                        bad[i] = wrong or team.get("health")
                return not bad

            if not wait_until(healthy, HEALTHY_WITHIN, poll=0.25):
                fail(f"ucpd status is not healthy {HEALTHY_WITHIN:g} s after the trial: {bad}")
            lap("health")
            counters = [((self.team.status(i) or {}).get("team") or {}).get("counters") or {} for i in range(self.nodes)]
            t.restores = {k: sum(c.get(k, 0) for c in counters)  # (since each daemon started)
                          for k in ("restores_from_holders", "restores_widened", "index_fallbacks")}
        except Exception as exc:  # the harness itself: a daemon that would not start, ...
            fail(f"harness: {type(exc).__name__}: {str(exc)[:600]}")
            t.notes.append(self.team.logs())
            try:
                self.team.start()
                self.forget()
            except Exception as exc2:
                t.notes.append(f"restarting the team failed: {exc2}")
        finally:
            self.kill(self.procs)
            if fails and not any(f.startswith("harness:") for f in fails):
                t.notes.append(self.team.logs(8000))  # the daemons' logs of a failed trial, before they go
            if fails and not any(f.startswith("harness:") for f in fails) and self.fresh_after_failure:
                # what a failed trial left (a stitched or unrebuildable step) would fail the next
                # trials too: each trial's failures are its own
                try:
                    self.team.start()
                    self.forget()
                    t.notes.append("a fresh team for the next trial")
                except Exception as exc:
                    t.notes.append(f"restarting the team failed: {exc}")
            t.failures = fails
            t.seconds = round(time.monotonic() - t0, 2)
            self.current = None
        return t

    def inject(self, kind: str, p: dict, procs: list, fail) -> None:
        node = p["node"]
        on_node = [procs[r] for r in range(node * self.per_node, (node + 1) * self.per_node)]
        later = p["job_kill_delay_ms"] / 1000
        if kind == "trainer_killed":
            self.kill([procs[p["rank"]]])
            time.sleep(later)  # the launcher notices, then kills the rest: a job restart
            self.kill(procs)
        elif kind == "node_lost":
            self.kill(on_node)
            self.team.lose(node)
            self.losses.append(time.time())
            time.sleep(later)
            self.kill(procs)
            if p["replace_after_dead"]:
                others = [i for i in range(self.nodes) if i != node]
                if not wait_until(lambda: all(self.team.sees_dead(i, node) for i in others), 10 * self.dead_after + 10):
                    fail(f"node {node} was not declared dead by every other node")
            self.team.restart(node)
        elif kind == "daemon_restart":
            self.team.kill(node)
            time.sleep(later)
            self.kill(procs)
            self.team.restart(node)
        elif kind == PARTITION:
            self.team.net.cut(node)
            others = [i for i in range(self.nodes) if i != node]
            if not wait_until(lambda: all(self.team.sees_dead(i, node) for i in others)
                              and all(self.team.sees_dead(node, i) for i in others), 10 * self.dead_after + 10):
                fail(f"node {node}, cut off, and the others did not declare each other dead")
            self.team.net.heal(node)
            if not wait_until(self.team.formed, 30):
                fail(f"the team did not form again within 30 s of node {node}'s link coming back")
            time.sleep(later)
            self.join(procs, 5, None)  # the run may finish; then the job is restarted all the same
        elif kind == "daemon_pause":
            self.team.pause(node)
            others = [i for i in range(self.nodes) if i != node]
            if not wait_until(lambda: all(self.team.sees_dead(i, node) for i in others), 10 * self.dead_after + 10):
                fail(f"paused node {node} was not declared dead by every other node")
            self.team.resume(node)
            wait_until(self.team.formed, 30)
            time.sleep(later)
            self.join(procs, 5, None)  # the run may finish; then the job is restarted all the same
        else:
            raise ValueError(kind)

    # --- the whole campaign --------------------------------------------------------------------

    def go(self, seconds: float, min_trials: int = 0, max_trials: int | None = None) -> list[Trial]:
        end = time.monotonic() + seconds
        try:
            self.team.start()
            i = 0
            while (time.monotonic() < end or i < min_trials) and (max_trials is None or i < max_trials):
                t = self.trial(i)
                self.trials.append(t)
                self.log(f"[{i:3d}] {t.kind:15s} {'passed' if t.passed else 'FAILED' if t.injected else 'not injected'}"
                         f" ({t.seconds:.1f} s {t.phases}, runs {t.runs}, latest {t.latest}, checked {t.checked_steps}"
                         f"{', restores ' + str(t.restores) if t.restores else ''})"
                         + "".join(f"\n        - {m[:400]}" for m in t.failures))
                i += 1
        finally:
            self.close()
        return self.trials

    def close(self) -> None:
        self.kill(self.procs)
        self.team.close()
        shutil.rmtree(self.base, ignore_errors=True)


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
