"""ucpd.checked: every copy path verifies exactly the chunks it reads, with one error text."""

import numpy as np
import pytest

from ucpd import native
from ucpd.checked import CheckedCopier, CheckedSource, touched_chunks, verify, view_byte_ranges, view_chunks
from ucpd.errors import ChecksumMismatch
from ucpd.ucl import Shard, View, plan_consolidate, plan_restore, resolve, source_pieces

CHUNK = 256


def source(arr: np.ndarray, damage: int | None = None) -> CheckedSource:
    crcs = native.crc32c_chunks(arr.view(np.uint8), CHUNK)
    if damage is not None:
        arr.view(np.uint8)[damage] ^= 0xFF
    return CheckedSource(arr, crcs, CHUNK, "test tensor 'w':")


def run(plan, sources, dst):
    cp = CheckedCopier(sources)
    for c in plan.copies:
        cp.add_array(c, dst)
    cp.run()


@pytest.mark.parametrize("rows", [None, (3, 17), (0, 1)])
def test_whole_and_row_slices_copy_right(rows):
    g = np.arange(32 * 24, dtype=np.int32).reshape(32, 24)
    src = source(g.reshape(-1).copy())
    pieces = source_pieces("a", resolve("w", Shard(0, 0, 1), g.shape)[0])
    plan = plan_consolidate("w", g.shape, pieces, rows)
    want = g if rows is None else g[rows[0] : rows[1]]
    out = np.zeros(want.size, np.int32)
    run(plan, {"a": src}, out)
    assert (out.reshape(want.shape) == want).all()


def test_column_shards_into_a_whole_tensor_scatter():
    g = np.arange(16 * 64, dtype=np.int16).reshape(16, 64)
    srcs, pieces = {}, []
    for i in range(2):
        frag = resolve("w", Shard(1, i, 2), (16, 32))[0]
        srcs[i] = source(np.ascontiguousarray(g[:, i * 32 : (i + 1) * 32]).reshape(-1))
        pieces += source_pieces(i, frag)
    out = np.zeros(g.size, np.int16)
    run(plan_consolidate("w", g.shape, pieces), srcs, out)
    assert (out.reshape(g.shape) == g).all()


def test_a_column_shard_of_a_whole_tensor_strided():
    g = np.arange(16 * 64, dtype=np.int32).reshape(16, 64)
    pieces = source_pieces("a", resolve("w", Shard(0, 0, 1), g.shape)[0])
    plan = plan_restore(resolve("w", Shard(1, 1, 4), (16, 16)), {"w": pieces})
    out = np.zeros(16 * 16, np.int32)
    run(plan, {"a": source(g.reshape(-1).copy())}, out)
    assert (out.reshape(16, 16) == g[:, 16:32]).all()


@pytest.mark.parametrize("rows, bad_byte, caught", [((4, 12), 5 * 96 + 3, True), ((4, 12), 15 * 96, False), ((0, 16), 0, True)])
def test_damage_is_caught_only_where_read(rows, bad_byte, caught):
    g = np.arange(16 * 24, dtype=np.int32).reshape(16, 24)  # 96-byte rows: slices cut chunks
    src = source(g.reshape(-1).copy(), damage=bad_byte)
    pieces = source_pieces("a", resolve("w", Shard(0, 0, 1), g.shape)[0])
    out = np.zeros((rows[1] - rows[0]) * 24, np.int32)
    plan = plan_consolidate("w", g.shape, pieces, rows)
    if not caught:
        run(plan, {"a": src}, out)
        return
    with pytest.raises(ChecksumMismatch, match=rf"test tensor 'w': chunk {bad_byte // CHUNK} \(tensor bytes \[\d+, \d+\)\) has crc32c 0x[0-9a-f]{{8}}, the snapshot records"):
        run(plan, {"a": src}, out)


def test_verify_and_touched_chunks():
    arr = np.arange(1000, dtype=np.uint8)
    assert touched_chunks([(0, 1), (255, 257), (990, 2000)], CHUNK, 1000) == [0, 1, 3]
    src = source(arr, damage=600)
    verify(src, [0, 1, 3])
    with pytest.raises(ChecksumMismatch, match="chunk 2 "):
        verify(src)


@pytest.mark.parametrize("view", [View(0, (4, 3), (512, 1)), View(7, (3, 2, 5), (2000, 600, 1)), View(0, (64, 4), (64, 1)), View(0, (0, 2), (2, 1))])
def test_view_chunks_covers_every_run(view):
    exact = set(touched_chunks(view_byte_ranges(view, 4), CHUNK, 1 << 30))
    got = view_chunks(view, 4, CHUNK)
    assert exact <= got
    if view.shape[0] == 4:  # runs far apart: the exact chunks only
        assert got == exact == {0, 8, 16, 24}
