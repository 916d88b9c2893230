"""``ucpd serve`` daemons forked from a preloaded interpreter instead of exec'd afresh: the tests'
daemon helper (``helpers.daemons``) starts them through ``start``.

Starting a daemon costs a fresh interpreter most of its start-up CPU: importing
``ucpd.daemon.server`` and its deps (numpy, zmq, psutil, the native module). So each test process
keeps one *zygote* (started on its first daemon; this file run as a script): a Python process that
has imported what ``ucpd serve`` imports, started no thread and made no ZeroMQ context, and waits
for requests on a socket. For each daemon it forks a child that forks the daemon and exits at
once, so the daemon is re-parented to the test process, which holds ``PR_SET_CHILD_SUBREAPER``
for that moment: the daemon is the test process's own child, as an exec'd one would be
(``os.waitpid``, its exit code, ``ppid``). The daemon then does what ``python -m ucpd serve ARGS``
would: ties itself to the test process (``runtime.tie_to_parent``: SIGTERM when it dies, as
``runtime.exit_with_parent`` does for an exec'd one), writes stdout and stderr to the log, takes
the given cwd, environment (applied before ``ucpd.cli.main`` runs) and argv (``sys.argv``, and
``/proc/PID/cmdline``, which ``ps`` and the leak check of tests/conftest.py read), runs
``ucpd.cli.main(ARGS)``, then exits as the interpreter would (threads joined, atexit run).

A daemon in a network namespace (``ip netns exec NS python -m ucpd serve ...``, ``helpers.netns``)
enters it (``setns``) before it runs: all it reads of the network is through sockets and
``getifaddrs``, which see the namespace (``ip netns exec``'s remount of ``/sys`` and the
``/etc/netns`` files change nothing it reads).

Where a fork could differ from a fresh interpreter, ``start`` execs as before: a command that is
not ``[ip netns exec NS] python -m ucpd serve``, an environment that changes a variable the
interpreter or a C library reads at start (``PYTHON*``, ``LD_*``, ``MALLOC_*``, ...) or one the
zygote's imports read (it records them), other than those the child sets again (``UCPD_FAULT``:
``faults.arm``; ``TMPDIR``: tempfile's cache), or ``UCPD_TEST_FORK_DAEMONS=0`` in the
environment (every daemon exec'd).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KNOB = "UCPD_TEST_FORK_DAEMONS"
# what a daemon imports before it serves (python -X importtime -m ucpd serve, a team's node)
PRELOAD = ("ucpd.cli", "ucpd.daemon.cli", "ucpd.daemon.server", "ucpd.daemon.flush_interval", "ucpd.team.team",
           "encodings.idna")
# read by the interpreter or a C library when a process starts: a fork keeps the zygote's
STARTUP_ENV = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "OMP_", "OPENBLAS_", "MKL_", "GOTO_", "NUMEXPR_", "LC_",
               "LANG")
REFRESHED = {"UCPD_FAULT", "TMPDIR", "TEMP", "TMP"}  # read at import, set again in each child (_become)
TITLE_ROOM = 4096  # bytes of argv the zygote starts with, that each daemon's command line is written over
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37  # linux/prctl.h
CLONE_NEWNET = 0x40000000  # linux/sched.h
NETNS_DIR = "/run/netns"  # where ip netns keeps its namespaces

_BASE_ENV = {k: v for k, v in os.environ.items() if k != "UCPD_FAULT"}  # before a test changed it


class Forked:
    """A daemon forked by the zygote, a child of this process: ``subprocess.Popen``'s ``pid``,
    ``args``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate`` and ``kill``."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args, self.returncode = pid, args, None
        self._waitpid = threading.Lock()

    def _reaped(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status)

    def poll(self) -> int | None:
        if self.returncode is None and self._waitpid.acquire(False):
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == self.pid:
                    self._reaped(status)
            except ChildProcessError:  # reaped by someone else (psutil's wait): as Popen, 0
                self.returncode = 0
            finally:
                self._waitpid.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            with self._waitpid:
                if self.returncode is None:
                    try:
                        self._reaped(os.waitpid(self.pid, 0)[1])
                    except ChildProcessError:
                        self.returncode = 0
            return self.returncode
        deadline, delay = time.monotonic() + timeout, 0.0005
        while self.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self):
        if self.returncode is None:  # as Popen: reaped later (start), not left a zombie
            _ACTIVE.append(self)


_ACTIVE: list[Forked] = []  # dropped while running


def start(args: list[str], log_path: str, cwd: str, env: dict | None = None):
    """Start ``args`` (a ``ucpd serve``) with stdout and stderr appended to ``log_path``, tied to
    this process (it gets SIGTERM when this process dies): forked from the zygote where that is
    the same as exec'ing it (see above), else exec'd through ``runtime.exit_with_parent``. Returns
    a ``Forked`` or a ``subprocess.Popen``."""
    _ACTIVE[:] = [f for f in _ACTIVE if f.poll() is None]
    env = dict(os.environ if env is None else env)
    netns, serve = _split(args)
    if serve is not None and _forkable(env):
        forked = _zygote().spawn(serve, netns, log_path, cwd, env)
        if forked is not None:
            return forked
    from ucpd.daemon.runtime import exit_with_parent

    with open(log_path, "ab") as log:
        return subprocess.Popen(exit_with_parent(args), stdout=log, stderr=log, cwd=cwd, env=env)


def _split(args: list[str]) -> tuple[str | None, list[str] | None]:
    """(network namespace or None, the ``python -m ucpd serve ...`` command), or (None, None):
    not a command a fork can run."""
    netns = None
    if args[:3] == ["ip", "netns", "exec"] and len(args) > 3:
        netns, args = args[3], args[4:]
        if os.sep in netns or not os.path.exists(os.path.join(NETNS_DIR, netns)):
            return None, None
    if args[:4] != [sys.executable, "-m", "ucpd", "serve"]:
        return None, None
    return netns, args


def _forkable(env: dict) -> bool:
    if os.environ.get(KNOB, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    keys = set(env) | set(_BASE_ENV)
    return not any(env.get(k) != _BASE_ENV.get(k) for k in keys if k.startswith(STARTUP_ENV))


class _Zygote:
    """The test process's end of its zygote."""

    def __init__(self) -> None:
        from multiprocessing.connection import Connection

        self.owner = os.getpid()
        ours, theirs = socket.socketpair()
        self.errors = os.path.join(_BASE_ENV.get("TMPDIR", "/tmp"), f"ucpd-zygote-{os.getpid()}.log")
        with open(self.errors, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(theirs.fileno()), str(os.getpid()), "x" * TITLE_ROOM],
                pass_fds=[theirs.fileno()], cwd=ROOT, env=_BASE_ENV, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.lock = threading.Lock()
        hello = self._recv()
        if "error" in hello:
            raise RuntimeError(f"the daemon zygote cannot fork ({KNOB}=0 execs every daemon): {hello['error']}")
        self.read_at_import: dict[str, str | None] = hello["read"]
        atexit.register(self.close)

    def close(self) -> None:
        """End it (EOF on its socket) and reap it, so that its CPU time counts as this process's children's."""
        if self.owner != os.getpid():
            return
        self.conn.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.errors)

    def _recv(self):
        try:
            return self.conn.recv()
        except (EOFError, OSError) as exc:
            raise RuntimeError(f"the daemon zygote died ({exc!r}):\n{_tail(self.errors)}") from None

    def ours(self) -> bool:
        """It is alive and this process's (not of the process this one was forked from)."""
        return self.owner == os.getpid() and self.proc.poll() is None

    def spawn(self, args: list[str], netns: str | None, log_path: str, cwd: str, env: dict) -> Forked | None:
        """The daemon (in network namespace ``netns``), forked and now our child; None: this
        environment needs a fresh interpreter."""
        if any(env.get(k) != v for k, v in self.read_at_import.items() if k not in REFRESHED):
            return None
        with self.lock, _subreaper():
            self.conn.send({"args": args, "netns": netns, "log": log_path, "cwd": cwd, "env": env})
            reply = self._recv()
        if "error" in reply:
            raise RuntimeError(f"the daemon zygote could not fork: {reply['error']}")
        return Forked(reply["pid"], args)


_ZYGOTE: _Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def _zygote() -> _Zygote:
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or not _ZYGOTE.ours():
            _ZYGOTE = _Zygote()  # first daemon, a forked copy of this process, or the zygote died
        return _ZYGOTE


class _subreaper:
    """This process adopts the orphans of its descendants while it holds it (PR_SET_CHILD_SUBREAPER)."""

    def __enter__(self):
        self.prctl = ctypes.CDLL(None, use_errno=True).prctl
        was = ctypes.c_int(0)
        self.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0)
        self.was = was.value
        if self.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")

    def __exit__(self, *exc):
        self.prctl(PR_SET_CHILD_SUBREAPER, self.was, 0, 0, 0)


def _tail(path: str, nbytes: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()[-nbytes:].decode(errors="replace")
    except OSError:
        return ""


# the zygote process


def _serve(fd: int, parent: int) -> None:
    """The zygote: preload, check it may fork, then fork a daemon per request until EOF."""
    from multiprocessing.connection import Connection

    from ucpd.daemon.runtime import tie_to_parent

    tie_to_parent(parent)  # the zygote goes with the test process
    os.set_inheritable(fd, False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C reaches the daemons themselves
    conn = Connection(fd)
    _set_title(f"python tests/helpers/zygote.py: forks the daemons of pid {parent}")
    read = _preload()
    why = _unforkable()
    conn.send({"error": why} if why else {"read": read})
    if why:
        return
    while True:
        try:
            req = conn.recv()
        except EOFError:
            return
        try:
            conn.send({"pid": _fork(req, conn, parent)})
        except Exception as exc:  # noqa: BLE001 - told to the test process
            conn.send({"error": repr(exc)})


def _preload() -> dict[str, str | None]:
    """Import what a daemon imports; returns the environment variables read meanwhile."""
    import importlib

    read: dict[str, str | None] = {}
    environ = type(os.environ)
    getitem = environ.__getitem__

    def recording(self, key):
        try:
            value = getitem(self, key)
        except KeyError:
            read[key] = None
            raise
        read[key] = value
        return value

    environ.__getitem__ = recording
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    finally:
        environ.__getitem__ = getitem
    return read


def _unforkable() -> str | None:
    pid = os.fork()  # numpy's OpenBLAS stops its thread pool before a fork (pthread_atfork)
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1 or threading.active_count() != 1:
        return f"importing {', '.join(PRELOAD)} started threads ({threads}): a fork would lose them"
    import logging

    if logging.getLogger().handlers:
        return "importing the daemon configured logging: ucpd serve's own set-up would not apply"
    zmq = sys.modules.get("zmq")
    if zmq is not None and getattr(zmq.Context, "_instance", None) is not None:
        return "importing the daemon made a ZeroMQ context"
    return None


def _fork(req: dict, conn, parent: int) -> int:
    """Fork a child that forks the daemon and exits, so the daemon is re-parented to the test
    process (the subreaper); returns the daemon's pid once that happened."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(r)
            me = os.getpid()
            pid = os.fork()
            if pid == 0:
                os.close(w)
                _become(req, conn, parent, me)  # never returns
            os.write(w, str(pid).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = f.read()
    os.waitpid(middle, 0)
    if not got:
        raise RuntimeError("the zygote's child died before it forked the daemon")
    return int(got)


def _become(req: dict, conn, parent: int, middle: int) -> None:
    """In the forked daemon: what ``python -m ucpd serve ...`` does, then exit as it would."""
    code = 1
    try:
        conn.close()
        while os.getppid() == middle:  # until the middle child has exited and we are the test's
            time.sleep(0.0005)
        from ucpd.daemon.runtime import tie_to_parent

        if os.getppid() != parent or not tie_to_parent(parent):
            os._exit(1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        if req["netns"]:
            _enter_netns(req["netns"])
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        import tempfile

        from ucpd import faults, knobs

        tempfile.tempdir = None
        faults.arm(knobs.get("UCPD_FAULT", "") or "")
        args = req["args"]
        sys.path[0] = os.path.abspath(req["cwd"])
        sys.argv = [os.path.join(ROOT, "ucpd", "__main__.py"), *args[3:]]
        _set_title(" ".join(args))
        from ucpd.cli import main

        code = _exit_code(main, args[3:])
        threading._shutdown()  # what the interpreter does at exit: join the threads, run atexit
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - the interpreter prints it and exits 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _enter_netns(name: str) -> None:
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)


def _exit_code(main, argv: list[str]) -> int:
    """``sys.exit(main(argv))`` as the interpreter ends on it."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _set_title(title: str) -> None:
    """Write ``title`` over this process's argv, as ``setproctitle`` does: ``/proc/self/cmdline``
    shows it (split at its spaces), up to the room the zygote's argv has."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (proc(5): fields 48, 49)
    except (OSError, IndexError, ValueError):
        return
    room = end - start
    text = title.encode()[:room - 2]
    # a NUL after the title, and not at argv's end: the kernel reads it as a title, up to that NUL
    ctypes.memmove(start, text + b"\0" + b" " * (room - len(text) - 1), room)


if __name__ == "__main__":
    sys.path[0] = ROOT  # not tests/helpers/: its modules are no daemon's
    _serve(int(sys.argv[1]), int(sys.argv[2]))
