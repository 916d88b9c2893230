"""A short seeded team chaos campaign, one per redundancy kind: 4 daemons on loopback, 2 trainer
ranks each, each fault kind met once (with replicas: a node lost and replaced, a daemon killed
and restarted on its shm, a daemon paused past --dead-after, a trainer killed; for XOR parity a
daemon restarted and, where ``ip netns`` works, a node's link cut; for Reed-Solomon a node lost;
in a large team's configuration, with every restart in the other layout, a node lost), the job
restarted as a new run after each, every committed step read back whole by every rank.

The long one is ``benchmarks/reliability/team_chaos.py --seed S --minutes M --redundancy KIND``;
what each trial checks is in ``tests/helpers/team_chaos/``. A failure prints the seed and the
table; replay it with the script (same seed, same draws).
"""

from __future__ import annotations

import warnings

import pytest

from helpers.netns import partitions_available
from helpers.scripts import load_benchmark

pytestmark = pytest.mark.slow

SEED = 20261201


def _campaign_module():
    return load_benchmark("reliability/team_chaos.py", "ucpd_team_chaos")


# Each fault kind once, and each redundancy kind on the path only it has (8 trials): replicas
# meet every kind, with a flush dir every node writes each version into (every flushed version is
# checked whole and of one run). XOR parity a restarted member (it encodes its blocks again:
# status must say healthy) and, where ``ip netns`` works (root), a partition: each daemon in a
# network namespace of its own, on one bridge, a node's link taken down until it and the others
# declare each other dead, then up again. Reed-Solomon a node lost (its part rebuilt onto the
# replacement, decoding with m = 2; a lost XOR member's rebuild and heal is
# tests/team/test_parity_healing_daemons.py's, on real daemons). A large team's configuration
# (--commit-fanout) a node lost, every restart in the other layout (TP 2 and TP 1 by turns): the
# restores go through the directory and the piece index (a daemon restart is the replicas
# case's). The long campaign draws every kind for each.
CASES = [("--replicas 1 --flush-dir {tmp}", ("node_lost", "daemon_restart", "daemon_pause", "trainer_killed"), False, False),
         ("xor", ("daemon_restart",), False, True),
         ("rs", ("node_lost",), False, False),
         ("--replicas 1 --commit-fanout 2", ("node_lost",), True, False)]


@pytest.mark.parametrize("redundancy,kinds,reshard,partitions", CASES,
                         ids=["replicas-1", "xor-parity-3", "rs-parity-2+2", "large-team-resharded"])
def test_a_short_seeded_team_chaos_campaign_finds_no_failure(redundancy, kinds, reshard, partitions, tmp_path):
    if partitions and partitions_available() is not None:
        warnings.warn(f"the {redundancy} case runs without a partition: {partitions_available()}", pytest.PytestWarning)
        partitions = False
    redundancy = redundancy.format(tmp=tmp_path / "flush")
    mod = _campaign_module()
    lines = []
    trials = mod.campaign(SEED, 0, nodes=4, per_node=2, redundancy=redundancy, dead_after=1.0, log=lines.append,
                          min_trials=len(kinds) + partitions, max_trials=len(kinds) + partitions, kinds=kinds,
                          reshard=reshard, partitions=partitions)
    text, per = mod.table(trials)
    print("\n".join(lines) + "\n" + text)
    assert {t.kind for t in trials if t.injected} == set(kinds) | ({"partition"} if partitions else set()), text
    failed = [(t.index, t.kind, t.failures) for t in trials if not t.passed]
    assert not failed, f"seed {SEED}, {redundancy}:\n" + "\n".join(lines) + "\n" + text
    if reshard:  # the restores of another layout read some ranks' parts, named by the index
        assert trials[-1].restores["restores_from_holders"] > 0 and trials[-1].restores["index_fallbacks"] == 0, text

