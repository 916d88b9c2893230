"""Node daemons for the demo and the tests: ``ucpd serve`` processes on loopback, one per
simulated node, each with private run and shm dirs; a node can be lost (SIGKILL, shm wiped)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonFailed(RuntimeError):
    pass


class Node:
    """One ``ucpd serve`` process."""

    def __init__(self, index: int, root: str, args: list[str]):
        self.index = index
        self.run_dir = os.path.join(root, f"node{index}", "run")
        self.shm_dir = f"/dev/shm/ucpd-gpt-{uuid.uuid4().hex[:12]}-{index}"
        self.log = os.path.join(root, f"node{index}", "daemon.log")
        self.args = args
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> None:
        os.makedirs(os.path.dirname(self.log), exist_ok=True)
        cmd = [sys.executable, "-m", "ucpd", "serve", "--run-dir", self.run_dir, "--shm-dir", self.shm_dir,
               "--log-level", "INFO", *self.args]
        with open(self.log, "ab") as log:
            # its own session: a Ctrl-C in the terminal reaches the demo, which stops us in order
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        sock = os.path.join(self.run_dir, "ucpd.sock")
        deadline = time.monotonic() + timeout
        while not os.path.exists(sock):
            if self.proc.poll() is not None:
                raise DaemonFailed(f"node {self.index}'s daemon exited with {self.proc.returncode}: {self.last_log_line()}")
            if time.monotonic() > deadline:
                raise DaemonFailed(f"node {self.index}'s daemon did not open its socket within {timeout:.0f} s")
            time.sleep(0.05)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.alive:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    def lose(self) -> None:
        """The node is gone: its daemon SIGKILLed, its RAM (shm dir) wiped."""
        self.kill()
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    def status(self) -> dict:
        out = subprocess.run([sys.executable, "-m", "ucpd", "status", "--json", "--run-dir", self.run_dir],
                             capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise DaemonFailed(f"ucpd status on node {self.index} failed: {(out.stderr or out.stdout).strip()[-300:]}")
        return json.loads(out.stdout)

    def last_log_line(self) -> str:
        try:
            with open(self.log) as f:
                lines = [ln for ln in f.read().splitlines() if ln.strip()]
        except OSError:
            return "(no log)"
        return lines[-1] if lines else "(empty log)"

    def log_tail(self, n: int = 15) -> str:
        try:
            with open(self.log) as f:
                return "\n".join(f.read().splitlines()[-n:])
        except OSError:
            return "(no log)"


class Cluster:
    """``nodes`` daemons on loopback. With more than one, they form a team (``--replicas``)."""

    def __init__(self, root: str, nodes: int, *, replicas: int = 1, keep: int = 2, mem_limit: str = "1G",
                 extra: tuple[str, ...] = (), job: str = "gpt"):
        self.root = root
        common = ["--mem-limit", mem_limit, "--keep", str(keep), *extra]
        if nodes > 1:
            peers = ",".join(f"tcp://127.0.0.1:{free_port()}" for _ in range(nodes))
            # a team serves one job, named up front (the trainers' RunSpec.job)
            team = ["--nodes", str(nodes), "--peers", peers, "--replicas", str(replicas), "--job", job,
                    "--heartbeat", "0.1", "--dead-after", "1.5"]
            self.nodes = [Node(i, root, [*team, "--node-rank", str(i), *common]) for i in range(nodes)]
        else:
            self.nodes = [Node(0, root, common)]

    def start(self) -> "Cluster":
        for n in self.nodes:
            n.start()
        return self

    @property
    def run_dirs(self) -> tuple[str, ...]:
        return tuple(n.run_dir for n in self.nodes)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def wait_dead(self, lost: int, on: int = 0, timeout: float = 20.0) -> None:
        """Wait until node ``on`` has declared node ``lost`` dead (a team only)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.nodes[on].status()
            nodes = (s.get("team") or {}).get("nodes")
            if nodes is None:
                return
            info = nodes[lost] if isinstance(nodes, list) else nodes.get(str(lost), {})
            if not info.get("live", False):
                return
            if time.monotonic() > deadline:
                raise DaemonFailed(f"node {on} did not notice that node {lost} is gone within {timeout:.0f} s")
            time.sleep(0.1)

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
