"""The piece index's pure part (``team.piece_index``): who owns a name, what a level keeps, how a
query is answered. The build over real nodes: ``test_team_piece_index.py``."""

from __future__ import annotations

import random

from ucpd.team import piece_index as pi


def entries(rank: int, names: dict) -> pi.Entries:
    """Rank ``rank``'s entries: ``{name: [(offsets, lengths), ...]}`` of a float32 tensor of 100 rows."""
    out: pi.Entries = {}
    for n, boxes in names.items():
        for o, ln in boxes:
            for b in pi.buckets((100,), o, ln):
                out.setdefault((n, b), ("float32", (100,), set()))[2].add((rank, o, ln))
    return out


def ask(shard: pi.Entries, name: str, offsets, lengths, near=frozenset(), asker=0):
    """``answer`` of the queries of one box of ``name`` (a tensor of 100 rows)."""
    wants = [[name, offsets, lengths, None if offsets is None else [100]]]
    return pi.answer(shard, pi.queries_of(wants), set(near), asker)


def reduce_scatter(own: list[pi.Entries]) -> list[pi.Entries | None]:
    """What each node holds after the build, computed with the module's own rules and no network:
    level 0 with the fold, then every level from the lower one and the partner's."""
    n = len(own)
    p = pi.owners(n)
    level = []
    for i in range(n):
        lv = pi.merge({}, own[i])
        if pi.folded(i, n) is not None:
            pi.merge(lv, own[pi.folded(i, n)])
        level.append(lv)
    for k in range(1, p.bit_length()):
        nxt = []
        for i in range(p):
            m, r = pi.level_keeps(i, k)
            lv = pi.merge({}, pi.keep(level[i], p, m, r))
            nxt.append(pi.merge(lv, pi.keep(level[pi.partner(i, k)], p, m, r)))
        level = nxt
    return level[:p]


def test_owners_are_the_largest_power_of_two_not_above_the_live_nodes():
    assert [pi.owners(n) for n in (1, 2, 3, 5, 8, 9, 1024, 8191)] == [1, 2, 2, 4, 8, 8, 1024, 4096]
    key = ("layers.3.attn.weight", 2)
    assert pi.owner(key, 64) == pi.owner(key, 64) < 64  # the same on every node


def test_a_tensor_s_rows_are_cut_in_buckets_so_its_readers_ask_different_owners():
    assert pi.buckets((100,), (0,), (100,)) == range(pi.BUCKETS)
    assert pi.buckets((100,), (50,), (7,)) == range(8, 9)  # rows 50..56
    assert pi.buckets((None, 4), (0, 0), (3, 4)) == range(1) and pi.buckets((), (), ()) == range(1)
    assert pi.buckets((100,), None, None) == range(pi.BUCKETS)


def test_after_the_halving_each_owner_holds_every_piece_of_its_names_and_nothing_else():
    rng = random.Random(7)
    for n in (1, 2, 3, 5, 8, 13):
        own = [entries(i, {f"t{rng.randrange(40)}": [((i * 7 % 90,), (10,))] for _ in range(6)}) for i in range(n)]
        shards = reduce_scatter(own)
        p = pi.owners(n)
        every = pi.merge({}, {})
        for e in own:
            every = pi.merge(every, e)
        for i, shard in enumerate(shards):
            assert shard == {key: e for key, e in every.items() if pi.owner(key, p) == i}, (n, i)


def test_the_same_piece_from_two_copies_of_a_part_is_kept_once():
    a = entries(3, {"w": [((0,), (50,))]})
    merged = pi.merge(pi.merge({}, a), entries(3, {"w": [((0,), (50,))]}))
    assert merged[("w", 0)][2] == {(3, (0,), (50,))} and len(merged) == pi.BUCKETS // 2


def test_a_level_keeps_the_owners_that_agree_with_the_node_in_its_low_bits():
    assert pi.level_keeps(5, 0) == (1, 0)  # level 0: everything
    assert pi.level_keeps(5, 2) == (4, 1)
    keys = {(f"n{i}", 0): ("f", (1,), set()) for i in range(200)}
    kept = pi.keep(keys, 8, 4, 1)
    assert kept and all(pi.owner(x, 8) % 4 == 1 for x in kept) and len(kept) < len(keys)


def test_a_query_gets_one_rank_per_distinct_saved_box_it_overlaps():
    # "w": 4 row blocks of 25, each saved by two data-parallel ranks (r and r + 4)
    shard = pi.merge({}, {})
    for r in range(8):
        shard = pi.merge(shard, entries(r, {"w": [(((r % 4) * 25,), (25,))]}))
    ranks, known = ask(shard, "w", [20], [40])  # rows 20..59: blocks 0, 1, 2
    assert known == ["w"] and len(ranks) == 3 and {r % 4 for r in ranks} == {0, 1, 2}


def test_a_query_prefers_a_rank_the_asker_holds_and_spreads_the_others_over_askers():
    shard = pi.merge({}, {})
    for r in range(4):
        shard = pi.merge(shard, entries(r, {"b": [((0,), (100,))]}))  # every rank holds all of it
    assert ask(shard, "b", None, None, near={2})[0] == {2}
    picked = {next(iter(ask(shard, "b", [0], [100], asker=a)[0])) for a in range(4)}
    assert picked == {0, 1, 2, 3}  # four askers, four different copies


def test_an_answer_says_which_names_the_shard_knows_so_an_unknown_one_is_noticed():
    shard = entries(0, {"w": [((0,), (100,))]})
    queries = pi.queries_of([["v", None, None, None], ["w", None, None, None]])
    assert pi.answer(shard, queries, set(), 0) == ({0}, ["w"])


def test_a_box_a_part_here_holds_whole_is_read_here_and_not_asked():
    local = pi.merge(entries(5, {"w": [((0,), (50,))]}), entries(6, {"b": [((0,), (100,))]}))
    wants = [["w", [10], [20], [100]], ["w", [40], [20], [100]], ["b", [0], [100], [100]], ["c", None, None, None]]
    ranks, rest = pi.held_here(wants, local)
    assert ranks == {5, 6} and [w[0] for w in rest] == ["w", "c"]  # rows 40..59 straddle rank 5's end


def test_entries_survive_the_wire():
    e = pi.merge(entries(1, {"w": [((0,), (10,)), ((10,), (10,))]}), {("s", 0): ("int64", (None, 4), set())})
    assert pi.from_wire(pi.to_wire(e)) == e


def test_the_queries_of_a_restore_are_the_global_boxes_its_targets_read():
    targets = [{"name": "w", "dtype": "float32", "shape": [50, 4], "placement": {"kind": "shard", "dim": 0, "index": 1, "parts": 2}},
               {"name": "b", "dtype": "float32", "shape": [4], "placement": {"kind": "replicated"}}]
    assert sorted(pi.wants_of(targets)) == [["b", [0], [4], [4]], ["w", [50, 0], [50, 4], [100, 4]]]
