#!/usr/bin/env python
"""The data lane alone: TCP (``DataLane``) against NIXL (``NixlLane``), puts and gets between two
processes on loopback, beside the plain socket floor.

    .venv/bin/python benchmarks/team/bench_lane.py [--mib 512] [--reps 5] [--batch-mib 32]
        [--in-flight 4] [--only tcp,nixl] [--json OUT]

Two processes (``multiprocessing`` spawn): this one (node 0, the caller) and a server (node 1),
each with a ``DataLane`` and a ``NixlLane`` (``--data-transport nixl``; skipped, and said so, when
NIXL cannot start) listening on 127.0.0.1, authenticated with a job secret. Every buffer is a
MAP_SHARED mapping of a file in /dev/shm (as the daemons' slots and replica files are), every
page written before anything is timed: the caller's source (a seeded pattern) and destination,
the server's destination (puts land there, as in a replica file) and source (gets read it, as
a slot). The server's ``on_put`` names the CRC32C of every 1 MiB chunk of the put (as
``replicas.landing`` does) and checks them all: the put is answered once every chunk matched.

Cases, --mib MiB (512) each, --reps times (5), interleaved rep by rep (floor, then every case):

- put, one request of --mib MiB; put, --batch-mib MiB (32) requests, --in-flight (4) at once
  from as many threads (the replication push: ``replicate.DATA_BATCH``/``PUSH_IN_FLIGHT``);
- get, one request (one range); get, --batch-mib MiB requests, --in-flight at once (a restore's
  fetches).

Time = the first request's call to the last one's return, in the caller (CLOCK_MONOTONIC):
everything the lane does is in it (its control messages, registrations, the receiver's CRC
pass). After each measurement (untimed) the bytes are checked: every put chunk verified by the
server, every byte of a get compared with the pattern. One untimed warm-up of each case first
(connections made, NIXL metadata loaded, mappings registered).

The floor: ``floors_net.SocketFloor``, a plain loopback TCP socket between two processes
(``sendall`` from a warm buffer, ``recv_into(MSG_WAITALL)`` into a warm one), the same bytes, 1
stream, measured in each rep before the cases. GB/s are 10^9 bytes per second; "x floor" is a
case's median over the floor's median. The table gives the CPU (``lscpu``), UCX's transports as
NIXL sees them and ``UCX_TLS`` (unset: UCX picks; on one host NIXL's peer-failure mode leaves cma
for the bytes and tcp for its messages). The machine is shared and noisy: compare the figures of
one run.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1]), str(ROOT)]

from common import MiB, log, machine, median, table, write_json  # noqa: E402
from floors_net import SocketFloor  # noqa: E402

SECRET = b"bench-lane-secret-of-32-bytes!!!"
SHM_PREFIX = "ucpd-bench-lane-"
CHUNK = MiB  # native.CHUNK_BYTES: what the receiver of a put checks
TIMEOUT = 600.0


def _shm(name: str, nbytes: int) -> mmap.mmap:
    path = f"/dev/shm/{SHM_PREFIX}{os.getpid()}-{name}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        os.unlink(path)  # (the mapping keeps the pages; nothing is left behind on any exit)
    return mm


def _pattern(mm: mmap.mmap, seed: int) -> None:
    """A seeded 1 MiB block, each MiB stamped with its index: every page written."""
    import numpy as np

    block = np.random.default_rng(seed).integers(0, 256, CHUNK, dtype=np.uint8)
    rows = np.frombuffer(mm, np.uint8).reshape(-1, CHUNK)
    rows[:] = block
    rows[:, :8] = (np.arange(rows.shape[0], dtype=np.uint64) * 1000003 + seed).view(np.uint8).reshape(-1, 8)
    del rows


def _lanes(rank: int, on_put, on_get, kinds):
    from ucpd.team.lane import DataLane

    lanes, why = {}, {}
    for kind in kinds:
        if kind == "tcp":
            lanes[kind] = DataLane(rank, SECRET, "127.0.0.1:0", on_put=on_put, on_get=on_get)
        else:
            from ucpd.team.lane_nixl import NixlLane

            lanes[kind] = NixlLane(rank, SECRET, "127.0.0.1:0", on_put=on_put, on_get=on_get)
        try:
            lanes[kind].start()
        except Exception as exc:  # (NIXL missing: the case is skipped, and the table says why)
            why[kind] = f"{type(exc).__name__}: {exc}"
            del lanes[kind]
    return lanes, why


def _server(conn, nbytes: int, kinds: list[str]) -> None:
    """Node 1: puts land in ``dst`` (every chunk named and checked), gets read ``src``."""
    from ucpd import native
    from ucpd.team.lane import Landing

    import numpy as np

    dst, src = _shm("server-dst", nbytes), _shm("server-src", nbytes)
    np.frombuffer(dst, np.uint8)[:] = 0  # (every page written)
    _pattern(src, 2)
    expect = _shm("server-expect", nbytes)  # what the caller puts: the chunks' CRCs are known
    _pattern(expect, 1)
    crcs = native.crc32c_chunks(memoryview(expect), CHUNK)
    expect.close()
    checked = {"ok": 0, "bad": 0}
    lock = threading.Lock()

    def on_put(s, b):
        off, n = b["offset"], b["nbytes"]
        chunks = [(c * CHUNK - off, (c + 1) * CHUNK - off, crcs[c])  # the chunks whole inside the put
                  for c in range(-(-off // CHUNK), (off + n) // CHUNK)]

        def done(ok, bad):
            with lock:
                checked["ok"] += len(ok)
                checked["bad"] += len(bad)

        return Landing(memoryview(dst)[off : off + n], chunks, done)

    def on_get(s, b):
        return [memoryview(src)[o : o + n] for o, n in b["ranges"]]

    lanes, why = _lanes(1, on_put, on_get, kinds)
    conn.send(({k: lane.address for k, lane in lanes.items()}, why))
    while True:
        msg = conn.recv()
        if msg == "checked":
            with lock:
                conn.send(dict(checked))
                checked.update(ok=0, bad=0)
        elif msg == "status":
            conn.send({k: lane.status() for k, lane in lanes.items()})
        else:
            break
    for lane in lanes.values():
        lane.close()


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        model = fields.get("Model name", "?").strip()
        return f"{model}, {fields.get('CPU(s)', '?').strip()} CPU(s), {fields.get('Hypervisor vendor', 'bare metal').strip()}"
    except (OSError, subprocess.SubprocessError, ValueError):
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="MiB moved per measurement")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch-mib", type=int, default=32, help="MiB per request of the batched cases")
    ap.add_argument("--in-flight", type=int, default=4, help="batched requests at once (threads)")
    ap.add_argument("--only", default="tcp,nixl", help="lanes to measure: tcp, nixl")
    ap.add_argument("--json", help="write the figures there too")
    args = ap.parse_args(argv)
    import numpy as np

    from ucpd import native

    nbytes, batch = args.mib * MiB, args.batch_mib * MiB
    kinds = [k for k in args.only.split(",") if k]
    info = machine()
    info["cpu"] = _cpu_model()
    log(f"bench_lane: {args.mib} MiB x {args.reps} reps on {info['cpu']}")

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_server, args=(child, nbytes, kinds), daemon=True)
    server.start()
    floor = None
    try:
        src, dst = _shm("caller-src", nbytes), _shm("caller-dst", nbytes)
        _pattern(src, 1)
        np.frombuffer(dst, np.uint8)[:] = 0
        want_get = native.crc32c_chunks(memoryview(_expected(nbytes, 2)), CHUNK)
        lanes, why = _lanes(0, None, None, kinds)
        if not parent.poll(TIMEOUT):
            raise TimeoutError("the server process did not start")
        addresses, server_why = parent.recv()
        why.update({k: v for k, v in server_why.items() if k not in why})
        for kind in list(lanes):
            if kind not in addresses:
                lanes.pop(kind).close()
                continue
            lanes[kind].set_peer(1, addresses[kind])
        pool = ThreadPoolExecutor(args.in_flight)
        floor = SocketFloor()

        def put_one(lane):
            return lambda: lane.put(1, {"origin": 0, "step": 1, "rank": 0, "offset": 0}, [memoryview(src)])

        def put_batched(lane):
            def run():
                list(pool.map(lambda off: lane.put(1, {"origin": 0, "step": 1, "rank": 0, "offset": off},
                                                   [memoryview(src)[off : off + batch]]), range(0, nbytes, batch)))
            return run

        def get_one(lane):
            return lambda: lane.get(1, {"origin": 1, "step": 1, "rank": 1, "ranges": [[0, nbytes]]}, [memoryview(dst)])

        def get_batched(lane):
            def run():
                list(pool.map(lambda off: lane.get(1, {"origin": 1, "step": 1, "rank": 1, "ranges": [[off, batch]]},
                                                   [memoryview(dst)[off : off + batch]]), range(0, nbytes, batch)))
            return run

        cases = []
        for kind, lane in lanes.items():
            cases += [(f"{kind} put, 1 x {args.mib} MiB", "put", put_one(lane)),
                      (f"{kind} put, {args.batch_mib} MiB x {nbytes // batch}, {args.in_flight} in flight", "put", put_batched(lane)),
                      (f"{kind} get, 1 x {args.mib} MiB", "get", get_one(lane)),
                      (f"{kind} get, {args.batch_mib} MiB x {nbytes // batch}, {args.in_flight} in flight", "get", get_batched(lane))]

        def check(what, label):
            if what == "put":
                parent.send("checked")
                got = parent.recv()
                if got != {"ok": nbytes // CHUNK, "bad": 0}:
                    raise AssertionError(f"{label}: the server checked {got}, not {nbytes // CHUNK} good chunks")
            else:
                if native.crc32c_chunks(memoryview(dst), CHUNK) != want_get:
                    raise AssertionError(f"{label}: the bytes got differ from the server's")
                np.frombuffer(dst, np.uint8)[:] = 0

        floor.measure(nbytes)
        for label, what, fn in cases:  # warm-up
            fn()
            check(what, label)
        figures: dict[str, list[float]] = {"socket floor, 1 stream": []}
        for label, _, _ in cases:
            figures[label] = []
        for rep in range(args.reps):
            figures["socket floor, 1 stream"].append(floor.gbps(nbytes))
            for label, what, fn in cases:
                t0 = time.monotonic()
                fn()
                figures[label].append(nbytes / (time.monotonic() - t0) / 1e9)
                check(what, label)
            log(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{k.split(',')[0]} {v[-1]:.2f}" for k, v in figures.items()))
        parent.send("status")
        server_status = parent.recv()
        nixl = lanes["nixl"].status()["nixl"] if "nixl" in lanes else None
        for lane in lanes.values():
            lane.close()
        pool.shutdown()
    finally:
        if floor is not None:
            floor.stop()
        try:
            parent.send("stop")
        except (BrokenPipeError, OSError):
            pass
        server.join(30)
        if server.is_alive():
            server.kill()

    base = median(figures["socket floor, 1 stream"])
    rows = [[label, f"{median(v):.2f}", f"{min(v):.2f} - {max(v):.2f}", f"{median(v) / base:.2f}"]
            for label, v in figures.items()]
    print()
    print(f"Data lane, {args.mib} MiB per measurement, {args.reps} reps, two processes on loopback; "
          f"CPU: {info['cpu']}; load at start {info['loadavg_at_start']}")
    if nixl:
        print(f"NIXL: UCX {nixl['ucx_version']}, UCX_TLS={os.environ.get('UCX_TLS') or '(unset)'}, "
              f"resources {', '.join(nixl['ucx_resources'] or [])}")
    for kind, reason in why.items():
        print(f"{kind}: not measured: {reason}")
    print()
    print(table(["case", "GB/s median", "min - max", "x floor"], rows, markdown=True))
    write_json(args.json, {"machine": info, "args": vars(args), "gbps": figures, "nixl": nixl, "skipped": why,
                           "server_status": server_status})
    return 0


def _expected(nbytes: int, seed: int) -> mmap.mmap:
    mm = mmap.mmap(-1, nbytes)
    _pattern(mm, seed)
    return mm


if __name__ == "__main__":
    raise SystemExit(main())
