"""The outgoing side of the peer links (``ucpd.team.transport``'s I/O thread only): one queue
pair per peer, where messages without payload (heartbeats, control) overtake queued payload
messages but never one already on the wire, and payload frames paced by a token bucket
(``net_limit``), one paced frame per link per round."""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Iterable

import zmq


class Outgoing:
    """One message waiting on the I/O thread; header fields are filled in when it is sent."""

    __slots__ = ("dest", "msg_type", "body", "frames", "entries", "req_id", "reply_to", "err", "deadline", "pos")

    def __init__(self, dest, msg_type, body, frames, entries, req_id, reply_to, err, deadline):
        self.dest, self.msg_type, self.body, self.frames, self.entries = dest, msg_type, body, frames, entries
        self.req_id, self.reply_to, self.err, self.deadline, self.pos = req_id, reply_to, err, deadline, -1


class TokenBucket:
    """Bytes per second with a small burst; a frame larger than the burst goes into debt."""

    def __init__(self, rate: float):
        self.rate = rate
        self.capacity = max(rate * 0.05, 64 << 10)
        self.tokens, self.stamp = self.capacity, time.monotonic()
        self._lock = threading.Lock()

    def wait(self, nbytes: int) -> float:
        """Seconds until ``nbytes`` may go (0: now)."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        need = min(nbytes, self.capacity)
        return 0.0 if self.tokens >= need else (need - self.tokens) / self.rate

    def take(self, nbytes: int) -> None:
        if self.rate > 0:
            self.tokens -= nbytes

    def acquire(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may go, and take them (any thread: the data lane's senders
        share one bucket; the I/O thread uses ``wait``/``take``, which never block)."""
        if self.rate <= 0:
            return
        while True:
            with self._lock:
                wait = self.wait(nbytes)
                if wait <= 0:
                    self.take(nbytes)
                    return
            time.sleep(wait)


SendHead = Callable[["Link", Outgoing], None]  # signs and sends a message's header and MAC frames


class Link:
    """The DEALER to one peer and what waits to go through it."""

    def __init__(self, rank: int, address: str, sock: zmq.Socket):
        self.rank, self.address, self.sock = rank, address, sock
        self.control: collections.deque[Outgoing] = collections.deque()  # no payload: jump the bucket
        self.bulk: collections.deque[Outgoing] = collections.deque()
        self.current: Outgoing | None = None  # partly sent multipart: the link is busy until it ends
        self.blocked = False  # last send hit EAGAIN (no connection, or HWM): wait for POLLOUT
        self.polled = False  # registered for POLLOUT

    def queued(self) -> bool:
        return bool(self.current or self.control or self.bulk)

    def route(self, out: Outgoing) -> None:
        (self.bulk if out.frames else self.control).append(out)

    def clear(self) -> None:
        """Forget what waits (its buffers are released: their trackers finish)."""
        self.control.clear(), self.bulk.clear()
        self.current = None

    def expire(self, now: float, drop: Callable[[Link, Outgoing], None]) -> None:
        """Drop (``drop(link, out)``) the queued messages past their deadline."""
        for name in ("control", "bulk"):
            queue = getattr(self, name)
            if any(out.deadline < now for out in queue):
                for out in queue:
                    if out.deadline < now:
                        drop(self, out)
                setattr(self, name, collections.deque(out for out in queue if out.deadline >= now))

    def step(self, bucket: TokenBucket, send_head: SendHead, counters: dict) -> tuple[bool, float]:
        """Send what may go now: every control message, then payload frames as the bucket
        allows. Returns (whether anything was sent, seconds until the bucket allows more);
        raises zmq.Again when the socket would block."""
        sent = False
        if self.current is None:
            while self.control:
                send_head(self, self.control[0])
                self.control.popleft()
                sent = True
            if not self.bulk:
                return sent, float("inf")
            wait = bucket.wait(self.bulk[0].entries[0][0])
            if wait > 0:
                return sent, wait
            send_head(self, self.bulk[0])
            self.current = self.bulk.popleft()
        out = self.current
        while True:
            size = out.entries[out.pos][0]
            wait = bucket.wait(size)
            if wait > 0:
                return sent, wait
            last = out.pos == len(out.frames) - 1
            self.sock.send(out.frames[out.pos], zmq.NOBLOCK | (0 if last else zmq.SNDMORE), copy=False)
            bucket.take(size)
            out.frames[out.pos] = None  # release the caller's buffer as soon as ZeroMQ has it
            counters["bytes_sent"] += size
            out.pos += 1
            sent = True
            if last:
                self.current = None
                return sent, 0.0
            if bucket.rate > 0:
                return sent, 0.0


def pump(links: Iterable[Link], bucket: TokenBucket, send_head: SendHead, counters: dict) -> float:
    """Send whatever may go now on every link; returns seconds until the bucket allows the next frame."""
    links = list(links)
    while True:  # round robin: one paced payload frame per link per round
        progress, wait = False, float("inf")
        for link in links:
            if link.blocked:
                continue
            try:
                sent, link_wait = link.step(bucket, send_head, counters)
            except zmq.Again:
                link.blocked = True
                continue
            progress |= sent
            wait = min(wait, link_wait)
        if not progress:
            return wait
