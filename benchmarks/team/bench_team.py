#!/usr/bin/env python
"""A team of ucpd daemons on loopback: replication, recovery after a node loss, memory, commit latency.

    .venv/bin/python benchmarks/team/bench_team.py [--size-mib 512] [--recovery-mib 342]
        [--overhead-mib 64] [--steps 6] [--reps 3] [--latency-nodes 2,4,8] [--latency-steps 10]
        [--rhythm 0.4] [--only replication,recovery,overhead,latency] [--json OUT] [--keep-logs DIR]

Every node is a real ``ucpd serve`` process (default flags except the team ones: ``--nodes``,
``--node-rank``, ``--peers``, ``--replicas``, and where a case says so ``--flush-dir``,
``--heartbeat``, ``--mem-limit``), with a private run dir (in a temp dir) and shm dir (under
``/dev/shm/ucpd-bench-team-*``), its peer port chosen free. Trainer ranks are spawned processes,
each with ``Checkpointer(run_dir_of_its_node, rank, world_size, embedded=False,
local_world_size=k)``. Between snapshots the trainers idle --rhythm seconds (the training step).
Times across processes use CLOCK_MONOTONIC. Four cases, in one run:

1. replication: 2-node team, ``--replicas 1``, one rank per node, each snapshotting --size-mib MiB
   of fp32 (a GPT-like mix of 2-D tensors, weights + 2 Adam moments, each rank holding the rows
   ``Shard(0, rank, 2)``). Interleaved step by step with the same two ranks snapshotting into a
   single plain daemon (``--nodes 1``, both ranks on it). Time = the first ``snapshot()`` call to
   the last ``wait()`` return. Step 1 is reported as the cold step; a step is warm when every
   rank wrote into a slot it had written before and no daemon made a new slot or replica file
   (the first steps fill keep=2 versions, the one being written and a spare); steps run until
   --steps warm ones were measured. Replication throughput = bytes replicated per step
   (``team.counters.replicated_bytes``, summed over the nodes) / (team time - plain time) of the
   same step. Its reference is the socket floor (``floors_net.py``): a plain
   loopback TCP socket between two processes moving the same bytes, ``sendall()`` from a warm
   buffer, ``recv_into(MSG_WAITALL)`` in 4 MiB slices into a preallocated warm buffer, timed from
   the first byte sent to the last received; 1 stream (the reference: target >= 0.8x) and 2
   streams at once, one each way, half the bytes each (the 2-node team replicates both ways).
   Each warm step also gets a bound: plain time + 1.25 x bytes / the socket floor (1 stream) of
   that step, and the ratio team time / bound (target <= 1.0). Beside them, raw pyzmq PUSH/PULL
   moving the same bytes in 4 MiB frames between two processes (and two such pairs at once, one
   each way). The floors run after each warm step (socket 1 stream, 2 streams, pyzmq 1 pair, 2
   pairs), interleaved with the steps.
2. recovery: 3-node team, ``--replicas 1 --flush-dir <temp dir on disk>``, one rank per node
   (TP=3: every tensor split by rows, ``Shard(0, r, 3)``), --recovery-mib MiB per node (342: 1 GiB
   in all, 512 MiB for each restoring rank), 4 steps; once step 4 is complete on disk, node 2's
   daemon and trainer are SIGKILLed and its shm dir deleted. A new job of 2 ranks (TP=2, ``Shard(0, r, 2)``: a real reshard) on nodes 0 and 1
   restores the whole state, after re-protection settled: from the survivors' RAM (the default
   path), from the flush dir through a fresh plain daemon (``ucpd serve`` with only
   ``--flush-dir``, plus its private run/shm dirs; the 2 ranks use it as their node daemon) with
   the page cache warm and then cold (POSIX_FADV_DONTNEED on the flushed files), ``torch.load`` of
   each rank's state saved with ``torch.save`` to /dev/shm, and the memcpy floor of the same
   bytes (native copy_batch, no CRC, from a warm buffer into the same targets). The 2 ranks run
   each case at once; time = first start to last end. Every ucpd restore is checked bit-exact.
   The reference is the socket floor (``floors_net.py``, as in 1.) moving one rank's bytes over 1
   stream: every case is also given as its time / that time (target for the RAM restore <= 1.0),
   the restore RPC too (``restore`` sent until the plan came back: before the client can copy
   its first byte); the socket floor moving both ranks' bytes, 2 streams at once one each way,
   is reported beside it. The socket floors run at the end of each repetition.
3. overhead: ``team.bytes.own``, ``team.bytes.replicas``, ``team.overhead`` of every node from
   ``ucpd status --json`` after 5 steps (3 nodes, --overhead-mib MiB per node, R=1 and R=2), with
   the bytes the node's shm dir really holds, against 1+R.
4. latency: N nodes (--latency-nodes), one rank each, 1 MiB each, ``--heartbeat 0.1
   --mem-limit 256M --replicas 1``; 3 warm-up steps then --latency-steps steps: from the last
   rank's ``snapshot()`` call until ``latest()`` returned the step on every node (each rank calls
   ``wait()`` then ``latest()`` on its node). A plain daemon with 1 rank is the reference.

Everything started is stopped, and every folder made is removed, on every exit path (signals too).
At the defaults a run takes 3-5 minutes on 2 cores and needs about 14 GiB of RAM at its peak
(the replication case: 2 team nodes x (4 slots + 2 replica files) + the plain daemon's slots +
the ranks' states + the socket floor's two buffers of the bytes replicated per step). The
daemons' log lines about membership views, warnings and errors are printed at the end
(--keep-logs keeps the whole logs). The machine is shared and noisy (2 cores): compare
figures of one run; run it several times.
"""

from __future__ import annotations

import argparse
import gc
import glob
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1]), str(ROOT), str(ROOT / "client")]

from common import MiB, fmt_num, fmt_seconds, fmt_spread, fmt_spread_num, log, machine, median, table, write_json  # noqa: E402
from daemons import FOREIGN_ENV, Daemon, Loopback, cleanup, cleanup_on_exit, on_cleanup, wait_for  # noqa: E402
from floors_net import SocketFloor  # noqa: E402

SHM_PREFIX = "ucpd-bench-team-"
BLOCKS = 6  # every tensor's rows are cut into 6 blocks: TP=1, 2, 3 and 6 all own whole blocks
FRAME = 4 * MiB
BOUND_FACTOR = 1.25  # a team's snapshot -> committed <= the plain daemon's + 1.25 x bytes / socket floor
THROUGHPUT_TARGET = 0.8  # replication throughput >= 0.8 x the socket floor (1 stream)

BENCH_JOB = "bench"  # the job of the benchmark's versions: flushed under <flush-dir>/bench/


# ------------------------------------------------------------------------------------------------
# the training state: GPT-like 2-D fp32 tensors, split by rows into BLOCKS seeded blocks


def gpt_shapes(global_bytes: int, layers: int, optim: bool = True) -> list[tuple[str, int, int]]:
    """(flat name, rows, cols) of a GPT whose tensors (with 2 Adam moments when ``optim``) hold
    about ``global_bytes``; every dimension that is split (rows) is a multiple of 192."""
    copies = 3 if optim else 1

    def layer(h):
        return [("ln1.weight", h, 1), ("attn.qkv.weight", 3 * h, h), ("attn.qkv.bias", 3 * h, 1),
                ("attn.proj.weight", h, h), ("attn.proj.bias", h, 1), ("ln2.weight", h, 1),
                ("mlp.fc1.weight", 4 * h, h), ("mlp.fc1.bias", 4 * h, 1), ("mlp.fc2.weight", h, 4 * h),
                ("mlp.fc2.bias", h, 1)]

    params = global_bytes // 4 // copies
    per_layer = lambda h: sum(r * c for _, r, c in layer(h))  # noqa: E731
    h = 192
    while layers * per_layer(h + 192) + (1536 + 1 + 8192) * (h + 192) <= params:
        h += 192
    vocab = max(192, (params - layers * per_layer(h) - 1537 * h) // h // 192 * 192)
    out = [("wte.weight", vocab, h), ("wpe.weight", 1536, h)]
    for i in range(layers):
        out += [(f"layers.{i}.{n}", r, c) for n, r, c in layer(h)]
    out.append(("ln_f.weight", h, 1))
    flat = []
    for name, r, c in out:
        flat.append((f"model.{name}", r, c))
        if optim:
            flat += [(f"optim.{name}.exp_avg", r, c), (f"optim.{name}.exp_avg_sq", r, c)]
    return flat


def tiny_shapes(world: int) -> list[tuple[str, int, int]]:
    """4 tensors of 64 x 1024 fp32 per rank (1 MiB a rank)."""
    return [(f"model.w{i}", 64 * world, 1024) for i in range(4)]


def nested(flat: dict) -> dict:
    """{"model.a.b": t, "optim.a.b.exp_avg": t} -> {"model": {"a.b": t}, "optim": {"a.b": {...}}}."""
    out: dict = {}
    for name, t in flat.items():
        top, rest = name.split(".", 1)
        if top == "optim":
            pname, moment = rest.rsplit(".", 1)
            out.setdefault("optim", {}).setdefault(pname, {})[moment] = t
        else:
            out.setdefault(top, {})[rest] = t
    return out


def local_rows(rows: int, rank: int, world: int, blocks: int) -> tuple[int, int, int]:
    """(first block, number of blocks, rows per block) that ``rank`` of ``world`` holds."""
    per = blocks // world
    return rank * per, per, rows // blocks


# ------------------------------------------------------------------------------------------------
# trainer rank processes (spawned): a command loop over a pipe


class _Rank:
    """What one trainer rank holds between commands."""

    def __init__(self):
        self.flat: dict = {}  # flat name -> local tensor
        self.placements: dict = {}
        self.state: dict = {}
        self.ckpts: dict = {}
        self.rpc: dict = {}  # last restore RPC: seconds, where
        self.begins: dict = {}  # key -> slot path of the last begin
        self.seen: dict = {}  # key -> slot paths this rank wrote into before
        self.fresh: dict = {}  # key -> Checkpointer arguments, one Checkpointer per restore
        self.expected: dict = {}
        self.floor_src = None
        self.last_step = None


def _fill(t, seed: int, index: int, first_block: int, nblocks: int, rows_per_block: int) -> None:
    import torch

    for b in range(nblocks):
        g = torch.Generator().manual_seed((seed * 1_000_003 + index * 101 + first_block + b) & 0x7FFFFFFF)
        t[b * rows_per_block:(b + 1) * rows_per_block].uniform_(generator=g)


def _build(ctx: _Rank, shapes, rank: int, world: int, seed: int, blocks: int = BLOCKS, fill: bool = True) -> int:
    """Local tensors of ``rank`` of ``world`` (rows split), their placements, the nested state."""
    import torch
    from ucpd_client import placement as P

    ctx.flat, ctx.placements = {}, {}
    for i, (name, rows, cols) in enumerate(shapes):
        first, n, per = local_rows(rows, rank, world, blocks)
        t = torch.empty(n * per, cols)
        if fill:
            _fill(t, seed, i, first, n, per)
        else:
            t.fill_(0.0)
        ctx.flat[name] = t
        ctx.placements[name] = P.Shard(0, rank, world)
    ctx.state = nested(ctx.flat)
    marker = torch.zeros(4 * blocks // world, 16)  # set to the step number before each snapshot
    ctx.flat["marker.step"] = marker
    ctx.placements["marker.step"] = P.Shard(0, rank, world)
    ctx.state["marker"] = {"step": marker}
    ctx.state["step"] = None
    return sum(t.numel() * t.element_size() for t in ctx.flat.values())


def _crc(t) -> int:
    from ucpd import native

    return native.crc32c(t.reshape(-1).view(__import__("torch").uint8).numpy())


def cmd_build_state(ctx, shapes, rank, world, seed, blocks=BLOCKS):
    return _build(ctx, shapes, rank, world, seed, blocks)


def cmd_build_target(ctx, shapes, rank, world, seed, step, blocks=BLOCKS):
    """Targets of a restore at ``rank`` of ``world``, with the CRC each tensor must end with, and
    a warm source buffer of the same bytes for the memcpy floor."""
    import torch

    nbytes = _build(ctx, shapes, rank, world, seed, blocks)
    ctx.flat["marker.step"].fill_(float(step))
    ctx.expected = {name: _crc(t) for name, t in ctx.flat.items()}
    ctx.last_step = step
    for t in ctx.flat.values():
        t.fill_(-1.0)  # stays mapped: restores write into warm pages, as a resumed job's would
    ctx.floor_src = torch.empty(nbytes, dtype=torch.uint8)
    ctx.floor_src.fill_(1)
    return nbytes


def _job(job_id):
    return job_id or uuid.uuid4().hex


def cmd_open(ctx, key, run_dir, rank, world, local_world_size, job_id, fresh=False):
    """A Checkpointer on ``run_dir``; with ``fresh``, only remembered: each restore then makes
    its own (as a restarted job's new process would: no mappings yet) and closes it after."""
    if fresh:
        ctx.fresh[key] = dict(run_dir=run_dir, rank=rank, world=world, local_world_size=local_world_size, job_id=job_id)
        return True
    from ucpd_client import Checkpointer

    ck = Checkpointer(run_dir, rank=rank, world_size=world, embedded=False, job_id=job_id,
                      local_world_size=local_world_size)
    orig = ck.session.conn
    rec = ctx.rpc

    class _Timed:  # the RPCs a benchmark wants to see: restore's duration and source, begin's slot
        def __init__(self, c):
            self._c = c

        def call(self, msg_type, **body):
            t0 = time.monotonic()
            reply = self._c.call(msg_type, **body)
            if msg_type == "restore":
                rec["rpc_s"] = time.monotonic() - t0
                rec["where"] = reply.get("where")
                # what the plan reads from peers' parts: got by the rank on the data lane, or fetched by its daemon
                plan, lane = reply.get("plan"), reply.get("remote")
                rows = [r[0] for r in lane["rows"]] if lane else list(reply.get("pending") or ())
                rec["peer_bytes"] = sum(plan.sources[i].nbytes for i in rows) if plan is not None else 0
                rec["lane"] = bool(lane)
            elif msg_type == "begin":
                ctx.begins[key] = reply.get("path")
            return reply

        def call_wait(self, step, timeout):
            return self._c.call_wait(step, timeout)

    ck.session.conn = lambda: _Timed(orig())  # every call of this rank goes through its session
    ctx.ckpts[key] = ck
    return True


def cmd_close(ctx, key=None):
    for k in [key] if key else list(ctx.ckpts):
        ck = ctx.ckpts.pop(k, None)
        if ck is not None:
            ck.close()
    return True


def cmd_drop(ctx):
    cmd_close(ctx)
    ctx.__init__()
    gc.collect()
    return True


def cmd_snapshot(ctx, key, step, latest=False):
    """snapshot() of ``step`` (the marker tensor and the plain value change, as a step would),
    then staged(), wait(); with ``latest``, then latest() until it names the step."""
    ck = ctx.ckpts[key]
    ctx.flat["marker.step"].fill_(float(step))
    ctx.state["step"] = step
    t = {"called": time.monotonic()}
    h = ck.snapshot(step, ctx.state, placements=ctx.placements)
    t["returned"] = time.monotonic()
    h.staged(timeout=300)
    t["staged"] = time.monotonic()
    h.wait(timeout=300)
    t["committed"] = time.monotonic()
    seen = ctx.seen.setdefault(key, set())
    t["new_slot"] = ctx.begins.get(key) not in seen  # the first write into this slot: page faults
    seen.add(ctx.begins.get(key))
    if latest:
        polls = 0
        while True:
            polls += 1
            got = ck.latest()
            if got is not None and got >= step:
                break
            if time.monotonic() - t["called"] > 60:
                raise TimeoutError(f"latest() still {got} 60 s after step {step} committed")
            time.sleep(0.002)
        t["latest"] = time.monotonic()
        t["latest_polls"] = polls
        t["latest_step"] = got
    return t


def cmd_latest(ctx, key):
    return ctx.ckpts[key].latest()


def cmd_restore(ctx, key):
    """Restore the newest step into the targets; checked bit for bit afterwards (untimed)."""
    for t in ctx.flat.values():
        t.fill_(-1.0)
    ctx.state["step"] = None
    ctx.rpc.clear()
    if key in ctx.fresh:
        cmd_open(ctx, key, **ctx.fresh[key])
    t0 = time.monotonic()
    got = ctx.ckpts[key].restore(ctx.state, placements=ctx.placements)
    t1 = time.monotonic()
    if key in ctx.fresh:
        cmd_close(ctx, key)
    bad = [name for name, t in ctx.flat.items() if _crc(t) != ctx.expected[name]]
    if ctx.state.get("step") != ctx.last_step:
        bad.append(f"plain value step = {ctx.state.get('step')!r}")
    return {"start": t0, "end": t1, "step": got, "bad": bad[:5], "nbad": len(bad), **ctx.rpc}


def cmd_torch_save(ctx, path):
    import torch

    torch.save(ctx.state, path)
    return os.path.getsize(path)


def cmd_torch_load(ctx, path):
    import torch

    t0 = time.monotonic()
    obj = torch.load(path)
    t1 = time.monotonic()
    del obj
    gc.collect()
    return {"start": t0, "end": t1}


def cmd_floor(ctx):
    from ucpd import native

    items, at, base = [], 0, ctx.floor_src.data_ptr()
    for t in ctx.flat.values():
        n = t.numel() * t.element_size()
        items.append((t.data_ptr(), base + at, n))
        at += n
    t0 = time.monotonic()
    native.copy_batch(items, crc_chunk=0)
    t1 = time.monotonic()
    return {"start": t0, "end": t1}


COMMANDS = {name[4:]: fn for name, fn in dict(globals()).items() if name.startswith("cmd_")}


def _rank_main(conn) -> None:
    import torch  # noqa: F401  (first import outside the timed commands)

    ctx = _Rank()
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            break
        name, kwargs = msg
        try:
            conn.send(("ok", COMMANDS[name](ctx, **kwargs)))
        except BaseException:
            conn.send(("err", traceback.format_exc()))
    cmd_close(ctx)


class Rank:
    """A spawned trainer rank process."""

    def __init__(self):
        self.conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=_rank_main, args=(child,), daemon=True)
        self.proc.start()
        on_cleanup(self)

    def send(self, name: str, **kwargs) -> None:
        self.conn.send((name, kwargs))

    def get(self, timeout: float = 600.0):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"rank process {self.proc.pid} did not answer in {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"rank process {self.proc.pid} failed:\n{value}")
        return value

    def call(self, name: str, **kwargs):
        self.send(name, **kwargs)
        return self.get()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(20)
        self.kill()


def all_ranks(ranks, name: str, per_rank=None, **kwargs) -> list:
    """The same command on every rank at once (``per_rank(i)``: extra kwargs of rank i)."""
    for i, r in enumerate(ranks):
        r.send(name, **kwargs, **(per_rank(i) if per_rank else {}))
    return [r.get() for r in ranks]


# ------------------------------------------------------------------------------------------------
# raw pyzmq PUSH/PULL pairs (light processes: no torch)


def _raw_receiver(conn) -> None:
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    conn.send(f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        got = 0
        while got < msg:
            got += len(pull.recv(copy=False))
        conn.send(time.monotonic())
    pull.close(0)
    ctx.term()


def _raw_sender(conn, address: str, buf_bytes: int) -> None:
    import numpy as np
    import zmq

    buf = np.ones(buf_bytes, dtype=np.uint8)  # pre-faulted
    view = memoryview(buf)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(address)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        total, frame = msg
        sent, i = 0, 0
        while sent < total:
            n = min(frame, total - sent)
            start = (i * frame) % (buf_bytes - frame + 1)
            push.send(view[start:start + n], copy=False)
            sent += n
            i += 1
        conn.send("sent")
    push.close(linger=5000)
    ctx.term()


class RawPair:
    def __init__(self):
        sp = mp.get_context("spawn")
        self.rconn, c1 = sp.Pipe()
        self.recv_proc = sp.Process(target=_raw_receiver, args=(c1,), daemon=True)
        self.recv_proc.start()
        address = self.rconn.recv()
        self.sconn, c2 = sp.Pipe()
        self.send_proc = sp.Process(target=_raw_sender, args=(c2, address, 64 * MiB), daemon=True)
        self.send_proc.start()
        assert self.sconn.recv() == "ready"
        on_cleanup(self)

    def stop(self):
        for c in (self.sconn, self.rconn):
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in (self.send_proc, self.recv_proc):
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def raw_transfer(pairs: list[RawPair], total_each: int) -> float:
    """Seconds for every pair to move ``total_each`` bytes, all at once."""
    for p in pairs:
        p.rconn.send(total_each)
    t0 = time.monotonic()
    for p in pairs:
        p.sconn.send((total_each, FRAME))
    ends = [p.rconn.recv() for p in pairs]
    for p in pairs:
        p.sconn.recv()
    return max(ends) - t0


def socket_floor_started(warm_bytes: int) -> SocketFloor:
    """The socket floor's two processes (``floors_net.py``), their connections made and used once
    (``warm_bytes``, 1 stream and 2 streams one each way) untimed; stopped at cleanup."""
    floor = SocketFloor()
    on_cleanup(floor)
    floor.measure(warm_bytes)
    floor.measure(warm_bytes, streams=2, both_ways=True)
    return floor


# ------------------------------------------------------------------------------------------------
# what the team's daemons hold and say


def shm_bytes(path: str) -> dict:
    """Bytes the files of a shm dir really hold (allocated blocks), by kind."""
    out = {"slots": 0, "replicas": 0, "other": 0}
    for e in os.scandir(path) if os.path.isdir(path) else []:
        if not e.is_file():
            continue
        n = e.stat().st_blocks * 512
        kind = "replicas" if e.name.startswith("replica-") else "slots" if e.name.startswith("slot-") else "other"
        out[kind] += n
    out["total"] = sum(out.values())
    return out


class FileWatch:
    """Slot and replica files appearing in daemons' shm dirs (a new file is a cold step)."""

    def __init__(self, daemons: list[Daemon]):
        self.daemons = daemons
        self.known = self._now()

    def _now(self) -> set:
        out = set()
        for d in self.daemons:
            if os.path.isdir(d.shm_dir):
                out |= {(d.tag, n) for n in os.listdir(d.shm_dir) if n.startswith(("slot-", "replica-"))}
        return out

    def new(self) -> int:
        now = self._now()
        fresh = len(now - self.known)
        self.known = now
        return fresh


def team_events(daemons: list[Daemon]) -> list[str]:
    """The daemons' log lines that say something happened: membership views after the first,
    warnings, errors (a view change with no node lost is a false suspicion, e.g. under load)."""
    out = []
    for d in daemons:
        views = 0
        try:
            with open(d.log, errors="replace") as f:
                for line in f:
                    if "team: live nodes" in line:
                        views += 1
                        out.append(f"{d.tag}: {line.strip()}")
                    elif " WARNING " in line or " ERROR " in line or "Traceback" in line:
                        out.append(f"{d.tag}: {line.strip()}")
        except OSError:
            pass
    return out


def replicated(nodes: list[Daemon]) -> int:
    return sum(d.status()["team"]["counters"]["replicated_bytes"] for d in nodes)


# ------------------------------------------------------------------------------------------------
# 1. replication throughput


def bench_replication(env: Loopback, args, out: dict) -> None:
    log(f"replication: 2-node team (--replicas 1) vs one plain daemon, {args.size_mib} MiB per rank")
    shapes = gpt_shapes(2 * args.size_mib * MiB, layers=12)
    team = env.team("repl", 2, ["--replicas", "1"])
    single = env.daemon("repl-single", [])
    ranks = [Rank(), Rank()]
    nbytes = all_ranks(ranks, "build_state", lambda i: {"rank": i}, shapes=shapes, world=2, seed=1)
    log(f"  state: {len(shapes) + 1} tensors per rank, {nbytes[0] / MiB:.0f} MiB per rank")
    job_team, job_single = uuid.uuid4().hex, uuid.uuid4().hex
    all_ranks(ranks, "open", lambda i: {"rank": i, "run_dir": team[i].run_dir}, key="team", world=2,
              local_world_size=1, job_id=job_team)
    all_ranks(ranks, "open", lambda i: {"rank": i}, key="single", run_dir=single.run_dir, world=2,
              local_world_size=2, job_id=job_single)
    pairs1 = [RawPair()]
    pairs2 = [RawPair(), RawPair()]
    floor = socket_floor_started(64 * MiB)
    rows = []  # per step: {"step", "team", "single", "replicated", "sock1", "sock2", "raw1", "raw2", "team_staged", ...}
    before = replicated(team)
    watch = FileWatch(team + [single])
    step, nwarm = 0, 0
    while nwarm < args.steps and step < args.steps + 10:
        step += 1
        row = {"step": step}
        fresh_slots = 0
        order = ("team", "single") if step % 2 else ("single", "team")  # neither always goes first
        for key in order:
            ts = all_ranks(ranks, "snapshot", key=key, step=step)
            row[key] = max(t["committed"] for t in ts) - min(t["called"] for t in ts)
            row[f"{key}_staged"] = max(t["staged"] for t in ts) - min(t["called"] for t in ts)
            row[f"{key}_call"] = max(t["returned"] - t["called"] for t in ts)
            fresh_slots += sum(t["new_slot"] for t in ts)
            if key == "team":
                now = replicated(team)
                row["replicated"], before = now - before, now
            time.sleep(args.rhythm)
        row["new_files"] = watch.new()
        row["fresh_slots"] = fresh_slots
        # warm: every rank wrote into a slot it had written before, and no daemon made a file
        row["warm"] = step > 1 and not fresh_slots and not row["new_files"]
        if row["warm"]:
            nwarm += 1
            total = row["replicated"]
            row["sock1"] = floor.measure(total)
            row["sock2"] = floor.measure(total, streams=2, both_ways=True)
            row["raw1"] = raw_transfer(pairs1, total)
            row["raw2"] = raw_transfer(pairs2, total // 2)
            row["bound"] = row["single"] + BOUND_FACTOR * row["sock1"]  # plain + 1.25 x bytes / floor (1 stream)
            time.sleep(args.rhythm)
        rows.append(row)
        log("  step %d (%s): team %s, plain %s, replicated %.0f MiB%s" % (
            step, "warm" if row["warm"] else f"{fresh_slots} fresh slots, {row['new_files']} new files",
            fmt_seconds(row["team"]), fmt_seconds(row["single"]), row["replicated"] / MiB,
            f"; socket 1 stream {fmt_seconds(row['sock1'])}, 2 streams {fmt_seconds(row['sock2'])}; raw pyzmq 1 pair "
            f"{fmt_seconds(row['raw1'])}, 2 pairs {fmt_seconds(row['raw2'])}; bound {fmt_seconds(row['bound'])}, "
            f"team / bound {row['team'] / row['bound']:.2f}" if "raw1" in row else ""))
    statuses = [d.cli_status() for d in team]
    shm = [shm_bytes(d.shm_dir) for d in team]
    all_ranks(ranks, "drop")
    for r in ranks:
        r.stop()
    for p in pairs1 + pairs2 + [floor]:
        p.stop()
    for d in team + [single]:
        d.stop()
    out["replication"] = {"state_bytes_per_rank": nbytes[0], "tensors_per_rank": len(shapes) + 1, "steps": rows,
                          "status_replicated_bytes": [s["team"]["counters"]["replicated_bytes"] for s in statuses],
                          "status_push_failures": [s["team"]["counters"]["push_failures"] for s in statuses],
                          "status_transport": [s["team"]["transport"] for s in statuses], "shm_bytes": shm,
                          "events": team_events(team + [single])}


def report_replication(r: dict) -> tuple[str, dict]:
    rows = r["steps"]
    warm = [x for x in rows if x["warm"]]
    cold = rows[0]
    allocating = [x["step"] for x in rows[1:] if not x["warm"]]
    extra = [x["team"] - x["single"] for x in warm]
    per_step = [x["replicated"] for x in warm]
    thr = [x["replicated"] / (x["team"] - x["single"]) / 1e9 if x["team"] > x["single"] else None for x in warm]
    sock1 = [x["replicated"] / x["sock1"] / 1e9 for x in warm]
    sock2 = [x["replicated"] / x["sock2"] / 1e9 for x in warm]
    raw1 = [x["replicated"] / x["raw1"] / 1e9 for x in warm]
    raw2 = [x["replicated"] / x["raw2"] / 1e9 for x in warm]
    bound = [x["bound"] for x in warm]
    over = [x["team"] / x["bound"] for x in warm]
    med_bytes = median(per_step)
    thr_med = med_bytes / median(extra) / 1e9 if median(extra) > 0 else float("nan")
    ratio_s1, ratio_s2 = thr_med / median(sock1), thr_med / median(sock2)
    ratio1, ratio2 = thr_med / median(raw1), thr_med / median(raw2)
    over_med = median(over)
    t = [
        ["plain daemon (--nodes 1, both ranks): snapshot -> committed", fmt_seconds(cold["single"]), fmt_spread(x["single"] for x in warm)],
        ["team of 2, --replicas 1: snapshot -> committed", fmt_seconds(cold["team"]), fmt_spread(x["team"] for x in warm)],
        ["  of which until staged (team / plain)", f"{fmt_seconds(cold['team_staged'])} / {fmt_seconds(cold['single_staged'])}",
         f"{fmt_spread(x['team_staged'] for x in warm)} (team); {fmt_spread(x['single_staged'] for x in warm)} (plain)"],
        ["  the snapshot() call (team)", fmt_seconds(cold["team_call"]), fmt_spread(x["team_call"] for x in warm)],
        ["extra time of the team (team - plain, same step)", fmt_seconds(cold["team"] - cold["single"]), fmt_spread(extra)],
        ["bytes replicated per step (both nodes)", f"{cold['replicated'] / MiB:.0f} MiB", f"{med_bytes / MiB:.0f} MiB"],
        [f"bound = plain + {BOUND_FACTOR} x bytes / socket floor (1 stream), same step", "-", fmt_spread(bound)],
        ["team / bound (target <= 1.0)", "-", fmt_spread_num(over, 2)],
        ["replication throughput = bytes / extra time", "-", fmt_spread_num(thr, 2, " GB/s")],
        ["socket floor: loopback TCP, 1 stream, same bytes, recv_into a preallocated buffer (the reference)", "-",
         fmt_spread_num(sock1, 2, " GB/s")],
        ["socket floor, 2 streams at once (one each way, half the bytes each)", "-", fmt_spread_num(sock2, 2, " GB/s")],
        ["raw pyzmq PUSH/PULL, 1 pair, same bytes, 4 MiB frames", "-", fmt_spread_num(raw1, 2, " GB/s")],
        ["raw pyzmq PUSH/PULL, 2 pairs at once (one each way)", "-", fmt_spread_num(raw2, 2, " GB/s")],
    ]
    text = table(["what", "cold (step 1)", f"warm, {len(warm)} steps: min / median / max"], t, markdown=True)
    text += (f"\n\nSteps that wrote into a fresh slot or made a new slot/replica file (neither cold nor warm, left out): "
             f"{allocating}; warm steps: {[x['step'] for x in warm]}.")
    summary = {"team_warm_median": median([x["team"] for x in warm]), "plain_warm_median": median([x["single"] for x in warm]),
               "extra_median": median(extra), "bytes_per_step": med_bytes, "throughput_gbps": thr_med,
               "socket1_gbps": median(sock1), "socket2_gbps": median(sock2), "ratio_socket1": ratio_s1, "ratio_socket2": ratio_s2,
               "throughput_target_met": ratio_s1 >= THROUGHPUT_TARGET,
               "bound_median": median(bound), "team_over_bound_median": over_med, "team_over_bound": over,
               "bound_target_met": over_med <= 1.0,
               "raw1_gbps": median(raw1), "raw2_gbps": median(raw2), "ratio_raw1": ratio1, "ratio_raw2": ratio2,
               "cold_team": cold["team"], "cold_plain": cold["single"],
               "status_replicated_bytes": r["status_replicated_bytes"]}
    text += (f"\nReplication throughput (median bytes / median extra) {thr_med:.2f} GB/s = **{ratio_s1:.2f}x** the socket floor, "
             f"1 stream ({median(sock1):.2f} GB/s); target >= {THROUGHPUT_TARGET}x: {'met' if ratio_s1 >= THROUGHPUT_TARGET else 'NOT met'}. "
             f"{ratio_s2:.2f}x the socket floor with 2 streams one each way ({median(sock2):.2f} GB/s); "
             f"{ratio1:.2f}x raw pyzmq 1 pair ({median(raw1):.2f} GB/s), {ratio2:.2f}x 2 pairs ({median(raw2):.2f} GB/s)."
             f"\nTeam snapshot -> committed / (plain + {BOUND_FACTOR} x bytes / socket floor), median of the warm steps: "
             f"**{over_med:.2f}** (bound {fmt_seconds(median(bound))}); target <= 1.0: {'met' if over_med <= 1.0 else 'NOT met'}. "
             f"Per step: " + "; ".join(f"{x['step']}: {fmt_seconds(x['team'])} / {fmt_seconds(x['bound'])} = {x['team'] / x['bound']:.2f}"
                                       for x in warm) + "."
             f"\n`ucpd status --json` team.counters.replicated_bytes at the end: "
             f"{', '.join(f'{b / MiB:.0f} MiB' for b in r['status_replicated_bytes'])} (nodes 0, 1)")
    return text, summary


# ------------------------------------------------------------------------------------------------
# 2. recovery after a node loss (and 3. overhead of that team, R=1)


def node_summary(s: dict, shm: dict) -> dict:
    t = s["team"]
    return {"node": t["node_rank"], "own": t["bytes"]["own"], "replicas": t["bytes"]["replicas"], "overhead": t["overhead"],
            "health": t["health"], "shm": shm}


def settled(nodes: list[Daemon], live: set[int], step: int) -> bool:
    """Every live node: healing idle, its part of ``step`` healthy (held at the redundancy)."""
    for d in nodes:
        t = d.status()["team"]
        if t["healing"]["pending"]:
            return False
        if any(v["health"] != "healthy" for v in t["versions"] if v["step"] == step):
            return False
        if {n["node"] for n in t["nodes"] if n["live"]} != live:
            return False
    return True


def drop_page_cache(root: str) -> int:
    """POSIX_FADV_DONTNEED on every file under ``root`` (flushed and fsynced: clean pages)."""
    n = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return n


def resident_bytes(root: str) -> int | None:
    """Bytes of the files under ``root`` in the page cache (util-linux ``fincore``)."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
    if not files or not shutil.which("fincore"):
        return None
    try:
        res = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES", *files],
                             capture_output=True, text=True, timeout=30, check=True)
        return sum(int(x) for x in res.stdout.split())
    except (subprocess.SubprocessError, ValueError):
        return None


def pair_time(results: list[dict]) -> float:
    return max(r["end"] for r in results) - min(r["start"] for r in results)


def bench_recovery(env: Loopback, args, out: dict) -> None:
    log(f"recovery: 3-node team (--replicas 1 --flush-dir), TP=3, {args.recovery_mib} MiB per node; lose node 2")
    shapes = gpt_shapes(3 * args.recovery_mib * MiB, layers=12)
    flush_dir = os.path.join(env.tmp, "flush")
    team = env.team("rec", 3, ["--replicas", "1", "--flush-dir", flush_dir])
    ranks = [Rank() for _ in range(3)]
    nbytes = all_ranks(ranks, "build_state", lambda i: {"rank": i}, shapes=shapes, world=3, seed=2)
    job = uuid.uuid4().hex
    all_ranks(ranks, "open", lambda i: {"rank": i, "run_dir": team[i].run_dir}, key="team", world=3,
              local_world_size=1, job_id=job)
    from ucpd.format import list_versions

    commits = []
    last = 4
    for step in range(1, last + 1):
        ts = all_ranks(ranks, "snapshot", key="team", step=step)
        commits.append(max(t["committed"] for t in ts) - min(t["called"] for t in ts))
        committed_at = max(t["committed"] for t in ts)
        log(f"  step {step}: committed in {fmt_seconds(commits[-1])}")
        time.sleep(args.rhythm)
    wait_for(lambda: any(v.step == last and v.state == "complete" for v in list_versions(os.path.join(flush_dir, BENCH_JOB))),
             f"the flush of step {last}", 180, team, interval=0.05)
    flushed_after = time.monotonic() - committed_at
    log(f"  step {last} complete on disk {fmt_seconds(flushed_after)} after its commit")
    wait_for(lambda: settled(team, {0, 1, 2}, last), f"step {last} healthy on every node before the loss", 60, team)
    health_before = [[(v["step"], v["health"], v["holders"]) for v in d.status()["team"]["versions"]] for d in team]
    overhead_r1 = [node_summary(d.cli_status(), shm_bytes(d.shm_dir)) for d in team]
    held_r1 = [d.status()["team"]["replicas_held"] for d in team]

    # the loss: node 2's trainer and daemon die, its RAM is gone
    ranks[2].kill()
    team[2].kill()
    shutil.rmtree(team[2].shm_dir, ignore_errors=True)
    t_kill = time.monotonic()
    survivors = team[:2]
    wait_for(lambda: all(not d.status()["team"]["nodes"][2]["live"] for d in survivors), "node 2 declared dead", 60, survivors, 0.05)
    dead_after = time.monotonic() - t_kill
    wait_for(lambda: settled(survivors, {0, 1}, last), "re-protection on the survivors", 180, survivors, 0.1)
    healed_after = time.monotonic() - t_kill
    healing = [d.status()["team"]["healing"] for d in survivors]
    log(f"  node 2 lost: declared dead after {dead_after:.2f} s, re-protected after {healed_after:.2f} s ({healing})")
    for r in ranks[:2]:  # the job dies with the node; a new one starts on the survivors
        r.stop()

    new = [Rank(), Rank()]
    plain = env.daemon("rec-plain", ["--flush-dir", flush_dir])
    tbytes = all_ranks(new, "build_target", lambda i: {"rank": i}, shapes=shapes, world=2, seed=2, step=last)
    job2 = uuid.uuid4().hex
    all_ranks(new, "open", lambda i: {"rank": i, "run_dir": survivors[i].run_dir}, key="ram", world=2,
              local_world_size=1, job_id=job2, fresh=True)
    all_ranks(new, "open", lambda i: {"rank": i}, key="flush", run_dir=plain.run_dir, world=2,
              local_world_size=2, job_id=uuid.uuid4().hex, fresh=True)
    fetched0 = sum(d.status()["team"]["counters"]["fetched_bytes"] for d in survivors)
    floor = socket_floor_started(64 * MiB)

    def restore(key):
        res = all_ranks(new, "restore", key=key)
        for i, r in enumerate(res):
            if r["nbad"] or r["step"] != last:
                raise AssertionError(f"restore from {key}: rank {i} got step {r['step']}, {r['nbad']} tensors differ: {r['bad']}")
        return res

    first = restore("ram")
    fetched_first = sum(d.status()["team"]["counters"]["fetched_bytes"] for d in survivors) - fetched0
    time.sleep(args.rhythm)
    first_flush = restore("flush")
    time.sleep(args.rhythm)
    tfiles = [os.path.join(env.shm, f"torch-rank{i}.pt") for i in range(2)]
    all_ranks(new, "torch_save", lambda i: {"path": tfiles[i]})
    cases = {"ram": [], "ram_rpc": [], "flush_warm": [], "flush_warm_rpc": [], "flush_cold": [], "flush_cold_rpc": [],
             "torch_load": [], "floor": [], "sock1": [], "sock2": [], "where": set(), "resident_before_cold": [],
             "resident_warm": []}
    for rep in range(args.reps):
        res = restore("ram")
        cases["ram"].append(pair_time(res))
        cases["ram_rpc"].append(max(r["rpc_s"] for r in res))
        cases["where"].update(f"ram:{r['where']}" for r in res)
        time.sleep(args.rhythm)
        cases["resident_warm"].append(resident_bytes(os.path.join(flush_dir, BENCH_JOB, f"step-{last}")))
        res = restore("flush")
        cases["flush_warm"].append(pair_time(res))
        cases["flush_warm_rpc"].append(max(r["rpc_s"] for r in res))
        cases["where"].update(f"flush:{r['where']}" for r in res)
        time.sleep(args.rhythm)
        drop_page_cache(flush_dir)
        cases["resident_before_cold"].append(resident_bytes(os.path.join(flush_dir, BENCH_JOB, f"step-{last}")))
        res = restore("flush")
        cases["flush_cold"].append(pair_time(res))
        cases["flush_cold_rpc"].append(max(r["rpc_s"] for r in res))
        time.sleep(args.rhythm)
        cases["torch_load"].append(pair_time(all_ranks(new, "torch_load", lambda i: {"path": tfiles[i]})))
        time.sleep(args.rhythm)
        cases["floor"].append(pair_time(all_ranks(new, "floor")))
        time.sleep(args.rhythm)
        cases["sock1"].append(floor.measure(max(tbytes)))  # one rank's bytes, 1 stream
        cases["sock2"].append(floor.measure(sum(tbytes), streams=2, both_ways=True))  # both ranks' bytes, one each way
        time.sleep(args.rhythm)
        log(f"  rep {rep + 1}: RAM {fmt_seconds(cases['ram'][-1])} (RPC {fmt_seconds(cases['ram_rpc'][-1])}), flush dir warm "
            f"{fmt_seconds(cases['flush_warm'][-1])} / cold {fmt_seconds(cases['flush_cold'][-1])}, torch.load "
            f"{fmt_seconds(cases['torch_load'][-1])}, memcpy floor {fmt_seconds(cases['floor'][-1])}, socket floor: a rank's "
            f"bytes {fmt_seconds(cases['sock1'][-1])}, both ranks' 2 streams {fmt_seconds(cases['sock2'][-1])}")
    fetched_total = sum(d.status()["team"]["counters"]["fetched_bytes"] for d in survivors) - fetched0
    flushed = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(flush_dir, BENCH_JOB, f"step-{last}")) for f in fs)
    floor.stop()
    all_ranks(new, "drop")
    for r in new:
        r.stop()
    for p in tfiles:
        if os.path.exists(p):
            os.unlink(p)
    for d in team + [plain]:
        d.stop()
    shutil.rmtree(flush_dir, ignore_errors=True)
    cases["where"] = sorted(cases["where"])
    out["recovery"] = {
        "state_bytes_per_node": nbytes[0], "tensors_per_rank": len(shapes) + 1, "restore_bytes_per_rank": tbytes,
        "global_bytes": sum(tbytes), "commits": commits, "flush_after_commit": flushed_after, "dead_after": dead_after,
        "reprotected_after": healed_after, "healing": healing, "first_ram": pair_time(first),
        "first_ram_rpc": max(r["rpc_s"] for r in first), "fetched_first": fetched_first,
        "first_flush": pair_time(first_flush), "first_flush_rpc": max(r["rpc_s"] for r in first_flush),
        "fetched_per_restore": (fetched_total - fetched_first) / max(1, args.reps), "flushed_bytes": flushed, **cases,
    }
    out["overhead_recovery_team"] = overhead_r1
    out["recovery"]["health_before_loss"] = health_before
    out["recovery"]["events"] = team_events(team + [plain])
    out["overhead_recovery_team_held"] = held_r1


def report_recovery(r: dict) -> tuple[str, dict]:
    g = r["global_bytes"]
    rank_bytes = max(r["restore_bytes_per_rank"])
    gb = lambda xs: fmt_spread_num([g / x / 1e9 for x in xs], 2)  # noqa: E731
    sock = median(r["sock1"])  # seconds to move one rank's bytes at the socket floor (1 stream)
    vs = lambda x: fmt_num(x / sock)  # noqa: E731  (a time / the socket floor's time of one rank's bytes)
    rows = [
        ["restore from the survivors' RAM (default path), first", fmt_seconds(r["first_ram"]), f"{g / r['first_ram'] / 1e9:.2f}",
         vs(r["first_ram"]), f"RPC {fmt_seconds(r['first_ram_rpc'])}"],
        ["restore from the survivors' RAM (default path)", fmt_spread(r["ram"]), gb(r["ram"]), vs(median(r["ram"])),
         f"RPC (plan + peer fetch) {fmt_spread(r['ram_rpc'])} = {vs(median(r['ram_rpc']))}x the socket floor"],
        ["restore from the flush dir, plain daemon, first", fmt_seconds(r["first_flush"]), f"{g / r['first_flush'] / 1e9:.2f}",
         vs(r["first_flush"]), f"RPC {fmt_seconds(r['first_flush_rpc'])}"],
        ["restore from the flush dir, plain daemon, page cache warm", fmt_spread(r["flush_warm"]), gb(r["flush_warm"]),
         vs(median(r["flush_warm"])), f"RPC {fmt_spread(r['flush_warm_rpc'])}"],
        ["restore from the flush dir, plain daemon, page cache dropped", fmt_spread(r["flush_cold"]), gb(r["flush_cold"]),
         vs(median(r["flush_cold"])), f"RPC {fmt_spread(r['flush_cold_rpc'])}"],
        ["torch.load <- /dev/shm (each rank its own file, new layout)", fmt_spread(r["torch_load"]), gb(r["torch_load"]),
         vs(median(r["torch_load"])), "no reshard, no checks"],
        ["memcpy floor (native copy_batch, no CRC, warm buffers)", fmt_spread(r["floor"]), gb(r["floor"]), vs(median(r["floor"])), ""],
        [f"socket floor: one rank's bytes ({rank_bytes / MiB:.0f} MiB), 1 loopback TCP stream (the reference)", fmt_spread(r["sock1"]),
         fmt_spread_num([rank_bytes / x / 1e9 for x in r["sock1"]], 2), "1.00", "GB/s of the one rank's bytes; recv_into a preallocated buffer"],
        ["socket floor: both ranks' bytes, 2 streams at once (one each way)", fmt_spread(r["sock2"]), gb(r["sock2"]),
         vs(median(r["sock2"])), ""],
    ]
    text = table(["2 ranks at once, whole state (min / median / max)", "time", "GB/s", "time / socket floor", "note"], rows,
                 markdown=True)
    ram = median(r["ram"])
    ratios = {
        "flush_warm": median(r["flush_warm"]) / ram, "flush_cold": median(r["flush_cold"]) / ram,
        "torch_load": median(r["torch_load"]) / ram, "ram_over_floor": ram / median(r["floor"]),
    }
    per_rep = {k: [a / b for a, b in zip(r[k], r["ram"])] for k in ("flush_warm", "flush_cold", "torch_load")}
    per_sock = {k: [a / b for a, b in zip(r[k], r["sock1"])] for k in ("ram", "ram_rpc", "flush_cold", "flush_warm")}
    text += (
        f"\n\nRAM restore vs flush dir (median of the per-rep ratios): **{median(per_rep['flush_warm']):.2f}x** faster "
        f"(page cache warm), **{median(per_rep['flush_cold']):.2f}x** (cold); target >= 5x: "
        f"{'met' if median(per_rep['flush_warm']) >= 5 else 'NOT met'} warm, {'met' if median(per_rep['flush_cold']) >= 5 else 'NOT met'} cold. "
        f"vs torch.load {median(per_rep['torch_load']):.2f}x; RAM restore = {ratios['ram_over_floor']:.2f}x the memcpy floor."
        f"\nRAM restore (2 ranks at once) / the socket floor's time to move one rank's bytes ({rank_bytes / MiB:.0f} MiB, 1 stream, "
        f"{fmt_seconds(sock)} = {rank_bytes / sock / 1e9:.2f} GB/s), median of the per-rep ratios: **{median(per_sock['ram']):.2f}** "
        f"(target <= 1.0: {'met' if median(per_sock['ram']) <= 1.0 else 'NOT met'}); its restore RPC (plan + peer fetch, until the "
        f"client may copy its first byte) {median(per_sock['ram_rpc']):.2f}; flush dir, page cache dropped "
        f"{median(per_sock['flush_cold']):.2f}, warm {median(per_sock['flush_warm']):.2f}.\n"
        f"Bytes fetched from peers per restore: {r['fetched_per_restore'] / MiB:.0f} MiB of {g / MiB:.0f} MiB. "
        f"Node 2 declared dead {r['dead_after']:.2f} s after the kill, re-protection done {r['reprotected_after']:.2f} s after it; "
        f"step 4 complete on disk {fmt_seconds(r['flush_after_commit'])} after its commit. Sources: {', '.join(r['where'])}. "
        f"Flushed files in the page cache: {', '.join(f'{x / MiB:.0f}' if x is not None else '?' for x in r['resident_warm'])} MiB "
        f"before the warm restores, {', '.join(f'{x / MiB:.0f}' if x is not None else '?' for x in r['resident_before_cold'])} MiB "
        f"before the cold ones (fincore), of {r['flushed_bytes'] / MiB:.0f} MiB."
    )
    summary = {**{k: median(v) for k, v in per_rep.items()}, "ram_median": ram, "flush_warm_median": median(r["flush_warm"]),
               "flush_cold_median": median(r["flush_cold"]), "torch_load_median": median(r["torch_load"]),
               "floor_median": median(r["floor"]), "ram_over_floor": ratios["ram_over_floor"], "first_ram": r["first_ram"],
               "dead_after": r["dead_after"], "reprotected_after": r["reprotected_after"],
               "fetched_per_restore": r["fetched_per_restore"], "resident_before_cold": r["resident_before_cold"],
               "resident_warm": r["resident_warm"], "restore_bytes_per_rank": rank_bytes,
               "socket1_median": sock, "socket1_gbps": rank_bytes / sock / 1e9, "socket2_median": median(r["sock2"]),
               "ram_rpc_median": median(r["ram_rpc"]),
               **{f"{k}_over_socket": median(v) for k, v in per_sock.items()},
               "socket_target_met": median(per_sock["ram"]) <= 1.0}
    return text, summary


# ------------------------------------------------------------------------------------------------
# 3. memory overhead


def bench_overhead(env: Loopback, args, out: dict) -> None:
    shapes = gpt_shapes(3 * args.overhead_mib * MiB, layers=4)
    res = {}
    for R in (1, 2):
        log(f"overhead: 3-node team, --replicas {R}, {args.overhead_mib} MiB per node, 5 steps")
        team = env.team(f"ovh{R}", 3, ["--replicas", str(R)])
        ranks = [Rank() for _ in range(3)]
        all_ranks(ranks, "build_state", lambda i: {"rank": i}, shapes=shapes, world=3, seed=3)
        all_ranks(ranks, "open", lambda i: {"rank": i, "run_dir": team[i].run_dir}, key="team", world=3,
                  local_world_size=1, job_id=uuid.uuid4().hex)
        for step in range(1, 6):
            all_ranks(ranks, "snapshot", key="team", step=step)
            time.sleep(args.rhythm)
        wait_for(lambda: settled(team, {0, 1, 2}, 5), "step 5 healthy on every node", 60, team)
        res[R] = [node_summary(d.cli_status(), shm_bytes(d.shm_dir)) for d in team]
        res[f"{R}_versions"] = [[v["step"] for v in d.status()["versions"]] for d in team]
        res[f"{R}_replicas_held"] = [d.status()["team"]["replicas_held"] for d in team]
        res[f"{R}_events"] = team_events(team)
        all_ranks(ranks, "drop")
        for r in ranks:
            r.stop()
        for d in team:
            d.stop()
    out["overhead"] = {"mib": args.overhead_mib, "1": res[1], "2": res[2], "versions": {"1": res["1_versions"], "2": res["2_versions"]},
                       "replicas_held": {"1": res["1_replicas_held"], "2": res["2_replicas_held"]},
                       "events": {"1": res["1_events"], "2": res["2_events"]}}


def report_overhead(o: dict, rec: list | None, rec_held: list | None = None) -> tuple[str, dict]:
    rows, summary = [], {}
    sets = [(f"R={R}, {o['mib']} MiB/node", R, o[str(R)]) for R in (1, 2)]
    if rec:
        sets.insert(1, ("R=1, the recovery team (before the loss)", 1, rec))
    for label, R, nodes in sets:
        for n in nodes:
            shm = n["shm"]
            rows.append([label, str(n["node"]), f"{n['own'] / MiB:.1f}", f"{n['replicas'] / MiB:.1f}",
                         fmt_num(n["overhead"]), f"{1 + R}", fmt_num(shm["total"] / n["own"]) if n["own"] else "-",
                         f"{shm['slots'] / MiB:.0f} + {shm['replicas'] / MiB:.0f} + {shm['other'] / MiB:.0f}"])
        summary[label] = [n["overhead"] for n in nodes]
    text = table(["team", "node", "own MiB", "replicas MiB", "team.overhead", "theory 1+R", "shm dir / own",
                  "shm dir MiB: slots + replica files + other"], rows, markdown=True)
    text += ("\n\nVersions in RAM per node (own): " + "; ".join(f"R={R}: {o['versions'][str(R)]}" for R in (1, 2))
             + ". Replicas held ([origin, step]): "
             + "; ".join(f"R={R}: {o['replicas_held'][str(R)]}" for R in (1, 2))
             + (f"; recovery team: {rec_held}" if rec_held else ""))
    return text, summary


# ------------------------------------------------------------------------------------------------
# 4. commit latency


def bench_latency(env: Loopback, args, out: dict) -> None:
    res, events = {}, {}
    ranks: list[Rank] = []
    for n in [1] + args.latency_nodes:
        log(f"latency: {n} node(s), 1 MiB per rank, {args.latency_steps} steps")
        if n == 1:
            nodes = [env.daemon("lat1", ["--mem-limit", "256M"])]
        else:
            nodes = env.team(f"lat{n}", n, ["--replicas", "1", "--heartbeat", "0.1", "--mem-limit", "256M"])
        while len(ranks) < n:
            ranks.append(Rank())
        use = ranks[:n]
        all_ranks(use, "build_state", lambda i: {"rank": i}, shapes=tiny_shapes(n), world=n, seed=4, blocks=n)
        job = uuid.uuid4().hex
        all_ranks(use, "open", lambda i: {"rank": i, "run_dir": nodes[i].run_dir}, key="lat", world=n,
                  local_world_size=1, job_id=job)
        rows = []
        for step in range(1, 3 + args.latency_steps + 1):
            ts = all_ranks(use, "snapshot", key="lat", step=step, latest=True)
            last_call = max(t["called"] for t in ts)
            row = {"step": step, "latest": max(t["latest"] for t in ts) - last_call,
                   "wait": max(t["committed"] for t in ts) - last_call,
                   "call_spread": last_call - min(t["called"] for t in ts),
                   "polls": max(t["latest_polls"] for t in ts)}
            if step > 3:
                rows.append(row)
            time.sleep(args.rhythm_latency)
        res[n] = rows
        events[n] = team_events(nodes) if n > 1 else []
        log(f"  {n} node(s): latest() on every node after {fmt_spread(r['latest'] for r in rows)} (min / median / max)")
        all_ranks(use, "drop")
        for d in nodes:
            d.stop()
    for r in ranks:
        r.stop()
    out["latency"] = {str(k): v for k, v in res.items()}
    out["latency_events"] = {str(k): v for k, v in events.items()}


def report_latency(lat: dict) -> tuple[str, dict]:
    rows, summary = [], {}
    for n, steps in lat.items():
        label = f"{n} (plain daemon, reference)" if n == "1" else n
        rows.append([label, fmt_spread(s["latest"] for s in steps), fmt_spread(s["wait"] for s in steps),
                     fmt_spread(s["call_spread"] for s in steps), str(max(s["polls"] for s in steps))])
        summary[n] = {"latest_median": median([s["latest"] for s in steps]), "latest_max": max(s["latest"] for s in steps),
                      "wait_median": median([s["wait"] for s in steps])}
    text = table(["nodes", "last snapshot() -> latest() = step on every node", "-> wait() returned on every node",
                  "spread of the snapshot() calls", "latest() calls needed (max)"], rows, markdown=True)
    return text, summary


# ------------------------------------------------------------------------------------------------


class MemWatch:
    """The lowest MemAvailable seen while the benchmark runs (sampled every 0.5 s, per part)."""

    def __init__(self):
        import threading

        self.low: dict[str, float] = {}
        self.part = "start"
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    @staticmethod
    def available_gib() -> float:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / (1 << 20)

    def _run(self):
        while not self._stop.wait(0.5):
            gib = self.available_gib()
            self.low[self.part] = round(min(self.low.get(self.part, gib), gib), 1)

    def stop(self):
        self._stop.set()


def main(argv=None) -> int:
    os.environ["UCPD_JOB"] = BENCH_JOB  # every Checkpointer of the run, in every process: one job
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=512, help="replication: MiB per rank (2 ranks)")
    ap.add_argument("--recovery-mib", type=int, default=342,
                    help="recovery: MiB per node (3 nodes); each of the 2 restoring ranks restores 3/2 of it (342: 512 MiB)")
    ap.add_argument("--overhead-mib", type=int, default=64, help="overhead: MiB per node (3 nodes)")
    ap.add_argument("--steps", type=int, default=6, help="replication: warm steps (after 3 that fill the slots)")
    ap.add_argument("--reps", type=int, default=3, help="recovery: repetitions of each restore")
    ap.add_argument("--latency-nodes", default="2,4,8")
    ap.add_argument("--latency-steps", type=int, default=10)
    ap.add_argument("--rhythm", type=float, default=0.4, help="seconds of 'training' between snapshots")
    ap.add_argument("--rhythm-latency", type=float, default=0.3)
    ap.add_argument("--only", default="replication,recovery,overhead,latency")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep-logs", default=None, help="copy the daemons' logs into this folder")
    args = ap.parse_args(argv)
    args.latency_nodes = [int(x) for x in args.latency_nodes.split(",") if x]
    only = set(args.only.split(","))

    for name in FOREIGN_ENV:
        os.environ.pop(name, None)
    cleanup_on_exit()
    info = machine()
    info["mem_available_gib_at_start"] = round(MemWatch.available_gib(), 1)
    mem = MemWatch()
    log(f"machine: {info}")
    env = Loopback(SHM_PREFIX, args.keep_logs)
    out: dict = {"machine": info, "args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M")}
    t0 = time.monotonic()
    ok = False
    parts = (("replication", bench_replication), ("recovery", bench_recovery), ("overhead", bench_overhead), ("latency", bench_latency))
    try:
        for part, bench in parts:
            if part in only:
                mem.part = part
                bench(env, args, out)
        ok = True
    except BaseException:
        for d in env.daemons:
            print(f"--- daemon {d.tag} log (tail)\n{d.log_tail(40)}", file=sys.stderr)
        raise
    finally:
        env.save_logs()
        cleanup()
        mem.stop()
        out["mem_available_low_gib"] = mem.low
        out["wall_s"] = round(time.monotonic() - t0, 1)
        out["load_at_end"] = [round(x, 2) for x in os.getloadavg()]
        leftovers = [p for p in glob.glob(f"/dev/shm/{SHM_PREFIX}*")]
        if leftovers:
            print(f"left in /dev/shm: {leftovers}", file=sys.stderr)
    summary = {}
    print()
    print(f"ucpd team benchmark, {time.strftime('%Y-%m-%d')}, {info.get('cpus')} CPUs, load {info['loadavg_at_start']} "
          f"-> {out['load_at_end']}, {out['wall_s']} s; lowest MemAvailable by part {out['mem_available_low_gib']} GiB "
          f"(at start {info['mem_available_gib_at_start']}); times min / median / max")
    if "replication" in out:
        text, summary["replication"] = report_replication(out["replication"])
        print(f"\n## 1. replication (2 nodes, --replicas 1, {out['replication']['state_bytes_per_rank'] / MiB:.0f} MiB per rank)\n\n{text}")
    if "recovery" in out:
        text, summary["recovery"] = report_recovery(out["recovery"])
        print(f"\n## 2. recovery after losing node 2 of 3 ({out['recovery']['global_bytes'] / MiB:.0f} MiB in all, "
              f"TP=3 -> TP=2)\n\n{text}")
    if "overhead" in out:
        text, summary["overhead"] = report_overhead(out["overhead"], out.get("overhead_recovery_team"),
                                                    out.get("overhead_recovery_team_held"))
        print(f"\n## 3. memory overhead (3 nodes, keep=2)\n\n{text}")
    if "latency" in out:
        text, summary["latency"] = report_latency(out["latency"])
        print(f"\n## 4. commit latency (1 MiB per rank, --heartbeat 0.1, {args.latency_steps} steps)\n\n{text}")
    ev = [("replication", out.get("replication", {}).get("events", [])), ("recovery", out.get("recovery", {}).get("events", []))]
    ev += [(f"overhead R={R}", out.get("overhead", {}).get("events", {}).get(str(R), [])) for R in (1, 2)]
    ev += [(f"latency {n} nodes", e) for n, e in out.get("latency_events", {}).items()]
    print("\n## team events in the daemons' logs (membership views after the first, warnings, errors)\n")
    for part, lines in ev:
        print(f"- {part}: {len(lines)} line(s)")
        for line in lines[:12]:
            print(f"    {line}")
    summary["events"] = {part: len(lines) for part, lines in ev}
    out["summary"] = summary
    write_json(args.json, out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
