"""Start a job's ranks as spawned processes (gloo over a file-store rendezvous), follow their
reports, kill them. Used by the demo and the tests."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import tempfile
import threading
import time
from typing import Callable, Iterator

import torch.multiprocessing as mp

from .trainer import RunSpec, rank_main


class JobFailed(RuntimeError):
    """A rank reported an error, died, or the job stopped reporting."""


class Job:
    def __init__(self, spec: RunSpec, name: str = "job"):
        self.spec, self.name = spec, name
        self.world = spec.world
        self.procs: list = []
        self.killed: set[int] = set()
        self._tmp = None

    def start(self) -> "Job":
        ctx = mp.get_context("spawn")
        self.q = ctx.Queue()
        self.go = ctx.Event()
        self._tmp = tempfile.mkdtemp(prefix="ucpd-gpt-")
        rendezvous = os.path.join(self._tmp, "rendezvous")
        self.procs = [
            ctx.Process(target=rank_main, args=(r, self.world, rendezvous, self.q, self.spec, self.go), daemon=True)
            for r in range(self.world)
        ]
        # The ranks ignore SIGINT (inherited through exec): a Ctrl-C goes to whoever runs the
        # job, which stops them in order, instead of every rank printing a traceback.
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            for p in self.procs:
                p.start()
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
        return self

    def _log_tail(self, rank: int) -> str:
        if not self.spec.log_dir:
            return ""
        path = os.path.join(self.spec.log_dir, f"rank{rank}.log")
        try:
            with open(path) as f:
                lines = [ln for ln in f.read().splitlines() if ln.strip()]
        except OSError:
            return ""
        return f" (last line of {path}: {lines[-1]})" if lines else ""

    def _died(self) -> list[int]:
        """Ranks that exited with an error or a signal that we did not send, signals first."""
        dead = [r for r, p in enumerate(self.procs) if p.exitcode not in (None, 0) and r not in self.killed]
        return sorted(dead, key=lambda r: (self.procs[r].exitcode >= 0, r))

    def _death(self, r: int) -> str:
        code = self.procs[r].exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
        return f"rank {r} {how}{self._log_tail(r)}"

    def messages(self, timeout: float) -> Iterator[tuple]:
        """Yield the ranks' reports; raise JobFailed on an error report, a rank that died, or
        ``timeout`` seconds without any report."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.q.get(timeout=0.25)
            except queue.Empty:
                dead = self._died()
                if dead:
                    try:  # its error report may still be in flight
                        msg = self.q.get(timeout=1.0)
                    except queue.Empty:
                        raise JobFailed(f"{self.name}: {self._death(dead[0])}") from None
                elif time.monotonic() > deadline:
                    raise JobFailed(f"{self.name}: no report from any rank for {timeout:.0f} s") from None
                else:
                    continue
            if msg[0] == "error":
                time.sleep(0.5)  # a rank that died is usually why the others fail: name it first
                died = self._died()
                if died and died[0] != msg[1]:
                    then = msg[2]["message"].splitlines()[0][:160]
                    raise JobFailed(f"{self.name}: {self._death(died[0])}; then rank {msg[1]} failed: {then}")
                raise JobFailed(f"{self.name}: rank {msg[1]} failed: {msg[2]['message']}")
            deadline = time.monotonic() + timeout
            yield msg

    def run(self, on_message: Callable[[tuple], bool | None] | None = None, *, until: str = "done",
            timeout: float = 120.0) -> list[tuple]:
        """Collect reports until every rank sent ``until`` (or ``on_message`` returns True)."""
        got, seen = [], set()
        for msg in self.messages(timeout):
            got.append(msg)
            if on_message is not None and on_message(msg):
                break
            if msg[0] == until:
                seen.add(msg[1])
                if len(seen) == self.world:
                    break
        return got

    def kill(self, ranks=None) -> None:
        """SIGKILL the given ranks (default: all)."""
        ranks = range(self.world) if ranks is None else ranks
        for r in ranks:
            p = self.procs[r]
            self.killed.add(r)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        for r in ranks:
            self.procs[r].join(10)

    def join(self, timeout: float = 30.0) -> None:
        for r, p in enumerate(self.procs):
            p.join(timeout)
            if p.exitcode is None:
                self.kill([r])
                raise JobFailed(f"{self.name}: rank {r} did not exit after finishing")
            if p.exitcode != 0 and r not in self.killed:
                raise JobFailed(f"{self.name}: {self._death(r)}")

    def close(self) -> None:
        """Kill whatever still runs and remove the rendezvous folder."""
        alive = [r for r, p in enumerate(self.procs) if p.is_alive()]
        if alive:
            self.kill(alive)
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> "Job":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def run_job(spec: RunSpec, name: str = "job", on_message=None, timeout: float = 120.0) -> list[tuple]:
    """Run a job to the end; returns every report."""
    with Job(spec, name) as job:
        got = job.run(on_message, timeout=timeout)
        job.join()
    return got


def losses(messages: list[tuple]) -> dict[int, float]:
    """{step: loss} from a job's reports."""
    return {m[2]["step"]: m[2]["loss"] for m in messages if m[0] == "step"}
