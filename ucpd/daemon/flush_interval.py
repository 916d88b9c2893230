"""How often a job's versions are flushed: a fixed ``--flush-every N``, or ``auto``.

``--flush-every auto`` picks, per job, the interval that minimises the expected cost of flushing
plus the expected work lost to failures the flushed copy is there for (Young 1974, with Daly's
2006 higher-order correction)::

    tau = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + C / 18M) - C      (C < 2M; else tau = M)

- ``C``, the cost of one flush: the measured duration of this job's flushes (an exponential
  average). It is an upper bound: the flush runs in the background and steps aside for
  snapshots, so training pays less than its whole duration.
- ``M``, the mean time between failures: ``--mtbf`` when given; else learned from this job's
  restarts seen by the daemon (a new run of the job begins a snapshot), with a prior of one
  failure per ``PRIOR_MTBF_S`` so a job that never failed is not flushed as rarely as never:
  ``M = (observed seconds + PRIOR_MTBF_S) / (restarts + 1)``.
- The interval in versions is ``tau`` over the measured time between this job's commits,
  at least 1, and at least the versions that one flush lasts (flushes never queue up).

A job's first committed version is flushed to measure ``C``; none more until that is done. A pure
object: the flusher and the server feed it times; tests give their own.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

PRIOR_MTBF_S = 24 * 3600.0
EWMA = 0.3  # weight of the newest measurement


def young_daly(cost: float, mtbf: float) -> float:
    """The checkpoint interval (seconds) minimising flush overhead plus expected lost work."""
    if cost <= 0:
        return 0.0
    if cost >= 2 * mtbf:
        return mtbf
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(cost / (2 * mtbf)) / 3 + cost / (18 * mtbf)) - cost


def parse_every(text) -> int | None:
    """``--flush-every``: a positive count, or ``auto`` (None)."""
    if text is None:
        return 1
    if str(text).strip().lower() == "auto":
        return None
    n = int(text)
    if n < 1:
        raise ValueError("--flush-every must be a positive number of versions, or auto")
    return n


def parse_duration(text) -> float:
    """``90``, ``90s``, ``15m``, ``6h``, ``2d`` -> seconds."""
    s = str(text).strip().lower()
    scale = {"s": 1, "m": 60, "h": 3600, "d": 86400}.get(s[-1:], None)
    value = float(s[:-1] if scale else s) * (scale or 1)
    if value <= 0:
        raise ValueError(f"a duration must be positive, got {text!r}")
    return value


@dataclass
class _JobClock:
    first_seen: float
    last_commit: float | None = None
    period: float | None = None  # seconds between commits (EWMA)
    flush_cost: float | None = None  # seconds per flush (EWMA)
    restarts: int = 0
    run: str | None = None  # the run (incarnation) seen last
    measuring: bool = False  # the first flush (auto) is queued and not measured yet


@dataclass
class FlushInterval:
    fixed: int | None = 1  # None: auto
    mtbf: float | None = None  # given; None: learned
    clock: object = time.monotonic
    jobs: dict[str, _JobClock] = field(default_factory=dict)

    @property
    def auto(self) -> bool:
        return self.fixed is None

    def _job(self, job: str) -> _JobClock:
        j = self.jobs.get(job)
        if j is None:
            j = self.jobs[job] = _JobClock(self.clock())
        return j

    # --- what the daemon tells it -------------------------------------------------------------

    def on_begin(self, job: str, run: str | None) -> None:
        """A rank began a snapshot; a run of the job other than the last one seen is a restart."""
        j = self._job(job)
        if run is not None:
            if j.run is not None and run != j.run:
                j.restarts += 1
            j.run = run

    def on_commit(self, job: str) -> None:
        j = self._job(job)
        now = self.clock()
        if j.last_commit is not None:
            gap = now - j.last_commit
            j.period = gap if j.period is None else (1 - EWMA) * j.period + EWMA * gap
        j.last_commit = now

    def due(self, job: str, since: int) -> bool:
        """Flush the version just committed, ``since`` versions after the last one flushed?"""
        j = self._job(job)
        if self.fixed is None and j.flush_cost is None:
            if j.measuring:
                return False  # the measuring flush is on its way
            j.measuring = True
            return True
        return since >= self.every(job)

    def on_flush_failed(self, job: str) -> None:
        """The measuring flush failed or was dropped: the next commit measures again."""
        self._job(job).measuring = False

    def on_flushed(self, job: str, seconds: float) -> None:
        j = self._job(job)
        j.measuring = False
        j.flush_cost = seconds if j.flush_cost is None else (1 - EWMA) * j.flush_cost + EWMA * seconds

    # --- the choice ---------------------------------------------------------------------------

    def mtbf_of(self, job: str) -> float:
        if self.mtbf is not None:
            return self.mtbf
        j = self._job(job)
        return (self.clock() - j.first_seen + PRIOR_MTBF_S) / (j.restarts + 1)

    def every(self, job: str) -> int:
        """Flush every this many committed versions of ``job``."""
        if self.fixed is not None:
            return self.fixed
        j = self._job(job)
        if j.flush_cost is None or not j.period:
            return 1  # measure a flush (and the commit period) first
        tau = young_daly(j.flush_cost, self.mtbf_of(job))
        return max(1, round(tau / j.period), math.ceil(j.flush_cost / j.period))

    def explain(self, job: str) -> dict:
        """The choice and its inputs, for ``ucpd status``."""
        if self.fixed is not None:
            return {"mode": "fixed", "every": self.fixed}
        j = self._job(job)
        mtbf = self.mtbf_of(job)
        return {
            "mode": "auto",
            "every": self.every(job),
            "flush_cost_s": None if j.flush_cost is None else round(j.flush_cost, 3),
            "commit_period_s": None if j.period is None else round(j.period, 3),
            "mtbf_s": round(mtbf, 1),
            "mtbf_from": "--mtbf" if self.mtbf is not None else f"{j.restarts} restart(s) seen",
            "interval_s": None if j.flush_cost is None else round(young_daly(j.flush_cost, mtbf), 1),
        }
