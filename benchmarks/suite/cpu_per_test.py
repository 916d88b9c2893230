"""A pytest plugin: each test's wall seconds and the machine's busy CPU seconds while it ran (every
process: the test's daemons and ranks too, whoever their parent), one tab-separated line per test.

Run the suite one test at a time on an otherwise quiet machine, so each test's CPU is its own:

    PYTHONPATH=benchmarks/suite CPU_PER_TEST=cpu.tsv .venv/bin/python -m pytest -q -n 0 \\
        -p cpu_per_test -p no:randomly -p no:cacheprovider

then sum by file or area (docs/TESTING.md, "Where the CPU goes"). ``/proc/stat`` is read, not
the test process's rusage: daemons forked from the zygote and ranks from a forkserver are not
the test's children to wait for.
"""

from __future__ import annotations

import os
import time

_HZ = os.sysconf("SC_CLK_TCK")
_started: dict[str, tuple[float, float]] = {}
_out = None


def busy_seconds() -> float:
    """CPU seconds the machine has spent on anything but idle and I/O wait since boot."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / _HZ


def pytest_configure(config):
    global _out
    _out = open(os.environ.get("CPU_PER_TEST", "cpu_per_test.tsv"), "a")


def pytest_unconfigure(config):
    if _out is not None:
        _out.close()


def pytest_runtest_logstart(nodeid, location):
    _started[nodeid] = (time.monotonic(), busy_seconds())


def pytest_runtest_logfinish(nodeid, location):
    t0, b0 = _started.pop(nodeid)
    _out.write(f"{nodeid}\t{time.monotonic() - t0:.2f}\t{busy_seconds() - b0:.2f}\n")
    _out.flush()
