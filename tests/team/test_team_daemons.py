"""A team of real daemons on loopback: a node is lost, a job on the survivors restores from RAM.

One scenario per behaviour whose process boundary matters (trainers, sockets, SIGKILL, files):
the team's decisions themselves (healing, retries, restarts before a timeout, typed errors for
losses) are tested in one process in ``test_team_seams.py`` and ``test_parity_team.py``.

Each node is a ``ucpd serve`` process with its own run and shm dirs and a TCP peer port;
trainer ranks are real gloo processes, each talking to its own node's daemon. Losing a node
means SIGKILL of its daemon and its trainers and deleting its shm dir. There is no flush
directory in these tests, so whatever is restored came from the survivors' RAM.
"""

from __future__ import annotations

import os
import time

import pytest

from helpers import TEST_JOB, ranks
from helpers.gpt_layout import empty_like_state, mismatches, rank_state
from helpers.waiting import wait_until

pytestmark = pytest.mark.slow


def snapshot_ranks(rank, world, rendezvous, q, run_dirs, per_node, tp, steps, hold, gate=None, dedup="balanced"):
    """Rank r talks to node r // per_node and snapshots each step (TPxDP layout); with ``gate``
    (a path), it waits after the first step until the test creates that file."""
    ranks.init_gloo(rank, world, rendezvous)
    from ucpd_client import Checkpointer

    ckpt = Checkpointer(run_dirs[rank // per_node], embedded=False, local_world_size=per_node, dedup=dedup)
    for step in steps:
        state, placements = rank_state(step, rank, tp, world // tp)
        ckpt.snapshot(step, state, placements=placements).wait(timeout=60)
        if gate and step == steps[0]:
            wait_until(lambda: os.path.exists(gate), "the test to open the gate", 120)
    q.put(("committed", rank, ckpt.latest()))
    if hold:
        time.sleep(600)  # the test SIGKILLs us
    ckpt.close()


def restore_ranks(rank, world, rendezvous, q, run_dirs, per_node, tp, step, then_snapshot):
    ranks.init_gloo(rank, world, rendezvous)
    from ucpd_client import Checkpointer

    want, placements = rank_state(step, rank, tp, world // tp)
    target = empty_like_state(want)
    with Checkpointer(run_dirs[rank // per_node], embedded=False, local_world_size=per_node) as ckpt:
        latest = ckpt.latest()
        got = ckpt.restore(target, placements=placements)
        bad = mismatches(target["model"], want["model"], "model.") + mismatches(target["optim"], want["optim"], "optim.")
        if target["step"] != step:
            bad.append(f"step value {target['step']}")
        after = None
        if then_snapshot:  # the job goes on: its new versions commit on the smaller team
            nxt, pl = rank_state(step + 1, rank, tp, world // tp)
            ckpt.snapshot(step + 1, nxt, placements=pl).wait(timeout=60)
            after = ckpt.latest()
    q.put((rank, latest, got, bad, after))


def restore_on(run_dirs, world, per_node, tp, step, then_snapshot=False):
    procs, results = ranks.spawn(restore_ranks, world, run_dirs, per_node, tp, step, then_snapshot)
    ranks.join(procs)
    for rank, latest, got, bad, after in sorted(results):
        assert (latest, got) == (step, step), f"{world} ranks TP{tp}: rank {rank} saw latest {latest}, restored {got}"
        assert not bad, f"{world} ranks TP{tp}xDP{world // tp}: rank {rank} differs in {bad}"
        if then_snapshot:
            assert after == step + 1, f"rank {rank}: step {step + 1} did not commit on the survivors (latest {after})"


def status(run_dir) -> dict:
    """What ``ucpd status --json`` prints (tests/daemon/test_status.py runs the command), asked
    over the socket: a poll needs no new interpreter."""
    from ucpd.rpc import Connection

    with Connection(run_dir, timeout=30) as c:
        return c.call("status")


wait_for = wait_until  # the name test_parity_healing_daemons imports


def test_three_nodes_one_replica_lose_a_node_and_restore_on_the_survivors_with_another_layout(make_team):
    team = make_team(3, "--replicas", "1", "--keep", "2")
    steps = (1, 2, 3)
    procs, done = ranks.spawn(snapshot_ranks, 6, team.run_dirs(), 2, 2, steps, True)  # TP2xDP3, 2 ranks a node
    assert sorted(m[2] for m in done) == [3] * 6, team.logs()
    s = status(team.nodes[0].run_dir)
    assert s["team"]["health"] == "healthy" and s["latest_committed"] == 3
    assert s["team"]["bytes"]["replicas"] > 0  # node 0 holds node 2's part

    ranks.kill(procs)  # the job dies with the node ...
    team.lose(2)  # ... and node 2's daemon and RAM are gone
    wait_for(lambda: not status(team.nodes[0].run_dir)["team"]["nodes"][2]["live"], "node 2 to be declared dead")

    survivors = team.run_dirs()[:2]
    restore_on(survivors, 4, 2, 2, 3, then_snapshot=True)  # TP2xDP2 on 2 nodes, then step 4 commits
    s = status(team.nodes[0].run_dir)
    assert s["team"]["health"] == "degraded"  # a node is missing
    assert s["team"]["counters"]["replicated_bytes"] > 0


def test_a_gossiping_team_loses_a_node_while_views_converge_and_another_after_a_commit(make_team):
    # the configuration of a large team, at 4 nodes: gossip, and commits through an aggregator per pair
    team = make_team(4, "--membership", "gossip", "--commit-fanout", "2", "--replicas", "1", "--keep", "2")
    team.lose(3)  # at once: the others have not all heard of each other yet
    wait_for(lambda: not status(team.nodes[0].run_dir)["team"]["nodes"][3]["live"], "node 3 to be declared dead")
    procs, done = ranks.spawn(snapshot_ranks, 6, team.run_dirs()[:3], 2, 2, (1, 2, 3), True)  # TP2xDP3 on 3 nodes
    assert sorted(m[2] for m in done) == [3] * 6, team.logs()
    for i in range(3):
        s = status(team.nodes[i].run_dir)["team"]
        assert s["membership"]["kind"] == "gossip" and s["membership"]["counters"]["pings"] > 0
        assert s["transport"]["heartbeats_sent"] == 0  # no all-to-all heartbeats
        assert [n["live"] for n in s["nodes"]] == [True, True, True, False]

    ranks.kill(procs)
    team.lose(2)
    for i in range(2):
        wait_for(lambda i=i: not status(team.nodes[i].run_dir)["team"]["nodes"][2]["live"], f"node {i} to drop node 2")
    restore_on(team.run_dirs()[:2], 4, 2, 2, 3, then_snapshot=True)  # node 2's part from its copy, then step 4


def large_team_that_lost_node_1(make_team):
    """--commit-fanout 2 (the configuration of a large team: what every node holds is gathered by
    recursive doubling, team.directory) on 5 daemons; a TP2xDP5 job saved steps 1-3 and was
    killed; node 1 is lost and every survivor has dropped it. The job wrote its replicated
    tensors by the lowest-rank rule, so a node part holds all its ranks need but rank 0's values
    (under balanced dedup their shares lie on every node, and a restore reads every part)."""
    team = make_team(5, "--commit-fanout", "2", "--replicas", "1", "--keep", "2")
    procs, done = ranks.spawn(snapshot_ranks, 10, team.run_dirs(), 2, 2, (1, 2, 3), True, None, "lowest")
    assert sorted(m[2] for m in done) == [3] * 10, team.logs()
    ranks.kill(procs)
    team.lose(1)
    for d in team.run_dirs()[:1] + team.run_dirs()[2:]:
        wait_for(lambda d=d: not status(d)["team"]["nodes"][1]["live"], "every survivor to drop node 1")
    return team


def test_a_job_restarted_on_a_large_teams_survivors_asks_the_directory_not_every_node(make_team):
    team = large_team_that_lost_node_1(make_team)
    survivors = [d for i, d in enumerate(team.run_dirs()) if i != 1]
    restore_on(survivors, 8, 2, 2, 3, then_snapshot=True)  # TP2xDP4, node 1's part from its copy

    c = {i: status(team.nodes[i].run_dir)["team"]["counters"] for i in (0, 2, 3, 4)}
    seen = {i: {k: v for k, v in c[i].items() if k.startswith(("directory", "restores", "holdings", "manifests"))} for i in c}
    assert all(c[i]["directory_gathers"] >= 1 and c[i]["directory_requests"] >= 1 for i in c), seen  # each asked for a level
    # asking every node would have each node answer `holdings` for each of the 8 ranks' latest and
    # restore; the directory's rare direct asks (a partner that saw another view) stay far below
    asked = sum(c[i]["holdings_answered"] + c[i]["manifests_answered"] for i in c)
    assert asked < 8, (seen, [ln for ln in team.logs().splitlines() if "directory" in ln])
    # another layout (DP5 -> DP4): each rank reads the parts the piece index names (node 1's
    # from its copy), not every part
    assert all(c[i]["restores_from_holders"] == 2 and c[i]["restores_widened"] == 0 for i in c), seen


def test_a_job_restarted_on_a_large_team_with_a_replaced_node_asks_only_the_holders_in_its_layout_and_another(make_team):
    # node 1 is replaced by a new daemon (empty RAM); the job restarts in the layout that saved
    # it, so each rank reads its node part (node 1's ranks from its copy) and rank 0's values
    team = large_team_that_lost_node_1(make_team)
    team.start(1)
    for d in team.run_dirs():
        wait_for(lambda d=d: all(n["live"] for n in status(d)["team"]["nodes"]), "every node to see node 1 again")
    for d in team.run_dirs():  # the copies healed while node 1 was gone have settled
        wait_for(lambda d=d: status(d)["team"]["health"] == "healthy", "every node to be healthy")
    before = {i: status(d)["team"]["counters"] for i, d in enumerate(team.run_dirs())}
    restore_on(team.run_dirs(), 10, 2, 2, 3)  # every rank bit-exact

    after = {i: status(d)["team"]["counters"] for i, d in enumerate(team.run_dirs())}
    grew = {i: {k: after[i][k] - before[i].get(k, 0) for k in after[i]} for i in after}
    moved = {i: {k: grew[i][k] for k in ("restores_from_holders", "restores_widened", "manifests_answered")} for i in grew}
    assert all(grew[i]["restores_from_holders"] == 2 and grew[i]["restores_widened"] == 0 for i in grew), (
        moved, [ln for ln in team.logs().splitlines() if "asks every rank" in ln])
    # rank 0's manifest came with latest's gather; only node 1's part, on its copy, is asked
    # for, once for both of node 1's ranks (twice if healing left two copies of it)
    asked = {i: grew[i]["manifests_answered"] for i in grew if grew[i]["manifests_answered"]}
    assert 1 not in asked and 1 <= sum(asked.values()) <= 2, moved

    # then in another layout (TP2xDP4 on nodes 0-3): node 1, replaced, holds no part; its
    # ranks' pieces are indexed by its copy, and every restore reads only the parts named
    restore_on(team.run_dirs()[:4], 8, 2, 2, 3)  # every rank bit-exact
    last = {i: status(d)["team"]["counters"] for i, d in enumerate(team.run_dirs()[:4])}
    more = {i: {k: last[i][k] - after[i].get(k, 0) for k in ("restores_from_holders", "restores_widened", "index_fallbacks")}
            for i in last}
    assert all(m == {"restores_from_holders": 2, "restores_widened": 0, "index_fallbacks": 0} for m in more.values()), more


def test_a_job_restarted_in_another_layout_on_a_large_team_reads_the_parts_the_piece_index_names(make_team):
    team = make_team(4, "--commit-fanout", "2", "--replicas", "1", "--keep", "2")
    procs, done = ranks.spawn(snapshot_ranks, 8, team.run_dirs(), 2, 2, (1, 2), True)  # TP2xDP4
    assert sorted(m[2] for m in done) == [2] * 8, team.logs()
    ranks.kill(procs)
    restore_on(team.run_dirs(), 4, 1, 4, 2)  # TP4 on the same nodes, one rank each: bit-exact
    c = {i: status(d)["team"]["counters"] for i, d in enumerate(team.run_dirs())}
    seen = {i: {k: v for k, v in c[i].items() if k.startswith(("index", "restores", "holdings", "manifests"))} for i in c}
    assert all(c[i]["restores_from_holders"] == 1 and c[i]["restores_widened"] == 0 for i in c), seen
    assert all(c[i]["index_fallbacks"] == 0 and c[i]["index_gathers"] == 1 for i in c), seen

    # the saved world size (8 ranks) in another placement (TP1xDP8): the node part and rank 0's
    # do not answer it, so the parts the index names are read next, not every part
    restore_on(team.run_dirs(), 8, 2, 1, 2)  # bit-exact
    d = {i: status(r)["team"]["counters"] for i, r in enumerate(team.run_dirs())}
    more = {i: {k: d[i][k] - c[i][k] for k in ("restores_from_holders", "restores_widened", "index_fallbacks")} for i in d}
    assert all(m == {"restores_from_holders": 2, "restores_widened": 0, "index_fallbacks": 0} for m in more.values()), more


def test_a_damaged_replica_is_detected_and_another_copy_serves(make_team):
    import glob

    team = make_team(3, "--replicas", "2")
    procs, _ = ranks.spawn(snapshot_ranks, 3, team.run_dirs(), 1, 1, (1,), True)
    ranks.kill(procs)
    team.lose(2)
    files = glob.glob(f"{team.nodes[0].shm_dir}/replica-*")
    assert files, "node 0 holds no replica"
    for path in files:  # flip a byte in every replica node 0 holds
        with open(path, "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0xFF]))
    wait_for(lambda: not status(team.nodes[0].run_dir)["team"]["nodes"][2]["live"], "node 2 to be declared dead")
    # the loss makes node 0 check every replica it holds again, off any restore's path: the
    # lost node's part and node 1's (which landed before the loss) are both found damaged
    wait_for(lambda: status(team.nodes[0].run_dir)["team"]["counters"]["replica_checksum_errors"] >= 2,
             "node 0's healing thread to find both damaged replicas before any restore")
    restore_on(team.run_dirs()[:2], 2, 1, 1, 1)  # node 0's rank reads node 2's part from node 1
    st = status(team.nodes[0].run_dir)
    assert st["team"]["counters"]["replica_checksum_errors"] >= 2
    assert st["checksum_failures"]["replica"] >= 1  # ucpd_checksum_failures_total{where="replica"}


def test_junk_and_forged_messages_on_the_peer_port_are_refused_and_the_team_keeps_committing(make_team):
    import zmq

    from ucpd.team.transport import PeerTransport

    team = make_team(2, "--replicas", "1", secret="the-job-secret-0123456789abcdef")
    ctx = zmq.Context.instance()
    junk = ctx.socket(zmq.DEALER)
    junk.connect(team.addresses[0])
    for frames in ([b"garbage"], [b"\x81\xa1v\x01", b"mac"], [b"x" * 1000, b"", b"payload"]):
        junk.send_multipart(frames)
    forger = PeerTransport(1, "tcp://127.0.0.1:0", b"not-the-job-secret-at-all-000000",
                           on_message=lambda *a: None, on_request=lambda *a: ({}, []))
    forger.bind()
    forger.start([team.addresses[0], "tcp://127.0.0.1:1"])
    forger.send(0, "commit", {"m": {"t": "commit", "step": 99}})

    def refused() -> int:
        t = status(team.nodes[0].run_dir)["team"]["transport"]
        return t["auth_failures"] + t["malformed"]

    wait_for(lambda: refused() >= 3, "node 0 to refuse the junk and the forgery")
    forger.close()
    junk.close(0)

    procs, done = ranks.spawn(snapshot_ranks, 2, team.run_dirs(), 1, 1, (1, 2), False)
    ranks.join(procs)
    assert sorted(m[2] for m in done) == [2, 2]
    t = status(team.nodes[0].run_dir)["team"]
    assert t["transport"]["auth_failures"] + t["transport"]["malformed"] >= 3, t["transport"]
    assert t["team_latest"] == 2  # the forged commit of step 99 changed nothing


def test_the_flush_of_a_team_holds_every_nodes_part_consolidated(make_team, make_daemon, dirs, tmp_path):
    from ucpd.format import list_versions

    flush = str(tmp_path / "flush")
    team = make_team(2, "--replicas", "1", "--flush-dir", flush)
    procs, done = ranks.spawn(snapshot_ranks, 2, team.run_dirs(), 1, 2, (1, 2), False)  # TP2 across the nodes
    ranks.join(procs)
    wait_for(lambda: any(v.step == 2 and v.state == "complete" for v in list_versions(os.path.join(flush, TEST_JOB))), "the flush of step 2", 60)
    team.stop()  # every node's RAM is gone: only the flushed files are left

    import shutil

    d = make_daemon("--mem-limit", "256M", flush=False)
    d.stop()
    shutil.rmtree(dirs["shm"], ignore_errors=True)
    d.flush_dir = flush
    d.start()
    restore_on([d.run_dir], 1, 1, 1, 2)  # one rank holds the whole model: both nodes' shards, from disk


def test_a_node_killed_while_writing_its_share_of_the_flush_leaves_it_to_the_others(make_team, make_daemon, dirs, tmp_path):
    """Every node writes the flush (``--flush-writers all``): node 2's daemon is SIGKILLed right
    after it wrote one piece of step 2; the survivors write its share, the version is whole on
    disk, and one rank restores it from there alone."""
    import shutil

    from ucpd.format import list_versions, validate

    flush = str(tmp_path / "flush")
    root = os.path.join(flush, TEST_JOB)
    team = make_team(4, "--replicas", "1", "--flush-dir", flush, start=False)
    for i in range(4):
        team.start(i, fault="flush.share@2" if i == 2 else None)
    procs, done = ranks.spawn(snapshot_ranks, 8, team.run_dirs(), 2, 2, (1, 2), True)  # TP2xDP4, 2 ranks a node
    assert sorted(m[2] for m in done) == [2] * 8, team.logs()
    wait_for(lambda: team.nodes[2].proc.poll() is not None, "node 2 to die writing its share of step 2", 60)
    shutil.rmtree(team.nodes[2].shm_dir, ignore_errors=True)  # its RAM is gone with it
    wait_for(lambda: any(v.step == 2 and v.state == "complete" for v in list_versions(root)),
             "the survivors to write node 2's share of step 2", 90)
    ranks.kill(procs)
    assert validate(root, 2, full=True) == []  # every chunk of every file against ucp.json
    wrote = {i: status(team.nodes[i].run_dir)["team"]["counters"].get("flush_written_bytes", 0) for i in (0, 1, 3)}
    assert all(wrote.values()), wrote  # every survivor wrote a share
    assert status(team.nodes[0].run_dir)["flush"]["last_error"] is None
    team.stop()

    d = make_daemon("--mem-limit", "256M", flush=False)
    d.stop()
    shutil.rmtree(dirs["shm"], ignore_errors=True)
    d.flush_dir = flush
    d.start()
    restore_on([d.run_dir], 1, 1, 1, 2)  # one rank holds the whole model, read from the files


def test_a_flush_reading_another_nodes_ram_keeps_that_part_until_it_is_fetched(make_team, tmp_path):
    from ucpd.format import list_versions

    flush = str(tmp_path / "flush")
    team = make_team(2, "--replicas", "0", "--keep", "2", "--flush-dir", flush, start=False)
    team.start(0, fault="flush.fetch@1")  # a slow flush: 3 s between pinning node 1's part and reading it
    team.start(1)
    gate = str(tmp_path / "gate")
    procs, _ = ranks.spawn(snapshot_ranks, 2, team.run_dirs(), 1, 2, (1, 2, 3, 4), False, gate, wait_for=0)
    # steps 2-4 come once node 0's flush of step 1 has pinned node 1's part, whatever the load
    wait_for(lambda: any(v["step"] == 1 and v["readers"] for v in status(team.nodes[1].run_dir)["versions"]),
             "node 0's flush to pin node 1's part of step 1", 60)
    open(gate, "w").close()
    ranks.join(procs)
    # meanwhile steps 2-4 committed: node 1 (keep 2) would have evicted step 1 without the pin
    assert status(team.nodes[0].run_dir)["latest_committed"] == 4, team.logs()
    wait_for(lambda: any(v.step == 1 and v.state == "complete" for v in list_versions(os.path.join(flush, TEST_JOB))), "the flush of step 1", 60)
    assert status(team.nodes[0].run_dir)["flush"]["last_error"] is None
    # once fetched, the pin is gone and node 1 keeps only its 2 newest again
    wait_for(lambda: [v["step"] for v in status(team.nodes[1].run_dir)["versions"]] == [3, 4], "node 1 to evict step 1", 20)


def test_parity_groups_rebuild_lost_nodes_and_a_job_on_the_survivors_restores(make_team, monkeypatch):
    """RS 4+2 loses two nodes (XOR, and every order a node's ranks seal in: test_parity_team.py)."""
    nodes, parity, lose = 6, "4+2", (4, 5)
    monkeypatch.setenv("UCPD_PARITY_UNIT", "64K")  # several rows even for this small state
    team = make_team(nodes, "--parity", parity)
    procs, done = ranks.spawn(snapshot_ranks, nodes, team.run_dirs(), 1, 1, (1, 2), True, timeout=240)
    assert sorted(m[2] for m in done) == [2] * nodes, team.logs()
    t = status(team.nodes[0].run_dir)["team"]
    assert t["bytes"]["parity"] > 0 and t["bytes"]["replicas"] == 0
    ranks.kill(procs)
    for i in lose:
        team.lose(i)
    survivors = [i for i in range(nodes) if i not in lose]
    wait_for(lambda: all(not n["live"] for n in status(team.nodes[0].run_dir)["team"]["nodes"] if n["node"] in lose),
             "the lost nodes to be declared dead")
    restore_on([team.nodes[i].run_dir for i in survivors], len(survivors), 1, 1, 2)
    assert status(team.nodes[survivors[0]].run_dir)["team"]["counters"].get("parity_rebuilt_bytes", 0) > 0


def test_a_flipped_bit_in_a_parity_block_is_detected_and_the_rebuild_goes_around_it(make_team, monkeypatch):
    monkeypatch.setenv("UCPD_PARITY_UNIT", "64K")
    team = make_team(6, "--parity", "4+2", start=False)
    for i in range(6):
        team.start(i, fault="parity.flip@2" if i == 4 else None)  # node 4 serves one block with a bit flipped
    procs, done = ranks.spawn(snapshot_ranks, 6, team.run_dirs(), 1, 1, (1, 2), True, timeout=240)
    assert sorted(m[2] for m in done) == [2] * 6, team.logs()
    ranks.kill(procs)
    team.lose(5)  # one loss: RS 4+2 has a block to spare in every row
    wait_for(lambda: not status(team.nodes[0].run_dir)["team"]["nodes"][5]["live"], "node 5 to be declared dead")
    restore_on([team.nodes[i].run_dir for i in range(5)], 5, 1, 1, 2)  # bit for bit
    errors = [status(team.nodes[i].run_dir)["team"]["counters"]["parity_checksum_errors"] for i in range(5)]
    assert sum(errors) >= 1, errors  # the flipped block was caught, not served
    assert sum(status(team.nodes[i].run_dir)["checksum_failures"].get("parity", 0) for i in range(5)) == sum(errors)


def test_a_holder_that_refuses_a_copy_once_gets_it_again_and_the_version_is_healthy(make_team):
    team = make_team(2, "--replicas", "1", start=False)
    team.start(0)
    team.start(1, fault="replica.refuse@1")  # node 1 refuses node 0's copy of step 1 once (no room, say)
    procs, done = ranks.spawn(snapshot_ranks, 2, team.run_dirs(), 1, 1, (1, 2), False)
    assert sorted(m[2] for m in done) == [2, 2], team.logs()
    s = status(team.nodes[0].run_dir)["team"]
    assert s["counters"]["push_failures"] >= 1  # the refusal was seen ...
    wait_for(lambda: [v["health"] for v in status(team.nodes[0].run_dir)["team"]["versions"]] == ["healthy"] * 2,
             "node 0's copies to be made again")  # ... and healed: node 1 holds both steps of node 0


def test_when_ram_has_lost_a_step_the_flush_dir_serves_it(make_team, tmp_path):
    from ucpd.format import list_versions

    flush = str(tmp_path / "flush")
    team = make_team(3, "--replicas", "0", "--flush-dir", flush)
    procs, done = ranks.spawn(snapshot_ranks, 3, team.run_dirs(), 1, 1, (1,), True)
    wait_for(lambda: any(v.step == 1 and v.state == "complete" for v in list_versions(os.path.join(flush, TEST_JOB))), "the flush of step 1", 60)
    ranks.kill(procs)
    team.lose(2)  # no replicas: node 2's part of step 1 is gone from RAM, but not from disk
    wait_for(lambda: not status(team.nodes[0].run_dir)["team"]["nodes"][2]["live"], "node 2 to be declared dead")
    restore_on(team.run_dirs()[:2], 2, 1, 1, 1)


def test_a_team_serves_one_job_and_refuses_another_with_what_to_do(make_team):
    import torch

    from ucpd_client import Checkpointer
    from ucpd_client.errors import SnapshotRejected

    team = make_team(2, "--replicas", "1", "--job", "main")
    with Checkpointer(team.nodes[0].run_dir, rank=0, world_size=1, embedded=False, job="other", local_world_size=1) as ckpt:
        with pytest.raises(SnapshotRejected, match=r"serves job 'main', not 'other'.*start another team"):
            ckpt.snapshot(1, {"w": torch.ones(16)}).wait()
        assert ckpt.latest() is None  # and it sees nothing of the team's job
    assert status(team.nodes[0].run_dir)["team_job"] == "main"
