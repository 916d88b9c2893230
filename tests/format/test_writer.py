"""write_version / retain / LATEST: round trips, sharding, pacing, failure and crash safety."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from ucpd.errors import FormatError
from ucpd.format import (
    REPLICATED,
    TensorSource,
    list_versions,
    open_version,
    read_latest,
    retain,
    validate,
    write_version,
)

from .helpers import rand_bytes, sample_state, source, sources_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check_roundtrip(root, step, state):
    with open_version(root, step) as r:
        assert set(r.tensors) == set(state)
        for name, (dtype, arr) in state.items():
            t = r.tensors[name]
            assert (t.dtype, t.shape) == (dtype, arr.shape)
            assert t.data_offset % t.dt.itemsize == 0  # typed views stay aligned
            got = r.array(name)
            assert got.shape == arr.shape and not got.flags.writeable
            np.testing.assert_array_equal(got, arr)
            r.verify(name)


@pytest.mark.parametrize("io", ["pwrite", "mmap", "direct"])
@pytest.mark.parametrize("callable_fill", [True, False])
def test_roundtrip_dtypes_scalars_empty(tmp_path, io, callable_fill):
    state = sample_state()
    write_version(tmp_path, 3, sources_of(state, callable_fill), layout={"tp": 2}, io=io)
    check_roundtrip(tmp_path, 3, state)
    assert validate(tmp_path) == []


def test_sharding_many_small_some_big_and_staging_overflow(tmp_path):
    rng = np.random.default_rng(7)
    state = {f"s.{i}": ("float32", rand_bytes("float32", (i % 13 + 1, 3), rng)) for i in range(150)}
    state["big.a"] = ("bfloat16", rand_bytes("bfloat16", (1536, 2048), rng))  # 6 MiB: 2 chunks
    state["big.b"] = ("float32", rand_bytes("float32", (700, 1000), rng))
    path = write_version(
        tmp_path, 1, sources_of(state), layout={}, shard_bytes=4 << 20, staging_bytes=1 << 20, fsync=False
    )
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    check_roundtrip(tmp_path, 1, state)
    with open_version(tmp_path) as r:
        assert len(r.tensors["big.a"].crcs) == 2 and r.meta.chunk_bytes == 4 << 20


def test_chunk_crcs_match_reference(tmp_path):
    crc32c = pytest.importorskip("crc32c")
    arr = rand_bytes("uint8", (1000,))
    write_version(tmp_path, 0, [source("x", arr, "uint8")], chunk_bytes=64, fsync=False)
    with open_version(tmp_path) as r:
        t = r.tensors["x"]
        raw = arr.tobytes()
        assert list(t.crcs) == [crc32c.crc32c(raw[i : i + 64]) for i in range(0, 1000, 64)]


def test_objects_roundtrip(tmp_path):
    objs = {"global": b"\x00global-state", "ranks": {0: b"r0", 3: b"", 12: os.urandom(100)}}
    write_version(tmp_path, 9, [], layout={"x": [1, 2]}, objects=objs, chunk_bytes=16)
    with open_version(tmp_path) as r:
        assert r.objects == {"global": objs["global"], "ranks": objs["ranks"]}
        assert r.meta.layout == {"x": [1, 2]} and r.tensors == {}


def test_progress_throttle_and_rate_limit(tmp_path):
    state = {f"t{i}": ("float32", rand_bytes("float32", (256, 256))) for i in range(4)}  # 4 x 256 KiB
    seen, throttled = [], []
    t0 = time.monotonic()
    write_version(
        tmp_path, 1, sources_of(state, callable_fill=False), progress=lambda d, t: seen.append((d, t)),
        throttle=throttled.append, rate_limit=4 << 20, fsync=False,
    )
    elapsed = time.monotonic() - t0
    total = 4 * (256 << 10)
    assert seen[-1] == (total, total) and all(b >= a for (a, _), (b, _) in zip(seen, seen[1:]))
    assert sum(throttled) == total
    assert elapsed >= 0.2  # 1 MiB at 4 MiB/s


def test_throttle_can_abort_and_fill_exception_leaves_nothing(tmp_path):
    write_version(tmp_path, 1, [source("a", rand_bytes("float32", (4,)), "float32")])

    def boom(out):
        raise RuntimeError("injected")

    srcs = [source("a", rand_bytes("float32", (4,)), "float32"), TensorSource("b", "float32", (4,), REPLICATED, boom)]
    with pytest.raises(RuntimeError, match="injected"):
        write_version(tmp_path, 2, srcs)

    def stop(n):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_version(tmp_path, 3, sources_of(sample_state(), callable_fill=False), throttle=stop)
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "step-1"]
    assert read_latest(tmp_path) == 1 and open_version(tmp_path).step == 1


def test_bad_arguments(tmp_path):
    a = rand_bytes("float32", (2,))
    with pytest.raises(FormatError, match="twice"):
        write_version(tmp_path, 1, [source("a", a, "float32"), source("a", a, "float32")])
    with pytest.raises(FormatError, match="dtype"):
        write_version(tmp_path, 1, [TensorSource("a", "float128", (2,), REPLICATED, b"")])
    with pytest.raises(FormatError, match="holds 4 bytes, expected 8"):
        write_version(tmp_path, 1, [TensorSource("a", "float32", (2,), REPLICATED, b"1234")])
    with pytest.raises(FormatError, match="JSON"):
        write_version(tmp_path, 1, [TensorSource("a", "float32", (2,), {1, 2}, a)])
    with pytest.raises(FormatError, match="objects"):
        write_version(tmp_path, 1, [], objects={"global": "not bytes"})
    assert list_versions(tmp_path) == []
    write_version(tmp_path, 1, [])
    with pytest.raises(FormatError, match="immutable"):
        write_version(tmp_path, 1, [])


def test_latest_only_moves_forward(tmp_path):
    write_version(tmp_path, 5, [])
    write_version(tmp_path, 3, [])
    assert read_latest(tmp_path) == 5
    write_version(tmp_path, 7, [], update_latest=False)
    assert read_latest(tmp_path) == 5 and open_version(tmp_path).step == 5  # LATEST is respected


def test_retain(tmp_path):
    for s in (1, 2, 3, 4):
        write_version(tmp_path, s, [source("a", rand_bytes("int32", (3,)), "int32")], fsync=False)
    (tmp_path / ".step-9.tmp-999999999").mkdir()  # stale: no such pid
    (tmp_path / "step-0").mkdir()  # torn, older than the newest complete
    from ucpd.format.root import write_latest

    write_latest(tmp_path, 2)  # a rolled-back LATEST is never deleted
    removed = {p.name for p in retain(tmp_path, keep=1)}
    assert removed == {"step-1", "step-3", "step-0", ".step-9.tmp-999999999"}
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "step-2", "step-4"]
    with pytest.raises(FormatError):
        retain(tmp_path, 0)


CRASH_CHILD = textwrap.dedent(
    """
    import sys, time, numpy as np
    from ucpd.format import TensorSource, write_version, REPLICATED
    root, marker = sys.argv[1], sys.argv[2]
    def fill(i):
        def f(out):
            out[:] = i
            if i == 3:
                open(marker, "w").close()
                time.sleep(60)
        return f
    srcs = [TensorSource(f"t{i}", "uint8", (1 << 16,), REPLICATED, fill(i)) for i in range(6)]
    write_version(root, 2, srcs, shard_bytes=1 << 17, staging_bytes=1 << 16)
    """
)


def test_sigkill_mid_write_keeps_previous_version(tmp_path):
    root = tmp_path / "ckpt"
    write_version(root, 1, [source("t0", rand_bytes("uint8", (10,)), "uint8")])
    marker = tmp_path / "marker"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "client")]))
    child = subprocess.Popen([sys.executable, "-c", CRASH_CHILD, str(root), str(marker)], env=env)
    try:
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert child.poll() is None, "writer exited early"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
    states = {(v.step, v.state) for v in list_versions(root)}
    assert states == {(1, "complete"), (2, "partial")}
    assert read_latest(root) == 1
    with open_version(root) as r:
        assert r.step == 1
    assert any("stale" in p for p in validate(root))
    retain(root, keep=1)
    assert sorted(os.listdir(root)) == ["LATEST", "step-1"] and validate(root) == []


def test_fill_rows_streams_big_tensors_in_row_blocks(tmp_path):
    crc32c = pytest.importorskip("crc32c")
    big = rand_bytes("float32", (999, 37))  # 147852 bytes; rows of 148 bytes do not divide chunks
    raw = big.reshape(-1).view(np.uint8)
    calls = []

    def fill(out):
        raise AssertionError("fill_rows should be used")

    def fill_rows(out, r0, r1):
        calls.append((r0, r1))
        out[:] = raw[r0 * 148 : r1 * 148]

    src = TensorSource("big", "float32", big.shape, REPLICATED, fill, fill_rows)
    write_version(tmp_path, 1, [src, source("small", rand_bytes("int8", (5,)), "int8")],
                  staging_bytes=2 << 14, chunk_bytes=1000, fsync=False)
    assert len(calls) > 4 and calls[0][0] == 0 and calls[-1][1] == 999
    assert all(a[1] == b[0] for a, b in zip(calls, calls[1:]))
    with open_version(tmp_path) as r:
        np.testing.assert_array_equal(r.array("big"), big)
        data = raw.tobytes()
        assert list(r.tensors["big"].crcs) == [crc32c.crc32c(data[i : i + 1000]) for i in range(0, len(data), 1000)]


def test_retain_leaves_protected_steps_alone(tmp_path):
    from ucpd.format import TensorSource, list_versions, retain, write_version

    for step in (1, 2, 3, 4):
        write_version(tmp_path, step, [TensorSource("w", "uint8", (3,), {"kind": "replicated"}, b"abc")], fsync=False)
    retain(tmp_path, 1, protect=[2])
    assert sorted(v.step for v in list_versions(tmp_path)) == [2, 4]


def piece_crcs(raw: np.ndarray, begin: int, chunk: int) -> list[int]:
    """CRCs of ``raw`` (tensor bytes from ``begin``) cut where the tensor offset is a multiple of ``chunk``."""
    from ucpd import native

    out, b = [], 0
    while b < raw.size:
        e = min(raw.size, (begin + b) // chunk * chunk + chunk - begin)
        out.append(native.crc32c(raw[b:e]))
        b = e
    return out


@pytest.mark.parametrize("io", ["pwrite", "mmap", "direct"])
def test_fills_that_checksum_what_they_write_are_not_read_again(tmp_path, io, monkeypatch):
    """``fill_crcs``: the writer records the CRCs the fills return (whole tensors, and row blocks
    that do not line up with the chunks) and reads none of those bytes itself; a fill may still
    return None, and then the writer checksums as usual."""
    from ucpd.format import writer

    big = rand_bytes("float32", (999, 37))  # rows of 148 bytes: blocks cut chunks
    small = rand_bytes("int16", (300,))
    plain = rand_bytes("uint8", (77,))
    big_raw, small_raw = big.reshape(-1).view(np.uint8), small.view(np.uint8)
    seen = []

    def fill_big(out, chunk):  # io="mmap": the whole tensor into a mapping of the file
        out[:] = big_raw
        seen.append(("big-whole",))
        return piece_crcs(out, 0, chunk)

    def fill_rows_big(out, r0, r1, chunk):
        out[:] = big_raw[r0 * 148 : r1 * 148]
        seen.append(("big", r0, r1))
        return piece_crcs(out, r0 * 148, chunk)

    def fill_small(out, chunk):
        out[:] = small_raw
        seen.append(("small",))
        return piece_crcs(out, 0, chunk)

    def fill_none(out, chunk):
        out[:] = plain
        return None

    computed = []
    real = writer.chunk_crcs
    monkeypatch.setattr(writer, "chunk_crcs", lambda buf, chunk: computed.append(memoryview(buf).nbytes) or real(buf, chunk))
    srcs = [
        TensorSource("big", "float32", big.shape, REPLICATED, fill_big, fill_rows_big, fill_crcs=True),
        TensorSource("small", "int16", small.shape, REPLICATED, fill_small, fill_crcs=True),
        TensorSource("plain", "uint8", plain.shape, REPLICATED, fill_none, fill_crcs=True),
    ]
    write_version(tmp_path, 1, srcs, staging_bytes=2 << 14, chunk_bytes=1000, io=io, fsync=False)
    assert computed == [77]  # only the tensor whose fill returned None
    assert sum(1 for s in seen if s[0] == "big") > 4 if io != "mmap" else ("big-whole",) in seen
    assert validate(tmp_path) == []
    check_roundtrip(tmp_path, 1, {"big": ("float32", big), "small": ("int16", small), "plain": ("uint8", plain)})


def test_the_writer_records_the_crcs_a_fill_returns(tmp_path):
    """They are trusted (the fill computed them from what it wrote): wrong ones show in validate;
    a wrong count is a FormatError."""
    data = rand_bytes("uint8", (3000,))

    def wrong(out, chunk):
        out[:] = data
        return [0] * len(piece_crcs(out, 0, chunk))

    write_version(tmp_path, 1, [TensorSource("w", "uint8", data.shape, REPLICATED, wrong, fill_crcs=True)],
                  chunk_bytes=1000, fsync=False)
    assert any("w" in p and "chunk" in p for p in validate(tmp_path))

    def short(out, chunk):
        out[:] = data
        return [0]

    with pytest.raises(FormatError, match="returned 1 checksums .* expected 3"):
        write_version(tmp_path, 2, [TensorSource("w", "uint8", data.shape, REPLICATED, short, fill_crcs=True)],
                      chunk_bytes=1000, fsync=False)
    assert [v.step for v in list_versions(tmp_path)] == [1]


def files_of(root) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


@pytest.mark.parametrize("staging", [1 << 20, 32 << 20])
def test_direct_io_writes_the_same_bytes_through_o_direct(tmp_path, monkeypatch, staging):
    """io="direct": every file byte for byte as io="pwrite" writes it (header, tensors cut at any
    offset, the last partial page), the aligned part of it through the O_DIRECT descriptor."""
    from ucpd.format import writer

    rng = np.random.default_rng(3)
    state = sample_state(rng)
    state["big"] = ("float32", rand_bytes("float32", (1000, 333), rng))  # 1.3 MiB: row blocks
    state["odd"] = ("int8", rand_bytes("int8", (4097,), rng))
    direct_bytes = []
    real = writer._Direct.write
    monkeypatch.setattr(writer._Direct, "write", lambda self, buf, off: direct_bytes.append(memoryview(buf).nbytes) or real(self, buf, off))
    big = state.pop("big")[1]
    raw = big.reshape(-1).view(np.uint8)

    def fill_rows(out, r0, r1):
        out[:] = raw[r0 * 1332 : r1 * 1332]

    srcs = sources_of(state) + [TensorSource("big", "float32", big.shape, REPLICATED, lambda out: fill_rows(out, 0, 1000), fill_rows)]
    for io in ("pwrite", "direct"):
        write_version(tmp_path / io, 1, srcs, shard_bytes=1 << 20, staging_bytes=staging, io=io, created=1.0e9)
    assert files_of(tmp_path / "pwrite") == files_of(tmp_path / "direct")
    total = sum(len(b) for n, b in files_of(tmp_path / "direct").items() if n.endswith(".safetensors"))
    assert total - 4096 * 6 < sum(direct_bytes) <= total and all(n % 4096 == 0 for n in direct_bytes)
    assert validate(tmp_path / "direct") == []


def test_direct_io_falls_back_where_the_file_system_refuses_it(tmp_path, monkeypatch):
    """No O_DIRECT on this platform, or writes refused with EINVAL: the files are written through
    the page cache, the same bytes; byte sources are never written with O_DIRECT."""
    import errno as errno_

    from ucpd.format import writer

    state = sample_state()
    write_version(tmp_path / "ref", 1, sources_of(state), io="pwrite", created=1.0e9)
    opened = []
    real_open = writer._Direct.open

    def open_refusing(path, fd):
        d = real_open(path, fd)
        if d is not None:
            opened.append(d.dfd)
        return d

    real_write_all = writer.write_all

    def write_all(fd, data, offset):
        if fd in opened:
            raise OSError(errno_.EINVAL, "Invalid argument")
        real_write_all(fd, data, offset)

    monkeypatch.setattr(writer._Direct, "open", staticmethod(open_refusing))
    monkeypatch.setattr(writer, "write_all", write_all)
    write_version(tmp_path / "einval", 1, sources_of(state), io="direct", created=1.0e9)
    assert opened and files_of(tmp_path / "einval") == files_of(tmp_path / "ref")
    opened.clear()
    write_version(tmp_path / "bytes", 1, sources_of(state, callable_fill=False), io="direct", created=1.0e9)
    assert not opened and files_of(tmp_path / "bytes") == files_of(tmp_path / "ref")
    many = {f"t.{i}": ("int8", rand_bytes("int8", (3,))) for i in range(200)}  # a header bigger than a half
    write_version(tmp_path / "ref-many", 1, sources_of(many), io="pwrite", created=1.0e9)
    write_version(tmp_path / "many", 1, sources_of(many), io="direct", staging_bytes=8192, created=1.0e9)
    assert not opened and files_of(tmp_path / "many") == files_of(tmp_path / "ref-many")
    monkeypatch.delattr(os, "O_DIRECT")
    write_version(tmp_path / "none", 1, sources_of(state), io="direct", created=1.0e9)
    assert files_of(tmp_path / "none") == files_of(tmp_path / "ref")
