"""The elastic scene on one machine: an elastic torchrun job loses a node, restarts on the
survivor with a layout chosen for the new world size, and restores from RAM.

    .venv/bin/python examples/elastic/scene.py [--steps 8] [--fail-at 4] [--keep-logs DIR]

1. Two "nodes", each one ``ucpd run ... -- torchrun --nnodes 1:2 --nproc-per-node 2
   --rdzv-backend c10d ...`` with its own run dir and shm dir; the two daemons ``ucpd run``
   starts form a team on loopback (``--replicas 1``, a job secret). ``train.py`` trains the
   example GPT on 4 ranks, pipeline 2 x data-parallel 2, snapshotting every step.
2. After step ``--fail-at`` is committed the workers wait for a go-ahead file. Node 1 is lost:
   its ``ucpd run``, torchrun agent, workers and daemon are SIGKILLed at once and its shm
   dir (its RAM) is removed. Then the go-ahead is given.
3. Node 0's workers fail at their next collective; its torchrun agent stops them and enters a
   new rendezvous round, which completes with node 0 alone once node 1's rendezvous
   heartbeat has expired (``--rdzv-conf keep_alive_interval=1,keep_alive_max_attempt=2``)
   and ``last_call_timeout`` has passed. The new workers see WORLD_SIZE=2, pick data-parallel
   2, restore the newest committed step from node 0's daemon — node 1's part from the
   replica node 0 holds, resharded — and train to the end.
4. The losses are compared, bit for bit, with an uninterrupted run in this process, and node
   0's daemon is asked how it served the restore (its team view, its counters; there is no
   flush dir, so RAM is the only place a restore can come from).

``run_scene()`` is what ``tests/examples/test_elastic.py`` calls; ``main()`` prints the timings.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # examples/: `gpt`

# torchrun's c10d rendezvous, tuned so that a lost node costs seconds, not minutes:
# keep-alive every second, a node silent for 2 of them is dead; a round with at least
# --nnodes' minimum waits last_call_timeout for more nodes (the first round too, so it must
# cover the gap between the two nodes' agents starting on a busy machine)
RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=3,join_timeout=120"


class SceneFailed(RuntimeError):
    """The scene did not go as it should; the message says at which point, with the logs."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class NodeProc:
    """One simulated node: a ``ucpd run -- torchrun ...`` process tree, its dirs and its log."""

    index: int
    run_dir: str
    shm_dir: str
    log: str
    proc: subprocess.Popen | None = None
    lost: bool = False

    def tree(self) -> list[psutil.Process]:
        """``ucpd run``, its daemon, the torchrun agent and its workers (every descendant)."""
        try:
            top = psutil.Process(self.proc.pid)
            return [top, *top.children(recursive=True)]
        except psutil.Error:
            return []

    def lose(self) -> None:
        """The node is gone: every process of it SIGKILLed at once, its RAM (shm dir) wiped."""
        procs = self.tree()
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=10)
        self.proc.wait(10)
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    def tail(self, n: int = 25) -> str:
        out = []
        for title, path in (("ucpd run + torchrun", self.log), ("daemon", os.path.join(self.run_dir, "ucpd-daemon.log"))):
            try:
                with open(path, errors="replace") as f:
                    lines = f.read().splitlines()[-n:]
            except OSError:
                lines = ["(no log)"]
            out.append(f"--- node {self.index}, {title} ({path}):\n" + "\n".join(lines))
        return "\n".join(out)


@dataclass
class SceneResult:
    steps: int
    fail_at: int
    losses: dict[int, float]  # the job's, phase 1 then phase 2
    reference: dict[int, float]  # uninterrupted, one process
    layouts: dict[int, str]  # the layout that computed each step
    restored: list[dict]  # the restarted workers' restore events
    status: dict  # node 0's `ucpd status --json` after the run
    timings: dict[str, float] = field(default_factory=dict)
    node0_exit: int | None = None
    skipped: dict[int, int] = field(default_factory=dict)  # rank -> tensors other ranks wrote for it at the parked step


class Scene:
    def __init__(self, work: str, steps: int, fail_at: int, timeout: float = 240.0, shm_prefix: str = "/dev/shm/ucpd-elastic"):
        self.work, self.steps, self.fail_at, self.timeout = work, steps, fail_at, timeout
        os.makedirs(work, exist_ok=True)
        self.events = os.path.join(work, "events.jsonl")
        self.go = os.path.join(work, "go")
        tag = uuid.uuid4().hex[:8]
        peers = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        self.peers = ",".join(peers)
        self.secret = os.path.join(work, "secret")
        with open(os.open(self.secret, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
        self.rdzv = f"127.0.0.1:{free_port()}"
        self.rdzv_id = f"elastic-{tag}"
        self.nodes = [
            NodeProc(i, os.path.join(work, f"node{i}", "run"), f"{shm_prefix}-{tag}-{i}",
                     os.path.join(work, f"node{i}", "launch.log"))
            for i in range(2)
        ]

    # --- plumbing ---------------------------------------------------------------------------

    def command(self, i: int) -> list[str]:
        node = self.nodes[i]
        ucpd = [sys.executable, "-m", "ucpd", "run", "--run-dir", node.run_dir, "--shm-dir", node.shm_dir,
                "--nodes", "2", "--node-rank", str(i), "--peers", self.peers, "--replicas", "1",
                "--secret-file", self.secret, "--heartbeat", "0.1", "--dead-after", "1.5",
                "--mem-limit", "1G", "--keep", "2"]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", self.rdzv, "--rdzv-id", self.rdzv_id,
                    # node 0 hosts the rendezvous store (on one machine both would match 127.0.0.1)
                    "--rdzv-conf", f"is_host={1 if i == 0 else 0},{RDZV_CONF}",
                    "--max-restarts", "3", "--monitor-interval", "0.2", "--local-addr", "127.0.0.1"]
        script = [os.path.join(HERE, "train.py"), "--steps", str(self.steps), "--hold-at", str(self.fail_at),
                  "--go-file", self.go, "--events", self.events]
        return [*ucpd, "--", *torchrun, *script]

    def start(self, i: int) -> None:
        node = self.nodes[i]
        os.makedirs(os.path.dirname(node.log), exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env.pop("UCPD_JOB", None)  # the job is torchrun's rendezvous id
        # torch 2.13's torchrun shares one TCPStore server with the workers of every restart
        # and prefixes nothing per attempt: a restarted worker can read its predecessors' gloo
        # addresses and fail (connection refused) or hang in init_process_group. Without the
        # sharing, each round's rank 0 worker hosts a store of its own.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        with open(node.log, "ab") as log:
            node.proc = subprocess.Popen(self.command(i), stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=ROOT,
                                         env=env, start_new_session=True)

    def read_events(self) -> list[dict]:
        try:
            with open(self.events) as f:
                return [json.loads(line) for line in f if line.strip()]
        except OSError:
            return []

    def wait_for(self, what: str, ok, timeout: float) -> list[dict]:
        """Poll the events until ``ok(events)``; a node that exits meanwhile, or the timeout, fails."""
        deadline = time.monotonic() + timeout
        while True:
            ev = self.read_events()
            if ok(ev):
                return ev
            for node in self.nodes:
                if node.proc is not None and node.proc.poll() is not None and not node.lost:
                    if not (node.index == 0 and what == "the end of training" and node.proc.returncode == 0):
                        raise SceneFailed(f"while waiting for {what}: node {node.index} exited with "
                                          f"{node.proc.returncode}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise SceneFailed(f"no {what} within {timeout:.0f} s\n{self.logs()}")
            time.sleep(0.05)

    def logs(self) -> str:
        ev = "\n".join(json.dumps(e) for e in self.read_events()[-30:])
        return "\n".join(n.tail() for n in self.nodes) + f"\n--- events ({self.events}):\n{ev}"

    def status(self, i: int) -> dict:
        out = subprocess.run([sys.executable, "-m", "ucpd", "status", "--json", "--run-dir", self.nodes[i].run_dir],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise SceneFailed(f"ucpd status on node {i}: {out.stderr.strip()[-500:]}\n{self.logs()}")
        return json.loads(out.stdout)

    def cleanup(self) -> None:
        for node in self.nodes:
            for p in node.tree() if node.proc is not None and node.proc.poll() is None else []:
                try:
                    p.send_signal(signal.SIGKILL)
                except psutil.Error:
                    pass
            if node.proc is not None and node.proc.poll() is None:
                node.proc.wait(10)
            subprocess.run([sys.executable, "-m", "ucpd", "stop", "--run-dir", node.run_dir], capture_output=True, timeout=30)
            shutil.rmtree(node.shm_dir, ignore_errors=True)

    # --- the scene --------------------------------------------------------------------------

    def run(self) -> SceneResult:
        from gpt import RunSpec, TrainConfig, Trainer

        t0 = time.time()
        for i in (0, 1):
            self.start(i)
        parked = self.wait_for(
            f"4 ranks parked after step {self.fail_at}",
            lambda ev: len({e["rank"] for e in ev if e["event"] == "parked" and e["world"] == 4}) == 4,
            self.timeout,
        )
        first_round = {e["world"] for e in parked if e["event"] == "start"}
        if first_round != {4}:
            raise SceneFailed(f"the job's first rendezvous rounds had worlds {sorted(first_round)}, not just 4: the two "
                              f"agents started too far apart for last_call_timeout\n{self.logs()}")
        t_parked = time.time()

        self.nodes[1].lost = True
        t_loss = time.time()
        self.nodes[1].lose()
        with open(self.go, "w"):
            pass
        t_go = time.time()

        ev = self.wait_for(
            "the end of training",
            lambda ev: len({e["rank"] for e in ev if e["event"] == "done" and e["world"] == 2}) == 2,
            self.timeout,
        )
        node0 = self.nodes[0]
        try:
            node0.proc.wait(60)
        except subprocess.TimeoutExpired:
            raise SceneFailed(f"node 0's `ucpd run` did not exit after training ended\n{self.logs()}") from None
        status = self.status(0)

        # an uninterrupted run, one process, no checkpoints
        torch_threads()
        ref = Trainer(RunSpec(train=TrainConfig(steps=self.steps)), 0, connect=False)
        reference = {ref.step + 1: ref.train_step() for _ in range(self.steps)}

        steps = [e for e in ev if e["event"] == "step"]
        losses, layouts = {}, {}
        for e in steps:  # phase 1 (world 4) up to the loss, phase 2 (world 2) after the restore
            if (e["world"] == 4 and e["step"] <= self.fail_at) or e["world"] == 2:
                losses[e["step"]], layouts[e["step"]] = e["loss"], e["layout"]
        restored = [e for e in ev if e["event"] == "restored" and e["world"] == 2]
        failed = [e for e in ev if e["event"] == "failed" and e["world"] == 4 and e["t"] >= t_go]
        starts2 = [e for e in ev if e["event"] == "start" and e["world"] == 2]
        first2 = [e for e in steps if e["world"] == 2]
        timings = {"start_to_parked": t_parked - t0}
        if failed:
            timings["detect"] = min(e["t"] for e in failed) - t_go  # survivors' collective fails
        if starts2:
            timings["rendezvous"] = min(e["t"] for e in starts2) - (min(e["t"] for e in failed) if failed else t_go)
        if restored and starts2:
            ready = min(e["t"] - e["seconds"] for e in restored)  # when the restore began
            timings["worker_start"] = ready - min(e["t"] for e in starts2)
            timings["restore"] = max(e["seconds"] for e in restored)
        if first2:
            timings["lost_until_training"] = min(e["t"] for e in first2) - t_loss
        skipped = {e["rank"]: e.get("skipped", 0) for e in ev if e["event"] == "parked" and e["world"] == 4}
        return SceneResult(self.steps, self.fail_at, losses, reference, layouts, restored, status, timings,
                           node0.proc.returncode, skipped)


def torch_threads() -> None:
    import torch

    torch.set_num_threads(1)


def run_scene(work: str | None = None, steps: int = 8, fail_at: int = 4, timeout: float = 240.0,
              shm_prefix: str = "/dev/shm/ucpd-elastic") -> SceneResult:
    """Play the scene in ``work`` (a new temp dir if None, removed afterwards), the nodes' shm
    dirs named ``<shm_prefix>-*``; the processes are gone and node 0's daemon stopped when
    this returns or raises."""
    own = work is None
    work = work or tempfile.mkdtemp(prefix="ucpd-elastic-")
    scene = Scene(work, steps, fail_at, timeout, shm_prefix)
    try:
        return scene.run()
    finally:
        scene.cleanup()
        if own:
            shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fail-at", type=int, default=4)
    ap.add_argument("--keep-logs", default=None, help="play in this folder and keep it (logs, events)")
    a = ap.parse_args(argv)
    if not 1 <= a.fail_at < a.steps:
        ap.error("--fail-at must be in [1, --steps - 1]")
    if a.keep_logs:
        os.makedirs(a.keep_logs, exist_ok=True)
    r = run_scene(a.keep_logs and os.path.abspath(a.keep_logs), a.steps, a.fail_at)
    print(f"{'step':>4}  {'layout':<12} {'loss':>12}  {'reference':>12}  same bits")
    for s in sorted(r.reference):
        got = r.losses.get(s)
        print(f"{s:>4}  {r.layouts.get(s, '-'):<12} {got if got is not None else float('nan'):>12.8f}  "
              f"{r.reference[s]:>12.8f}  {'yes' if got == r.reference[s] else 'NO'}")
    t = r.timings
    print(f"node 1 lost after step {r.fail_at}; restored step {sorted({e['step'] for e in r.restored})} on "
          f"{len(r.restored)} ranks ({', '.join(sorted({e['layout'] for e in r.restored}))})")
    for key, what in (("detect", "survivors' collective failed"), ("rendezvous", "torchrun re-rendezvous, new workers"),
                      ("worker_start", "worker imports, gloo, model"), ("restore", "restore from RAM (slowest rank)"),
                      ("lost_until_training", "from the loss to the first resumed step")):
        if key in t:
            print(f"  {what:<42} {t[key]:6.2f} s")
    ok = r.losses == r.reference and r.node0_exit == 0
    print("elastic scene OK" if ok else "elastic scene FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
