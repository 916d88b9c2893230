"""Weight refit for RL from ucpd's RAM copy: one copy, two consumers.

A 2-node team of daemons on loopback; a trainer of 2 ranks (rank r on node r) holds every
weight of a small fused transformer as dim-0 shards (FSDP's layout: rank r holds rows
[r*n/2, (r+1)*n/2)), updates the weights every step and snapshots them (with Adam-like moments
the rollouts never read). Two rollout processes run the model in another layout — tensor
parallel 2 over fused QKV and gate/up projections, a row-parallel down projection, a vocabulary
padded for TP, in bf16 — rollout r talking to node r's daemon (rollout 1's bytes from node 0
cross the team). Each rollout subscribes, pulls every version it is told of while the trainer
goes on, and checks what it got against the trainer's rule. Rollout 1 is SIGKILLed after its
second version and started again: it catches up from ``latest()``.

    python examples/rl/refit.py [--steps 6] [--work DIR]

Prints one line per pulled version and exits 0 when both rollouts hold the last step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import torch

LAYERS, H, HEADS, KV_HEADS, HD, F, VOCAB, VOCAB_PAD = 2, 64, 8, 2, 8, 128, 1000, 1024
Q, KV = HEADS * HD, KV_HEADS * HD
JOB = "rl-refit"
HERE = os.path.dirname(os.path.abspath(__file__))


# --- the model and the trainer's rule -------------------------------------------------------------

def shapes() -> dict[str, tuple[int, ...]]:
    out = {"embed.weight": (VOCAB, H)}
    for i in range(LAYERS):
        out[f"layers.{i}.attn.qkv.weight"] = (Q + 2 * KV, H)  # fused [q; k; v]
        out[f"layers.{i}.mlp.gate_up.weight"] = (2 * F, H)  # fused [gate; up]
        out[f"layers.{i}.mlp.down.weight"] = (H, F)
    return out


def weights_at(step: int) -> dict[str, torch.Tensor]:
    """The trainer's full weights after ``step`` updates (what every rollout must hold)."""
    out = {}
    for j, (name, shape) in enumerate(shapes().items()):
        g = torch.Generator().manual_seed(j)
        w0, target = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        out[name] = w0 + (target - w0) * (1 - 0.9 ** step)  # w <- w - 0.1 * (w - target), step times
    return out


def rollout_layout(r: int, tp: int = 2) -> tuple[dict, dict]:
    """Rank r of a TP ``tp`` rollout engine: its empty bf16 tensors and their placements."""
    from ucpd_client import placement as P

    into, placements = {}, {}
    for name, shape in shapes().items():
        if name == "embed.weight":
            into[name], placements[name] = torch.zeros(VOCAB_PAD // tp, H, dtype=torch.bfloat16), P.Padded(0, VOCAB, P.Shard(0, r, tp))
        elif "qkv" in name:
            into[name], placements[name] = torch.empty((Q + 2 * KV) // tp, H, dtype=torch.bfloat16), P.Fused(0, (Q, KV, KV), P.Shard(0, r, tp))
        elif "gate_up" in name:
            into[name], placements[name] = torch.empty(2 * F // tp, H, dtype=torch.bfloat16), P.Fused(0, (F, F), P.Shard(0, r, tp))
        else:  # down: row parallel
            into[name], placements[name] = torch.empty(H, F // tp, dtype=torch.bfloat16), P.Shard(1, r, tp)
    return into, placements


def expected_rollout(step: int, r: int, tp: int = 2) -> dict[str, torch.Tensor]:
    out = {}
    for name, w in weights_at(step).items():
        if name == "embed.weight":
            w = torch.cat([w, torch.zeros(VOCAB_PAD - VOCAB, H)]).chunk(tp)[r]
        elif "qkv" in name:
            w = torch.cat([p.chunk(tp)[r] for p in w.split((Q, KV, KV))])
        elif "gate_up" in name:
            w = torch.cat([p.chunk(tp)[r] for p in w.split((F, F))])
        else:
            w = w.chunk(tp, dim=1)[r]
        out[name] = w.bfloat16()
    return out


# --- the processes ---------------------------------------------------------------------------------

def event(work: str, **e) -> None:
    with open(os.path.join(work, "events.jsonl"), "a") as f:
        f.write(json.dumps({"t": time.time(), **e}) + "\n")


def trainer(args) -> None:
    from ucpd_client import Checkpointer, placement as P

    r, world = args.rank, 2
    with Checkpointer(args.run_dirs.split(",")[r], rank=r, world_size=world, job=JOB, embedded=False,
                      local_world_size=1) as ckpt:
        for step in range(1, args.steps + 1):
            model = {n: w.chunk(world)[r].clone() for n, w in weights_at(step).items()}
            optim = {f"{n}.exp_avg": torch.full_like(w, 0.1 * step) for n, w in model.items()}
            placements = {f"model.{n}": P.Shard(0, r, world) for n in model}
            placements.update({f"optim.{n}": P.Shard(0, r, world) for n in optim})
            ckpt.snapshot(step, {"model": model, "optim": optim, "step": step}, placements=placements).wait(timeout=60)
            event(args.work, who=f"trainer{r}", step=step)
            time.sleep(args.pause)  # the trainer goes on; rollouts pull meanwhile


def rollout(args) -> None:
    from ucpd_client import Weights

    r = args.rank
    into, placements = rollout_layout(r)
    names = {n: f"model.{n}" for n in into}
    with Weights(job=JOB, run_dir=args.run_dirs.split(",")[r]) as w, w.subscribe() as sub:
        step = w.latest()  # a restarted rollout catches up first
        pulled = 0  # a notice of a version latest() already gave (it committed as we subscribed) is skipped
        while True:
            if step is not None and step > pulled:
                w.pull(step, into, placements=placements, names=names)
                pulled = step
                want = expected_rollout(step, r)
                bad = [n for n in into if not torch.equal(into[n], want[n])]
                event(args.work, who=f"rollout{r}", step=step, ok=not bad, bad=bad, warm=w.last_pull["warm"],
                      buckets=w.last_pull["buckets"], pid=os.getpid())
                print(f"rollout {r} (pid {os.getpid()}): step {step} {'ok' if not bad else f'WRONG {bad}'}", flush=True)
                if step >= args.steps:
                    return
            step = sub.next(timeout=60)
            if step is None:
                raise SystemExit(f"rollout {r}: no new version within 60 s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_events(work: str) -> list[dict]:
    try:
        with open(os.path.join(work, "events.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def wait_for(work: str, cond, what: str, timeout: float, procs=()) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ev = read_events(work)
        if cond(ev):
            return ev
        for p in procs:
            if p.poll() not in (None, 0):
                raise RuntimeError(f"{what}: a process exited with {p.returncode}")
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not within {timeout} s")


def scene(work: str, steps: int = 6, shm_prefix: str | None = None, timeout: float = 120.0) -> list[dict]:
    """Run the scene in ``work``; returns its events (the rollouts' pulls and the trainer's steps)."""
    os.makedirs(work, exist_ok=True)
    shm_prefix = shm_prefix or f"/dev/shm/ucpd-rl-{uuid.uuid4().hex[:8]}"
    addrs = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    run_dirs = [os.path.join(work, f"node{i}") for i in range(2)]
    env = {**os.environ, "UCPD_JOB": JOB}
    procs: list[subprocess.Popen] = []
    log = open(os.path.join(work, "scene.log"), "ab")

    def start(*cmd) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, *cmd], stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env)
        procs.append(p)
        return p

    def me(role: str, rank: int) -> list[str]:
        return [os.path.abspath(__file__), role, "--rank", str(rank), "--steps", str(steps), "--work", work,
                "--run-dirs", ",".join(run_dirs)]

    try:
        for i in range(2):
            start("-m", "ucpd", "serve", "--run-dir", run_dirs[i], "--shm-dir", f"{shm_prefix}-node{i}", "--nodes", "2",
                  "--node-rank", str(i), "--peers", ",".join(addrs), "--mem-limit", "1G", "--keep", "2",
                  "--replicas", "1", "--heartbeat", "0.1", "--dead-after", "1.5")
        deadline = time.monotonic() + 30
        while not all(os.path.exists(os.path.join(d, "ucpd.sock")) for d in run_dirs):
            if time.monotonic() > deadline:
                raise TimeoutError("the daemons did not start")
            time.sleep(0.05)
        rollouts = [start(*me("rollout", r)) for r in range(2)]
        trainers = [start(*me("trainer", r)) for r in range(2)]
        pulled = lambda who, n: lambda ev: len([e for e in ev if e.get("who") == who and "ok" in e]) >= n  # noqa: E731
        wait_for(work, pulled("rollout1", 2), "rollout 1's second version", timeout, procs)
        rollouts[1].send_signal(signal.SIGKILL)  # a rollout engine dies mid-run ...
        rollouts[1].wait()
        procs.remove(rollouts[1])
        event(work, who="scene", killed="rollout1")
        rollouts[1] = start(*me("rollout", 1))  # ... and comes back
        for p in (*trainers, *rollouts):
            left = max(1.0, timeout - 1)
            if p.wait(left) != 0:
                raise RuntimeError(f"a process of the scene exited with {p.returncode}; see {work}/scene.log")
        return read_events(work)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
        for i in range(2):
            shutil.rmtree(f"{shm_prefix}-node{i}", ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", nargs="?", default="scene", choices=["scene", "trainer", "rollout"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--work", default=None)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--run-dirs", default="")
    ap.add_argument("--pause", type=float, default=0.3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.role == "trainer":
        trainer(args)
        return 0
    if args.role == "rollout":
        rollout(args)
        return 0
    work = args.work or tempfile.mkdtemp(prefix="ucpd-rl-")
    events = scene(work, args.steps)
    for e in events:
        if e["who"].startswith("rollout"):
            print(f"{e['who']} pid {e['pid']}: step {e['step']} {'ok' if e['ok'] else 'WRONG'} "
                  f"({e['buckets']} buckets, {e['warm']} warm)")
    bad = [e for e in events if e.get("ok") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
