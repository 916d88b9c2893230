"""A short seeded team chaos campaign, one per redundancy kind: 4 daemons on loopback, 2 trainer
ranks each, one trial of each fault kind (a node lost and replaced, a daemon killed and
restarted on its shm, a daemon paused past --dead-after, a trainer killed; for parity the first
two; in a large team's configuration, with every restart in the other layout, the first two; with
partitions, where ``ip netns`` works, a node lost and a node's link cut),
the job restarted as a new run after each, every committed step read back whole by every rank.

The long one is ``benchmarks/reliability/team_chaos.py --seed S --minutes M --redundancy KIND``;
what each trial checks is in ``tests/helpers/team_chaos.py``. A failure prints the seed and the
table; replay it with the script (same seed, same draws).
"""

from __future__ import annotations


import pytest

from helpers.scripts import load_benchmark

pytestmark = pytest.mark.slow

SEED = 20261201


def _campaign_module():
    return load_benchmark("reliability/team_chaos.py", "ucpd_team_chaos")


# Replicas meet every fault kind, with a flush dir every node writes each version into (every
# flushed version is checked whole and of one run); parity the two that take a node's RAM (its
# part is rebuilt onto the replacement and the group heals, or a restarted member encodes its
# blocks again: status must say healthy after each): the long campaign draws every kind for each.
# A large team's configuration (--commit-fanout) with every restart in the other layout (TP 2 and
# TP 1 by turns): the restores go through the directory and the piece index. With partitions
# (root, ``ip netns``: each daemon in a network namespace of its own, on one bridge), a node's
# link taken down until it and the others declare each other dead, then up again.
CASES = [("--replicas 1 --flush-dir {tmp}", ("node_lost", "daemon_restart", "daemon_pause", "trainer_killed"), False, False),
         ("xor", ("node_lost", "daemon_restart"), False, False),
         ("rs", ("node_lost", "daemon_restart"), False, False),
         ("--replicas 1 --commit-fanout 2", ("node_lost", "daemon_restart"), True, False),
         ("xor", ("node_lost",), False, True)]


@pytest.mark.parametrize("redundancy,kinds,reshard,partitions", CASES,
                         ids=["replicas-1", "xor-parity-3", "rs-parity-2+2", "large-team-resharded", "xor-partitioned"])
def test_a_short_seeded_team_chaos_campaign_finds_no_failure(redundancy, kinds, reshard, partitions, monkeypatch, tmp_path):
    if partitions:
        from helpers.team_chaos import partitions_available

        why = partitions_available()
        if why is not None:
            pytest.skip(f"partitions need network namespaces: {why}")
    redundancy = redundancy.format(tmp=tmp_path / "flush")
    mod = _campaign_module()
    lines = []
    kinds = tuple(kinds) + (("partition",) if partitions else ())
    trials = mod.campaign(SEED, 0, nodes=4, per_node=2, redundancy=redundancy, dead_after=1.0, log=lines.append,
                          min_trials=len(kinds), max_trials=len(kinds), kinds=kinds[: len(kinds) - partitions],
                          reshard=reshard, partitions=partitions)
    text, per = mod.table(trials)
    print("\n".join(lines) + "\n" + text)
    assert {t.kind for t in trials if t.injected} == set(kinds), text
    failed = [(t.index, t.kind, t.failures) for t in trials if not t.passed]
    assert not failed, f"seed {SEED}, {redundancy}:\n" + "\n".join(lines) + "\n" + text
    if reshard:  # the restores of another layout read some ranks' parts, named by the index
        assert trials[-1].restores["restores_from_holders"] > 0 and trials[-1].restores["index_fallbacks"] == 0, text
