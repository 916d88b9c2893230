"""ucpd.checked: every copy path verifies exactly the chunks it reads, with one error text."""

import numpy as np
import pytest

from ucpd import native
from ucpd.checked import CheckedCopier, CheckedSource, ConsolidatingCopier, touched_chunks, verify, view_byte_ranges, view_chunks
from ucpd.errors import ChecksumMismatch
from ucpd.ucl import Shard, View, plan_consolidate, plan_restore, resolve, source_pieces
from ucpd.ucl.plan import Copy

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


# rows 4..12 read bytes 384..1152 of 256-byte chunks: chunk 1 is read in part (256..384 before the
# copied bytes), chunk 4 too (1152..1280 after them); damage anywhere in a chunk read is caught
@pytest.mark.parametrize("rows, bad_byte, caught", [((4, 12), 5 * 96 + 3, True), ((4, 12), 300, True), ((4, 12), 1200, True),
                                                    ((4, 12), 15 * 96, False), ((0, 16), 0, True)])
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


def run_verified(plan, sources, dst):
    cp = CheckedCopier(sources)
    for c in plan.copies:
        cp.add_array(c, dst)
    cp.run_verified()


@pytest.mark.parametrize("rows", [None, (3, 17), (0, 1)])
def test_run_verified_copies_what_run_copies(rows):
    g = np.arange(32 * 24, dtype=np.int32).reshape(32, 24)
    pieces = source_pieces("a", resolve("w", Shard(0, 0, 1), g.shape)[0])
    plan = plan_consolidate("w", g.shape, pieces, rows)
    want = g if rows is None else g[rows[0] : rows[1]]
    out = np.zeros(want.size, np.int32)
    run_verified(plan, {"a": source(g.reshape(-1).copy())}, out)
    assert (out.reshape(want.shape) == want).all()
    out = np.zeros(16 * 16, np.int32)  # a strided column shard
    plan = plan_restore(resolve("w", Shard(1, 1, 4), (16, 16)), {"w": source_pieces("a", resolve("w", Shard(0, 0, 1), (16, 64))[0])})
    g = np.arange(16 * 64, dtype=np.int32).reshape(16, 64)
    run_verified(plan, {"a": source(g.reshape(-1).copy())}, out)
    assert (out.reshape(16, 16) == g[:, 16:32]).all()


@pytest.mark.parametrize("bad_byte", [300, 5 * 96 + 3, 16 * 96 - 1])  # a whole chunk, a slice's edge chunk, the last
def test_run_verified_never_writes_a_byte_of_a_damaged_chunk(bad_byte):
    g = np.arange(16 * 24, dtype=np.int32).reshape(16, 24)  # 1536 bytes, 6 chunks
    src = source(g.reshape(-1).copy(), damage=bad_byte)
    pieces = source_pieces("a", resolve("w", Shard(0, 0, 1), g.shape)[0])
    rows = (1, 16)
    out = np.full((rows[1] - rows[0]) * 24, -1, np.int32)
    with pytest.raises(ChecksumMismatch, match=f"chunk {bad_byte // CHUNK} "):
        run_verified(plan_consolidate("w", g.shape, pieces, rows), {"a": src}, out)
    written = out.view(np.uint8)
    lo = (bad_byte // CHUNK) * CHUNK - 96  # the damaged chunk's bytes in the destination (rows from 1)
    assert (written[max(0, lo) : lo + CHUNK] == 0xFF).all()


def test_native_copy_batch_verified_copies_the_sound_chunks_only():
    src = np.random.default_rng(1).integers(0, 255, 5 * 1000 + 17, dtype=np.uint8)
    crcs = native.crc32c_chunks(src, 1000)
    src[2500] ^= 1
    dst = np.zeros_like(src)
    assert native.copy_batch_verified([(dst.ctypes.data, src.ctypes.data, src.nbytes)], [crcs], 1000, threads=2) == [
        (0, 2, native.crc32c(src[2000:3000]))]
    assert (dst[2000:3000] == 0).all() and (dst[:2000] == src[:2000]).all() and (dst[3000:] == src[3000:]).all()
    with pytest.raises(native.NativeError, match="CRCs expected"):
        native.copy_batch_verified([(dst.ctypes.data, src.ctypes.data, src.nbytes)], [crcs[:2]], 1000)


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


# -- ConsolidatingCopier (the flush): the file's chunk CRCs come out of the copy ----------------------

DISK = 4 * CHUNK + 64  # a file chunk that the source chunks do not divide


def consolidate_blocks(shards, placement, gshape, dtype, block_rows, dst_chunk=DISK, damage=None):
    """Consolidate ``shards`` ({rank: local array}) block by block as the flush does; returns the
    global tensor and, per block, the CRCs the copier gave (None: it gave none)."""
    srcs, pieces = {}, []
    for r, local in shards.items():
        frag = resolve("w", placement(r), local.shape)[0]
        srcs[r] = source(np.ascontiguousarray(local).reshape(-1).copy(), damage=damage.get(r) if damage else None)
        pieces += source_pieces(r, frag)
    out = np.zeros(int(np.prod(gshape)), dtype)
    row = int(np.prod(gshape[1:])) * out.itemsize
    cp = ConsolidatingCopier(srcs, threads=2)
    got = []
    for r0 in range(0, gshape[0], block_rows):
        r1 = min(gshape[0], r0 + block_rows)
        plan = plan_consolidate("w", gshape, pieces, (r0, r1))
        dst = out[r0 * row // out.itemsize : r1 * row // out.itemsize]
        got.append((r0 * row, dst, cp.block(plan.copies, dst, r0 * row, dst_chunk)))
    cp.finish()
    return out.reshape(gshape), got


def pieces_crcs(dst: np.ndarray, origin: int, chunk: int) -> list[int]:
    raw = dst.view(np.uint8)
    out, b = [], 0
    while b < raw.size:
        e = min(raw.size, (origin + b) // chunk * chunk + chunk - origin)
        out.append(native.crc32c(raw[b:e]))
        b = e
    return out


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("block_rows", [64, 7, 3])
def test_consolidating_copier_gives_the_destination_crcs_of_every_block(dim, block_rows):
    g = np.random.default_rng(dim + block_rows).integers(0, 1 << 31, size=(64, 512), dtype=np.int32)
    shards = {r: np.split(g, 4, axis=dim)[r] for r in range(4)}
    out, blocks = consolidate_blocks(shards, lambda r: Shard(dim, r, 4), g.shape, np.int32, block_rows)
    assert (out == g).all()
    for origin, dst, crcs in blocks:
        assert crcs == pieces_crcs(dst, origin, DISK)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("block_rows", [64, 5])
def test_consolidating_copier_catches_damage_even_in_chunks_cut_by_blocks(dim, block_rows):
    g = np.arange(64 * 512, dtype=np.int32).reshape(64, 512)
    shards = {r: np.split(g, 4, axis=dim)[r] for r in range(4)}
    for bad_byte in (0, CHUNK - 1, 3 * CHUNK + 5, shards[2].nbytes - 1):
        with pytest.raises(ChecksumMismatch, match=rf"test tensor 'w': chunk {bad_byte // CHUNK} \(tensor bytes"):
            consolidate_blocks(shards, lambda r: Shard(dim, r, 4), g.shape, np.int32, block_rows, damage={2: bad_byte})


def test_consolidating_copier_checks_chunks_it_read_only_in_part():
    """A source holding more than the global tensor needs (a padded vocabulary): the chunk its
    last rows share with the padding is checked at finish, reading the padding."""
    g = np.arange(10 * 30, dtype=np.int32).reshape(10, 30)  # 1200 bytes: chunk 4 is read in part
    padded = np.zeros((12, 30), np.int32)
    padded[:10] = g
    src = source(padded.reshape(-1).copy(), damage=1250)  # in the part of chunk 4 that is not copied
    cp = ConsolidatingCopier({"a": src})
    out = np.zeros(g.size, np.int32)
    assert cp.block([Copy("a", View(0, (g.size,), (1,)), View(0, (g.size,), (1,)))], out, 0, DISK) == pieces_crcs(out, 0, DISK)
    assert (out.reshape(g.shape) == g).all()
    with pytest.raises(ChecksumMismatch, match="chunk 4 "):
        cp.finish()


def test_consolidating_copier_short_runs_go_the_old_way():
    """Runs shorter than MIN_RUN_BYTES (a narrow column shard) are copied by CheckedCopier and
    the caller checksums the destination itself (None)."""
    g = np.arange(64 * 8, dtype=np.int32).reshape(64, 8)
    out, blocks = consolidate_blocks({r: np.split(g, 4, axis=1)[r] for r in range(4)}, lambda r: Shard(1, r, 4), g.shape, np.int32, 64)
    assert (out == g).all() and blocks[0][2] is None
    with pytest.raises(ChecksumMismatch):
        consolidate_blocks({r: np.split(g, 4, axis=1)[r] for r in range(4)}, lambda r: Shard(1, r, 4), g.shape, np.int32, 64, damage={1: 5})
