#!/usr/bin/env python
"""ucpd as a user's training loop runs it: default daemon flags, a compute gap between snapshots,
cold first snapshots apart, warm figures after every slot was used, the floor in the same run.

    .venv/bin/python benchmarks/loop/bench_loop.py [--runs 1] [--size-gib 1] [--gap 0.5]
                     [--warm 12] [--flush-warm 22] [--train-rounds 3] [--quick] [--json OUT]
                     [--skip-idle] [--skip-flush] [--skip-train]

Scenes (each run does all of them, in this order; ``--runs N`` repeats the whole and reports
every run and the spread min/median/max over runs):

- **cold**: a fresh ``ucpd serve`` (default flags; only private ``--run-dir``/``--shm-dir``),
  its first ``keep + 1`` = 3 snapshots, each after a ``--gap`` idle sleep, beside the cost of
  faulting in that many bytes of fresh /dev/shm (``posix_fallocate`` + one written byte per
  page, as the daemon does; and a single-thread copy of the state into a fresh mapping),
  measured just before the daemon starts;
- **(a) idle loop**: the same daemon, then ``--warm`` cycles of: sleep ``--gap``, snapshot
  (the call, until staged, until committed: ``handle.timings``), sleep ``--gap``, the floor =
  one single-thread memcpy of the same bytes (``ucpd.native.copy_batch(threads=1)``, per
  tensor, no CRC) into a pre-faulted shm buffer laid out like a slot; and a 2-thread copy of the
  same as a reference;
- **(b) flush loop**: a fresh daemon with ``--flush-dir D --flush-every 10`` (else defaults,
  the flush rate included), 3 cold snapshots, then ``--flush-warm`` cycles as in (a); the
  snapshots that overlap a flush are also reported apart;
- **(c) training**: the example GPT (``examples/gpt``, TP1 x PP1 x DP1, its ZeRO AdamW)
  sized so a step takes >= 0.5 s here; rounds of blocks of ``--train-steps`` steps each of:
  no checkpoint, ucpd ``snapshot()`` every step (``optimizer.step`` waits for the last one's
  ``staged()``, as ``Checkpointer.guard`` does), DCP ``async_save`` every step (a
  ``DefaultStager`` with shared-memory staging in a background thread — pinned memory and
  non-blocking copies need an accelerator; the optimizer update waits for its staging; the
  next save waits for the previous upload, as torch's async-checkpointing recipe does), and
  ``torch.save`` to /dev/shm every step. The first step of each block is not counted (it
  overlaps nothing), each block ends with the outstanding checkpoint finished (untimed).

The state of (a)/(b)/cold: a GPT-like (Llama-style: per layer input norm, q, k, v, o,
post-attention norm, gate, up, down) fp32 model of 6 layers, hidden 768, with the vocabulary
filling the rest, + Adam exp_avg + exp_avg_sq: 57 parameters x 3 = 171 tensors, --size-gib GiB.

Everything lives in private folders ``/dev/shm/ucpd-bench-loop-*`` and ``/tmp/ucpd-bench-loop-*``,
removed at exit and on SIGTERM/SIGINT. ``run_all.py`` runs it with ``--json`` only: one run
of the default sizes (a few minutes). ``--quick`` is a smoke test (256 MiB, few reps, small GPT).
The machine is shared and noisy: compare ratios within one run; the spread is over runs.
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path[:0] = [str(HERE.parents[1]), str(ROOT), str(ROOT / "client")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import GiB, MiB, fmt_seconds, log, machine, median, spread, table, timed_snapshot, write_json  # noqa: E402
from daemons import cleanup, cleanup_on_exit, enough_shm, private_dir, start_daemon  # noqa: E402
from floor import SlotLikeBuffer  # noqa: E402

PREFIX = "ucpd-bench-loop-"
BENCH_JOB = "bench-loop"
KEEP_DEFAULT = 2  # the daemon's default --keep: warm-up = keep + 1 snapshots uses every slot once

# ------------------------------------------------------------------------------------------------
# state: 171 tensors, GPT-like (Llama-style blocks), fp32 weights + two Adam moments


def llama_shapes(size_bytes: int, layers: int = 6, hidden: int = 768) -> list[tuple[str, tuple[int, ...]]]:
    ffn = (8 * hidden // 3 + 63) // 64 * 64
    block = [
        ("input_layernorm.weight", (hidden,)),
        ("self_attn.q_proj.weight", (hidden, hidden)),
        ("self_attn.k_proj.weight", (hidden, hidden)),
        ("self_attn.v_proj.weight", (hidden, hidden)),
        ("self_attn.o_proj.weight", (hidden, hidden)),
        ("post_attention_layernorm.weight", (hidden,)),
        ("mlp.gate_proj.weight", (ffn, hidden)),
        ("mlp.up_proj.weight", (ffn, hidden)),
        ("mlp.down_proj.weight", (hidden, ffn)),
    ]
    per_layer = sum(int(np.prod(s)) for _, s in block)
    params = size_bytes // 12  # fp32 weight + exp_avg + exp_avg_sq
    vocab = max(64, (params - layers * per_layer - hidden) // (2 * hidden) // 64 * 64)
    out = [("embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        out += [(f"layers.{i}.{n}", s) for n, s in block]
    out += [("norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return out


class State:
    def __init__(self, size_bytes: int, layers: int = 6, hidden: int = 768):
        g = torch.Generator().manual_seed(0)
        self.params = llama_shapes(size_bytes, layers, hidden)
        self.model, self.optim = {}, {}
        for name, shape in self.params:
            self.model[name] = torch.randn(shape, generator=g)
            self.optim[name] = {"exp_avg": torch.randn(shape, generator=g) * 1e-3, "exp_avg_sq": torch.rand(shape, generator=g) * 1e-6}
        self.nested = {"model": self.model, "optim": self.optim, "step": 0}
        self.flat = [self.model[n] for n, _ in self.params] + [self.optim[n][k] for n, _ in self.params for k in ("exp_avg", "exp_avg_sq")]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.flat)
        self.vocab = self.params[0][1][0]


# ------------------------------------------------------------------------------------------------
# floor and first-touch


class Floor:
    """A pre-faulted shm buffer laid out like a slot; one copy of the state into it, 1 thread
    (the floor) or 2 (a reference)."""

    def __init__(self, flat: list[torch.Tensor]):
        from ucpd import native

        self.native = native
        self.buffer = SlotLikeBuffer(private_dir(PREFIX, "floor"), [t.numel() * t.element_size() for t in flat])
        self.total, self.buf, self.offs = self.buffer.total, self.buffer.array, self.buffer.offsets
        self.items = [(self.buffer.base + o, t.data_ptr(), t.numel() * t.element_size()) for o, t in zip(self.offs, flat)]
        self.flat = flat

    def copy(self, threads: int = 1) -> float:
        t0 = time.perf_counter()
        self.native.copy_batch(self.items, threads=threads, crc_chunk=0)
        return time.perf_counter() - t0

    def copy_crc(self) -> float:
        """ucpd's own copy path (native copy_batch + CRC32C per chunk, the client's threads) into
        this warm buffer: the snapshot's copy without the daemon and without a slot rotation."""
        from ucpd import knobs

        t0 = time.perf_counter()
        self.native.copy_batch(self.items, threads=knobs.copy_threads(), crc_chunk=self.native.CHUNK_BYTES)
        return time.perf_counter() - t0

    def check(self) -> None:
        for o, t in list(zip(self.offs, self.flat))[::20]:
            n = t.numel() * t.element_size()
            assert bytes(self.buf[o : o + min(n, 4096)]) == t.reshape(-1).view(torch.uint8)[: min(n, 4096)].numpy().tobytes()

    def close(self) -> None:
        del self.buf
        self.buffer.close()


def first_touch(nbytes: int, floor: Floor | None = None) -> dict:
    """Fault in ``nbytes`` of fresh /dev/shm: (1) posix_fallocate + one written byte per page (what
    the daemon's slot allocation does); (2) a single-thread copy of the state into a fresh
    mapping (first touch by the copy itself). The files are removed right after."""
    d = private_dir(PREFIX, "touch")
    out = {}
    size = (nbytes + (2 << 20) - 1) // (2 << 20) * (2 << 20)
    path = os.path.join(d, "fresh.bin")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, size)
    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
        pages = np.frombuffer(mm, dtype=np.uint8)
        pages[:: mmap.PAGESIZE] = 0
        del pages
    os.close(fd)
    out["fallocate_touch"] = time.perf_counter() - t0
    os.unlink(path)
    if floor is not None:
        path = os.path.join(d, "fresh-copy.bin")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, floor.total)
        mm = mmap.mmap(fd, floor.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        buf = np.frombuffer(mm, dtype=np.uint8)
        base = buf.ctypes.data
        items = [(base + (dst - floor.buffer.base), src, n) for dst, src, n in floor.items]
        t0 = time.perf_counter()
        floor.native.copy_batch(items, threads=1, crc_chunk=0)
        out["copy_into_fresh_1t"] = time.perf_counter() - t0
        del buf
        gc.collect()
        mm.close()
        os.unlink(path)
    shutil.rmtree(d, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------------------
# the client's side of a snapshot


class MapTimer:
    """Times the client's slot mapping (``Checkpointer._maps.get``) on the snapshot worker by
    wrapping it in this process: a slot file not mapped ahead (between snapshots, on the
    ``ucpd-ahead`` thread) is mapped and populated inside the copy phase; one still being mapped
    ahead when the snapshot needs it is waited for there (that wait counts as "map")."""

    def __init__(self, ck):
        import threading

        self.acc = 0.0
        orig = ck._maps.get

        def get(path, writable):
            if not threading.current_thread().name.startswith("ucpd-snapshot"):
                return orig(path, writable)  # the mapping ahead, between snapshots
            t0 = time.perf_counter()
            try:
                return orig(path, writable)
            finally:
                self.acc += time.perf_counter() - t0

        ck._maps.get = get

    def take(self) -> float:
        v, self.acc = self.acc, 0.0
        return v


def proc_cpu() -> float:
    """user + system CPU seconds of this process, every thread."""
    t = os.times()
    return t.user + t.system


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def snap_once(ck, step: int, state: dict, maps: MapTimer | None = None) -> dict:
    """One snapshot: the call, until staged, until committed, and the worker's split."""
    state["step"] = step
    if maps is not None:
        maps.take()
    wall, tm = timed_snapshot(ck, step, state)
    c0 = tm["called"]
    mapped = maps.take() if maps is not None else 0.0
    return {
        "map": mapped,  # mapping the slot (first use of a slot file), inside "copy"
        "step": step,
        "call": wall["call"],
        "staged": tm["staged"] - c0,
        "committed": tm["committed"] - c0,
        "begin": tm["slot"] - tm["returned"],  # queue + begin RPC (slot lent; allocation if none free)
        "copy": tm["staged"] - tm["slot"],  # copy + CRC into the slot
        "commit_rpc": tm["sealed"] - tm["staged"],  # manifest + commit RPC
        "wait_rpc": tm["committed"] - tm["sealed"],
    }


def slot_summary(ck) -> dict:
    st = ck.status()
    out = {}
    for k in ("slots", "memory", "flush"):
        if k in st:
            out[k] = st[k]
    return out


def loop_scene(st: State, floor: Floor, gap: float, warm: int, extra_flags: list[str] | None, tag: str,
               cold_touch: bool) -> dict:
    """Fresh daemon; 3 cold snapshots; ``warm`` cycles of gap/snapshot/gap/floor."""
    from ucpd_client import Checkpointer

    out: dict = {"flags": extra_flags or []}
    if cold_touch:
        out["touch_before"] = first_touch(st.nbytes, floor)
        log(f"[{tag}] first touch of fresh shm: {', '.join(f'{k} {fmt_seconds(v)}' for k, v in out['touch_before'].items())}")
    daemon = start_daemon(PREFIX, tag, extra_flags or [])  # default flags: only its private dirs
    # full copies: the state does not change between these snapshots (bench_incremental.py measures references)
    ck = Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, job=BENCH_JOB, incremental=False)
    maps = MapTimer(ck)
    state = st.nested
    step = 0
    try:
        cold = []
        for _ in range(KEEP_DEFAULT + 1):
            time.sleep(gap)
            step += 1
            cold.append(snap_once(ck, step, state, maps))
        out["cold"] = cold
        log(f"[{tag}] cold snapshots (committed): {', '.join(fmt_seconds(c['committed']) for c in cold)}; "
            f"staged {', '.join(fmt_seconds(c['staged']) for c in cold)}")
        # Settling: once keep+1 slots rotate, the daemon still prepares a spare (the rank has no
        # free slot after the next begin) and faults it in on a thread while the next snapshots
        # copy. Keep snapshotting in the same rhythm until no slot is being allocated (a slot
        # reserved for allocation shows as "writing" between snapshots); those are reported apart.
        settle = []
        for _ in range(6):
            time.sleep(gap)
            step += 1
            settle.append(snap_once(ck, step, state, maps))
            slots = (ck.status().get("slots") or {})
            settle[-1]["slots"] = slots
            if not slots.get("writing"):
                break
        out["settle"] = settle
        log(f"[{tag}] settling snapshots (committed): {', '.join(fmt_seconds(c['committed']) for c in settle)}; "
            f"slots then {settle[-1]['slots']}")
        floor.copy(1)  # warm the floor's code path once
        snaps, floors, floors2, crcs = [], [], [], []
        cpu0, wall0 = cpu_seconds(daemon.pid), time.perf_counter()
        for _ in range(warm):
            time.sleep(gap)
            step += 1
            snaps.append(snap_once(ck, step, state, maps))
            time.sleep(gap)
            floors.append(floor.copy(1))
            floors2.append(floor.copy(2))
            crcs.append(floor.copy_crc())
        out["daemon_cpu_per_snapshot"] = (cpu_seconds(daemon.pid) - cpu0) / warm
        out["warm_wall"] = time.perf_counter() - wall0
        floor.check()
        out["warm"] = snaps
        out["floor_1t"] = floors
        out["copy_2t"] = floors2
        out["copy_crc"] = crcs
        out["status"] = slot_summary(ck)
        if extra_flags and "--flush-dir" in extra_flags:
            # let the last due flush finish, so its figures are in the log
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                fl = ck.status().get("flush") or {}
                if fl.get("step") is None:
                    break
                time.sleep(0.05)
            out["flush_status"] = ck.status().get("flush")
    finally:
        ck.close()
        out["daemon_log"] = [ln for ln in daemon.stop() if "flush" in ln or "WARN" in ln or "ERROR" in ln][-40:]
    if cold_touch:
        out["touch_after"] = first_touch(st.nbytes, None)
    return out


def summarize_loop(sc: dict, flush_every: int | None = None) -> dict:
    floor = median(sc["floor_1t"])
    w = sc["warm"]
    s = {
        "floor_1t": floor,
        "copy_2t": median(sc["copy_2t"]),
        "copy_crc": median(sc["copy_crc"]),
        "daemon_cpu_per_snapshot": sc["daemon_cpu_per_snapshot"],
        "call": median([x["call"] for x in w]),
        "staged": median([x["staged"] for x in w]),
        "committed": median([x["committed"] for x in w]),
        "split": {k: median([x[k] for x in w]) for k in ("begin", "map", "copy", "commit_rpc", "wait_rpc")},
        "staged_max": max(x["staged"] for x in w),
        "committed_max": max(x["committed"] for x in w),
    }
    s["staged_x"] = s["staged"] / floor
    s["committed_x"] = s["committed"] / floor
    s["staged_max_x"] = s["staged_max"] / floor
    s["committed_max_x"] = s["committed_max"] / floor
    if flush_every:
        # a flush starts when step k*flush_every commits; the next few snapshots overlap it
        near = [x for x in w if x["step"] % flush_every in (0, 1, 2, 3)]
        if near:
            s["near_flush"] = {
                "steps": [x["step"] for x in near],
                "staged": [x["staged"] for x in near], "committed": [x["committed"] for x in near],
                "split": [{k: x[k] for k in ("begin", "copy", "commit_rpc")} for x in near],
            }
    cold = sc["cold"]
    s["cold_committed"] = [c["committed"] for c in cold]
    s["cold_staged"] = [c["staged"] for c in cold]
    s["cold_split"] = [{k: c[k] for k in ("begin", "map", "copy", "commit_rpc")} for c in cold]
    s["settle_committed"] = [c["committed"] for c in sc.get("settle", [])]
    if "touch_before" in sc:
        touch = median([sc["touch_before"]["fallocate_touch"], sc["touch_after"]["fallocate_touch"]])
        s["touch"] = touch
        s["touch_copy_1t"] = sc["touch_before"].get("copy_into_fresh_1t")
        s["first_x_touch"] = cold[0]["committed"] / touch
        s["second_x_floor"] = cold[1]["committed"] / floor
    return s


# ------------------------------------------------------------------------------------------------
# (c) training: the example GPT


def gpt_trainer(args):
    from examples.gpt.model import GPTConfig
    from examples.gpt.trainer import RunSpec, TrainConfig, Trainer

    cfg = GPTConfig(vocab_size=args.gpt_vocab, hidden=args.gpt_hidden, heads=8, kv_heads=4, ffn=4 * args.gpt_hidden,
                    layers=args.gpt_layers, seq_len=args.gpt_seq, dropout=0.1)
    spec = RunSpec(model=cfg, train=TrainConfig(steps=10**9, global_batch=args.gpt_batch, micro_batch=max(1, args.gpt_batch // 2),
                                                 dataset_size=512))
    return Trainer(spec, 0)


def train_scene(args) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from ucpd_client import Checkpointer

    tr = gpt_trainer(args)
    state, placements = tr.state()
    tensors = list(state["model"].values()) + [state["optim"]["exp_avg"], state["optim"]["exp_avg_sq"]]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    n_params = sum(p.numel() for _, p in tr.params)
    log(f"[train] example GPT: {n_params / 1e6:.1f} M parameters, state {nbytes / MiB:.0f} MiB in {len(tensors)} tensors, "
        f"{torch.get_num_threads()} torch threads")
    daemon = start_daemon(PREFIX, "train")
    ck = Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, job=BENCH_JOB + "-gpt")
    d = private_dir(PREFIX, "train-peers")
    dcp_dir = os.path.join(d, "dcp")
    pt_path = os.path.join(d, "state.pt")
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=True,
                                          use_non_blocking_copy=False))
    pending = {"ucpd": None, "dcp": None}

    def checkpoint(method: str) -> float:
        """Take this step's checkpoint; returns the seconds the call blocked."""
        state, placements = tr.state()
        t0 = time.perf_counter()
        if method == "ucpd":
            pending["ucpd"] = ck.snapshot(tr.step, state, placements=placements)
        elif method == "dcp":
            if pending["dcp"] is not None:
                pending["dcp"].upload_completion.result()  # one save in flight at a time
            pending["dcp"] = dcp.async_save(state, checkpoint_id=dcp_dir, async_stager=stager, no_dist=True)
        elif method == "torch.save":
            torch.save(state, pt_path)
        return time.perf_counter() - t0

    blocked = [0.0]

    def before_update(method: str):
        def timed(fn):
            def hook():
                t0 = time.perf_counter()
                fn()
                blocked[0] += time.perf_counter() - t0
            return hook

        if method == "ucpd" and pending["ucpd"] is not None:
            return timed(lambda: pending["ucpd"].staged(120))
        if method == "dcp" and pending["dcp"] is not None:
            return timed(lambda: pending["dcp"].staging_completion.result())
        return None

    def finish(method: str) -> None:
        if method == "ucpd" and pending["ucpd"] is not None:
            pending["ucpd"].wait(120)
        if method == "dcp" and pending["dcp"] is not None:
            pending["dcp"].upload_completion.result()
        pending["ucpd"] = pending["dcp"] = None

    methods = ["none", "ucpd", "dcp", "torch.save"]
    rec: dict[str, dict[str, list]] = {m: {"step": [], "call": [], "train": [], "blocked": [], "cpu": []} for m in methods}
    handles = []  # (ucpd) the worker's split of each counted snapshot
    try:
        # warm-up: the first steps of the model, the daemon's slots (keep + 1 snapshots), DCP's
        # shared-memory staging buffers and its writer, torch.save's file
        for m in ["none", "ucpd", "ucpd", "ucpd", "ucpd", "dcp", "dcp", "torch.save"]:
            hook = before_update(m)
            tr.train_step(before_update=hook)
            checkpoint(m)
        for m in methods:
            finish(m)
        log("[train] warm-up done")
        cpu0 = cpu_seconds(daemon.pid)
        for r in range(args.train_rounds):
            order = methods[r % len(methods):] + methods[: r % len(methods)]
            for m in order:
                for i in range(args.train_steps + 1):
                    blocked[0] = 0.0
                    c0 = proc_cpu() + cpu_seconds(daemon.pid)
                    t0 = time.perf_counter()
                    tr.train_step(before_update=before_update(m))
                    t1 = time.perf_counter()
                    call = checkpoint(m)
                    t2 = time.perf_counter()
                    # CPU seconds of this process (the trainer, the snapshot worker's copy threads,
                    # DCP's threads) and of the daemon during the step: far less sensitive to the
                    # other jobs on the machine than wall time; the cost of work that finishes
                    # after the step lands in the next step's figure
                    cpu = proc_cpu() + cpu_seconds(daemon.pid) - c0
                    if i:
                        rec[m]["cpu"].append(cpu)  # the first step of a block overlaps no earlier checkpoint
                        rec[m]["step"].append(t2 - t0)
                        rec[m]["train"].append(t1 - t0)
                        rec[m]["call"].append(call)
                        rec[m]["blocked"].append(blocked[0])
                        if m == "ucpd":
                            handles.append(pending["ucpd"])
                finish(m)
            log(f"[train] round {r + 1}: " + ", ".join(f"{m} {fmt_seconds(median(rec[m]['step']))}" for m in methods))
        cpu_per_snap = (cpu_seconds(daemon.pid) - cpu0) / (args.train_rounds * (args.train_steps + 1))
    finally:
        ck.close()
        stager.close()
        daemon.stop()
        shutil.rmtree(d, ignore_errors=True)
    daemon_cpu = cpu_per_snap
    base = median(rec["none"]["step"])
    per_round = {m: [] for m in methods}  # each round's block median / the same round's no-checkpoint median
    k = args.train_steps
    for r in range(args.train_rounds):
        b = median(rec["none"]["step"][r * k:(r + 1) * k])
        for m in methods:
            per_round[m].append(median(rec[m]["step"][r * k:(r + 1) * k]) / b)
    splits = []
    for h in handles:
        tm = h.timings
        if "committed" in tm or "sealed" in tm:
            splits.append({"begin": tm["slot"] - tm["returned"], "copy": tm["staged"] - tm["slot"],
                           "commit_rpc": tm["sealed"] - tm["staged"]})
    out = {"params": n_params, "state_bytes": nbytes, "tensors": len(tensors), "torch_threads": torch.get_num_threads(),
           "config": {k: getattr(args, k) for k in ("gpt_hidden", "gpt_layers", "gpt_vocab", "gpt_seq", "gpt_batch")},
           "raw": rec, "base_step": base, "daemon_cpu": daemon_cpu,
           "ucpd_split": {k: median([x[k] for x in splits]) for k in ("begin", "copy", "commit_rpc")} if splits else None}
    for m in methods:
        out[m] = {"step": median(rec[m]["step"]), "train": median(rec[m]["train"]), "call": median(rec[m]["call"]),
                  "blocked": median(rec[m]["blocked"]), "cpu": median(rec[m]["cpu"]),
                  "cpu_pct": (median(rec[m]["cpu"]) / median(rec["none"]["cpu"]) - 1) * 100, "paired_pct": (median(per_round[m]) - 1) * 100,
                  "paired_rounds": per_round[m], "slowdown_pct": (median(rec[m]["step"]) / base - 1) * 100, "n": len(rec[m]["step"])}
    return out


# ------------------------------------------------------------------------------------------------
# report


def ok(flag: bool) -> str:
    return "met" if flag else "NOT MET"


def targets_of(run: dict) -> list[dict]:
    t = []
    a, b, c = run.get("idle"), run.get("flush"), run.get("train")
    if a:
        t.append({"target": "(a) staged <= 1.0x floor", "value": a["staged_x"], "limit": 1.0, "met": a["staged_x"] <= 1.0})
        t.append({"target": "(a) committed <= 1.2x floor", "value": a["committed_x"], "limit": 1.2, "met": a["committed_x"] <= 1.2})
        t.append({"target": "first snapshot <= 1.5x first-touch of fresh shm", "value": a["first_x_touch"], "limit": 1.5,
                  "met": a["first_x_touch"] <= 1.5})
        t.append({"target": "second snapshot warm (committed <= 1.2x floor)", "value": a["second_x_floor"], "limit": 1.2,
                  "met": a["second_x_floor"] <= 1.2})
    if b:
        t.append({"target": "(b) flush every 10: staged <= 1.2x floor", "value": b["staged_x"], "limit": 1.2, "met": b["staged_x"] <= 1.2})
        t.append({"target": "(b) flush every 10: committed <= 1.5x floor", "value": b["committed_x"], "limit": 1.5,
                  "met": b["committed_x"] <= 1.5})
    if c:
        v = c["ucpd"].get("paired_pct", c["ucpd"]["slowdown_pct"])
        t.append({"target": f"(c) GPT step ({fmt_seconds(c['base_step'])}) slowed < 3% by ucpd every step", "value": v, "limit": 3.0,
                  "met": v < 3.0 and c["base_step"] >= 0.5})
    return t


def print_run(i: int, run: dict, st_bytes: int) -> None:
    print(f"\n--- run {i + 1} (load at start {run['loadavg']}) ---")
    rows = []
    for key, title in (("idle", "(a) idle gap, default flags"), ("flush", "(b) --flush-dir --flush-every 10")):
        s = run.get(key)
        if not s:
            continue
        f = s["floor_1t"]
        rows.append([f"{title}: floor, 1-thread memcpy", fmt_seconds(f), "1.00x", f"{st_bytes / f / 1e9:.1f} GB/s"])
        rows.append([f"{title}: 2-thread copy (reference)", fmt_seconds(s["copy_2t"]), f"{s['copy_2t'] / f:.2f}x", ""])
        rows.append([f"{title}: ucpd's copy+CRC path into the warm floor buffer (reference)", fmt_seconds(s["copy_crc"]),
                     f"{s['copy_crc'] / f:.2f}x", ""])
        rows.append([f"{title}: snapshot() call", fmt_seconds(s["call"]), "", f"daemon CPU {fmt_seconds(s['daemon_cpu_per_snapshot'])}/snapshot"])
        rows.append([f"{title}: staged", fmt_seconds(s["staged"]), f"{s['staged_x']:.2f}x", f"max {s['staged_max_x']:.2f}x"])
        rows.append([f"{title}: committed", fmt_seconds(s["committed"]), f"{s['committed_x']:.2f}x", f"max {s['committed_max_x']:.2f}x"])
        sp = s["split"]
        rows.append([f"{title}: split begin / map / copy(incl. map) / commit / wait",
                     " / ".join(fmt_seconds(sp[k]) for k in ("begin", "map", "copy", "commit_rpc", "wait_rpc")), "", ""])
        if s.get("near_flush"):
            nf = s["near_flush"]
            rows.append([f"{title}: snapshots right after a flush started (steps {nf['steps']})",
                         "committed " + ", ".join(fmt_seconds(x) for x in nf["committed"]),
                         ", ".join(f"{x / f:.2f}x" for x in nf["committed"]), ""])
        rows.append([f"{title}: cold #1/#2/#3 committed", " / ".join(fmt_seconds(x) for x in s["cold_committed"]),
                     " / ".join(f"{x / f:.1f}x" for x in s["cold_committed"]), ""])
        if s.get("settle_committed"):
            rows.append([f"{title}: settling (the daemon faults in a spare slot) committed",
                         " / ".join(fmt_seconds(x) for x in s["settle_committed"]),
                         " / ".join(f"{x / f:.1f}x" for x in s["settle_committed"]), ""])
        for j, c in enumerate(s["cold_split"]):
            rows.append([f"{title}: cold #{j + 1} begin / map / copy(incl. map) / commit",
                         " / ".join(fmt_seconds(c[k]) for k in ("begin", "map", "copy", "commit_rpc")), "", ""])
        if "touch" in s:
            rows.append([f"{title}: first touch of fresh shm (fallocate + touch; copy into fresh, 1t)",
                         f"{fmt_seconds(s['touch'])}; {fmt_seconds(s['touch_copy_1t'])}", f"{s['touch'] / f:.1f}x", ""])
            rows.append([f"{title}: cold #1 / first touch", "", f"{s['first_x_touch']:.2f}x", ""])
    print(table(["what", "median", "x floor", "note"], rows))
    c = run.get("train")
    if c:
        print(f"\n(c) example GPT, {c['params'] / 1e6:.1f} M params, state {c['state_bytes'] / MiB:.0f} MiB, {c['tensors']} tensors, "
              f"{c['torch_threads']} torch threads")
        print(table(["method", "step (median)", "slowdown (medians)", "slowdown (median of per-round pairs)", "train part",
                     "of it: waiting for staging", "checkpoint call", "CPU s/step (+ vs none)", "n"],
                    [[m, fmt_seconds(c[m]["step"]), f"{c[m]['slowdown_pct']:+.1f}%", f"{c[m].get('paired_pct', float('nan')):+.1f}%",
                      fmt_seconds(c[m]["train"]),
                      fmt_seconds(c[m]["blocked"]), fmt_seconds(c[m]["call"]),
                      f"{c[m]['cpu']:.2f} ({c[m]['cpu_pct']:+.1f}%)" if "cpu" in c[m] else "-", str(c[m]["n"])] for m in ("none", "ucpd", "dcp", "torch.save")]))
        if c.get("ucpd_split"):
            print("ucpd snapshots during training, worker split (median): " + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in c["ucpd_split"].items())
                  + f"; daemon CPU {fmt_seconds(c['daemon_cpu'])} per snapshot")
    print("\ntargets")
    print(table(["target", "measured", "limit", ""],
                [[t["target"], f"{t['value']:.2f}" + ("%" if "slowed" in t["target"] else "x"), str(t["limit"]), ok(t["met"])] for t in run["targets"]]))


def print_spread(runs: list[dict]) -> None:
    if len(runs) < 2:
        return
    print(f"\n--- spread over {len(runs)} runs (min / median / max of each run's median ratio) ---")
    keys = [("idle", "staged_x", "(a) staged / floor"), ("idle", "committed_x", "(a) committed / floor"),
            ("idle", "first_x_touch", "cold #1 committed / first touch"), ("idle", "second_x_floor", "cold #2 committed / floor"),
            ("flush", "staged_x", "(b) staged / floor"), ("flush", "committed_x", "(b) committed / floor")]
    rows = []
    for scene, k, title in keys:
        xs = [r[scene][k] for r in runs if r.get(scene)]
        if xs:
            s = spread(xs)
            rows.append([title, f"{s['min']:.2f}x", f"{s['median']:.2f}x", f"{s['max']:.2f}x"])
    for m in ("ucpd", "dcp", "torch.save"):
        xs = [r["train"][m].get("paired_pct", r["train"][m]["slowdown_pct"]) for r in runs if r.get("train")]
        if xs:
            s = spread(xs)
            rows.append([f"(c) step slowdown, {m}", f"{s['min']:+.1f}%", f"{s['median']:+.1f}%", f"{s['max']:+.1f}%"])
        xs = [r["train"][m]["cpu_pct"] for r in runs if r.get("train") and "cpu_pct" in r["train"][m]]
        if xs:
            s = spread(xs)
            rows.append([f"(c) CPU per step (trainer + daemon), {m}", f"{s['min']:+.1f}%", f"{s['median']:+.1f}%", f"{s['max']:+.1f}%"])
    print(table(["what", "min", "median", "max"], rows))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1, help="repeat every scene this many times; report each run and the spread")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--gap", type=float, default=0.5, help="idle seconds before each snapshot and each floor copy")
    ap.add_argument("--warm", type=int, default=10, help="warm snapshots in (a), after keep+1 cold ones and the settling ones")
    ap.add_argument("--flush-warm", type=int, default=22, help="warm snapshots in (b) (flushes at steps 10, 20, ...)")
    ap.add_argument("--train-rounds", type=int, default=5)
    ap.add_argument("--train-steps", type=int, default=2, help="counted steps per method per round (one more is run)")
    ap.add_argument("--gpt-hidden", type=int, default=512)
    ap.add_argument("--gpt-layers", type=int, default=6)
    ap.add_argument("--gpt-vocab", type=int, default=16384)
    ap.add_argument("--gpt-seq", type=int, default=64)
    ap.add_argument("--gpt-batch", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="smoke test: 256 MiB, few reps, a small GPT")
    ap.add_argument("--skip-idle", action="store_true")
    ap.add_argument("--skip-flush", action="store_true")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", nargs="+", metavar="JSON", help="print the tables of earlier runs' JSON files (and their spread); runs nothing")
    args = ap.parse_args(argv)
    if args.report:
        import json

        runs, nbytes = [], None
        for path in args.report:
            with open(path) as f:
                d = json.load(f)
            runs += d["runs"]
            nbytes = d["state"]["bytes"]
        for i, run in enumerate(runs):
            print_run(i, run, nbytes)
        print_spread(runs)
        return 0
    if args.quick:
        args.size_gib, args.warm, args.flush_warm, args.train_rounds, args.train_steps = 0.25, 4, 11, 1, 2
        args.gpt_hidden, args.gpt_layers, args.gpt_vocab = 256, 2, 4096
        args.hidden = 384

    cleanup_on_exit()
    if not enough_shm(int(args.size_gib * GiB * 9)):
        return 2
    t_start = time.perf_counter()
    st = State(int(args.size_gib * GiB), hidden=getattr(args, "hidden", 768))
    log(f"state: {st.nbytes / GiB:.2f} GiB, {len(st.flat)} tensors (vocab {st.vocab}); gap {args.gap} s; "
        f"{torch.get_num_threads()} torch threads; copy threads {__import__('ucpd.knobs', fromlist=['x']).copy_threads()}")
    floor = Floor(st.flat)
    runs = []
    try:
        for i in range(args.runs):
            run: dict = {"loadavg": [round(x, 2) for x in os.getloadavg()]}
            if not args.skip_idle:
                raw = loop_scene(st, floor, args.gap, args.warm, None, "idle", cold_touch=True)
                run["idle"] = summarize_loop(raw)
                run["idle_raw"] = raw
                log(f"[idle] staged {run['idle']['staged_x']:.2f}x, committed {run['idle']['committed_x']:.2f}x floor "
                    f"({fmt_seconds(run['idle']['floor_1t'])})")
            if not args.skip_flush:
                fd = os.path.join(private_dir(PREFIX, "flush"), "flush")
                raw = loop_scene(st, floor, args.gap, args.flush_warm, ["--flush-dir", fd, "--flush-every", "10"], "flush",
                                 cold_touch=False)
                shutil.rmtree(os.path.dirname(fd), ignore_errors=True)
                run["flush"] = summarize_loop(raw, flush_every=10)
                run["flush_raw"] = raw
                log(f"[flush] staged {run['flush']['staged_x']:.2f}x, committed {run['flush']['committed_x']:.2f}x floor")
            if not args.skip_train:
                run["train"] = train_scene(args)
            run["targets"] = targets_of(run)
            runs.append(run)
            print_run(i, run, st.nbytes)
    finally:
        floor.close()
        cleanup()
    print(f"\nucpd training-loop benchmark: {st.nbytes / GiB:.2f} GiB, {len(st.flat)} tensors, gap {args.gap} s, "
          f"{args.runs} run(s); floor = 1-thread memcpy into a warm buffer, interleaved")
    print_spread(runs)
    print("\n(the machine is shared with other jobs and noisy: compare ratios of the same run)")
    out = {
        "benchmark": "loop", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "args": vars(args),
        "state": {"bytes": st.nbytes, "tensors": len(st.flat), "vocab": st.vocab},
        "runs": runs, "wall_seconds": time.perf_counter() - t_start,
    }
    write_json(args.json, out)
    log(f"done in {out['wall_seconds']:.0f} s" + (f"; JSON in {args.json}" if args.json else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
