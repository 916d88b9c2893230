"""A seeded chaos campaign: trials of faults on a team of real daemons (``helpers.daemon_team``),
the job (``job``) restarted as a new run after each, every trial checked (``ledger``)."""

from __future__ import annotations

import os
import random
import re
import shutil
import time
import uuid

from ..daemon_team import DaemonTeam
from ..netns import Net
from ..waiting import eventually
from .job import JOB, _context, rank_main, read_journal
from .ledger import Ledger
from .trial import KINDS, PARTITION, Trial, draw

HEALTHY_WITHIN = 20.0  # seconds after a trial's last run within which status must say healthy again
STEPS_A, STEPS_B = 4, 2  # steps of the faulted run, of the run after it


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
        extra = redundancy_args(redundancy, nodes)
        flush = None
        if "--flush-dir" in extra:  # each team generation flushes into a folder of its own
            k = extra.index("--flush-dir")
            flush = extra[k + 1]
            del extra[k:k + 2]
        self.team = DaemonTeam(self.base, f"/dev/shm/ucpd-team-chaos-{os.getpid()}-{uuid.uuid4().hex[:6]}", nodes,
                               ["--keep", "3", "--log-level", "INFO", *extra], dead_after=dead_after,
                               secret=uuid.uuid4().hex if partitions else None,  # peers off loopback prove it
                               net=Net(nodes) if partitions else None, flush_dir=flush)
        self.run = 0
        self.procs: list = []
        self.trials: list[Trial] = []
        self.current: Trial | None = None
        self.ledger = Ledger(per_node, redundancy_tolerance(redundancy, nodes), self.note)

    # --- jobs -----------------------------------------------------------------------------------

    def env(self, rank: int, run: int) -> dict:
        node = rank // self.per_node
        return {
            "RANK": str(rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(rank % self.per_node),
            "LOCAL_WORLD_SIZE": str(self.per_node), "UCPD_RUN_DIR": self.team.nodes[node].run_dir,
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

    def fresh_team(self) -> None:
        """A fresh team (new dirs, ports, shm), every node started; what the last one held is gone."""
        self.team.renew().start()
        self.ledger.forget()

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
            if m and self.ledger.bad_steps.get(int(m.group(1)), index) < index:  # found by an earlier trial: still there
                self.note(f"again: {msg}")
                return
            if m:
                self.ledger.bad_steps[int(m.group(1))] = index
            if msg not in fails:
                fails.append(msg)

        work = os.path.join(self.base, f"trial{index:04d}")
        mark = [time.monotonic()]

        def lap(name: str) -> None:
            now = time.monotonic()
            t.phases[name] = round(now - mark[0], 2)
            mark[0] = now

        try:
            if not self.team.started or not self.team.formed():
                if not eventually(self.team.formed, 30):
                    self.note("the team did not form again: started afresh")
                    self.fresh_team()
                    if not eventually(self.team.formed, 30):
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

            eventually(reached, 60, poll=0.01)
            lap("run_a")
            time.sleep(params["delay_ms"] / 1000)  # a seeded offset from the trigger, not a wait for anything
            injected_at = time.time()
            self.inject(kind, params, procs, fail)
            t.injected = True
            lap("inject")
            ja = self.journals(wa)
            before = self.ledger.reported
            self.ledger.absorb(run_a, ja)
            self.ledger.check_run(run_a, ja, fail, clean=False, injected_at=injected_at, reported=before)
            t.reported = self.ledger.reported
            if not eventually(self.team.formed, 30):
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
            before = self.ledger.reported
            self.ledger.absorb(run_b, jb)
            self.ledger.check_run(run_b, jb, fail, clean=True, injected_at=None, reported=before)
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
            if self.ledger.reported is not None and (t.latest is None or t.latest < self.ledger.reported):
                fail(f"latest() is {t.latest} after the trial, but a rank saw step {self.ledger.reported} committed")
            for s in held:
                reads = {r: next((x for x in recs if x["e"] == "read" and x["step"] == s), None) for r, recs in jv.items()}
                self.ledger.check_read(s, reads, fail, newest=(s == t.latest))
            if t.latest is not None and t.latest not in held:
                fail(f"latest() is {t.latest}, which no node lists as a committed version")
            self.ledger.check_flush_dir(self.team.flush_dir(), fail, t.latest)
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

            if not eventually(healthy, HEALTHY_WITHIN, poll=0.25):
                fail(f"ucpd status is not healthy {HEALTHY_WITHIN:g} s after the trial: {bad}")
            lap("health")
            counters = [((self.team.status(i) or {}).get("team") or {}).get("counters") or {} for i in range(self.nodes)]
            t.restores = {k: sum(c.get(k, 0) for c in counters)  # (since each daemon started)
                          for k in ("restores_from_holders", "restores_widened", "index_fallbacks")}
        except Exception as exc:  # the harness itself: a daemon that would not start, ...
            fail(f"harness: {type(exc).__name__}: {str(exc)[:600]}")
            t.notes.append(self.team.logs(1500))
            try:
                self.fresh_team()
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
                    self.fresh_team()
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
            self.ledger.losses.append(time.time())
            time.sleep(later)
            self.kill(procs)
            if p["replace_after_dead"]:
                others = [i for i in range(self.nodes) if i != node]
                if not eventually(lambda: all(self.team.sees_dead(i, node) for i in others), 10 * self.dead_after + 10):
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
            if not eventually(lambda: all(self.team.sees_dead(i, node) for i in others)
                              and all(self.team.sees_dead(node, i) for i in others), 10 * self.dead_after + 10):
                fail(f"node {node}, cut off, and the others did not declare each other dead")
            self.team.net.heal(node)
            if not eventually(self.team.formed, 30):
                fail(f"the team did not form again within 30 s of node {node}'s link coming back")
            time.sleep(later)
            self.join(procs, 5, None)  # the run may finish; then the job is restarted all the same
        elif kind == "daemon_pause":
            self.team.pause(node)
            others = [i for i in range(self.nodes) if i != node]
            if not eventually(lambda: all(self.team.sees_dead(i, node) for i in others), 10 * self.dead_after + 10):
                fail(f"paused node {node} was not declared dead by every other node")
            self.team.resume(node)
            eventually(self.team.formed, 30)
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
