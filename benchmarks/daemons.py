"""What a benchmark starts and makes, and how it goes away: ``ucpd serve`` daemons with private
run and shm folders, teams of them on loopback, and the cleanup that stops every process and
removes every folder on every exit path (errors, SIGTERM, SIGINT).

Import from a script under ``benchmarks/<name>/`` as ``common`` is (see its docstring). Standard
library only: ``benchmarks/gpu/bench_gpu.py`` runs it on a GPU machine without network.

    from daemons import cleanup_on_exit, start_daemon
    cleanup_on_exit()
    d = start_daemon("ucpd-bench-x-", "ram", ["--keep", "1"])
    ...
    d.stop()
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# variables of a trainer's or a launcher's environment that would change what a daemon (or the
# ranks a benchmark spawns) does: none of them reaches a process a benchmark starts
FOREIGN_ENV = (
    "UCPD_RUN_DIR", "UCPD_SHM_DIR", "UCPD_JOB_ID", "UCPD_KEEP", "UCPD_MEM_LIMIT", "UCPD_SECRET_FILE",
    "UCPD_EMBEDDED_IDLE_EXIT", "UCPD_RPC_TIMEOUT", "UCPD_FAULT", "UCPD_PEER_PAYLOAD_MAC",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
    "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)

# ------------------------------------------------------------------------------------------------
# cleanup: what is registered here is stopped (newest first), then the folders are removed

_STOPPABLE: list = []  # objects with a stop() method: daemons, rank processes, socket pairs
_PATHS: list[str] = []


def on_cleanup(obj) -> None:
    """Call ``obj.stop()`` at cleanup unless :func:`forget` was called for it first."""
    _STOPPABLE.append(obj)


def forget(obj) -> None:
    if obj in _STOPPABLE:
        _STOPPABLE.remove(obj)


def remove_at_cleanup(path: str) -> str:
    _PATHS.append(path)
    return path


def cleanup() -> None:
    """Stop everything registered, newest first, and remove every registered folder."""
    while _STOPPABLE:
        obj = _STOPPABLE.pop()
        try:
            obj.stop()
        except Exception:  # the rest still goes
            pass
    for path in _PATHS:
        shutil.rmtree(path, ignore_errors=True)
    _PATHS.clear()


def _on_signal(signum, _frame):
    cleanup()
    sys.exit(128 + signum)


def cleanup_on_exit() -> None:
    """Run :func:`cleanup` at exit and on SIGTERM / SIGINT (``run_all.py`` stops a benchmark
    that overran with SIGTERM)."""
    atexit.register(cleanup)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)


def private_dir(prefix: str, tag: str, shm: bool = True) -> str:
    """A new folder ``<prefix><tag>-XXXX`` on /dev/shm (or in the temp dir), removed at cleanup."""
    return remove_at_cleanup(tempfile.mkdtemp(prefix=f"{prefix}{tag}-", dir="/dev/shm" if shm else None))


def enough_shm(need: int) -> bool:
    """Whether /dev/shm has ``need`` bytes free; says so on stderr when not."""
    free = shutil.disk_usage("/dev/shm").free
    if free < need:
        print(f"/dev/shm has {free / (1 << 30):.1f} GiB free, this run needs about {need / (1 << 30):.1f} GiB", file=sys.stderr)
        return False
    return True


# ------------------------------------------------------------------------------------------------
# daemons


def child_env() -> dict:
    """The environment of a process a benchmark starts: this checkout's ``ucpd`` and client first
    on the path, none of :data:`FOREIGN_ENV`."""
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "client")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _die_with_parent() -> None:
    try:  # PR_SET_PDEATHSIG: a daemon of a benchmark killed with SIGKILL does not outlive it
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except Exception:
        pass


class Daemon:
    """A ``ucpd serve`` process on ``run_dir`` and ``shm_dir``.

    ``log``: a file that gets the daemon's output (None: this process's stdout and stderr);
    ``installed``: run the ``ucpd`` this Python imports, in its run dir with this process's
    environment (``make gpu-check``: its build must win over the checkout's, which has none),
    else this checkout's (:func:`child_env`, in the checkout); ``remove``: folders removed when
    it stops."""

    def __init__(self, run_dir: str, shm_dir: str, args=(), *, tag: str = "daemon", log: str | None = None,
                 installed: bool = False, remove=()):
        self.run_dir, self.shm_dir, self.args, self.tag, self.log = run_dir, shm_dir, list(args), tag, log
        self.installed, self.remove = installed, list(remove)
        self.proc: subprocess.Popen | None = None

    def _where(self) -> dict:
        if self.installed:
            return {"cwd": self.run_dir, "env": None}
        return {"cwd": str(ROOT), "env": child_env()}

    def start(self, timeout: float = 60.0) -> "Daemon":
        """Start it and return once it serves: its socket is there and its lock file names it."""
        cmd = [sys.executable, "-m", "ucpd", "serve", "--run-dir", self.run_dir, "--shm-dir", self.shm_dir, *self.args]
        if self.log:
            with open(self.log, "ab") as f:
                f.write(f"$ {' '.join(cmd)}\n".encode())
                f.flush()
                self.proc = subprocess.Popen(cmd, stdout=f, stderr=f, preexec_fn=_die_with_parent, **self._where())
        else:
            self.proc = subprocess.Popen(cmd, preexec_fn=_die_with_parent, **self._where())
        on_cleanup(self)
        sock = os.path.join(self.run_dir, "ucpd.sock")
        deadline = time.monotonic() + timeout
        while True:
            try:
                with open(os.path.join(self.run_dir, "ucpd.lock")) as f:
                    pid = int(f.read().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if os.path.exists(sock) and pid == self.proc.pid:
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon {self.tag} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon {self.tag} did not start in {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.02)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def status(self) -> dict:
        """The daemon's ``status`` reply, over its socket."""
        from ucpd.rpc import Connection

        with Connection(self.run_dir, timeout=20.0) as c:
            return c.call("status")

    def cli_status(self) -> dict:
        """``ucpd status --json`` (what an operator runs)."""
        out = subprocess.run([sys.executable, "-m", "ucpd", "status", "--json", "--run-dir", self.run_dir],
                             capture_output=True, text=True, timeout=60, check=True, **self._where())
        return json.loads(out.stdout)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> list[str]:
        """SIGTERM (SIGKILL after 30 s), then its ``remove`` folders go. Returns the last 200
        lines of its log (read before they go)."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        forget(self)
        lines = self.log_lines(200)
        for path in self.remove:
            shutil.rmtree(path, ignore_errors=True)
        return lines

    def log_lines(self, n: int = 40) -> list[str]:
        if not self.log:
            return []
        try:
            with open(self.log, errors="replace") as f:
                return f.read().splitlines()[-n:]
        except OSError:
            return []

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_lines(n))


def start_daemon(prefix: str, tag: str, args=(), *, log: bool = True, installed: bool = False) -> Daemon:
    """A started daemon with a private run dir ``<temp>/<prefix>run-<tag>-*`` and shm dir
    ``/dev/shm/<prefix><tag>-*/segments``, both removed when it stops; its log (with ``log``)
    is ``daemon.log`` in its run dir. ``installed``: as :class:`Daemon`'s."""
    run_dir = private_dir(prefix, f"run-{tag}", shm=False)
    shm_root = private_dir(prefix, tag)
    return Daemon(run_dir, os.path.join(shm_root, "segments"), args, tag=tag, log=os.path.join(run_dir, "daemon.log") if log else None,
                  installed=installed, remove=[shm_root, run_dir]).start()


# ------------------------------------------------------------------------------------------------
# teams on loopback


def join_or_kill(procs, timeout: float = 60.0) -> None:
    """Wait for each process (``multiprocessing``) up to ``timeout``; kill the ones still alive."""
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, what: str, timeout: float, daemons=(), interval: float = 0.1):
    """Poll ``cond()`` until true; after ``timeout`` s a TimeoutError with the daemons' log tails
    (an exception of ``cond`` counts as false until then)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if cond():
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {d.tag}\n{d.log_tail(30)}" for d in daemons)
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}\n{logs}")
        time.sleep(interval)


class Loopback:
    """A run's temp dir and shm root (both removed at cleanup), its daemons and teams under them,
    each logging to ``<tmp>/<tag>/daemon.log`` (copied to ``keep_logs`` by :meth:`save_logs`)."""

    def __init__(self, prefix: str, keep_logs: str | None = None):
        self.tmp = remove_at_cleanup(tempfile.mkdtemp(prefix=prefix))
        self.shm = remove_at_cleanup(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))
        self.keep_logs = keep_logs
        self.daemons: list[Daemon] = []

    def _daemon(self, tag: str, args) -> Daemon:
        d_dir = os.path.join(self.tmp, tag)
        os.makedirs(d_dir, exist_ok=True)
        shm_dir = os.path.join(self.shm, tag)
        d = Daemon(os.path.join(d_dir, "run"), shm_dir, args, tag=tag, log=os.path.join(d_dir, "daemon.log"), remove=[shm_dir])
        self.daemons.append(d)
        return d

    def daemon(self, tag: str, args) -> Daemon:
        """A plain daemon (``args``: its flags), started."""
        return self._daemon(tag, args).start()

    def team(self, tag: str, n: int, extra) -> list[Daemon]:
        """``n`` daemons (``--nodes n --node-rank i --peers ...`` on free loopback ports, plus
        ``extra``), started; returns once every node sees every node live."""
        peers = ",".join(f"tcp://127.0.0.1:{free_port()}" for _ in range(n))
        nodes = [self._daemon(f"{tag}-n{i}", ["--nodes", str(n), "--node-rank", str(i), "--peers", peers, *extra]) for i in range(n)]
        for d in nodes:
            d.start()
        wait_for(lambda: all(all(x["live"] for x in d.status()["team"]["nodes"]) for d in nodes), f"team {tag} to form", 60, nodes)
        return nodes

    def save_logs(self) -> None:
        if not self.keep_logs:
            return
        os.makedirs(self.keep_logs, exist_ok=True)
        for d in self.daemons:
            if os.path.exists(d.log):
                shutil.copy(d.log, os.path.join(self.keep_logs, f"{d.tag}.log"))
