"""Who writes which rows of a flush every node writes (``team.flush_plan.ShareFlush``), as a pure
state machine: balanced shares, written where the bytes are, and a lost, refusing or failing
writer's pieces rewritten by the others, never the ones already durable."""

from __future__ import annotations

import random

import pytest

from ucpd.team.flush_plan import SLACK, Piece, ShareFlush, row_blocks

MiB = 1 << 20


def pieces_held_by_rank(n: int, size=lambda i: 8 * MiB) -> list[Piece]:
    """Piece i is all in rank i's part."""
    return [Piece(i, f"t{i}", 0, 1, size(i), ((i, size(i)),)) for i in range(n)]


def run(sm: ShareFlush, on_batch=None) -> None:
    """Answer every batch as written (``on_batch(batch)`` may answer it otherwise: True)."""
    while not sm.complete and not sm.error:
        batches = sm.ready()
        assert batches, "pieces left with no writer to send them to"
        for b in batches:
            if on_batch is None or not on_batch(b):
                sm.on_done(b.id, [[p.id] for p in b.pieces])


def test_row_blocks_cover_the_rows_in_blocks_of_at_most_the_bound():
    assert row_blocks(10, 100, 250) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert row_blocks(3, 1000, 10) == [(0, 1), (1, 2), (2, 3)]  # a row larger than the bound: a row each
    assert row_blocks(1, 0, 10) == [(0, 1)]


def test_shares_are_balanced_when_nobody_holds_anything():
    rng = random.Random(3)
    pieces = [Piece(i, f"t{i}", 0, 1, rng.randint(1, 64) * MiB) for i in range(400)]
    sm = ShareFlush(pieces, {}, range(16), batch_bytes=256 * MiB)
    run(sm)
    load = [sum(sm.pieces[p].nbytes for p, n in sm.written_by.items() if n == node) for node in range(16)]
    mean = sum(load) / 16
    assert max(load) <= mean * (1 + SLACK) + 64 * MiB and min(load) >= mean * 0.85


def test_every_piece_is_written_by_the_node_holding_it_when_that_is_balanced():
    pieces = pieces_held_by_rank(32)
    holders = {r: {r % 8} for r in range(32)}  # rank r on node r % 8: four equal ranks a node
    sm = ShareFlush(pieces, holders, range(8), batch_bytes=16 * MiB)
    run(sm)
    assert all(sm.written_by[p.id] == p.id % 8 for p in pieces)  # no byte crossed the network


def test_balance_wins_over_holding_when_one_node_holds_everything():
    pieces = pieces_held_by_rank(40)
    sm = ShareFlush(pieces, {r: {0} for r in range(40)}, range(4), batch_bytes=64 * MiB)
    run(sm)
    by_node = [sum(1 for n in sm.written_by.values() if n == node) for node in range(4)]
    assert by_node[0] <= 11 and sum(by_node) == 40  # node 0 writes its share, not everything


def test_replicated_bytes_count_for_every_holder_once():
    p = Piece(0, "ln", 0, 1, 4 * MiB, ((0, 4 * MiB), (1, 4 * MiB), (2, 4 * MiB)))
    sm = ShareFlush([p], {0: {0}, 1: {1}, 2: {1}}, range(3), batch_bytes=MiB)
    assert sm.held_by(1, p) == 4 * MiB  # two ranks' copies of the same bytes: still the piece's size
    assert sm.held_by(2, p) == 0


def test_batches_hold_at_most_the_bound_and_one_is_in_flight_per_node():
    sm = ShareFlush(pieces_held_by_rank(12), {r: {0} for r in range(12)}, [0], batch_bytes=20 * MiB)
    first = sm.ready()
    assert [len(b.pieces) for b in first] == [2] and sm.ready() == []  # 16 MiB: a third would pass 20
    sm.on_done(first[0].id, [[0], [0]])
    assert len(sm.ready()) == 1


def test_a_lost_writers_unfinished_pieces_go_to_the_others_and_its_finished_ones_stay():
    pieces = pieces_held_by_rank(12)
    holders = {r: {r % 3} for r in range(12)}
    sm = ShareFlush(pieces, holders, range(3), batch_bytes=8 * MiB)  # one piece a batch
    first = {b.node: b for b in sm.ready()}
    sm.on_done(first[2].id, [[1]])  # node 2 finished one piece
    done_by_2 = first[2].pieces[0].id
    sm.on_lost(2)  # then died with the rest of its share
    sm.on_done(first[0].id, [[1]])
    sm.on_done(first[1].id, [[1]])
    late = sm.ready()
    sm.on_done(999, [[1]])  # a reply nobody waits for is ignored
    for b in late:
        sm.on_done(b.id, [[1]] * len(b.pieces))
    run(sm)
    assert sm.complete and sm.written_by[done_by_2] == 2
    assert {n for p, n in sm.written_by.items() if p != done_by_2} <= {0, 1}
    assert 2 not in {n for r, ns in sm.holders.items() for n in ns}  # and nothing is read from it


def test_a_reply_from_a_writer_declared_lost_meanwhile_does_not_count():
    sm = ShareFlush(pieces_held_by_rank(2), {0: {0}, 1: {1}}, range(2), batch_bytes=8 * MiB)
    b = {b.node: b for b in sm.ready()}
    sm.on_lost(1)
    sm.on_done(b[1].id, [[5]])  # it answered after all: its piece is already someone else's
    assert b[1].pieces[0].id not in sm.done
    sm.on_done(b[0].id, [[5]])
    run(sm)
    assert sm.written_by == {0: 0, 1: 0}


def test_a_node_that_cannot_see_the_flush_dir_writes_nothing_more():
    sm = ShareFlush(pieces_held_by_rank(9), {r: {r % 3} for r in range(9)}, range(3), batch_bytes=8 * MiB)

    def refuse(b):
        if b.node == 1:
            sm.on_refused(b.id, "not mounted")
            return True
        return False

    run(sm, refuse)
    assert sm.complete and 1 not in sm.written_by.values() and 1 not in sm.writers


def test_a_piece_that_fails_on_a_node_goes_to_another_and_three_failures_fail_the_flush():
    sm = ShareFlush(pieces_held_by_rank(1), {0: {0}}, range(3), batch_bytes=8 * MiB)
    tried = []

    def fail(b):
        tried.append(b.node)
        sm.on_failed(b.id, f"node {b.node}: a holder did not answer")
        return True

    run(sm, fail)
    assert tried[0] == 0 and len(set(tried)) == 3  # its holder first, then each other node once
    assert sm.error == "rows [0, 1) of 't0' failed 3 times; the last: node %d: a holder did not answer" % tried[-1]


@pytest.mark.parametrize("event", ["lost", "refused"])
def test_losing_the_last_writer_fails_the_flush(event):
    sm = ShareFlush(pieces_held_by_rank(2), {}, [0], batch_bytes=8 * MiB)
    b = sm.ready()[0]
    if event == "lost":
        sm.on_lost(0)
    else:
        sm.on_refused(b.id, "disk gone")
    assert sm.error and not sm.complete


def test_random_losses_never_leave_a_piece_unwritten_or_written_twice():
    for seed in range(30):
        rng = random.Random(seed)
        nodes = rng.randint(2, 9)
        pieces = [Piece(i, f"t{i % 7}", i, i + 1, rng.randint(1, 32) * MiB, ((i % nodes, MiB),)) for i in range(60)]
        sm = ShareFlush(pieces, {r: {r, (r + 1) % nodes} for r in range(nodes)}, range(nodes), batch_bytes=48 * MiB)
        lose = set(rng.sample(range(1, nodes), rng.randint(0, nodes - 1)))

        def answer(b):
            if b.node in lose and rng.random() < 0.5:
                lose.discard(b.node)
                sm.on_lost(b.node)
                return True
            return False

        run(sm, answer)
        assert sm.complete and not sm.error, seed
        assert set(sm.done) == set(sm.pieces)
