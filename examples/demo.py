"""The main job: a tensor+data-parallel training run loses its ranks and resumes, from RAM,
on a different parallel layout — then proves the result matches a run that never failed.

    make demo        (or: .venv/bin/python examples/demo.py [--steps 40] [--fail-at 25])

1. Starts a node daemon (`ucpd serve`) with a flush directory.
2. Trains a small two-layer model with 4 gloo ranks, TP=2 x DP=2 (column-parallel first layer,
   row-parallel second, Adam), snapshotting every step with `Checkpointer.snapshot()`.
3. SIGKILLs every trainer in the middle of the run (the node is lost to training).
4. Restarts the job with 3 ranks, TP=1 x DP=3: each restores the newest committed version from
   the daemon's RAM, resharded to its own layout, and trains on.
5. Checks the final weights against an uninterrupted single-process run on the same data.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

D_IN, D_FF, D_OUT, BATCH = 32, 64, 8, 24


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: the same whatever the layout."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, D_IN, generator=g)
    y = torch.sin(x[:, :D_OUT] * 2.0) + 0.1 * torch.randn(BATCH, D_OUT, generator=g)
    return x, y


def init_global() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "fc1.weight": torch.randn(D_FF, D_IN, generator=g) * 0.2,
        "fc1.bias": torch.zeros(D_FF),
        "fc2.weight": torch.randn(D_OUT, D_FF, generator=g) * 0.2,
        "fc2.bias": torch.zeros(D_OUT),
    }


def layout(tp: int, tp_rank: int):
    """Megatron-style: fc1 column-parallel (rows split), fc2 row-parallel (columns split)."""
    from ucpd_client import placement as P

    return {
        "fc1.weight": P.Shard(0, tp_rank, tp),
        "fc1.bias": P.Shard(0, tp_rank, tp),
        "fc2.weight": P.Shard(1, tp_rank, tp),
        "fc2.bias": P.Replicated(),
    }


class _ReduceFromTP(torch.autograd.Function):
    """Sum partial outputs across the tensor-parallel group; the gradient passes through as is."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Model:
    def __init__(self, params: dict[str, torch.Tensor], tp_group):
        self.p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        self.tp_group = tp_group

    def loss(self, x, y):
        h = torch.relu(x @ self.p["fc1.weight"].T + self.p["fc1.bias"])
        out = h @ self.p["fc2.weight"].T
        if self.tp_group is not None:
            out = _ReduceFromTP.apply(out, self.tp_group)
        out = out + self.p["fc2.bias"]
        return ((out - y) ** 2).mean()


def full_state(step, model, opt, placements):
    """The trainer's state dict: weights, Adam moments (same placement as their weight), step."""
    state = {"model": dict(model.p), "optim": {}, "step": step, "rng": torch.get_rng_state()}
    pl = {}
    for name, p in model.p.items():
        s = opt.state[p]
        state["optim"][name] = {"exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"], "step": s["step"]}
        pl[f"model.{name}"] = placements[name]
        pl[f"optim.{name}.exp_avg"] = placements[name]
        pl[f"optim.{name}.exp_avg_sq"] = placements[name]
    return state, pl


def trainer(rank, world, tp, run_dir, port, first_step, last_step, progress):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from ucpd_client import Checkpointer

    dp = world // tp
    tp_rank, dp_rank = rank % tp, rank // tp
    tp_groups = [dist.new_group([d * tp + t for t in range(tp)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * tp + t for d in range(dp)]) for t in range(tp)]
    tp_group = tp_groups[dp_rank] if tp > 1 else None
    placements = layout(tp, tp_rank)
    ckpt = Checkpointer(run_dir, rank=rank, world_size=world, embedded=False)

    # Targets with this layout's local shapes; filled from the checkpoint or the initial weights.
    glob = init_global()
    local = {}
    for name, t in glob.items():
        pl = placements[name]
        local[name] = t.chunk(pl.parts, pl.dim)[pl.index].clone() if hasattr(pl, "parts") else t.clone()
    model = Model(local, tp_group)
    opt = torch.optim.Adam(model.p.values(), lr=3e-3)
    step = first_step
    if ckpt.latest() is not None:
        # Adam's state must exist before restore fills it in place: one zero-lr step creates it
        for p in model.p.values():
            p.grad = torch.zeros_like(p)
        opt.step()
        state, pl = full_state(0, model, opt, placements)
        t0 = time.perf_counter()
        restored = ckpt.restore(state, placements=pl)  # fills weights and Adam state in place
        step = restored + 1
        if rank == 0:
            progress.put(("restored", restored, time.perf_counter() - t0))
    guard = None
    while step <= last_step:
        x, y = data(step)
        xs, ys = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]
        opt.zero_grad()
        loss = model.loss(xs, ys)
        loss.backward()
        for p in model.p.values():
            dist.all_reduce(p.grad, group=dp_groups[tp_rank])
            p.grad /= dp
        if guard is None:
            guard = ckpt.guard(opt)  # optimizer.step waits until the last snapshot is staged
        opt.step()
        state, pl = full_state(step, model, opt, placements)
        t0 = time.perf_counter()
        h = ckpt.snapshot(step, state, placements=pl)
        call = time.perf_counter() - t0
        h.staged()
        if rank == 0:
            progress.put(("step", step, loss.item(), call))
        step += 1
    h.wait()
    if rank == 0:
        progress.put(("done", last_step))
    ckpt.close()
    dist.destroy_process_group()


def reference(steps: int) -> dict[str, torch.Tensor]:
    model = Model(init_global(), None)
    opt = torch.optim.Adam(model.p.values(), lr=3e-3)
    for step in range(1, steps + 1):
        x, y = data(step)
        opt.zero_grad()
        model.loss(x, y).backward()
        opt.step()
    return {k: v.detach() for k, v in model.p.items()}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(world, tp, run_dir, first, last, kill_after=None):
    ctx = mp.get_context("spawn")
    progress = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=trainer, args=(r, world, tp, run_dir, port, first, last, progress)) for r in range(world)]
    for p in procs:
        p.start()
    calls = []
    while True:
        msg = progress.get(timeout=300)
        if msg[0] == "restored":
            print(f"  restored step {msg[1]} from the daemon's RAM, resharded, in {msg[2] * 1e3:.1f} ms")
        elif msg[0] == "step":
            calls.append(msg[3])
            if msg[1] % 5 == 0:
                print(f"  step {msg[1]:3d}  loss {msg[2]:.4f}  snapshot() returned in {msg[3] * 1e3:.2f} ms")
            if kill_after is not None and msg[1] >= kill_after:
                time.sleep(0.2)
                for p in procs:
                    os.kill(p.pid, signal.SIGKILL)
                for p in procs:
                    p.join()
                print(f"  ** SIGKILL to all {world} trainers after step {msg[1]}: the job is down **")
                return calls
        elif msg[0] == "done":
            for p in procs:
                p.join()
            return calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fail-at", type=int, default=25)
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="ucpd-demo-")
    run_dir, flush_dir = os.path.join(work, "run"), os.path.join(work, "flush")
    shm_dir = f"/dev/shm/ucpd-demo-{os.getpid()}"
    daemon = subprocess.Popen(
        [sys.executable, "-m", "ucpd", "serve", "--run-dir", run_dir, "--shm-dir", shm_dir, "--flush-dir", flush_dir,
         "--flush-every", "10", "--mem-limit", "1G", "--keep", "2", "--log-level", "WARNING"],
    )
    try:
        while not os.path.exists(os.path.join(run_dir, "ucpd.sock")):
            if daemon.poll() is not None:
                raise SystemExit("the daemon did not start")
            time.sleep(0.05)
        print(f"[1] daemon up: run dir {run_dir}, shm {shm_dir}, flush dir {flush_dir}")
        print("[2] training with 4 ranks, TP=2 x DP=2, a snapshot every step")
        calls = run_job(4, 2, run_dir, 1, args.steps, kill_after=args.fail_at)
        calls.sort()
        print(f"    snapshot() call: median {calls[len(calls) // 2] * 1e3:.2f} ms over {len(calls)} steps")
        subprocess.run([sys.executable, "-m", "ucpd", "status", "--run-dir", run_dir], check=True)
        print("[3] restarting with 3 ranks, TP=1 x DP=3, restoring from RAM")
        run_job(3, 1, run_dir, 1, args.steps)
        print("[4] checking against an uninterrupted single-process run")
        ref = reference(args.steps)
        from ucpd_client import Checkpointer

        with Checkpointer(run_dir, rank=0, world_size=1, embedded=False) as ckpt:
            final = {"model": {k: torch.zeros_like(v) for k, v in ref.items()}}
            got_step = ckpt.restore(final)
        worst = max(float((final["model"][k] - ref[k]).abs().max()) for k in ref)
        print(f"    final step {got_step}: max |difference| to the reference = {worst:.2e}")
        ok = got_step == args.steps and worst < 1e-4
        print("demo OK: the run survived losing all its trainers and resumed on a new layout" if ok else "demo FAILED")
        return 0 if ok else 1
    finally:
        daemon.terminate()
        daemon.wait()
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
