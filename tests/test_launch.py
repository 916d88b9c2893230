"""``ucpd run`` (ucpd/launch.py): it starts a daemon or reuses the one serving the run dir
(replacing a stale socket), gives the launcher the environment, forwards signals, returns the
launcher's exit code, stops only the daemon it started and only when asked, and says what
went wrong when it cannot."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from ucpd import launch
from ucpd.cli import build_parser
from ucpd.errors import DaemonUnreachable


def ucpd_run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ucpd", "run", *args], capture_output=True, text=True, timeout=timeout)


def launcher(tmp_path, body: str) -> list[str]:
    """A Python launcher whose code is ``body`` (``OUT`` names a file in tmp_path)."""
    path = tmp_path / "launcher.py"
    path.write_text(f"import json, os, signal, sys, time\nOUT = {str(tmp_path / 'out')!r}\n" + textwrap.dedent(body))
    return [sys.executable, str(path)]


DUMP_ENV = """
with open(OUT, "w") as f:
    json.dump({k: v for k, v in os.environ.items() if k.startswith("UCPD_")}, f)
"""


@pytest.fixture
def node(tmp_path, ucpd_isolation):
    """A run dir and shm dir for ``ucpd run``; whatever daemon serves them is stopped afterwards."""
    run_dir, shm_dir = str(tmp_path / "run"), f"{ucpd_isolation}-run"
    yield {"run": run_dir, "shm": shm_dir, "args": ["--run-dir", run_dir, "--shm-dir", shm_dir, "--mem-limit", "64M"]}
    subprocess.run([sys.executable, "-m", "ucpd", "stop", "--run-dir", run_dir], capture_output=True, timeout=30)


def daemon_pid(run_dir: str) -> int | None:
    """The pid of the daemon holding run_dir's lock (None: nobody)."""
    return launch._lock_holder(run_dir)


def wait_gone(pid: int, timeout: float = 15) -> bool:
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        pass
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_starts_a_daemon_that_outlives_the_launcher_and_serves_the_restarted_job(tmp_path, node, monkeypatch):
    monkeypatch.delenv("UCPD_JOB", raising=False)
    snap = """
    import torch
    from ucpd_client import Checkpointer
    with Checkpointer() as ckpt:  # finds the daemon through UCPD_RUN_DIR
        latest = ckpt.latest()
        if latest is None:
            ckpt.snapshot(5, {"w": torch.arange(1000.0)}).wait()
        else:
            w = torch.zeros(1000)
            ckpt.restore({"w": w})
            assert torch.equal(w, torch.arange(1000.0))
    with open(OUT, "w") as f:
        json.dump({"latest": latest, "env": {k: v for k, v in os.environ.items() if k.startswith("UCPD_")}}, f)
    """
    first = ucpd_run(*node["args"], "--job", "j1", "--", *launcher(tmp_path, snap))
    assert first.returncode == 0, first.stderr
    assert "started a daemon" in first.stderr and "keeps the job's snapshots" in first.stderr
    got = json.loads((tmp_path / "out").read_text())
    assert got["latest"] is None
    assert got["env"]["UCPD_RUN_DIR"] == node["run"] and got["env"]["UCPD_SHM_DIR"] == node["shm"]
    assert got["env"]["UCPD_JOB"] == "j1"
    pid = daemon_pid(node["run"])
    assert pid is not None and psutil.pid_exists(pid)  # left running by default

    # the job started again: the same daemon, the snapshot still in its RAM
    again = ucpd_run("--run-dir", node["run"], "--job", "j1", "--", *launcher(tmp_path, snap))
    assert again.returncode == 0, again.stderr
    assert f"reusing the daemon at {node['run']} (pid {pid}" in again.stderr
    assert json.loads((tmp_path / "out").read_text())["latest"] == 5


def test_without_job_ucpd_job_is_left_unset(tmp_path, node, monkeypatch):
    monkeypatch.delenv("UCPD_JOB", raising=False)
    out = ucpd_run(*node["args"], "--stop-daemon-on-exit", "--", *launcher(tmp_path, DUMP_ENV))
    assert out.returncode == 0, out.stderr
    env = json.loads((tmp_path / "out").read_text())
    assert "UCPD_JOB" not in env and env["UCPD_RUN_DIR"] == node["run"]


def test_reuses_a_running_daemon_and_never_stops_it(tmp_path, make_daemon, monkeypatch):
    d = make_daemon("--mem-limit", "64M", flush=False)
    monkeypatch.delenv("UCPD_RUN_DIR")  # found through --run-dir alone
    out = ucpd_run("--run-dir", d.run_dir, "--keep", "5", "--stop-daemon-on-exit", "--", *launcher(tmp_path, DUMP_ENV))
    assert out.returncode == 0, out.stderr
    assert f"reusing the daemon at {d.run_dir} (pid {d.pid}" in out.stderr
    assert "not applied: --keep" in out.stderr
    env = json.loads((tmp_path / "out").read_text())
    assert env["UCPD_RUN_DIR"] == d.run_dir and env["UCPD_SHM_DIR"] == d.shm_dir  # the daemon's, from hello
    assert d.proc.poll() is None  # not ours to stop


def test_a_stale_socket_of_a_dead_daemon_is_replaced(tmp_path, make_daemon):
    d = make_daemon("--mem-limit", "64M", flush=False)
    d.kill()  # SIGKILL: its socket and lock file stay behind
    assert os.path.exists(os.path.join(d.run_dir, "ucpd.sock"))
    out = ucpd_run("--run-dir", d.run_dir, "--shm-dir", d.shm_dir, "--stop-daemon-on-exit", "--",
                   *launcher(tmp_path, DUMP_ENV))
    assert out.returncode == 0, out.stderr
    assert "stale socket" in out.stderr and "started a daemon" in out.stderr
    assert "stopped the daemon" in out.stderr and daemon_pid(d.run_dir) is None


def test_stop_daemon_on_exit_stops_the_daemon_it_started(tmp_path, node):
    out = ucpd_run(*node["args"], "--stop-daemon-on-exit", "--", *launcher(tmp_path, """
    with open(OUT, "w") as f:
        f.write(open(os.path.join(os.environ["UCPD_RUN_DIR"], "ucpd.lock")).read().strip())
    """))
    assert out.returncode == 0, out.stderr
    pid = int((tmp_path / "out").read_text())
    assert wait_gone(pid) and daemon_pid(node["run"]) is None


@pytest.mark.parametrize("code, expected", [("sys.exit(7)", 7), ("os.kill(os.getpid(), signal.SIGKILL)", 128 + 9)])
def test_returns_the_launchers_exit_code(tmp_path, node, code, expected):
    out = ucpd_run(*node["args"], "--stop-daemon-on-exit", "--", *launcher(tmp_path, code))
    assert out.returncode == expected, out.stderr


def test_forwards_each_signal_to_the_launcher_once(tmp_path, node):
    """USR1 then TERM sent to `ucpd run` reach the launcher (in its own process group) exactly
    once each; the launcher's exit code is returned; the daemon is stopped as asked."""
    body = """
    got = ["ready"]
    def on(sig, _):
        got.append(signal.Signals(sig).name)
        with open(OUT, "w") as f:
            json.dump(got, f)
        if sig == signal.SIGTERM:
            time.sleep(0.3)  # a second delivery would be recorded meanwhile
            with open(OUT, "w") as f:
                json.dump(got, f)
            os._exit(42)
    signal.signal(signal.SIGUSR1, on)
    signal.signal(signal.SIGTERM, on)
    with open(OUT, "w") as f:
        json.dump(["ready"], f)
    while True:
        time.sleep(0.05)
    """
    proc = subprocess.Popen([sys.executable, "-m", "ucpd", "run", *node["args"], "--stop-daemon-on-exit", "--",
                             *launcher(tmp_path, body)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "out").exists() or "ready" not in (tmp_path / "out").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else "no launcher"
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while "SIGUSR1" not in (tmp_path / "out").read_text():
            assert time.monotonic() < deadline, "SIGUSR1 was not forwarded"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 42, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert json.loads((tmp_path / "out").read_text()) == ["ready", "SIGUSR1", "SIGTERM"]
    assert daemon_pid(node["run"]) is None


def test_no_launcher_is_an_error_that_shows_the_usage(node):
    for argv in ([*node["args"]], [*node["args"], "--"]):
        out = ucpd_run(*argv)
        assert out.returncode == 2 and "no launcher after `--`" in out.stderr
    out = ucpd_run(*node["args"], "--", "no-such-launcher-xyz")
    assert out.returncode == 2 and "'no-such-launcher-xyz' not found" in out.stderr
    assert daemon_pid(node["run"]) is None  # nothing started for a job that cannot run


def test_a_daemon_that_fails_to_start_is_reported_with_its_log(tmp_path, node):
    out = ucpd_run(*node["args"], "--nodes", "2", "--", sys.executable, "-c", "pass")  # a team without --peers
    assert out.returncode == 2
    log = os.path.join(node["run"], "ucpd-daemon.log")
    assert f"the daemon exited with code 2 before serving {node['run']}; the end of its log {log}" in out.stderr
    assert "--peers" in out.stderr  # its own error, quoted from the log
    assert not (tmp_path / "out").exists()


def test_a_reused_daemon_must_be_the_node_asked_for(tmp_path, make_daemon):
    d = make_daemon("--mem-limit", "64M", flush=False)
    out = ucpd_run("--run-dir", d.run_dir, "--nodes", "2", "--node-rank", "1", "--", *launcher(tmp_path, DUMP_ENV))
    assert out.returncode == 2
    assert "--nodes 2 (it has 1)" in out.stderr and "--node-rank 1 (it is node 0)" in out.stderr
    assert not (tmp_path / "out").exists()


def test_a_daemon_holding_the_run_dir_without_answering_is_an_error(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "ucpd.sock").touch()  # a socket file nobody answers on
    fd = os.open(run_dir / "ucpd.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # ... held by a live process (this one)
        os.write(fd, f"{os.getpid()}\n".encode())
        with pytest.raises(DaemonUnreachable, match=f"pid {os.getpid()} holds .* did not answer"):
            launch.find_daemon(str(run_dir), timeout=0.5)
    finally:
        os.close(fd)
    assert launch.find_daemon(str(run_dir)) is None  # lock released: a stale socket, not a daemon


def test_serve_options_pass_through_and_help():
    args = build_parser().parse_args(
        ["run", "--nodes", "2", "--node-rank", "1", "--peers", "tcp://a:1,tcp://b:2", "--replicas", "1",
         "--mem-limit", "1G", "--job", "j", "--stop-daemon-on-exit", "--", sys.executable, "-m", "torch.distributed.run"]
    )
    assert launch.serve_argv(args) == ["--node-rank", "1", "--nodes", "2", "--peers", "tcp://a:1,tcp://b:2",
                                       "--mem-limit", "1G", "--replicas", "1", "--job", "j"]
    assert launch.launcher_of(args) == [sys.executable, "-m", "torch.distributed.run"]
    text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    for needle in ("--stop-daemon-on-exit", "UCPD_RUN_DIR", "UCPD_JOB", "--replicas", "torchrun", "ucpd stop"):
        assert needle in text


def test_exit_code_of_a_signal_death():
    assert launch.exit_code(-signal.SIGTERM) == 143 and launch.exit_code(3) == 3
