"""The scale models of ``ucpd.sim`` at small N: restart planning with the real UCL planner and
placement code, loss probabilities (closed form against Monte Carlo), and the flush plans."""

from __future__ import annotations

import pytest

from ucpd.sim import flush, loss, recovery
from ucpd.sim.network import Topology


def test_restart_planning_per_rank_reads_a_constant_number_of_pieces():
    small, big = recovery.simulate(64, sample_ranks=4), recovery.simulate(512, sample_ranks=4)
    assert small["unrecoverable_parts"] == big["unrecoverable_parts"] == 0
    assert small["copies_per_rank"] == big["copies_per_rank"] <= 3  # a shifted ZeRO range spans 2 saved ones


def test_the_indexed_sources_give_the_same_plan_as_all_pieces():
    old, new = recovery.Layout(256), recovery.Layout(240)
    src_of = {i: i for i in range(256)}
    for j in (0, 17, 239):
        assert recovery.plan_rank(old, new, j, 3, src_of, indexed=True) == recovery.plan_rank(old, new, j, 3, src_of, indexed=False)


def test_a_rack_failure_without_domains_loses_the_version_and_with_domains_does_not():
    for domain, expected in ((False, 1.0), (True, 0.0)):
        r = loss.evaluate(Topology(256, 32), loss.Scheme("r1", "replicas", r=1, domain=domain), trials=50)
        assert r["rack_failure_lost"] == expected
    assert recovery.simulate(256, lost="rack", domain=False)["unrecoverable_parts"] > 0
    assert recovery.simulate(256, lost="rack", domain=True)["unrecoverable_parts"] == 0


@pytest.mark.parametrize("scheme", [loss.Scheme("r1", "replicas", r=1, domain=True), loss.Scheme("xor", "parity", k=3, m=1, domain=True),
                                    loss.Scheme("g2", "gemini", m=2)])
def test_monte_carlo_agrees_with_the_closed_form(scheme):
    r = loss.evaluate(Topology(512, 32), scheme, p=0.02, trials=1500)
    sd = (r["independent_closed"] * (1 - r["independent_closed"]) / r["trials"]) ** 0.5
    assert abs(r["independent_mc"] - r["independent_closed"]) < 4 * sd + 0.01, r


def test_the_holders_table_is_the_placement_rule_for_every_node():
    from ucpd.team.holders import replica_holders

    topo = Topology(128, 8)
    for r, domain in ((2, True), (1, False)):
        table = loss.holders_table(topo, r, domain)
        domains = topo.domains() if domain else None
        assert [list(row) for row in table] == [replica_holders(o, range(128), r, domains) for o in range(128)]


def test_flush_by_owners_spreads_writes_and_node0_does_not():
    a, b = flush.simulate(64, plan="node0"), flush.simulate(64, plan="owners")
    assert a["crossed_over_state"] <= 1 and b["crossed_over_state"] <= 1
    assert a["write_max_over_mean"] == 64 and b["write_max_over_mean"] < 1.15  # the plan's 10% slack
    assert b["crossed_over_state"] < 0.05  # written where the bytes are
    assert b["ram_at_busiest"] < 300e6 < a["ram_at_busiest"]  # one piece's window, not the version
    assert b["time_s"] < a["time_s"]


def test_a_writer_lost_halfway_costs_one_batch_written_again():
    from ucpd.team.flush_lead import batch_bytes

    r = flush.simulate(64, plan="owners", lose=True)
    assert r["lost"] is not None
    assert 0 < r["rewritten_bytes"] <= batch_bytes(int(r["state_bytes"]), 64)
    assert r["write_max_over_mean"] < 1.25  # the others took its rest, still balanced


def test_a_restart_through_the_directory_costs_log_n_requests_a_node_and_no_hub():
    from ucpd.sim import discovery

    n = 64
    ask_all, doubling, hub = (discovery.simulate(n, s) for s in ("ask_all", "doubling", "hub"))
    assert ask_all == discovery.simulate(n, "ask_all", exact=True)  # the closed form is the pair-by-pair count
    assert ask_all["requests_per_node_max"] == 2 * 8 * (n - 1)  # latest and restore, each rank, each other node
    assert doubling["requests_per_node_max"] <= 2 * 6 and doubling["served_max"] <= 2 * 6  # log2(64) a gather
    manifests = n * doubling["node_manifest_bytes"]
    assert doubling["in_bytes_max"] < 1.01 * manifests  # each node gets every node's holdings once
    assert doubling["out_bytes_max"] < 1.01 * manifests  # and sends as much: no node is a hub
    assert hub["out_bytes_max"] > (n - 2) * manifests  # a hub sends the whole set to every node
    assert doubling["time_s"] < ask_all["time_s"] / 10 and doubling["time_s"] < hub["time_s"] / 10


def test_a_resharded_restart_through_the_piece_index_receives_a_few_parts_not_every_manifest():
    from ucpd.sim import discovery

    for n in (64, 256):
        doubling, index = discovery.simulate(n, "doubling"), discovery.simulate(n, "index")
        manifests = n * doubling["node_manifest_bytes"]
        assert index["in_bytes_max"] < manifests / 10  # a few ranks' manifests and the index's share
        assert index["out_bytes_max"] < manifests / 10  # no node is a hub either
        assert index["requests_per_node_max"] < 100 and index["served_max"] < 100


def test_pulled_reads_load_the_busiest_source_no_more_than_equal_shares_and_no_less_than_the_bound():
    for lost in ("random", "rack"):
        equal, pulled, best = (recovery.simulate(256, lost=lost, replicas=2, split=s, sample_ranks=1)
                               for s in (True, "pull", "best"))
        assert equal["moved_bytes"] == pytest.approx(pulled["moved_bytes"]) == pytest.approx(best["moved_bytes"])
        assert best["source_max_bytes"] <= pulled["source_max_bytes"] * 1.0001 <= equal["source_max_bytes"] * 1.0002
