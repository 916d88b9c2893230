"""Shared fixtures: real daemons in real processes, each test with its own run, shm and flush dirs.

Every test is isolated from every other (and from a developer's own daemon), whatever the order
the tests run in (pytest-randomly shuffles it; ``-p no:randomly`` turns that off, and
``-p randomly --randomly-seed=N`` replays the order a failed run printed):

* ``UCPD_RUN_DIR`` and ``UCPD_SHM_DIR`` point into the test's own folders, so a ``Checkpointer()``,
  an embedded daemon or a ``ucpd`` command that falls back to the defaults never meets another
  test's daemon or segments (nor ``/tmp/ucpd-$USER``); the job and torchrun variables a shell
  may carry (``UCPD_JOB_ID``, ``RANK``, ...) are removed.
* Whatever a test started is stopped when it ends: the daemons of ``make_daemon``, the rank
  processes of ``helpers.ranks.spawn``, and any daemon still serving one of the test's run dirs
  (an embedded daemon outlives the trainer that started it, on purpose).
* Its shm dirs (``/dev/shm/ucpd-test-<id>*``) are removed; ``TMPDIR`` (for the test and the
  processes it starts) is a private folder removed afterwards, and the ranks' gloo rendezvous
  files live in the test's ``tmp_path``: nothing is left in the temp dir.
* A torch.distributed process group the test made in this process is destroyed.
A test that needed cleaning up after gets a PytestWarning naming what it left.
"""

from __future__ import annotations

import fcntl
import glob
import multiprocessing.util
import os
import shutil
import tempfile
import uuid
import warnings

import psutil
import pytest

from ucpd.launch import lock_pid

# One intra-op thread in each test process and every rank it starts (before torch is imported), as
# torchrun sets for several ranks a node (OMP_NUM_THREADS=1): with 3 workers on 2 cores and several
# ranks each, every process's idle OpenMP threads spun for CPU (the RS chaos case's 24 ranks: 11.4
# -> 4.3 CPU-seconds, 8.4 -> 4.3 s). A test that wants more threads asks torch for them.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from helpers import TEST_JOB, ranks  # noqa: E402
from helpers.budgets import Spent  # noqa: E402
from helpers.daemons import Daemon  # noqa: E402

LOCK_NAME = "ucpd.lock"
SOCKET_NAME = "ucpd.sock"

# Variables from the environment that would change what a Checkpointer or a daemon does.
_FOREIGN_ENV = (
    "UCPD_RUN_DIR", "UCPD_SHM_DIR", "UCPD_JOB", "UCPD_JOB_ID", "UCPD_KEEP", "UCPD_MEM_LIMIT", "UCPD_SECRET_FILE",
    "UCPD_EMBEDDED_IDLE_EXIT", "UCPD_RPC_TIMEOUT", "UCPD_FAULT",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
    "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)


def _order_seed(config) -> int | None:
    """pytest-randomly's seed when it shuffled this run (None with ``-p no:randomly``)."""
    if not config.pluginmanager.hasplugin("randomly") or not getattr(config.option, "randomly_reorganize", True):
        return None
    return getattr(config.option, "randomly_seed", None)


def pytest_sessionstart(session):
    seed = _order_seed(session.config)  # printed first too: also under -q, and before a run that hangs
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if seed is not None and reporter is not None:
        reporter.write_line(f"random test order: replay it with -p randomly --randomly-seed={seed}")


_SPENT = Spent()


def pytest_runtest_logreport(report):
    _SPENT.add(report.nodeid, report.duration)


def pytest_terminal_summary(terminalreporter, config):
    if not hasattr(config, "workerinput") and len(_SPENT.seconds) > 1:  # several areas: each against its budget
        terminalreporter.write_sep("-", "time per test area, summed over the workers (tests/helpers/budgets.py)")
        for line in _SPENT.table():
            terminalreporter.write_line(line)
    seed = _order_seed(config)
    if seed is not None:
        terminalreporter.write_line(f"random test order: replay it with -p randomly --randomly-seed={seed}")


def _holder(lock_path: str) -> psutil.Process | None:
    """The live ``ucpd serve`` process that holds a daemon lock file (None: nobody does)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None  # free: its daemon is gone
    except BlockingIOError:
        pass
    finally:
        os.close(fd)  # also drops the lock if we took it
    pid = lock_pid(os.path.dirname(lock_path))
    if not pid or pid == os.getpid():
        return None
    try:
        p = psutil.Process(pid)
        return p if "ucpd" in " ".join(p.cmdline()) else None
    except psutil.Error:
        return None


def stop_daemons_under(*roots: str) -> list[str]:
    """Stop (SIGTERM, then SIGKILL) every daemon whose run or shm dir lock lies under ``roots``;
    returns a line for each one that had to be stopped."""
    found: dict[int, tuple[psutil.Process, str]] = {}
    for root in roots:
        for lock in glob.glob(os.path.join(glob.escape(root), "**", LOCK_NAME), recursive=True):
            p = _holder(lock)
            if p is not None:
                found.setdefault(p.pid, (p, os.path.dirname(lock)))
    for p, _ in found.values():
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs([p for p, _ in found.values()], timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    return [f"pid {p.pid} serving {where}" for p, where in found.values()]


def _default_group_exists() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@pytest.fixture(scope="session", autouse=True)
def _process_wide_temp_dirs(tmp_path_factory):
    """Temp dirs that live as long as a process, not a test, made before any test changes TMPDIR:
    multiprocessing's (made on first use, removed at exit), and torch's inductor cache, which
    importing torch._dynamo (the first DTensor does) makes in the temp dir and then names in
    os.environ for good; here it goes to this run's basetemp, for every process of the run."""
    multiprocessing.util.get_temp_dir()
    session = pytest.MonkeyPatch()
    session.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("torchinductor")))
    yield
    session.undo()


@pytest.fixture(autouse=True)
def ucpd_isolation(request, tmp_path, monkeypatch):
    """Private default dirs for this test; afterwards, stop what it left running and remove its
    shm dirs. Yields the prefix of the test's shm dirs (``/dev/shm/ucpd-test-<id>``)."""
    shm_prefix = f"/dev/shm/ucpd-test-{uuid.uuid4().hex[:12]}"
    for name in _FOREIGN_ENV:
        monkeypatch.delenv(name, raising=False)
    # the temp dir of this test and of every process it starts: removed afterwards (short, for
    # socket paths made under it)
    private_tmp = tempfile.mkdtemp(prefix="ucpd-t-")
    monkeypatch.setenv("TMPDIR", private_tmp)
    monkeypatch.setattr(tempfile, "tempdir", private_tmp)
    monkeypatch.setenv("UCPD_RUN_DIR", str(tmp_path / "default-run"))
    monkeypatch.setenv("UCPD_JOB", TEST_JOB)  # the test's ranks (other processes too) are one job
    monkeypatch.setenv("UCPD_SHM_DIR", f"{shm_prefix}-default")
    monkeypatch.setenv("UCPD_EMBEDDED_IDLE_EXIT", "120")  # a stray embedded daemon ends on its own too
    monkeypatch.setattr(ranks, "WORKDIR", str(tmp_path))
    started: list = []
    monkeypatch.setattr(ranks, "STARTED", started)
    had_group = _default_group_exists()
    yield shm_prefix
    ranks.kill(started)
    if not had_group and _default_group_exists():
        # a Checkpointer made later in this process would take its rank, world size and job id from it
        import torch.distributed as dist

        dist.destroy_process_group()
        warnings.warn(f"{request.node.nodeid} left a torch.distributed process group (now destroyed)", pytest.PytestWarning)
    shm_dirs = glob.glob(glob.escape(shm_prefix) + "*")
    leaked = stop_daemons_under(str(tmp_path), private_tmp, *shm_dirs)
    for d in glob.glob(glob.escape(shm_prefix) + "*"):
        shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(private_tmp, ignore_errors=True)
    if leaked:
        warnings.warn(f"{request.node.nodeid} left daemons running (now stopped): {leaked}", pytest.PytestWarning)


@pytest.fixture
def dirs(tmp_path, ucpd_isolation):
    """A private run dir, shm dir (under /dev/shm, removed afterwards) and flush dir; ``flushed``
    is where the test job's versions are flushed (``<flush-dir>/<job>``)."""
    flush = str(tmp_path / "flush")
    return {"run": str(tmp_path / "run"), "shm": ucpd_isolation, "flush": flush, "flushed": os.path.join(flush, TEST_JOB)}


@pytest.fixture
def make_daemon(dirs):
    """Factory: make_daemon(*extra_args, flush=True) starts a daemon for this test."""
    started: list[Daemon] = []

    def make(*extra: str, flush: bool = True) -> Daemon:
        d = Daemon(dirs["run"], dirs["shm"], extra, dirs["flush"] if flush else None)
        started.append(d)
        return d.start()

    yield make
    for d in started:
        d.stop()


@pytest.fixture
def daemon(make_daemon):
    return make_daemon("--mem-limit", "1G", "--keep", "2")
