"""Throughput of PeerTransport against raw pyzmq PUSH/PULL over the same loopback, in one run.

    .venv/bin/python benchmarks/team/bench_transport.py [--size-mib 512] [--frame-mib 4]
                                                       [--message-mib 4,32] [--reps 3] [--json OUT]

The receiver runs in a child process, as a peer daemon would. Each case moves --size-mib MiB from
one pre-faulted source buffer, zero-copy, in --frame-mib MiB frames: raw PUSH/PULL sends bare
frames; PeerTransport sends messages of each --message-mib size (signed header, CRC32C per frame
computed by the sender and checked by the receiver), then, at the first size, adds the keyed
BLAKE2b payload MAC (UCPD_PEER_PAYLOAD_MAC=1). Timing runs from the first send until the child
reports the last byte. Cases are interleaved per repetition. The machine is shared and noisy:
compare the ratios of one run. A message of several frames is handed over whole, so the receiver
holds all its frames at once (with glibc, freeing them together trims the heap and the next
message faults in fresh pages).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import fmt_num, machine, median, table, write_json  # noqa: E402

from ucpd.team.transport import PeerTransport  # noqa: E402

MiB = 1 << 20
SECRET = b"bench-secret"


def receiver(conn, kind: str, total: int, frame: int, payload_mac: bool) -> None:
    """Child process: receive ``total`` bytes, then send "done" on ``conn``."""
    if kind == "raw":
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        conn.send(f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
        for _ in range(total // frame):
            pull.recv(copy=False)
        conn.send("done")
        pull.close(0)
        ctx.term()
        return
    received = [0]

    def on_message(src, msg_type, body, frames) -> None:
        received[0] += sum(len(f) for f in frames)
        if received[0] >= total:
            conn.send("done")

    node = PeerTransport(1, "tcp://127.0.0.1:0", SECRET, on_message=on_message, on_request=lambda *a: ({}, []),
                         frame_bytes=frame, payload_mac=payload_mac)
    conn.send(node.bind())
    node.start([conn.recv(), "tcp://127.0.0.1:1"])
    conn.recv()  # "stop"
    node.close()


def run_case(kind: str, src: np.ndarray, total: int, frame: int, message: int, payload_mac: bool) -> float:
    """Seconds from the first send to the receiver's "done"."""
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=receiver, args=(child, kind, total, frame, payload_mac))
    proc.start()
    address = parent.recv()
    view = memoryview(src)
    if kind == "raw":
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(address)
        t0 = time.perf_counter()
        for i in range(total // frame):
            start = (i * frame) % len(view)
            push.send(view[start:start + frame], copy=False)
        parent.recv()
        elapsed = time.perf_counter() - t0
        push.close(0)
        ctx.term()
    else:
        node = PeerTransport(0, "tcp://127.0.0.1:0", SECRET, on_message=lambda *a: None,
                             on_request=lambda *a: ({}, []), frame_bytes=frame, payload_mac=payload_mac)
        parent.send(node.bind())
        node.start(["tcp://127.0.0.1:1", address])
        try:
            node.request(1, "ping", {}, timeout=30)  # the link is up: set-up is not timed
            t0 = time.perf_counter()
            for i in range(total // message):
                start = (i * message) % len(view)
                node.send(1, "bulk", {"i": i}, [view[start:start + message]])
            parent.recv()
            elapsed = time.perf_counter() - t0
            parent.send("stop")
        finally:
            node.close()
    proc.join(30)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--frame-mib", type=int, default=4)
    ap.add_argument("--message-mib", default="4,32", help="comma-separated message sizes")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    total, frame = args.size_mib * MiB, args.frame_mib * MiB
    messages = [int(m) * MiB for m in args.message_mib.split(",")]
    src = np.random.default_rng(0).integers(0, 256, max(2 * max(messages), 64 * MiB), dtype=np.uint8)
    cases = {"raw PUSH/PULL": lambda: run_case("raw", src, total, frame, frame, False)}
    for m in messages:
        cases[f"PeerTransport, {m // MiB} MiB messages"] = lambda m=m: run_case("peer", src, total, frame, m, False)
    cases[f"  + payload MAC, {messages[0] // MiB} MiB messages"] = (
        lambda: run_case("peer", src, total, frame, messages[0], True))
    for fn in cases.values():  # warm-up: page cache, lazy imports
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.reps):
        for name, fn in cases.items():
            times[name].append(fn())
    raw = median(times["raw PUSH/PULL"])
    rows, results = [], {}
    for name, ts in times.items():
        rates = sorted(total / t / 1e9 for t in ts)
        ratio = raw / median(ts)
        results[name] = {"seconds": ts, "gbps_min": rates[0], "gbps_median": median(rates),
                         "gbps_max": rates[-1], "ratio_to_raw": ratio}
        rows.append([name, fmt_num(rates[0]), fmt_num(median(rates)), fmt_num(rates[-1]), fmt_num(ratio) + "x"])
    print(f"{args.size_mib} MiB over tcp://127.0.0.1 in {args.frame_mib} MiB frames, sender and receiver "
          f"processes, {args.reps} repetitions, GB/s = 10^9 B/s")
    print(table(["case", "GB/s min", "median", "max", "vs raw (median)"], rows))
    write_json(args.json, {"machine": machine(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
