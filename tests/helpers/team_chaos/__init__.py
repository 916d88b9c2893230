"""A seeded chaos campaign on a team of real daemons, with a job restarted after every fault.

Used by ``benchmarks/reliability/team_chaos.py`` (a long run), ``benchmarks/reliability/team_soak.py``
and ``tests/faults/test_team_chaos.py`` (a short seed per redundancy kind in CI). Its parts, as the
concepts they hold: ``job`` (the state and the trainer ranks), ``trial`` (a fault drawn from the
seed, the table), ``ledger`` (what the team committed, and the checks), ``campaign`` (the trials
on a ``helpers.daemon_team.DaemonTeam``, in network namespaces of ``helpers.netns`` with
partitions).

The team: N ``ucpd serve`` processes on loopback (``--nodes N --node-rank I --listen ... --peers
...``), each with its own run dir and shm dir, ``--replicas R`` or ``--parity K[+M]``. The job:
``ranks_per_node`` trainer processes per node (TP = ranks per node, DP = nodes), each told who it is
by the environment a launcher sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``UCPD_RUN_DIR`` of its node's daemon, ``UCPD_JOB``, and ``UCPD_JOB_ID`` naming the run) and
using ``Checkpointer()`` with no arguments. A run reads ``latest()``, restores it (if any) and
snapshots the next steps, waiting for each to commit, as the README's loop does.

The state's values encode the step *and the run*: every element of every tensor is
``code * 10**8 + i`` (``code = run * 10000 + step``, ``i`` the element's index in the global tensor,
so a shard restored in the wrong place is seen too), a replicated tensor holds ``code`` itself,
and plain values hold the step and the run. A version stitched from two runs cannot restore
into one run's values on every rank.

A trial: a run of the job (run A) meets a fault at a seeded moment —

* ``node_lost``: a node's daemon and trainers are SIGKILLed, its shm dir deleted, a fresh daemon
  started at its node rank (before or after the others declared it dead);
* ``daemon_restart``: a daemon is SIGKILLed and started again on its run and shm dirs;
* ``daemon_pause``: a daemon is SIGSTOPped until its peers declare it dead, then SIGCONTed;
* ``trainer_killed``: one rank is SIGKILLed mid-run;

— then the rest of the job is killed (a job restart), the team is left to form again, and a new
run (run B, a new job id) resumes at ``latest() + 1`` and commits a few steps. Checks:

1. every committed step still held (any node's status) is read back whole by every rank
   (``restore(state, step=s)`` into zeroed tensors), each tensor decodes to that step and to one
   run, the same run on every rank and node (a version stitched from two runs fails, naming
   the ranks, nodes and runs), and a run that did snapshot that step;
2. ``latest()`` is never below a step some rank saw committed (its ``wait()`` returned);
3. a run's snapshots are never refused (``SnapshotRejected``, ``ProtocolError``), and a run
   started on a formed team commits every step; its ranks agree on ``latest()`` at start;
4. the newest committed version (``latest()``) restores whole;
5. ``ucpd status`` of every node comes back to ``healthy`` (bounded wait).

Draws (fault kind, victim, moment, replacement timing, delays) come from ``random.Random(seed)``
only, in a fixed order: the same seed draws the same trials (timings differ, so a time-bounded
campaign may stop at another trial).
"""

from __future__ import annotations

from ..netns import partitions_available
from .campaign import HEALTHY_WITHIN, STEPS_A, STEPS_B, Campaign, redundancy_args, redundancy_tolerance
from .job import JOB, decode, job_state, rank_main, read_journal, zero_state
from .ledger import Ledger
from .trial import KINDS, PARTITION, Trial, category, draw, table

__all__ = ["Campaign", "HEALTHY_WITHIN", "JOB", "KINDS", "Ledger", "PARTITION", "STEPS_A", "STEPS_B", "Trial",
           "category", "decode", "draw", "job_state", "partitions_available", "rank_main", "read_journal",
           "redundancy_args", "redundancy_tolerance", "table", "zero_state"]
