"""A torchrun worker for the elastic scene: the example GPT (``examples/gpt``) trained with a
parallel layout chosen from the world size torchrun gives it, snapshotting every step, and
resuming from the newest committed step whenever it starts.

    ucpd run [serve options] -- torchrun --nnodes 1:2 --nproc-per-node 2 ... examples/elastic/train.py --steps 8

The checkpointing is the five lines a training loop adds (marked ``# ucpd``): a
``Checkpointer()`` (it finds the node daemon through ``$UCPD_RUN_DIR``, which ``ucpd run``
sets, and reads RANK/WORLD_SIZE/LOCAL_WORLD_SIZE/TORCHELASTIC_RUN_ID from torchrun),
``latest()`` and ``restore()`` on start, ``snapshot()`` every step, ``wait()`` at the end.

Layouts (``LAYOUTS``): 4 ranks train pipeline 2 x data-parallel 2, 2 ranks data-parallel 2,
1 rank alone; all tensor-parallel 1, so that the arithmetic does not depend on the layout
(the trainer sums gradients in a fixed order) and a resumed run can be compared bit for bit.
A restore after a change of world size reshards pipeline stages and ZeRO-1 partitions.

For the scene's runner (``examples/elastic/scene.py``) every process appends JSON events to
``--events``: ``start``, ``restored``, ``step`` (the rank that knows the loss), ``parked``,
``failed``, ``done``. With ``--hold-at N --go-file F`` a 4-rank run waits after step N is
committed until F exists, so that a node can be lost at a known step without a race.
"""

from __future__ import annotations

import time

T_START = time.time()  # before the imports: a restarted worker's start, as the runner measures it

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/: `gpt`

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gpt import RunSpec, TrainConfig, Trainer  # noqa: E402
from ucpd_client import Checkpointer  # noqa: E402

LAYOUTS = {4: dict(tp=1, pp=2, dp=2), 2: dict(tp=1, pp=1, dp=2), 1: dict(tp=1, pp=1, dp=1)}


def layout_for(world: int) -> dict:
    if world not in LAYOUTS:
        raise SystemExit(f"train.py: no layout for a world of {world} ranks (known: {sorted(LAYOUTS)})")
    return LAYOUTS[world]


class Events:
    """JSON lines appended to one file by every process (one short write each: atomic)."""

    def __init__(self, path: str | None, **common):
        self.path, self.common = path, common

    def __call__(self, event: str, **fields) -> None:
        if not self.path:
            return
        line = json.dumps({"event": event, "t": time.time(), **self.common, **fields}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="a torchrun worker: the example GPT with ucpd snapshots")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hold-at", type=int, default=None, help="a 4-rank run waits after this step is committed ...")
    ap.add_argument("--go-file", default=None, help="... until this file exists")
    ap.add_argument("--events", default=None, help="append JSON events here")
    args = ap.parse_args(argv)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = Events(args.events, rank=rank, world=world, restart=restart, pid=os.getpid())
    events("start", t=T_START)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        spec = RunSpec(**layout_for(world), train=TrainConfig(steps=args.steps))
        trainer = Trainer(spec, rank)
        events("initialized")
        ckpt = Checkpointer()  # ucpd
        if ckpt.latest() is not None:  # ucpd
            t0 = time.perf_counter()
            state, placements = trainer.state()
            step = ckpt.restore(state, placements=placements)  # ucpd
            trainer.load_values(state)
            events("restored", step=step, seconds=time.perf_counter() - t0, layout=spec.layout_name,
                   where=ckpt.last_restore["where"])
        handle = None
        while trainer.step < args.steps:
            # the last snapshot must have copied the parameters before the optimizer changes them
            loss = trainer.train_step(before_update=(lambda h=handle: h.staged(60)) if handle is not None else None)
            state, placements = trainer.state()
            handle = ckpt.snapshot(trainer.step, state, placements=placements)  # ucpd
            if trainer.reports:
                events("step", step=trainer.step, loss=loss, layout=spec.layout_name)
            if world == 4 and args.hold_at == trainer.step and args.go_file:
                handle.wait(120)  # committed on every node: a node may now be lost
                events("parked", step=trainer.step, skipped=handle.skipped)  # tensors other ranks wrote for it
                while not os.path.exists(args.go_file):
                    time.sleep(0.02)
        if handle is not None:
            handle.wait(120)  # ucpd
        ckpt.close()
    except BaseException as exc:
        # the survivors of a lost node land here: their next collective fails
        events("failed", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        raise
    events("done", step=trainer.step, layout=spec.layout_name)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
