"""A daemon whose controlling process dies exits instead of living on (``runtime.exit_with_parent``,
which the tests' daemon helpers and the chaos campaign start every daemon through): the process
that started it is SIGKILLed (a campaign ended by ``timeout``), and the daemon is gone within
seconds, its run dir free for the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil

from helpers.waiting import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STARTER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from helpers.daemons import spawn_and_wait
    proc = spawn_and_wait([sys.executable, "-m", "ucpd", "serve", "--run-dir", {run!r}, "--shm-dir", {shm!r},
                           "--mem-limit", "64M"], {run!r}, {log!r}, cwd={root!r})
    print(proc.pid, flush=True)
    time.sleep(600)
""")


def test_a_daemon_exits_when_the_process_that_started_it_is_killed(tmp_path, ucpd_isolation):
    run, shm, log = str(tmp_path / "run"), f"{ucpd_isolation}-pd", str(tmp_path / "daemon.log")
    code = STARTER.format(tests=os.path.join(ROOT, "tests"), run=run, shm=shm, log=log, root=ROOT)
    starter = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        pid = int(starter.stdout.readline())
        daemon = psutil.Process(pid)
        assert "serve" in daemon.cmdline() and daemon.ppid() == starter.pid  # the daemon itself, not a wrapper
        starter.send_signal(signal.SIGKILL)  # no clean-up runs in the starter
        starter.wait()
        wait_until(lambda: not daemon.is_running() or daemon.status() == psutil.STATUS_ZOMBIE,
                   "the daemon to exit after its parent died", 20)
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
    with open(log) as f:
        assert "Traceback" not in f.read()  # it stopped as on SIGTERM: cleanly
