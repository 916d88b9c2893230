"""An object-store flush's parts (``format.shares.plan_parts``): every byte of every file in
exactly one part, parts of at least the part size ending where rows end, and the parts filled
by "writers" making the very files, ``ucp.json`` and ``objects.bin`` one writer makes, each
part's CRC32C known from its writer's grid CRCs alone."""

from __future__ import annotations

import numpy as np
import pytest

from ucpd import native
from ucpd.format import REPLICATED, spec, write_version
from ucpd.format.shares import grid_crcs, join_crcs, part_crc, plan_files, plan_parts, remote_meta, span_crc

from .helpers import rand_bytes, sample_state, sources_of

CHUNK = 256
OBJECTS = {"global": None, "ranks": {0: b"rank zero", 1: b"rank one's loader"}}


def state_and_layout(rng, shard_bytes=4096):
    state = sample_state(rng)
    state["big"] = ("float32", rand_bytes("float32", (300, 11), rng))  # rows that cross chunk edges
    state["wide"] = ("float32", rand_bytes("float32", (2, 700), rng))  # a row larger than a part
    names = sorted(state)
    return state, plan_files([(n, state[n][0], state[n][1].shape, REPLICATED) for n in names], shard_bytes)


@pytest.mark.parametrize("part_bytes", [100, 1000, 5000])
def test_parts_cover_every_file_once_in_whole_rows(part_bytes):
    state, layout = state_and_layout(np.random.default_rng(3))
    parts = plan_parts(layout, part_bytes)
    for fname, (size, doff, _) in layout.files.items():
        mine = [p for p in parts if p.file == fname]
        assert [p.number for p in mine] == list(range(1, len(mine) + 1))
        assert [p.offset for p in mine] == [0] + [p.offset + p.size for p in mine[:-1]]
        assert mine[-1].offset + mine[-1].size == size
        assert all(p.size >= part_bytes for p in mine[:-1])  # S3: every part but the last at least the minimum
        assert mine[0].head == doff and all(p.head == 0 for p in mine[1:])
        for p in mine:
            at = p.offset + p.head
            for s in p.segments:
                place = layout.tensors[s.name]
                assert s.at == at == place.begin + s.r0 * place.row_bytes and s.nbytes == (s.r1 - s.r0) * place.row_bytes
                at += s.nbytes
            assert at == p.offset + p.size


def test_a_file_has_at_most_max_parts():
    _, layout = state_and_layout(np.random.default_rng(4))
    parts = plan_parts(layout, 1, max_parts=3)
    assert all(sum(p.file == f for p in parts) <= 3 for f in layout.files)


def test_the_parts_writers_fill_make_one_writers_files_and_ucp_json(tmp_path):
    rng = np.random.default_rng(5)
    state, layout = state_and_layout(rng)
    one = write_version(tmp_path / "one", 1, sorted(sources_of(state), key=lambda s: s.name), chunk_bytes=CHUNK,
                        shard_bytes=4096, fsync=False, created=1.0e9, objects=OBJECTS)
    files = {f: bytearray(size) for f, (size, _, _) in layout.files.items()}
    got: dict[str, list] = {}
    for part in reversed(plan_parts(layout, 700)):  # any order: a part depends on nothing but its rows
        buf = np.zeros(part.size, np.uint8)
        head = layout.files[part.file][2]
        buf[: part.head] = np.frombuffer(head[: part.head], np.uint8)
        grids = []
        for s in part.segments:
            place = layout.tensors[s.name]
            raw = np.ascontiguousarray(state[s.name][1]).reshape(-1).view(np.uint8)
            out = buf[s.at - part.offset : s.at - part.offset + s.nbytes]
            out[:] = raw[s.r0 * place.row_bytes : s.r1 * place.row_bytes]
            grids.append(grid_crcs(out, s.r0 * place.row_bytes, CHUNK))
            assert span_crc(grids[-1], s.r0 * place.row_bytes, s.nbytes, CHUNK) == native.crc32c(out)
            got.setdefault(s.name, []).append((s.r0, grids[-1], s.nbytes))
        assert part_crc(part, head, grids, layout, CHUNK) == native.crc32c(buf)  # what S3 must have received
        files[part.file][part.offset : part.offset + part.size] = buf.tobytes()
    crcs = {n: join_crcs(((c, nb) for _, c, nb in sorted(got.get(n, []), key=lambda x: x[0])), CHUNK) for n in state}
    meta, blob = remote_meta(1, layout, crcs, objects=OBJECTS, chunk=CHUNK, created=1.0e9)
    for f, data in files.items():
        assert (one / f).read_bytes() == bytes(data), f
    assert blob == (one / spec.OBJECTS_FILE).read_bytes()
    assert meta == (one / spec.META_FILE).read_bytes()  # byte for byte
