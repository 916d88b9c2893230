"""``Weights``: a receiver of a job's committed versions — an RL rollout engine, an evaluator —
reading the tensors it names straight from the daemons' RAM, into its own tensors, in its own
layout. One RAM copy serves the trainer's restores and these receivers alike.

    from ucpd_client import Weights, placement as P
    w = Weights(job="train")                      # the node daemon at $UCPD_RUN_DIR
    sub = w.subscribe()                           # pushed by the daemon at each commit
    step = sub.next()                             # or w.latest() after a restart
    w.pull(step, into=model.state_dict(), placements={"qkv.weight": P.Fused(0, (q, k, v), P.Shard(0, r, 2))},
           names={"qkv.weight": "model.layers.0.attn.qkv.weight"})

A receiver is any process on a node of the team (it need not be a trainer rank): it talks to
its node's daemon. What other nodes hold, the receiver gets itself on the team's data lane with a
ticket its daemon hands it (``ucpd_client.lane_pull``): straight into its tensors where a saved
row is read whole by one contiguous run (else into a reused window, then copied), each chunk
checked as it lands, so those bytes cross once. (``UCPD_PULL_LANE=0``, CUDA targets, or a team
without a TCP data lane: the daemon fetches them into a landing file and the receiver copies them.)
``pull`` reads only the tensors named (``into``'s, renamed by ``names``), in buckets of at most
half of ``bucket_bytes`` of saved bytes (a tensor larger than that is cut in row blocks when its
placement is replicated, a shard or a box), two at a time: the next bucket is asked for (and, landed by the
daemon, fetched into its RAM) while the current one is received and copied, so at most
``bucket_bytes`` are staged on each side. Each bucket is read under a lease (the version cannot be evicted while it is read; the
lease ends after ``$UCPD_PULL_LEASE_S``, 30 s, so a trainer's ``--keep`` never waits longer on
a hung receiver); a version evicted between two buckets of a long pull raises VersionNotFound at
the next one. The copy is one pass over the source: each CRC32C chunk is checksummed as it is
copied (``ucpd_client.restore``, ``verify="fused"``, ``native.copy_batch``; CUDA targets by DMA
from the registered slot, each window checked first); a chunk that fails raises
ChecksumMismatch once the bucket is copied (its bytes have landed: pull again). A target whose dtype
differs from the saved one is filled through a bucket-sized staging tensor and converted.

Plans are cached: the first pull of a layout sends the targets and gets the plan (and the
saved dtypes, one ``describe``); each later pull of that layout sends a plan id and a step and
gets back only the sources' places and CRCs (``ucpd.daemon.pulls``).
"""

from __future__ import annotations

import difflib
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping

import msgpack
import torch
import zmq

from ucpd import knobs, protocol
from ucpd.errors import ChecksumMismatch, PlacementMismatch, UcpdError, VersionNotFound
from ucpd.protocol import RestorePlan
from ucpd.rpc import SOCKET_NAME, Connection
from ucpd.ucl.placements import Box, Replicated, Shard, placement_from_dict
from ucpd.ucl.resolve import resolve

from . import state as state_mod
from .errors import InvalidJobName
from .lane_pull import LanePull
from .restore import apply_plan, process_id
from .session import DaemonSession
from .staging import dtype_name, entry_of

BUCKET_BYTES = 256 << 20  # the default bound on staged bytes a side: two pull requests of half of it in flight
MAX_BUCKET_BYTES = 1 << 30


@dataclass
class _Item:
    """One target of a bucket: a global tensor (or a row block of it) into a local view."""

    index: int  # the position of its tensor in the pull's ``into``
    name: str  # the global (saved) name
    rows: tuple[int, int] | None  # a row block of the local tensor, or None: all of it
    placement: dict  # the wire placement of what this item fills
    nbytes: int


@dataclass
class _Bucket:
    items: list[_Item]
    targets: list[dict] = field(default_factory=list)
    plan_id: int | None = None
    tensors: tuple = ()  # the cached plan's per-target copies (protocol.PlanTensor)


@dataclass
class _Layout:
    """A receiver layout's cached pull: the saved dtypes, the buckets and their plans."""

    saved: dict[str, str]  # global name -> saved dtype
    buckets: list[_Bucket]


class Subscription:
    """Committed steps of a job as the daemon pushes them (``Weights.subscribe``).

    A thread of its own holds a ZeroMQ connection to the daemon, sends ``subscribe`` and renews
    it every ``seconds / 3``; every reply is a step the daemon committed. ``next()`` returns the
    newest step newer than the last one returned (a receiver that fell behind skips to the
    newest); ``notified`` maps each step to when it arrived (``time.perf_counter()``)."""

    def __init__(self, run_dir: str, job: str, seconds: float = 60.0):
        self.run_dir, self.job, self.seconds = run_dir, job, seconds
        self.notified: dict[int, float] = {}
        self.last: int | None = None  # the last step next() returned
        self._steps: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ucpd-subscription", daemon=True)
        self._thread.start()
        if not self._started.wait(knobs.rpc_timeout()):
            raise UcpdError(f"the subscription to job {job!r} at {run_dir} did not start")
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        sock = None
        try:
            if not os.path.exists(os.path.join(self.run_dir, SOCKET_NAME)):
                Connection(self.run_dir)  # raises DaemonUnreachable with what to do
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"ipc://{os.path.join(self.run_dir, SOCKET_NAME)}")
        except BaseException as exc:
            self._error = exc
            self._started.set()
            return
        self._started.set()
        ids, renew_at = 0, 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= renew_at:  # also re-subscribes to a daemon that restarted
                    ids += 1
                    sock.send(protocol.request("subscribe", ids, job=self.job, seconds=self.seconds))
                    renew_at = now + self.seconds / 3
                if not sock.poll(100):
                    continue
                _, body, err = protocol.decode_reply(sock.recv(), "subscribe")
                if err is None and body["step"] is not None:
                    self.notified.setdefault(body["step"], time.perf_counter())
                    self._steps.put(body["step"])
        finally:
            sock.close(linger=0)

    def next(self, timeout: float | None = None) -> int | None:
        """The newest committed step newer than the last one returned; waits up to ``timeout``
        seconds (None: until one commits). None when none came in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            newest = self.last
            try:
                while True:
                    s = self._steps.get_nowait()
                    newest = s if newest is None else max(newest, s)
            except queue.Empty:
                pass
            if newest is not None and newest != self.last:
                self.last = newest
                return newest
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            try:
                s = self._steps.get(timeout=0.5 if left is None else min(left, 0.5))
                self._steps.put(s)
            except queue.Empty:
                pass

    def __iter__(self):
        while not self._stop.is_set():
            step = self.next(timeout=1.0)
            if step is not None:
                yield step

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Weights:
    """A receiver of job ``job``'s committed versions (see the module docstring).

    ``run_dir``: the daemon to talk to (default ``$UCPD_RUN_DIR``, else the default run dir): this
    node's, a member of the job's team. ``bucket_bytes`` (at most 1 GiB): the bound on the staging
    memory of both ends (a peer's bytes fetched for the two buckets in flight, of half of it each;
    a dtype conversion)."""

    def __init__(self, job: str | None = None, run_dir: str | None = None, bucket_bytes: int = BUCKET_BYTES):
        job = job or os.environ.get("UCPD_JOB")
        if not job:
            raise InvalidJobName("Weights needs the job whose versions it reads: Weights(job=...) or $UCPD_JOB")
        self.job = protocol.job_name("job", job)
        if not 1 <= bucket_bytes <= MAX_BUCKET_BYTES:
            raise ValueError(f"bucket_bytes must be in [1, {MAX_BUCKET_BYTES}], got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.run_dir = run_dir or knobs.run_dir()
        conn = Connection(self.run_dir, timeout=knobs.rpc_timeout())
        self.session = DaemonSession(self.run_dir, 0, 1, self.job, None, conn)
        self._layouts: dict[tuple, _Layout] = {}
        self._ahead: ThreadPoolExecutor | None = None  # asks for the next bucket while one is copied
        self._lane: LanePull | None = None  # other nodes' rows received here (made at the first such pull)
        self._use_lane = os.environ.get("UCPD_PULL_LANE", "1").strip().lower() not in ("0", "false", "no", "off")
        # the last pull: step, buckets, warm (buckets planned before), bytes, meta_bytes (its pull requests and replies)
        self.last_pull: dict | None = None

    # --- versions ---------------------------------------------------------------------------------

    def latest(self) -> int | None:
        """The newest committed step of the job (a receiver that restarts catches up from it)."""
        return self.session.conn().call("latest")["step"]

    def subscribe(self, seconds: float = 60.0) -> Subscription:
        """Be told of each step of the job as it commits (pushed by the daemon)."""
        return Subscription(self.run_dir, self.job, seconds)

    # --- pulls -------------------------------------------------------------------------------------

    def pull(self, step: int, into: Mapping[str, Any], placements: Mapping[str, Any] | None = None,
             names: Mapping[str, str] | None = None) -> int:
        """Fill the tensors of ``into`` (a nested state; CPU or CUDA) with ``step``'s saved
        tensors: each local name is read as ``names.get(name, name)``, placed by
        ``placements.get(name)`` (a ``ucpd_client.placement`` object; a DTensor brings its own;
        unlisted: the whole tensor). Returns the step. Raises VersionNotFound (the step is gone,
        before or during the pull: pull a newer one), PlacementMismatch (a name, shape or
        placement the version does not answer), ChecksumMismatch (a source failed its checksums:
        that bucket's targets hold what was copied, the damaged chunk too; pull again)."""
        tensors, _ = state_mod.split(dict(into))
        entries = [entry_of((names or {}).get(n, n), t, (placements or {}).get(n)) for n, t in tensors.items()]
        key = tuple((e.name, dtype_name(e.tensor), tuple(e.tensor.shape), repr(e.placement)) for e in entries)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = self._plan_layout(step, entries)
        stats = {"step": step, "buckets": len(layout.buckets), "warm": 0, "bytes": 0, "meta_bytes": 0}
        buckets, conn = layout.buckets, self.session.conn()
        if self._ahead is None:
            self._ahead = ThreadPoolExecutor(1, thread_name_prefix="ucpd-pull-ahead")
        lane = self._use_lane and all(e.tensor.is_cpu for e in entries)
        fut = self._ahead.submit(self._ask, step, buckets[0], stats, entries, lane)
        try:
            for k, b in enumerate(buckets):
                try:
                    reply, plan, fills, staged = fut.result()
                except VersionNotFound as exc:
                    fut = None
                    raise VersionNotFound(
                        f"{exc} (asked for bucket {k + 1} of {len(buckets)} of this pull; the buckets before it were "
                        "filled): pull a newer step (Weights.latest(), or the subscription's next notice)") from None
                fut = None
                # the next bucket is asked for (on another node: fetched here) while this one is copied
                nxt = self._ahead.submit(self._ask, step, buckets[k + 1], stats, entries, lane) if k + 1 < len(buckets) else None
                try:
                    self._fill(step, plan, reply, conn, stats, fills, staged)
                finally:
                    fut = nxt
        finally:
            if fut is not None:  # a bucket failed: the one asked for ahead gives its lease back unread
                try:
                    conn.call("release", lease=fut.result()[0]["lease"])
                except BaseException:
                    pass
        self.last_pull = stats
        return step

    def _plan_layout(self, step: int, entries: list) -> _Layout:
        """Saved dtypes (one ``describe``) and the buckets of a receiver layout's first pull."""
        described = self.session.describe(step)["tensors"]
        saved = {}
        for e in entries:
            if e.name not in described:
                close = [n for n in described if n.endswith("." + e.name)][:3] or difflib.get_close_matches(e.name, described, 3)
                raise PlacementMismatch(f"tensor {e.name!r} is not in step {step} of job {self.job!r}"
                                        + (f" (similar saved names: {', '.join(close)})" if close else ""))
            saved[e.name] = described[e.name]["dtype"]
        items = []
        half = max(1, self.bucket_bytes // 2)  # two requests in flight: one copied, the next fetched
        for i, e in enumerate(entries):
            size = protocol_itemsize(saved[e.name]) * e.tensor.numel()
            items.extend(_cut(i, e, size, half))
        buckets: list[_Bucket] = []
        used = 0
        for it in items:
            if not buckets or (used and used + it.nbytes > half):
                buckets.append(_Bucket([]))
                used = 0
            buckets[-1].items.append(it)
            used += it.nbytes
        for b in buckets:
            b.targets = [{"name": it.name, "dtype": saved[it.name], "shape": list(_rows(entries[it.index].tensor, it.rows).shape),
                          "placement": it.placement} for it in b.items]
        return _Layout(saved, buckets)

    def _ask(self, step: int, b: _Bucket, stats: dict, entries: list, lane: bool) -> tuple:
        """One bucket's pull request (on the pull-ahead thread's own connection): its lease, its
        plan (a warm one: the cached copies over this version's sources), its targets (fills and
        dtype staging). ``lane``: ask to get the rows other nodes hold ourselves (``_fill``)."""
        body: dict = {"step": step, "job": self.job, **process_id(), **({"lane": True} if lane else {})}
        if b.plan_id is not None:
            body["plan"] = b.plan_id
        else:
            body["targets"] = b.targets
        conn = self.session.conn()
        try:
            reply = conn.call("pull", **body)
        except UcpdError as exc:
            if b.plan_id is None or "not (or no longer) cached" not in str(exc):
                raise
            b.plan_id, body["targets"] = None, b.targets  # the daemon restarted or dropped the plan
            body.pop("plan")
            reply = conn.call("pull", **body)
        stats["meta_bytes"] += len(protocol.request("pull", 1, **body)) + _reply_bytes(reply)
        plan: RestorePlan = reply["plan"]
        if plan.tensors:
            b.plan_id, b.tensors = reply["plan_id"], plan.tensors
        else:
            stats["warm"] += 1
            plan = RestorePlan(plan.sources, b.tensors)
        fills, staged = self._targets(b, entries)
        return reply, plan, fills, staged

    @staticmethod
    def _targets(b: _Bucket, entries: list) -> tuple[list, list]:
        """A bucket's fills (its targets as entries, in the plan's order) and the (target,
        staging tensor) pairs of those whose dtype differs from the saved one."""
        fills, staged = [], []
        for it, t in zip(b.items, b.targets):
            target = _rows(entries[it.index].tensor, it.rows)
            if dtype_name(target) != t["dtype"]:
                host = torch.empty(target.shape, dtype=getattr(torch, t["dtype"]))
                staged.append((target, host))
                target = host
            fills.append(entry_of(it.name, target, None))
        return fills, staged

    def _fill(self, step: int, plan: RestorePlan, reply: dict, conn, stats: dict, fills: list, staged: list) -> None:
        """Receive one bucket's rows other nodes hold (into the targets, or the window), copy
        the rest into its targets in one pass, each chunk checksummed as it is copied, and give
        its lease back. (The next bucket's request is on its way meanwhile.)"""
        stats["bytes"] += sum(e.tensor.numel() * e.tensor.element_size() for e in fills)
        damaged = False
        try:
            if reply.get("remote"):  # (its errors name no damaged source here: each holder was tried)
                if self._lane is None:
                    self._lane = LanePull(self.session.maps)
                plan = self._lane.receive(step, plan, reply["remote"], fills)
            try:
                apply_plan(self.session, fills, plan, verify="fused")
            except ChecksumMismatch:
                damaged = True
                raise
        finally:
            conn.call("release", lease=reply["lease"], **({"damaged": True} if damaged else {}))
        for target, host in staged:
            target.copy_(host)

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.shutdown(wait=True)
            self._ahead = None
        if self._lane is not None:
            self._lane.close()
            self._lane = None
        self.session.close()

    def __enter__(self) -> "Weights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def protocol_itemsize(dtype: str) -> int:
    from ucpd.dtypes import dtype as lookup

    return lookup(dtype).itemsize


def _rows(t: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    return t if rows is None else t[rows[0]:rows[1]]


def _cut(index: int, e, nbytes: int, bucket: int) -> list[_Item]:
    """A target as bucket items: whole, or in row blocks of at most ``bucket`` bytes when it is
    larger and its placement puts the whole local tensor at one box of the global one (replicated,
    shard, box) and it is contiguous."""
    whole = [_Item(index, e.name, None, e.placement, nbytes)]
    t = e.tensor
    if nbytes <= bucket or t.dim() == 0 or t.shape[0] < 2 or not t.is_contiguous():
        return whole
    p = placement_from_dict(e.placement)
    if not isinstance(p, (Replicated, Shard, Box)):
        return whole
    frags = resolve(e.name, p, tuple(t.shape))
    if len(frags) != 1 or frags[0].fills or len(frags[0].pieces) != 1:
        return whole
    piece = frags[0].pieces[0]
    if piece.local.offset != 0 or not piece.local.is_contiguous:
        return whole
    row_bytes = max(1, nbytes // t.shape[0])
    per = max(1, bucket // row_bytes)
    offsets, lengths, gshape = tuple(piece.box.offsets), tuple(piece.box.lengths), tuple(frags[0].global_shape)
    out = []
    for r0 in range(0, t.shape[0], per):
        r1 = min(t.shape[0], r0 + per)
        box = Box((offsets[0] + r0, *offsets[1:]), (r1 - r0, *lengths[1:]), gshape)
        out.append(_Item(index, e.name, (r0, r1), box.to_dict(), (r1 - r0) * row_bytes))
    return out


def _reply_bytes(reply: dict) -> int:
    """The size of a pull reply as the daemon packed it."""
    body = {k: v for k, v in reply.items() if v is not None and k != "plan"}
    body.update(reply["plan"].to_wire())
    return len(msgpack.packb(body, use_bin_type=True))


__all__ = ["Weights", "Subscription", "BUCKET_BYTES"]
