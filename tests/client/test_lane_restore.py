"""Where a restore's rows held on peers land (``ucpd_client.lane_restore``), in one process: the
lane is a fake that serves byte ranges of the holders' parts (as ``ReceiverLane.get`` does, each
chunk checked as it lands), the plans are written by hand, the targets are real tensors.

- A contiguous run lands in the target itself, all but the two chunks at its edges, which go
  through the window (1 MiB chunks: at most 2 MiB a run).
- A strided read (a column shard) or a row read by several copies goes whole through the window.
- Gets are at most ``GET_BYTES``, cut at chunk bounds; the window at most ``WINDOW_BYTES`` a round.
- A damaged copy at one holder: the next holder serves it; none left: ChecksumMismatch.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import ucpd_client.lane_restore as LR
from ucpd import native
from ucpd.errors import ChecksumMismatch
from ucpd.protocol import PlanCopy, PlanSource, PlanTensor, RestorePlan
from ucpd.ucl.geometry import View
from ucpd_client.lane_pull import LanePull
from ucpd_client.mapping import Mappings
from ucpd_client.restore import _add_copies

MiB = 1 << 20
C = MiB  # the chunk


def part_of(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)


def source(offset: int, data: np.ndarray) -> PlanSource:
    crcs = tuple(native.crc32c(data[k:k + C]) for k in range(0, data.nbytes, C))
    return PlanSource("/nonexistent/peer-file", offset, data.nbytes, "float32", crcs, C)


class FakeLane(LanePull):
    """A LanePull whose ``get`` reads the holders' parts from memory: ``parts[(node, rank)]`` the
    file of rank ``rank``'s part at ``node`` (``damaged`` nodes serve a flipped byte)."""

    def __init__(self, parts: dict, damaged=()):
        super().__init__(Mappings())
        self.parts, self.damaged = parts, set(damaged)
        self.gets: list[tuple[int, int]] = []  # (node, bytes)
        self._fake_lock = threading.Lock()

    def lane_of(self, remote):
        return "fake lane"

    def get_ranges(self, lane, step, origin, rank, nodes, ranges, views, checks):
        for node in nodes:
            data = self.parts[(node, rank)].copy()
            if node in self.damaged:
                data[len(data) // 2] ^= 0xFF
            bad = 0
            for (off, n), view, chunks in zip(ranges, views, checks):
                np.frombuffer(view, np.uint8)[:] = data[off:off + n]
                bad += sum(native.crc32c(view[s:e]) != crc for s, e, crc in chunks)
            with self._fake_lock:
                self.gets.append((node, sum(n for _, n in ranges)))
            if not bad:
                return
        raise ChecksumMismatch(f"no holder of rank {rank}'s part served it")

    def pool(self):
        if self._pool is None:
            self._pool = ThreadPoolExecutor(4)
        return self._pool


def run(plan, parts, remote_rows, hosts, damaged=()):
    pull = FakeLane(parts, damaged)
    remote = {"rows": remote_rows, "lanes": [], "ticket": b"", "key": b""}
    lr = LR.LaneRestore(pull, 1, plan, remote, hosts, _add_copies, 1)
    lr.start()
    try:
        lr.join()
        pull.capacity = pull._window_file.capacity if pull._window_file is not None else 0
    finally:
        pull.close()
    return lr, pull


def flat_copy(key, src_lo, n, dst_lo) -> PlanCopy:  # in float32 elements
    return PlanCopy(key, View(src_lo, (n,), (1,)), View(dst_lo, (n,), (1,)))


def test_a_contiguous_run_lands_in_the_target_but_for_its_two_edge_chunks():
    data = part_of(1, 11 * C // 2)  # 5.5 chunks: rank 1's part of one tensor, at byte 4096 of its file
    f = np.zeros(4096 + data.nbytes, np.uint8)
    f[4096:] = data
    lo, hi = 300 * 1024, 4 * C + 700 * 1024  # the target holds these bytes of it
    target = torch.zeros((hi - lo) // 4, dtype=torch.float32)
    plan = RestorePlan((source(4096, data),), (PlanTensor("w", (flat_copy(0, lo // 4, (hi - lo) // 4, 0),), ()),))
    lr, pull = run(plan, {(1, 1): f}, [(0, 1, 1, [1])], [target])
    assert bytes(target.numpy().view(np.uint8)) == bytes(data[lo:hi])
    assert lr.stats["in_place_bytes"] == 3 * C  # chunks 1-3 straight into the target
    assert lr.stats["window_bytes"] == 2 * C  # chunk 0 and chunk 4, each read in part
    assert lr.rows == {0}


def test_a_run_that_ends_the_row_lands_its_last_short_chunk_in_place():
    data = part_of(2, 5 * C + 4096)
    target = torch.zeros((data.nbytes - C) // 4, dtype=torch.float32)  # from chunk 1 to the end
    plan = RestorePlan((source(0, data),), (PlanTensor("w", (flat_copy(0, C // 4, target.numel(), 0),), ()),))
    lr, _ = run(plan, {(1, 1): data}, [(0, 1, 1, [1])], [target])
    assert bytes(target.numpy().view(np.uint8)) == bytes(data[C:])
    assert lr.stats == {"in_place_bytes": data.nbytes - C, "window_bytes": 0, "gets": 1}


def test_a_column_shard_goes_whole_through_the_window():
    rows, cols = 512, 1024  # float32: 2 MiB, row-major; the target takes columns 256..767
    data = part_of(3, rows * cols * 4)
    target = torch.zeros((rows, cols // 2), dtype=torch.float32)
    copy = PlanCopy(0, View(cols // 4, (rows, cols // 2), (cols, 1)), View(0, (rows, cols // 2), (cols // 2, 1)))
    plan = RestorePlan((source(0, data),), (PlanTensor("w", (copy,), ()),))
    lr, _ = run(plan, {(2, 0): data}, [(0, 0, 0, [2])], [target])
    want = torch.from_numpy(data.view(np.float32).reshape(rows, cols)[:, cols // 4: cols // 4 + cols // 2].copy())
    assert bytes(target.numpy().view(np.uint8)) == bytes(want.numpy().view(np.uint8))  # (random bits: NaNs too)
    assert lr.stats["in_place_bytes"] == 0 and lr.stats["window_bytes"] == data.nbytes


def test_gets_and_window_rounds_are_bounded(monkeypatch):
    monkeypatch.setattr(LR, "GET_BYTES", 2 * C)
    monkeypatch.setattr(LR, "WINDOW_BYTES", 3 * C)
    big = part_of(4, 9 * C)  # read whole: in place, 9 chunks in gets of at most 2
    small = [part_of(10 + k, C // 2) for k in range(8)]  # a quarter of each read: through the window, 6 a round
    f = np.concatenate([big, *small])
    srcs = [source(0, big)] + [source(9 * C + k * (C // 2), s) for k, s in enumerate(small)]
    targets = [torch.zeros(big.nbytes // 4)] + [torch.zeros(C // 16) for _ in small]
    tensors = tuple(PlanTensor(f"t{k}", (flat_copy(k, 0, t.numel(), 0),), ()) for k, t in enumerate(targets))
    lr, pull = run(RestorePlan(tuple(srcs), tensors), {(1, 1): f}, [(k, 1, 1, [1]) for k in range(9)], targets)
    for t, d in zip(targets, [big, *(s[:C // 4] for s in small)]):
        assert bytes(t.numpy().view(np.uint8)) == bytes(d)
    # in place: 2+2+2+2+1 chunks; the window: round 1 (6 halves) in gets of 2 MiB + 1 MiB, round 2 (2 halves)
    assert sorted(n for _, n in pull.gets) == sorted([2 * C] * 4 + [C] + [2 * C, C] + [C])
    assert lr.stats["in_place_bytes"] == 9 * C and lr.stats["window_bytes"] == 8 * (C // 2)
    assert pull.capacity == 3 * C  # the window never grew past a round


def test_a_damaged_copy_is_read_from_the_next_holder_and_none_left_raises():
    data = part_of(5, 3 * C)
    plan = RestorePlan((source(0, data),), (PlanTensor("w", (flat_copy(0, 0, data.nbytes // 4, 0),), ()),))
    parts = {(1, 1): data, (2, 1): data}
    target = torch.zeros(data.nbytes // 4)
    _, pull = run(plan, parts, [(0, 1, 1, [1, 2])], [target], damaged={1})
    assert bytes(target.numpy().view(np.uint8)) == bytes(data)
    assert [n for n, _ in pull.gets] == [1, 2]
    with pytest.raises(ChecksumMismatch):
        run(plan, parts, [(0, 1, 1, [1, 2])], [torch.zeros(data.nbytes // 4)], damaged={1, 2})


def test_a_large_range_is_cut_at_chunk_bounds_with_its_checks_made_relative():
    view = memoryview(bytearray(5 * C))
    checks = [(k * C, (k + 1) * C, k) for k in range(5)]
    parts = list(LR._parts([(4096, 5 * C, view, checks)], 2 * C))
    assert [[(o, n) for o, n, _, _ in p] for p in parts] == [[(4096, 2 * C)], [(4096 + 2 * C, 2 * C)], [(4096 + 4 * C, C)]]
    assert [p[0][3] for p in parts] == [[(0, C, 0), (C, 2 * C, 1)], [(0, C, 2), (C, 2 * C, 3)], [(0, C, 4)]]
