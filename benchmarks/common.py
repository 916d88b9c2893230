"""Small helpers shared by the benchmark scripts: timing (a snapshot timed to its end
included), machine facts, spreads over runs, tables, log lines, JSON. (Daemons, teams and
cleanup: ``daemons.py``.)

Import from a script under ``benchmarks/<name>/`` with::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from common import ...

GB/s everywhere are 10^9 bytes per second. The machines we run on are shared and noisy:
compare figures taken in the same run, and report medians.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Iterable, Sequence

GiB = 1 << 30
MiB = 1 << 20


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def time_reps(fn: Callable[[], object], reps: int, warmup: int = 1) -> list[float]:
    """Wall seconds of ``reps`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def timed_snapshot(ck, step: int, state, placements=None) -> tuple[dict, dict]:
    """One ``ck.snapshot()`` waited to the end: the caller's seconds until the call returned,
    ``staged()`` returned and ``wait()`` returned (``call``, ``staged``, ``committed``), and the
    handle's own perf_counter stamps (``handle.timings``: called, returned, slot, staged, sealed,
    committed)."""
    t0 = time.perf_counter()
    h = ck.snapshot(step, state, placements=placements)
    t1 = time.perf_counter()
    h.staged()
    t2 = time.perf_counter()
    h.wait()
    t3 = time.perf_counter()
    return {"call": t1 - t0, "staged": t2 - t0, "committed": t3 - t0}, h.timings


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds and seconds > 0 else float("nan")


def machine() -> dict:
    """What the figures were measured on."""
    info = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["mem_gib"] = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    if "torch" in sys.modules:
        info["torch"] = sys.modules["torch"].__version__
    return info


def spread(xs: Iterable[float | None]) -> dict:
    """median, min, max, n and the values of ``xs`` (None left out; None figures when empty)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0, "runs": []}
    return {"median": median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "runs": xs}


def fmt_spread(xs: Iterable[float | None]) -> str:
    """"min / median / max" of seconds ("-" when there are none)."""
    s = spread(xs)
    if not s["n"]:
        return "-"
    return f"{fmt_seconds(s['min'])} / {fmt_seconds(s['median'])} / {fmt_seconds(s['max'])}"


def fmt_spread_num(xs: Iterable[float | None], digits: int = 2, unit: str = "") -> str:
    """"min / median / max" of numbers ("-" when there are none)."""
    s = spread(xs)
    if not s["n"]:
        return "-"
    return f"{s['min']:.{digits}f} / {s['median']:.{digits}f} / {s['max']:.{digits}f}{unit}"


def fmt_seconds(s: float | None) -> str:
    if s is None or s != s:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1.0:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def fmt_num(x: float | None, digits: int = 2) -> str:
    if x is None or x != x:
        return "-"
    return f"{x:.{digits}f}"


def table(header: Sequence[str], rows: Iterable[Sequence[str]], markdown: bool = False) -> str:
    """A plain-text (or Markdown) table with left-aligned first column, right-aligned rest."""
    rows = [list(map(str, r)) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def write_json(path: str | None, obj: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(tmp, path)
