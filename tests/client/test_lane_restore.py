"""Where a restore's rows held on peers land (``ucpd_client.lane_restore``), in one process: the
lane is a fake that serves byte ranges of the holders' parts (as ``ReceiverLane.get`` does, each
chunk checked as it lands), the plans are written by hand, the targets are real tensors.

- A contiguous run lands in the target itself, every byte of it; the rest of the chunks at its
  edges lands in a scratch, so that each chunk is checked whole (1 MiB chunks).
- A strided read (a column shard) goes whole through the window, in bounded rounds.
- Gets are at most ``GET_BYTES``, cut at chunk bounds, never inside a chunk at an edge.
- A damaged copy at one holder (a flipped byte even outside what the target keeps): the next
  holder serves it; none left: ChecksumMismatch.
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
    file of rank ``rank``'s part at ``node`` (``damaged``: node -> the byte it serves flipped)."""

    def __init__(self, parts: dict, damaged=None):
        super().__init__(Mappings())
        self.parts, self.damaged = parts, dict(damaged or {})
        self.gets: list[tuple[int, int]] = []  # (node, bytes)
        self._fake_lock = threading.Lock()

    def lane_of(self, remote):
        return "fake lane"

    def get_ranges(self, lane, step, origin, rank, nodes, ranges, views, checks, after=None, remedy=""):
        last = None
        for node in nodes:
            data = self.parts[(node, rank)].copy()
            if node in self.damaged:
                data[self.damaged[node]] ^= 0xFF
            bad = 0
            for (off, n), view, check in zip(ranges, views, checks):  # as ReceiverLane.get lands them
                np.frombuffer(view, np.uint8)[:] = data[off:off + n]
                if callable(check):
                    check(view)
                else:
                    bad += sum(native.crc32c(view[s:e]) != crc for s, e, crc in check)
            with self._fake_lock:
                self.gets.append((node, sum(n for _, n in ranges)))
            try:
                if bad:
                    raise ChecksumMismatch(f"{bad} chunks")
                if after is not None:
                    after()
                return
            except ChecksumMismatch as exc:
                last = exc
        raise ChecksumMismatch(f"no holder of rank {rank}'s part served it: {last}")

    def pool(self):
        if self._pool is None:
            self._pool = ThreadPoolExecutor(4)
        return self._pool


def run(plan, parts, remote_rows, hosts, damaged=None):
    pull = FakeLane(parts, damaged)
    remote = {"rows": remote_rows, "lanes": [], "ticket": b"", "key": b""}
    lr = LR.LaneRestore(pull, 1, plan, remote, hosts, _add_copies, 1)
    try:
        lr.run()
        pull.capacity = pull._window_file.capacity if pull._window_file is not None else 0
    finally:
        pull.close()
    return lr, pull


def flat_copy(key, src_lo, n, dst_lo) -> PlanCopy:  # in float32 elements
    return PlanCopy(key, View(src_lo, (n,), (1,)), View(dst_lo, (n,), (1,)))


def as_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy())


def test_a_contiguous_run_lands_in_the_target_and_its_edge_chunks_rest_in_a_scratch():
    data = part_of(1, 11 * C // 2)  # 5.5 chunks: rank 1's part of one tensor, at byte 4096 of its file
    f = np.zeros(4096 + data.nbytes, np.uint8)
    f[4096:] = data
    lo, hi = 300 * 1024, 4 * C + 700 * 1024  # the target holds these bytes of it
    target = torch.zeros((hi - lo) // 4, dtype=torch.float32)
    plan = RestorePlan((source(4096, data),), (PlanTensor("w", (flat_copy(0, lo // 4, (hi - lo) // 4, 0),), ()),))
    lr, pull = run(plan, {(1, 1): f}, [(0, 1, 1, [1])], [target])
    assert as_bytes(target) == bytes(data[lo:hi])
    assert lr.stats["in_place_bytes"] == hi - lo  # every byte it holds, straight into it
    assert lr.stats["scratch_bytes"] == lo + (5 * C - hi)  # the rest of chunks 0 and 4, for their CRCs
    assert lr.stats["window_bytes"] == 0 and pull.capacity == 0
    assert lr.rows == {0}


def test_a_run_that_ends_the_row_lands_its_last_short_chunk_in_place():
    data = part_of(2, 5 * C + 4096)
    target = torch.zeros((data.nbytes - C) // 4, dtype=torch.float32)  # from chunk 1 to the end
    plan = RestorePlan((source(0, data),), (PlanTensor("w", (flat_copy(0, C // 4, target.numel(), 0),), ()),))
    lr, _ = run(plan, {(1, 1): data}, [(0, 1, 1, [1])], [target])
    assert as_bytes(target) == bytes(data[C:])
    assert lr.stats == {"in_place_bytes": data.nbytes - C, "scratch_bytes": 0, "window_bytes": 0, "gets": 1}


def test_a_row_read_by_several_runs_lands_each_in_its_target():
    data = part_of(3, 3 * C)
    a, b = torch.zeros(C // 4 + 100), torch.zeros(2 * C // 4 - 100)  # split inside chunk 1
    copies = (PlanTensor("a", (flat_copy(0, 0, a.numel(), 0),), ()), PlanTensor("b", (flat_copy(0, a.numel(), b.numel(), 0),), ()))
    lr, _ = run(RestorePlan((source(0, data),), copies), {(1, 1): data}, [(0, 1, 1, [1])], [a, b])
    assert as_bytes(a) + as_bytes(b) == bytes(data)
    assert lr.stats["in_place_bytes"] == data.nbytes and lr.stats["window_bytes"] == 0
    assert lr.stats["scratch_bytes"] == C  # chunk 1 came twice, once for each run's CRC


def test_a_column_shard_goes_whole_through_the_window():
    rows, cols = 512, 1024  # float32: 2 MiB, row-major; the target takes columns 256..767
    data = part_of(3, rows * cols * 4)
    target = torch.zeros((rows, cols // 2), dtype=torch.float32)
    copy = PlanCopy(0, View(cols // 4, (rows, cols // 2), (cols, 1)), View(0, (rows, cols // 2), (cols // 2, 1)))
    plan = RestorePlan((source(0, data),), (PlanTensor("w", (copy,), ()),))
    lr, _ = run(plan, {(2, 0): data}, [(0, 0, 0, [2])], [target])
    want = torch.from_numpy(data.view(np.float32).reshape(rows, cols)[:, cols // 4: cols // 4 + cols // 2].copy())
    assert as_bytes(target) == as_bytes(want)  # (random bits: NaNs too)
    assert lr.stats["in_place_bytes"] == 0 and lr.stats["window_bytes"] == data.nbytes


def test_gets_are_bounded_and_never_split_an_edge_chunk(monkeypatch):
    monkeypatch.setattr(LR, "GET_BYTES", 2 * C)
    big = part_of(4, 9 * C)  # read whole: in place, 9 chunks in gets of at most 2
    small = [part_of(10 + k, C // 2) for k in range(8)]  # a quarter of each read: the whole half chunk for its CRC
    f = np.concatenate([big, *small])
    srcs = [source(0, big)] + [source(9 * C + k * (C // 2), s) for k, s in enumerate(small)]
    targets = [torch.zeros(big.nbytes // 4)] + [torch.zeros(C // 16) for _ in small]
    tensors = tuple(PlanTensor(f"t{k}", (flat_copy(k, 0, t.numel(), 0),), ()) for k, t in enumerate(targets))
    lr, pull = run(RestorePlan(tuple(srcs), tensors), {(1, 1): f}, [(k, 1, 1, [1]) for k in range(9)], targets)
    for t, d in zip(targets, [big, *(s[:C // 4] for s in small)]):
        assert as_bytes(t) == bytes(d)
    assert sorted(n for _, n in pull.gets) == sorted([2 * C] * 4 + [C] + [2 * C] * 2)  # 4 half chunks a get
    assert lr.stats["scratch_bytes"] == 8 * (C // 4) and lr.stats["window_bytes"] == 0


def test_the_window_is_bounded_by_rounds(monkeypatch):
    monkeypatch.setattr(LR, "WINDOW_BYTES", 3 * C)
    rows, cols = 512, 512  # bfloat16, a half chunk each; the targets take half the columns: through the window
    parts = [part_of(20 + k, rows * cols * 2) for k in range(8)]  # bfloat16
    f = np.concatenate(parts)
    srcs = tuple(PlanSource("/x", k * p.nbytes, p.nbytes, "bfloat16", source(0, p).crcs, C) for k, p in enumerate(parts))
    copy = lambda k: PlanCopy(k, View(0, (rows, cols // 2), (cols, 1)), View(0, (rows, cols // 2), (cols // 2, 1)))  # noqa: E731
    targets = [torch.zeros((rows, cols // 2), dtype=torch.bfloat16) for _ in parts]
    plan = RestorePlan(srcs, tuple(PlanTensor(f"t{k}", (copy(k),), ()) for k in range(8)))
    lr, pull = run(plan, {(1, 1): f}, [(k, 1, 1, [1]) for k in range(8)], targets)
    for t, p in zip(targets, parts):
        want = p.view(np.uint16).reshape(rows, cols)[:, : cols // 2]
        assert as_bytes(t) == want.tobytes()
    assert pull.capacity == 3 * C and lr.stats["window_bytes"] == 4 * C  # rounds of 6 and 2 halves


def test_a_damaged_copy_is_read_from_the_next_holder_and_none_left_raises():
    data = part_of(5, 3 * C)
    plan = RestorePlan((source(0, data),), (PlanTensor("w", (flat_copy(0, C // 8, 2 * C // 4, 0),), ()),))
    parts = {(1, 1): data, (2, 1): data}
    flip = {1: C // 16}  # in chunk 0, before the target's first byte: only its carried CRC sees it
    target = torch.zeros(2 * C // 4)
    _, pull = run(plan, parts, [(0, 1, 1, [1, 2])], [target], damaged=flip)
    assert as_bytes(target) == bytes(data[C // 2: C // 2 + 2 * C])
    assert {n for n, _ in pull.gets} == {1, 2}
    with pytest.raises(ChecksumMismatch):
        run(plan, parts, [(0, 1, 1, [1, 2])], [torch.zeros(2 * C // 4)], damaged={1: C // 16, 2: 3 * C - 1})


