"""A version written by many writers (``format.shares``): the same files as ``write_version``,
whatever the writers' pieces and their order, checked on the way in and committed by one."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ucpd.errors import FormatError, StorageError
from ucpd.format import REPLICATED, open_version, validate, write_version
from ucpd.format import spec
from ucpd.format._checksum import chunk_crcs
from ucpd.format.shares import (
    GridCRCs, commit_files, create_files, grid_crcs, join_crcs, plan_files, write_rows,
)

from .helpers import rand_bytes, sample_state, sources_of

CHUNK = 256  # small chunks: most pieces start and end inside one


def fill_from(arr: np.ndarray, place):
    """``write_rows``' fill for rows of ``arr`` (the whole tensor, storage-typed)."""
    raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)

    def fill(out, a, b, chunk):
        out[:] = raw[a * place.row_bytes : b * place.row_bytes]
        return grid_crcs(out, a * place.row_bytes, chunk)

    return fill


def write_in_pieces(root, step, state, rng, shard_bytes=4096):
    """``state`` written by "writers" that each take random row blocks, in a random order."""
    names = sorted(state)
    layout = plan_files([(n, state[n][0], state[n][1].shape, REPLICATED) for n in names], shard_bytes)
    tmp = root / spec.tmp_dirname(step, os.getpid())
    root.mkdir(parents=True, exist_ok=True)
    create_files(tmp, layout, fsync=False)
    pieces = []
    for n in names:
        place = layout.tensors[n]
        rows = place.rows
        if place.end == place.begin:
            continue
        cuts = sorted({0, rows, *rng.integers(0, rows + 1, size=min(rows, 3)).tolist()})
        pieces += [(n, a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
    got: dict[str, list] = {}
    for i in rng.permutation(len(pieces)):
        n, a, b = pieces[i]
        place = layout.tensors[n]
        crcs = write_rows(tmp / place.file, place, a, b, fill_from(state[n][1], place), CHUNK, fsync=False)
        got.setdefault(n, []).append((a, crcs, (b - a) * place.row_bytes))
    crcs = {n: join_crcs(((c, nb) for _, c, nb in sorted(got.get(n, []))), CHUNK) for n in names}
    return commit_files(tmp, root, step, layout, crcs, chunk=CHUNK, fsync=False, created=1.0e9)


def test_the_writers_pieces_make_the_same_files_as_one_writer(tmp_path):
    rng = np.random.default_rng(7)
    state = sample_state(rng)
    state["big"] = ("float32", rand_bytes("float32", (300, 11), rng))  # rows that cross chunk edges
    one = write_version(tmp_path / "one", 1, sorted(sources_of(state), key=lambda s: s.name), chunk_bytes=CHUNK,
                        shard_bytes=4096, fsync=False, created=1.0e9)
    many = write_in_pieces(tmp_path / "many", 1, state, rng)
    assert sorted(os.listdir(one)) == sorted(os.listdir(many))
    for f in os.listdir(one):  # byte for byte, ucp.json included
        assert (one / f).read_bytes() == (many / f).read_bytes(), f
    assert validate(tmp_path / "many", 1, full=True) == []
    with open_version(tmp_path / "many", 1) as r:
        assert np.array_equal(r.array("big").view(np.uint8), state["big"][1].view(np.uint8))


@pytest.mark.parametrize("seed", range(4))
def test_grid_crcs_of_any_split_join_into_the_chunk_crcs(seed):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, int(rng.integers(1, 5000)), dtype=np.uint8)
    cuts = sorted({0, data.nbytes, *rng.integers(0, data.nbytes, 6).tolist()})
    pieces = []
    for a, b in zip(cuts, cuts[1:]):
        acc = GridCRCs(a, CHUNK)  # each piece itself fed in uneven blocks
        inner = sorted({a, b, *rng.integers(a, b + 1, 2).tolist()})
        for x, y in zip(inner, inner[1:]):
            acc.feed(data[x:y])
        pieces.append((acc.finish(), b - a))
    assert join_crcs(pieces, CHUNK) == chunk_crcs(data, CHUNK)


def test_rows_written_where_the_lead_made_no_files_name_the_flush_dir_to_mount(tmp_path):
    layout = plan_files([("w", "float32", (4, 4), None)])
    place = layout.tensors["w"]
    arr = np.zeros((4, 4), np.float32)
    with pytest.raises(StorageError, match="does not see the flush dir.*mount it on every node"):
        write_rows(tmp_path / "nowhere" / place.file, place, 0, 4, fill_from(arr, place), CHUNK)


def test_a_write_the_file_system_lost_is_caught_when_the_rows_are_read_back(tmp_path, monkeypatch):
    layout = plan_files([("w", "float32", (64, 4), None)])
    create_files(tmp_path / "v", layout, fsync=False)
    place = layout.tensors["w"]
    import ucpd.format.shares as shares

    real = shares.write_all
    monkeypatch.setattr(shares, "write_all", lambda fd, buf, off: real(fd, buf[: len(buf) // 2], off))  # half lands
    arr = np.ones((64, 4), np.float32)
    with pytest.raises(StorageError, match="read back differ.*lost a write"):
        write_rows(tmp_path / "v" / place.file, place, 0, 64, fill_from(arr, place), CHUNK)


def test_a_version_is_not_committed_while_a_tensor_misses_pieces(tmp_path):
    layout = plan_files([("w", "float32", (64, 4), None)])
    tmp = tmp_path / spec.tmp_dirname(3, os.getpid())
    create_files(tmp, layout, fsync=False)
    place = layout.tensors["w"]
    crcs = write_rows(tmp / place.file, place, 0, 32, fill_from(np.ones((64, 4), np.float32), place), CHUNK, fsync=False)
    with pytest.raises(FormatError, match="2 chunk CRCs were reported, its 1024 bytes have 4"):
        commit_files(tmp, tmp_path, 3, layout, {"w": join_crcs([(crcs, 512)], CHUNK)}, chunk=CHUNK, fsync=False)
    assert not (tmp_path / "step-3").exists() and not tmp.exists()  # nothing visible, nothing left
