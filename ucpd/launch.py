"""``ucpd run [serve options] -- LAUNCHER ...``: start (or reuse) this node's daemon, then run
the job's launcher (``torchrun``, ``deepspeed``, a script) beside it.

What it does, in order:

1. Finds the daemon of the run dir (``--run-dir``, else ``$UCPD_RUN_DIR``, else the default).
   One that answers ``hello`` is reused, as it is (it keeps the options it was started with; a
   ``--nodes``/``--node-rank``/``--shm-dir`` that contradicts it is an error). A socket left by
   a dead daemon (nobody holds the run dir's lock) is stale: a new daemon replaces it. A daemon
   that holds the lock but does not answer is an error, not something to start beside.
2. Otherwise starts ``ucpd serve`` with the serve options given here, in its own session (a
   Ctrl-C for the job does not reach it), logging to ``<run-dir>/ucpd-daemon.log``, and waits
   until it answers; if it exits or stays silent, the error quotes the end of that log.
3. Runs the launcher with ``UCPD_RUN_DIR`` (and ``UCPD_SHM_DIR``: the daemon's segment folder,
   where a daemon restarted later for this run dir re-adopts the snapshots) in its environment,
   and ``UCPD_JOB`` if ``--job`` is given (``ucpd serve``'s ``--job`` too: passed to a daemon
   started here; without it the trainers derive the job from torchrun's rendezvous id). The launcher runs in its own process group; SIGINT,
   SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 sent to ``ucpd run`` are forwarded to it once.
4. Returns the launcher's exit code (128 + N when signal N killed it). The daemon it started
   keeps running afterwards, holding the job's snapshots in RAM, so that the job restarted
   (by hand, by a scheduler, by ``torchrun --max-restarts``) restores from memory; it exits
   after ``--idle-exit`` seconds without clients if given, on ``ucpd stop``, or at once when
   ``--stop-daemon-on-exit`` is passed. A reused daemon is never stopped by ``ucpd run``.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass

from . import knobs
from .errors import AlreadyRunning, DaemonUnreachable, LaunchError
from .daemon.runtime import LOCK_NAME  # the run dir's lock, holding the daemon's pid

LOG_NAME = "ucpd-daemon.log"
SOCKET_NAME = "ucpd.sock"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# options that only ``ucpd run`` reads; everything else of ``ucpd serve`` (``--job`` too) is passed through
_OWN = ("stop_daemon_on_exit", "start_timeout", "launcher", "help")

DESCRIPTION = """\
Start (or reuse) this node's ucpd daemon, then run the job's launcher beside it.

Run it once per node, in place of the launcher: `ucpd run [serve options] -- torchrun ...`.
A daemon already serving the run dir is reused as it is; otherwise one is started with the
serve options given here (the same as `ucpd serve`'s, team flags included) and logs to
<run-dir>/ucpd-daemon.log. The launcher gets UCPD_RUN_DIR, UCPD_SHM_DIR and, with --job,
UCPD_JOB in its environment (without --job, trainers take the job from torchrun's
rendezvous id), and the signals ucpd run receives. ucpd run exits with the launcher's code.

The daemon outlives the launcher by default: it keeps the job's last snapshots in RAM, so
a restarted job resumes from memory. Stop it with `ucpd stop --run-dir DIR`, let it exit when
idle (--idle-exit SECONDS), or pass --stop-daemon-on-exit."""

EPILOG = """\
examples:
  # one node
  ucpd run --mem-limit 64G -- torchrun --nproc-per-node 8 train.py
  # every node of a Slurm job (srun sets SLURM_JOB_NODELIST and SLURM_NODEID), or of a torchrun rendezvous
  srun --ntasks-per-node 1 ucpd run --peers-from slurm --replicas 1 -- torchrun --nproc-per-node 8 train.py
  ucpd run --peers-from torchrun --replicas 1 -- torchrun --nnodes 4 --nproc-per-node 8 \
      --rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id job42 train.py
  # node I of N from a list written by hand, elastic (survivors restart; their daemons keep a lost node's replicas)
  ucpd run --nodes N --node-rank I --peers tcp://node0:7420,...,tcp://nodeN-1:7420 \\
           --replicas 1 --secret-file /run/secrets/ucpd -- \\
      torchrun --nnodes 1:N --nproc-per-node 8 --rdzv-backend c10d \\
               --rdzv-endpoint node0:29400 --rdzv-id job42 --max-restarts 3 train.py"""


@dataclass
class NodeDaemon:
    """The daemon ``ucpd run`` works with: one it found, or one it started (``proc``)."""

    run_dir: str
    pid: int
    shm_dir: str
    node_rank: int
    nodes: int
    proc: subprocess.Popen | None = None
    log: str | None = None

    @property
    def started(self) -> bool:
        return self.proc is not None

    def stop(self, timeout: float = 30.0) -> None:
        """Shut down the daemon we started, as ``ucpd stop`` does (SIGTERM if it does not
        answer, SIGKILL if it hangs)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        from .rpc import Connection

        try:
            with Connection(self.run_dir, timeout=10.0) as conn:
                conn.call("shutdown")
        except DaemonUnreachable:
            self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- the command line ------------------------------------------------------------------------


def _serve_parser() -> argparse.ArgumentParser:
    """``ucpd serve``'s own parser, so that ``ucpd run`` takes exactly its options."""
    from .daemon import cli as daemon_cli

    sub = argparse.ArgumentParser(add_help=False).add_subparsers()
    daemon_cli.add_commands(sub)
    return sub.choices["serve"]


def add_command(sub) -> None:
    serve = _serve_parser()
    p = sub.add_parser(
        "run", parents=[serve], conflict_handler="resolve",
        help="start (or reuse) the node daemon, then the launcher (ucpd run -- torchrun ...)",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    own = p.add_argument_group("ucpd run")
    own.add_argument("--stop-daemon-on-exit", action="store_true",
                     help="stop the daemon this command started when the launcher exits (default: it keeps running, "
                          "holding the snapshots for a restarted job; a reused daemon is never stopped)")
    own.add_argument("--start-timeout", type=float, default=60.0, help="seconds to wait for a new daemon to answer (default 60)")
    p.add_argument("launcher", nargs=argparse.REMAINDER, help="-- then the launcher and its arguments")
    for action in p._actions:  # serve's --job (the job a team serves, passed through) is exported too
        if action.dest == "job":
            action.help = ("the job: exported to the launcher as UCPD_JOB, and the job a daemon started here serves "
                           "(default: UCPD_JOB left unset, trainers use torchrun's rendezvous id)")
    p.set_defaults(func=cmd_run, _serve_actions=[a for a in serve._actions if a.dest != "help"])


def serve_argv(args) -> list[str]:
    """The serve options given on the command line, as ``ucpd serve`` arguments (defaults left out)."""
    out: list[str] = []
    for action in args._serve_actions:
        value = getattr(args, action.dest, None)
        if value is None or value == action.default or action.dest in _OWN:
            continue
        flag = action.option_strings[-1]
        if isinstance(value, bool):
            out.append(flag)
        else:
            out += [flag, str(value)]
    return out


def _options(args) -> dict:
    """The options that say which daemon this is (run dir, shm dir, node rank, nodes), from the
    command line over the --config file, as ``ucpd serve`` reads them."""
    opts: dict = {}
    if getattr(args, "config", None):
        with open(args.config, "rb") as f:
            opts = {k.replace("-", "_"): v for k, v in tomllib.load(f).items()}
    for key in ("run_dir", "shm_dir", "node_rank", "nodes"):
        if getattr(args, key, None) is not None:
            opts[key] = getattr(args, key)
    return opts


def torchrun_peers(argv: list[str], launcher: list[str]) -> list[str]:
    """``--peers-from torchrun`` as the daemon reads it: the store beside the launcher's own
    rendezvous endpoint (``c10d://HOST:PORT+1``) and, unless given, its ``--nnodes``."""
    if "--peers-from" not in argv or argv[argv.index("--peers-from") + 1] != "torchrun":
        return argv
    from .team.peers_from import torchrun_endpoint

    host, port, nnodes = torchrun_endpoint(launcher, os.environ)
    out = list(argv)
    out[out.index("--peers-from") + 1] = f"c10d://{host}:{port + 1}"
    if nnodes and "--nodes" not in out:
        out += ["--nodes", str(nnodes)]
    return out


def launcher_of(args) -> list[str]:
    launcher = list(args.launcher or [])
    if launcher[:1] == ["--"]:
        launcher = launcher[1:]
    if not launcher:
        raise LaunchError(
            "no launcher after `--`: write `ucpd run [serve options] -- torchrun --nproc-per-node N train.py`"
        )
    if shutil.which(launcher[0]) is None:
        raise LaunchError(f"launcher {launcher[0]!r} not found (not on PATH, or not executable)")
    return launcher


def cmd_run(args) -> int:
    launcher = launcher_of(args)
    opts = _options(args)
    run_dir = os.path.abspath(opts.get("run_dir") or knobs.run_dir())
    daemon = find_daemon(run_dir)
    if daemon is not None:
        check_matches(daemon, opts)
        say(f"reusing the daemon at {run_dir} (pid {daemon.pid}, node {daemon.node_rank} of {daemon.nodes}, "
            f"shm {daemon.shm_dir})")
        ignored = [a for a in serve_argv(args) if a.startswith("--") and a not in ("--run-dir", "--shm-dir", "--nodes", "--node-rank")]
        if ignored:
            say(f"it keeps the options it was started with; not applied: {' '.join(ignored)}")
    else:
        daemon = start_daemon(run_dir, torchrun_peers(serve_argv(args), launcher), args.start_timeout)
        say(f"started a daemon at {run_dir} (pid {daemon.pid}, node {daemon.node_rank} of {daemon.nodes}, "
            f"shm {daemon.shm_dir}, log {daemon.log})")
    try:
        code = run_launcher(launcher, launcher_env(os.environ, daemon, args.job))
    finally:
        if daemon.started and args.stop_daemon_on_exit:
            daemon.stop()
            say(f"stopped the daemon at {run_dir} (--stop-daemon-on-exit)")
        elif daemon.started:
            say(f"the daemon (pid {daemon.pid}) keeps the job's snapshots in RAM at {run_dir} for a restarted job; "
                f"`ucpd stop --run-dir {run_dir}` frees them")
    return code


def say(text: str) -> None:
    print(f"ucpd run: {text}", file=sys.stderr, flush=True)


# --- the daemon ------------------------------------------------------------------------------


def _lock_holder(run_dir: str) -> int | None:
    """The pid in the run dir's lock file if a live process holds the lock, else None (no
    daemon, or a dead one whose socket is stale)."""
    path = os.path.join(run_dir, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: read who holds it
            try:
                return int(os.pread(fd, 32, 0).decode().strip() or 0) or -1
            except ValueError:
                return -1
        return None  # we could take it: nobody holds it
    finally:
        os.close(fd)  # drops our lock too


def lock_pid(run_dir: str) -> int | None:
    """The pid written in the run dir's lock file (whether or not its writer still holds it)."""
    try:
        with open(os.path.join(run_dir, LOCK_NAME)) as f:
            return int(f.read().strip() or 0) or None
    except (OSError, ValueError):
        return None


def _hello(run_dir: str, timeout: float) -> dict:
    from .rpc import Connection

    with Connection(run_dir, timeout=timeout) as conn:
        return conn.call("hello", rank=0, world_size=1, pid=os.getpid())


def _described(run_dir: str, reply: dict, proc=None, log=None) -> NodeDaemon:
    return NodeDaemon(run_dir, int(reply["pid"]), str(reply["shm_dir"]), int(reply.get("node_rank", 0)),
                      int(reply.get("nodes", 1)), proc, log)


def find_daemon(run_dir: str, timeout: float = 10.0) -> NodeDaemon | None:
    """The daemon serving ``run_dir``, or None when there is none (no socket, or a stale one
    whose daemon is gone). A daemon that holds the run dir but does not answer raises."""
    if not os.path.exists(os.path.join(run_dir, SOCKET_NAME)):
        return None
    holder = _lock_holder(run_dir)
    if holder is None:
        say(f"{run_dir} has a stale socket (its daemon is gone); starting a new daemon")
        return None
    try:
        return _described(run_dir, _hello(run_dir, timeout))
    except DaemonUnreachable:
        who = f"pid {holder}" if holder > 0 else "a process"
        raise DaemonUnreachable(
            f"{who} holds {run_dir} but its daemon did not answer within {timeout:.0f} s: check "
            f"`ucpd status --run-dir {run_dir}`, stop it (`kill {holder if holder > 0 else 'PID'}`), or pass another --run-dir"
        ) from None


def check_matches(daemon: NodeDaemon, opts: dict) -> None:
    """A reused daemon must be the node this command describes."""
    wrong = []
    if "nodes" in opts and int(opts["nodes"]) != daemon.nodes:
        wrong.append(f"--nodes {opts['nodes']} (it has {daemon.nodes})")
    if "node_rank" in opts and int(opts["node_rank"]) != daemon.node_rank:
        wrong.append(f"--node-rank {opts['node_rank']} (it is node {daemon.node_rank})")
    if opts.get("shm_dir") and os.path.realpath(opts["shm_dir"]) != os.path.realpath(daemon.shm_dir):
        wrong.append(f"--shm-dir {opts['shm_dir']} (it uses {daemon.shm_dir})")
    if wrong:
        raise AlreadyRunning(
            f"the daemon already serving {daemon.run_dir} (pid {daemon.pid}) is not the one asked for: "
            f"{', '.join(wrong)}; stop it (`ucpd stop --run-dir {daemon.run_dir}`) or pass another --run-dir"
        )


def _log_tail(path: str, lines: int = 8) -> str:
    try:
        with open(path, errors="replace") as f:
            got = [ln for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return "\n".join("    " + ln for ln in got[-lines:]) or "    (empty log)"


def start_daemon(run_dir: str, serve_args: list[str], timeout: float = 60.0) -> NodeDaemon:
    """Start ``ucpd serve --run-dir run_dir ...`` in its own session and wait until it answers.
    Raises DaemonUnreachable (quoting its log) if it exits or stays silent."""
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    log = os.path.join(run_dir, LOG_NAME)
    cmd = [sys.executable, "-m", "ucpd", "serve", "--run-dir", run_dir, *serve_args]
    with open(log, "ab") as out:
        out.write(f"--- ucpd run started: {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            other = find_daemon(run_dir)  # lost a race to another `ucpd run` on this node?
            if other is not None and other.pid != proc.pid:
                say(f"another daemon started at {run_dir} meanwhile (pid {other.pid}); reusing it")
                return other
            raise DaemonUnreachable(
                f"the daemon exited with code {proc.returncode} before serving {run_dir}; the end of its log "
                f"{log}:\n{_log_tail(log)}"
            )
        # the daemon writes its pid into the lock file once it holds the lock, then binds the
        # socket (read without flock: probing the lock now could make the new daemon's own
        # non-blocking flock fail)
        if lock_pid(run_dir) == proc.pid and os.path.exists(os.path.join(run_dir, SOCKET_NAME)):
            try:
                reply = _hello(run_dir, 2.0)
                if int(reply["pid"]) == proc.pid:
                    return _described(run_dir, reply, proc, log)
            except DaemonUnreachable:
                pass
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise DaemonUnreachable(
                f"the daemon started at {run_dir} did not answer within {timeout:.0f} s (killed); the end of its "
                f"log {log}:\n{_log_tail(log)}"
            )
        time.sleep(0.05)


# --- the launcher ----------------------------------------------------------------------------


def launcher_env(base, daemon: NodeDaemon, job: str | None) -> dict[str, str]:
    """The launcher's environment: ``base`` with the daemon's run and shm dirs, and UCPD_JOB
    when a job is given (else whatever ``base`` has: unset unless the user set it)."""
    env = dict(base)
    env["UCPD_RUN_DIR"] = daemon.run_dir
    env["UCPD_SHM_DIR"] = daemon.shm_dir
    if job:
        env["UCPD_JOB"] = job
    return env


def exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it: 128 + N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def run_launcher(launcher: list[str], env: dict[str, str]) -> int:
    """Run the launcher in its own process group, forward our signals to it, return its code."""
    try:
        proc = subprocess.Popen(launcher, env=env, process_group=0)
    except OSError as exc:
        raise LaunchError(f"cannot start the launcher {launcher[0]!r}: {exc}") from None

    def forward(signum, _frame):
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {}
    for sig in FORWARDED:
        try:
            previous[sig] = signal.signal(sig, forward)
        except ValueError:  # not the main thread: the launcher still runs, unforwarded
            break
    try:
        while True:
            try:
                return exit_code(proc.wait())
            except KeyboardInterrupt:  # a SIGINT that arrived before our handler: forwarded too
                forward(signal.SIGINT, None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
