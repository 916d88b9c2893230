#!/usr/bin/env python
"""The socket floor: what a plain loopback TCP socket moves between two processes, the reference
of the team's replication and restore figures (``bench_team.py``).

    .venv/bin/python benchmarks/team/floors_net.py [--mib 1024] [--reps 3]

    from floors_net import SocketFloor, socket_floor
    gbps = socket_floor(1 << 30)                                  # 1 stream, 3 reps: [GB/s, ...]
    gbps = socket_floor(1 << 30, streams=2, both_ways=True)       # 2 streams at once, one each way
    floor = SocketFloor()                                         # kept between measurements
    seconds = floor.measure(1 << 30)                              # interleaved with other work
    floor.stop()

Two endpoint processes, A and B (``multiprocessing`` spawn; standard library only, no torch),
each with one preallocated buffer of the bytes moved, every page written once before it is
timed (grown, and written again, when a later measurement moves more). A stream is one TCP
connection over 127.0.0.1 (a listener on port 0; default socket options, so the kernel tunes
the socket buffers, as it does for the daemons' sockets), made once and reused by the next
measurements. The bytes are split evenly across the streams; stream ``i`` goes A -> B, or, with
``both_ways``, B -> A for odd ``i`` (the 2-node team replicates both ways at once: each node
sends and receives). A stream's sender ``sendall()``s its part of its buffer in one call; its
receiver ``recv_into(..., MSG_WAITALL)``s it into the same part of its own buffer in 4 MiB
slices. Each stream's sender and receiver is a thread of its endpoint process.

A measurement: the parent hands both endpoints their streams; each starts its receiving threads
(blocked in ``recv_into``) and its sending threads (waiting for the start), and says it is
ready; then the parent says go. Time = the last byte received - the first ``sendall()`` call,
on CLOCK_MONOTONIC (one clock for every process of the machine): process startup, connecting
and touching the buffers are not in it. GB/s are 10^9 bytes per second.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import threading
import time

MiB = 1 << 20
SLICE = 4 * MiB  # a receiver's recv_into() size
TIMEOUT = 600.0  # seconds the parent waits for an endpoint's answer


def _touched(n: int) -> bytearray:
    return bytearray(b"\x01") * n  # memset: every page written once


def _endpoint(conn, name: str) -> None:
    """An endpoint process: a command loop over ``conn`` (see :class:`SocketFloor`)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    conn.send(listener.getsockname()[1])
    socks: dict = {}  # stream key -> connected socket
    buf = bytearray()
    threads: list[threading.Thread] = []
    stamps: dict = {}
    errors: list[str] = []
    go = threading.Event()

    def sender(key, off, n):
        try:
            part = memoryview(buf)[off:off + n]
            go.wait()
            t0 = time.monotonic()
            socks[key].sendall(part)
            del part
            stamps.setdefault("send_start", []).append(t0)
        except BaseException as e:  # noqa: BLE001 (reported to the parent)
            errors.append(f"{name} send {key}: {e!r}")

    def receiver(key, off, n):
        try:
            s = socks[key]
            whole = memoryview(buf)[off:off + n]
            got = 0
            while got < n:
                k = min(SLICE, n - got)
                r = s.recv_into(whole[got:got + k], k, socket.MSG_WAITALL)
                if r == 0:
                    raise ConnectionError("peer closed the stream")
                got += r
            t1 = time.monotonic()
            del whole
            stamps.setdefault("recv_end", []).append(t1)
        except BaseException as e:  # noqa: BLE001
            errors.append(f"{name} recv {key}: {e!r}")

    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg is None:
                break
            op = msg[0]
            if op == "accept":  # ("accept", key): the peer's sender connects to our listener
                s, _ = listener.accept()
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                socks[msg[1]] = s
                conn.send("ok")
            elif op == "connect":  # ("connect", key, port)
                s = socket.create_connection(("127.0.0.1", msg[2]))
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                socks[msg[1]] = s
                conn.send("ok")
            elif op == "job":  # ("job", size, [(key, "send" | "recv", offset, nbytes)])
                if len(buf) < msg[1]:
                    buf = bytearray()
                    buf = _touched(msg[1])
                go.clear()
                stamps.clear()
                errors.clear()
                threads = [threading.Thread(target=sender if role == "send" else receiver, args=(key, off, n), daemon=True)
                           for key, role, off, n in msg[2]]
                for t in threads:
                    t.start()
                conn.send("ready")
            elif op == "go":
                go.set()
                for t in threads:
                    t.join()
                threads = []
                conn.send({"errors": list(errors), **{k: list(v) for k, v in stamps.items()}})
    finally:
        for s in socks.values():
            s.close()
        listener.close()


class SocketFloor:
    """Two endpoint processes (A, B) kept between measurements; see the module's docstring."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conns, self.procs, self.ports = [], [], []
        for name in ("A", "B"):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_endpoint, args=(child, name), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
            self.ports.append(self._get(len(self.conns) - 1))
        self.streams: set = set()  # (index, src endpoint) connected

    def _get(self, i: int):
        c = self.conns[i]
        if not c.poll(TIMEOUT):
            raise TimeoutError(f"socket floor endpoint {'AB'[i]} did not answer in {TIMEOUT:.0f} s")
        return c.recv()

    def _stream(self, index: int, src: int) -> tuple:
        key = (index, src)
        if key not in self.streams:
            dst = 1 - src
            self.conns[dst].send(("accept", key))
            self.conns[src].send(("connect", key, self.ports[dst]))
            assert self._get(src) == "ok" and self._get(dst) == "ok"
            self.streams.add(key)
        return key

    def measure(self, nbytes: int, streams: int = 1, both_ways: bool = False) -> float:
        """Seconds to move ``nbytes`` in all over ``streams`` connections at once (the first
        ``sendall()`` call to the last byte received)."""
        jobs: list[list] = [[], []]
        off = 0
        for i in range(streams):
            n = nbytes // streams + (1 if i < nbytes % streams else 0)
            src = 1 if both_ways and i % 2 else 0
            key = self._stream(i, src)
            jobs[src].append((key, "send", off, n))
            jobs[1 - src].append((key, "recv", off, n))
            off += n
        for i in (0, 1):
            self.conns[i].send(("job", nbytes, jobs[i]))
        for i in (0, 1):
            assert self._get(i) == "ready"
        for i in (0, 1):
            self.conns[i].send(("go",))
        res = [self._get(i) for i in (0, 1)]
        errors = [e for r in res for e in r["errors"]]
        if errors:
            raise RuntimeError("socket floor: " + "; ".join(errors))
        starts = [t for r in res for t in r.get("send_start", [])]
        ends = [t for r in res for t in r.get("recv_end", [])]
        assert len(starts) == len(ends) == streams
        return max(ends) - min(starts)

    def gbps(self, nbytes: int, streams: int = 1, both_ways: bool = False) -> float:
        return nbytes / self.measure(nbytes, streams, both_ways) / 1e9

    def stop(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.conns, self.procs = [], []


def socket_floor(nbytes: int, streams: int = 1, both_ways: bool = False, reps: int = 3) -> list[float]:
    """GB/s of ``reps`` measurements moving ``nbytes`` (in all) over ``streams`` loopback TCP
    connections at once, between two processes started for it (one untimed warm-up
    measurement of the same bytes first: the connections and buffers are then warm)."""
    floor = SocketFloor()
    try:
        floor.measure(nbytes, streams, both_ways)
        return [floor.gbps(nbytes, streams, both_ways) for _ in range(reps)]
    finally:
        floor.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="MiB moved per measurement (in all)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    n = args.mib * MiB
    floor = SocketFloor()
    try:
        floor.measure(n)
        one, two = [], []
        for _ in range(args.reps):  # interleaved
            one.append(floor.gbps(n))
            two.append(floor.gbps(n, streams=2, both_ways=True))
    finally:
        floor.stop()
    fmt = lambda xs: " / ".join(f"{x:.2f}" for x in sorted(xs))  # noqa: E731
    print(f"socket floor, {args.mib} MiB: 1 stream {fmt(one)} GB/s; 2 streams at once, one each way {fmt(two)} GB/s (sorted)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
