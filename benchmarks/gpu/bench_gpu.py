#!/usr/bin/env python
"""ucpd on a GPU against the PCIe floor, in one run (``make gpu-check`` runs it).

    python benchmarks/gpu/bench_gpu.py [--size-gib 4] [--reps 5] [--small 10000] [--train-steps 20]
                                       [--skip-train] [--skip-dcp] [--quick] [--json OUT] [--allow-no-gpu]

A GPT-like state (per layer: norms, qkv, proj, fc1, fc2; bf16 weights, fp32 Adam moments) of
about ``--size-gib`` GiB on ``cuda:0``. Medians of ``--reps`` (spread min-max), each figure beside
the floor measured in the same run:

- floors: one pinned ``cudaMemcpy`` of the same bytes device->host and host->device (one flat
  copy and one per tensor; torch ``copy_(non_blocking=True)`` into/from ``pin_memory()``
  buffers), and the cost of page-locking that much fresh memory (``pin_memory()``);
- ucpd snapshot (a real ``ucpd serve``, default flags but its private dirs and a memory limit):
  the ``snapshot()`` call (the trainer blocked), until ``staged()``, until committed; the first
  snapshot of the job (cold slot) beside the pinning cost;
- restore into CUDA tensors, same layout (``UCPD_RESTORE_VERIFY=window``, the default, and
  ``all``) and resharded (every 2-D tensor's second half of columns, ``Shard(1, 1, 2)``), per
  byte against the host->device floor; ``last_device_restore`` (pageable bytes must be 0);
- ``--small`` tiny tensors (2 KiB each): call, staged, committed and restore per tensor;
- a training step of a bf16 MLP stack with and without a snapshot every step (``guard``);
- DCP ``async_save`` with a pinned asynchronous stager beside it (blocked / until staged / until
  done), and DCP ``load`` of the same state into CUDA tensors from page-cached local disk.

Without a CUDA device it says so and exits 2 (0 with ``--allow-no-gpu``): nothing here runs on
a CPU. Everything lives in private folders under /dev/shm and the temp dir, removed at exit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE.parents[1]))
try:  # an installed ucpd (make gpu-check: the build in its own folder), else this checkout
    import ucpd._native  # noqa: F401
except ImportError:
    sys.path[1:1] = [str(ROOT), str(ROOT / "client")]

from common import GiB, fmt_seconds, log, machine, spread, table, timed_snapshot, write_json  # noqa: E402
from daemons import cleanup_on_exit, private_dir, start_daemon  # noqa: E402

PREFIX = "ucpd-bench-gpu-"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=4.0, help="state size (GiB)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--small", type=int, default=10_000, help="how many 2 KiB tensors in the small-tensor case (0: skip)")
    ap.add_argument("--train-steps", type=int, default=20, help="counted steps per variant of the training case")
    ap.add_argument("--train-hidden", type=int, default=4096)
    ap.add_argument("--train-layers", type=int, default=16)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-dcp", action="store_true")
    ap.add_argument("--quick", action="store_true", help="smoke test: 0.25 GiB, 2 reps, 1,000 small tensors, a small model")
    ap.add_argument("--json", default=None)
    ap.add_argument("--allow-no-gpu", action="store_true", help="exit 0 (not 2) when there is no CUDA device")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_gib, args.reps, args.small, args.train_steps = 0.25, 2, 1000, 4
        args.train_hidden, args.train_layers = 1024, 4
    return args


# ------------------------------------------------------------------------------------------------
# the state and the floors


def gpt_state(torch, nbytes: int) -> dict:
    """bf16 weights + fp32 exp_avg/exp_avg_sq (10 bytes per parameter), sized to ``nbytes``."""
    params = nbytes // 10
    hidden = 1024
    while 12 * (hidden * 2) ** 2 * 8 < params:
        hidden *= 2
    layers = max(1, params // (12 * hidden * hidden))
    shapes = []
    for i in range(layers):
        shapes += [(f"l{i}.ln1", (hidden,)), (f"l{i}.qkv", (3 * hidden, hidden)), (f"l{i}.proj", (hidden, hidden)),
                   (f"l{i}.ln2", (hidden,)), (f"l{i}.fc1", (4 * hidden, hidden)), (f"l{i}.fc2", (hidden, 4 * hidden))]
    g = torch.Generator(device="cuda").manual_seed(0)
    model, optim = {}, {}
    for name, shape in shapes:
        model[name] = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
        optim[name] = {"exp_avg": torch.randn(shape, device="cuda", generator=g), "exp_avg_sq": torch.rand(shape, device="cuda", generator=g)}
    return {"model": model, "optim": optim}


def flat(state: dict) -> list:
    out = []
    for v in state.values():
        out += flat(v) if isinstance(v, dict) else [v]
    return out


def floors(torch, tensors: list, reps: int) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    views, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        views.append((t.view(-1).view(torch.uint8), host[off : off + n]))
        off += n
    out = {}

    def timed(fn) -> list[float]:
        xs = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            xs.append(time.perf_counter() - t0)
        return xs

    out["d2h_flat"] = spread(timed(lambda: host.copy_(dev, non_blocking=True)))
    out["d2h_per_tensor"] = spread(timed(lambda: [h.copy_(d, non_blocking=True) for d, h in views]))
    out["h2d_flat"] = spread(timed(lambda: dev.copy_(host, non_blocking=True)))
    out["h2d_per_tensor"] = spread(timed(lambda: [d.copy_(h, non_blocking=True) for d, h in views]))
    del host, dev, views
    pins = []
    for _ in range(min(reps, 3)):
        t0 = time.perf_counter()
        p = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        pins.append(time.perf_counter() - t0)
        del p
    out["pin_fresh"] = spread(pins)
    return out


# ------------------------------------------------------------------------------------------------
# ucpd


def serve(mem_limit: int):
    """A started ``ucpd serve`` (default flags but a memory limit), stopped at exit: the ucpd this
    Python imports (make gpu-check's build), not the checkout's."""
    return start_daemon(PREFIX, "serve", ["--mem-limit", str(mem_limit), "--log-level", "WARNING"], log=False, installed=True)


def snap(ck, step: int, state: dict) -> dict:
    """call, staged, committed: the caller's seconds."""
    return timed_snapshot(ck, step, state)[0]


def bench_ucpd(torch, state: dict, nbytes: int, reps: int, res: dict) -> None:
    from ucpd import knobs
    from ucpd_client import Checkpointer, placement as P

    d = serve(mem_limit=int(nbytes * 4.5) + (256 << 20))
    ck = Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False, job="bench-gpu")
    try:
        torch.cuda.synchronize()
        res["first_snapshot"] = snap(ck, 1, state)
        log(f"first snapshot: committed {fmt_seconds(res['first_snapshot']['committed'])}")
        runs = [snap(ck, 2 + i, state) for i in range(reps + 2)][2:]  # every slot of the rotation used once first
        for k in ("call", "staged", "committed"):
            res[f"snapshot_{k}"] = spread([r[k] for r in runs])
        last = 2 + reps + 1
        targets = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()},
                   "optim": {k: {m: torch.empty_like(x) for m, x in v.items()} for k, v in state["optim"].items()}}
        for mode in ("all", "window"):
            xs, stats = [], None
            with knobs.override(UCPD_RESTORE_VERIFY=mode):
                for _ in range(reps):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    ck.restore(targets, step=last)
                    xs.append(time.perf_counter() - t0)
                    stats = ck.last_device_restore
            res[f"restore_same_{mode}"] = spread(xs)
            res[f"restore_same_{mode}_stats"] = stats
        for name, t in state["model"].items():  # bit for bit
            if not torch.equal(targets["model"][name], t):
                raise SystemExit(f"restore returned wrong data for {name}")
        half, pl, half_bytes = {"model": {}, "optim": {}}, {}, 0
        for name, t in state["model"].items():
            if t.dim() == 2:
                cols = t.shape[1] // 2
                half["model"][name] = torch.empty(t.shape[0], cols, dtype=t.dtype, device="cuda")
                half["optim"][name] = {m: torch.empty(t.shape[0], cols, device="cuda") for m in ("exp_avg", "exp_avg_sq")}
                for key in (f"model.{name}", f"optim.{name}.exp_avg", f"optim.{name}.exp_avg_sq"):
                    pl[key] = P.Shard(1, 1, 2)
                half_bytes += t.shape[0] * cols * 10
        xs = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ck.restore(half, step=last, placements=pl)
            xs.append(time.perf_counter() - t0)
        res["restore_resharded"] = spread(xs)
        res["restore_resharded_bytes"] = half_bytes
        res["restore_resharded_stats"] = ck.last_device_restore
        name = next(iter(half["model"]))
        if not torch.equal(half["model"][name], state["model"][name][:, state["model"][name].shape[1] // 2 :]):
            raise SystemExit("resharded restore returned wrong data")
    finally:
        ck.close()


def bench_small(torch, n: int, reps: int, res: dict) -> None:
    from ucpd_client import Checkpointer

    state = {f"t{i}": torch.full((512,), float(i), device="cuda") for i in range(n)}
    d = serve(mem_limit=1 << 30)
    ck = Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False, job="bench-gpu-small")
    try:
        runs = [snap(ck, 1 + i, state) for i in range(reps + 3)][3:]
        for k in ("call", "staged", "committed"):
            res[f"small_{k}_per_tensor"] = spread([r[k] / n for r in runs])
        out = {k: torch.empty_like(v) for k, v in state.items()}
        xs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            ck.restore(out)
            xs.append((time.perf_counter() - t0) / n)
        res["small_restore_per_tensor"] = spread(xs)
    finally:
        ck.close()


def bench_train(torch, args, res: dict) -> None:
    from ucpd_client import Checkpointer

    layers = [torch.nn.Linear(args.train_hidden, args.train_hidden, bias=False) for _ in range(args.train_layers)]
    model = torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.GELU())]).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, 256, args.train_hidden, device="cuda", dtype=torch.bfloat16)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).float().pow(2).mean().backward()
        opt.step()

    for _ in range(3):
        step()
    res["train_state_bytes"] = sum(p.numel() * p.element_size() * 5 for p in model.parameters())
    d = serve(mem_limit=int(res["train_state_bytes"] * 4.5) + (256 << 20))
    ck = Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False, job="bench-gpu-train")
    hook = ck.guard(opt)
    try:
        ck.snapshot(0, {"model": model.state_dict(), "optim": opt.state_dict()}).wait()  # the first, cold: not counted
        for variant in ("none", "ucpd", "none", "ucpd"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(args.train_steps):
                step()
                if variant == "ucpd":
                    ck.snapshot(i + 1, {"model": model.state_dict(), "optim": opt.state_dict()})
            torch.cuda.synchronize()
            res.setdefault(f"train_step_{variant}", []).append((time.perf_counter() - t0) / args.train_steps)
        ck._last.wait()
    finally:
        hook.remove()
        ck.close()


def bench_dcp(torch, state: dict, reps: int, res: dict) -> None:
    import torch.distributed.checkpoint as dcp

    root = private_dir(PREFIX, "dcp", shm=False)
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = lambda: DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
                                                      use_non_blocking_copy=True))  # noqa: E731
    except ImportError as exc:
        res["dcp_async_save"] = f"unavailable in this torch: {exc}"
        stager = None
    if stager is not None:
        blocked, staged, done = [], [], []
        for i in range(reps):
            path = os.path.join(root, f"save-{i}")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            resp = dcp.async_save(state, checkpoint_id=path, async_stager=stager())
            t1 = time.perf_counter()
            fut = getattr(resp, "staging_completion", None)
            if fut is not None:
                fut.result()
            t2 = time.perf_counter()
            (getattr(resp, "upload_completion", None) or resp).result()
            t3 = time.perf_counter()
            blocked.append(t1 - t0)
            staged.append(t2 - t0)
            done.append(t3 - t0)
        res["dcp_async_save_blocked"], res["dcp_async_save_staged"], res["dcp_async_save_done"] = spread(blocked), spread(staged), spread(done)
    path = os.path.join(root, "plain")
    dcp.save(state, checkpoint_id=path)
    target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()},
              "optim": {k: {m: torch.empty_like(x) for m, x in v.items()} for k, v in state["optim"].items()}}
    xs = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dcp.load(target, checkpoint_id=path)
        torch.cuda.synchronize()
        xs.append(time.perf_counter() - t0)
    res["dcp_load"] = spread(xs)


# ------------------------------------------------------------------------------------------------


def report(res: dict, nbytes: int) -> list[list[str]]:
    rows = []
    fl = res["floors"]
    d2h, h2d = fl["d2h_flat"]["median"], fl["h2d_flat"]["median"]

    def row(what, key, floor=None, per=1.0):
        r = res.get(key)
        if not isinstance(r, dict):
            rows.append([what, str(r) if r is not None else "-", "", ""])
            return
        m = r["median"]
        ratio = f"{m / floor / per:.2f}x [{r['min'] / floor / per:.2f}, {r['max'] / floor / per:.2f}]" if floor else ""
        rows.append([what, fmt_seconds(m), f"[{fmt_seconds(r['min'])}, {fmt_seconds(r['max'])}]", ratio])

    rows.append(["floor: D2H pinned, flat / per tensor", f"{nbytes / d2h / 1e9:.1f} / {nbytes / fl['d2h_per_tensor']['median'] / 1e9:.1f} GB/s", "", ""])
    rows.append(["floor: H2D pinned, flat / per tensor", f"{nbytes / h2d / 1e9:.1f} / {nbytes / fl['h2d_per_tensor']['median'] / 1e9:.1f} GB/s", "", ""])
    res["pin_fresh"] = fl["pin_fresh"]
    row("pinning that much fresh memory (pin_memory())", "pin_fresh")
    row("snapshot() returns (trainer blocked)", "snapshot_call")
    row("staged / D2H floor", "snapshot_staged", d2h)
    row("committed / D2H floor", "snapshot_committed", d2h)
    if "first_snapshot" in res:
        f = res["first_snapshot"]["committed"]
        rows.append(["first snapshot (cold slot) / pinning", fmt_seconds(f), "", f"{f / fl['pin_fresh']['median']:.2f}x"])
    row("restore same layout (verify all) / H2D floor", "restore_same_all", h2d)
    row("restore same layout (verify window) / H2D floor", "restore_same_window", h2d)
    if "restore_resharded_bytes" in res:
        row("restore resharded, Shard(1,1,2), per byte / H2D floor", "restore_resharded", h2d, res["restore_resharded_bytes"] / nbytes)
    for k in ("call", "staged", "committed", "restore"):
        row(f"small tensors: {k} per tensor", f"small_{k}_per_tensor")
    for k in ("none", "ucpd"):
        if f"train_step_{k}" in res:
            res[f"train_step_{k}"] = spread(res[f"train_step_{k}"])
            row(f"training step, checkpoint: {k}", f"train_step_{k}")
    if "train_step_ucpd" in res:
        a, b = res["train_step_none"]["median"], res["train_step_ucpd"]["median"]
        rows.append(["training step: ucpd every step, slowdown", f"{(b / a - 1) * 100:+.1f}%", "", ""])
    row("DCP async_save + pinned stager: blocked", "dcp_async_save_blocked")
    row("DCP async_save + pinned stager: staged / D2H floor", "dcp_async_save_staged", d2h)
    row("DCP async_save: done", "dcp_async_save_done")
    row("DCP load into CUDA tensors (page-cached disk) / H2D floor", "dcp_load", h2d)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device (torch.cuda.is_available() is False); nothing here runs on a CPU. "
              "Run it on a GPU machine: `make gpu-check` (README, 'Checking on a GPU').", file=sys.stderr)
        return 0 if args.allow_no_gpu else 2
    cleanup_on_exit()
    from ucpd import native

    res: dict = {"device": torch.cuda.get_device_name(0), "native_cuda": native.cuda_available(), "args": vars(args)}
    log(f"{res['device']}; ucpd native CUDA part: {res['native_cuda']}; building a {args.size_gib} GiB state")
    state = gpt_state(torch, int(args.size_gib * GiB))
    tensors = flat(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    res["state"] = {"bytes": nbytes, "tensors": len(tensors)}
    log(f"state: {nbytes / GiB:.2f} GiB, {len(tensors)} tensors")
    res["floors"] = floors(torch, tensors, args.reps)
    sections = [("ucpd", lambda: bench_ucpd(torch, state, nbytes, args.reps, res))]
    if args.small:
        sections.append(("small", lambda: bench_small(torch, args.small, args.reps, res)))
    if not args.skip_train:
        sections.append(("train", lambda: bench_train(torch, args, res)))
    if not args.skip_dcp:
        sections.append(("dcp", lambda: bench_dcp(torch, state, min(args.reps, 3), res)))
    for name, fn in sections:
        log(f"{name} ...")
        try:
            fn()
        except Exception as exc:  # one section failing does not lose the others
            res[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            log(f"{name} failed: {res[f'{name}_error']}")
    rows = report(res, nbytes)
    print(f"\nucpd on {res['device']}: {nbytes / GiB:.2f} GiB, {len(tensors)} tensors, medians of {args.reps} [min, max]")
    print(table(["what", "median", "spread", "x floor"], rows))
    errors = {k: v for k, v in res.items() if k.endswith("_error")}
    for k, v in errors.items():
        print(f"  ! {k}: {v}")
    write_json(args.json, {"benchmark": "gpu", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "results": res,
                           "table": rows})
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
