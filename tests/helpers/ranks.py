"""Running real trainer ranks: spawned processes joined by a gloo process group."""

from __future__ import annotations

import os
import tempfile
import time

import torch.multiprocessing as mp

# Set per test by the autouse fixture in tests/conftest.py: where rendezvous files go (the test's
# tmp_path, never the shared temp dir) and the list of rank processes it must stop afterwards.
WORKDIR: str | None = None
STARTED: list = []


def init_gloo(rank: int, world: int, rendezvous: str) -> None:
    """Join the test's gloo group through a file store (no TCP port that another process could
    take between choosing it and binding it)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)


def _context():
    """Ranks fork from a server that imported torch and the client once (per test process), not
    from a fresh interpreter each: a rank starts in milliseconds instead of a second or two of
    imports, which over the suite's hundreds of ranks is most of its CPU time."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "ucpd_client"])
    return ctx


def _as_spawned(environ: dict, target, *args) -> None:
    """Run ``target`` with the environment its test had when it started the rank (the fork
    server's is the one of the moment it started), as a spawned process would."""
    os.environ.clear()
    os.environ.update(environ)
    tempfile.tempdir = None  # from $TMPDIR again
    target(*args)


def spawn(target, world: int, *args, wait_for: int | None = None, timeout: float = 180.0):
    """Start ``world`` ranks of ``target(rank, world, rendezvous, queue, *args)``; collect one
    message per rank from the queue (``wait_for`` messages, default ``world``). Returns (procs,
    messages)."""
    ctx = _context()
    q = ctx.Queue()
    # a new file for every group: a file store must never be reused
    rendezvous = os.path.join(tempfile.mkdtemp(prefix="gloo-", dir=WORKDIR), "rendezvous")
    environ = dict(os.environ)
    procs = [ctx.Process(target=_as_spawned, args=(environ, target, r, world, rendezvous, q, *args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.queue = q  # the queue lives as long as its ranks (they unpickle it as they start)
        p.start()
        STARTED.append(p)
    messages = []
    deadline = time.monotonic() + timeout
    while len(messages) < (world if wait_for is None else wait_for):
        left = deadline - time.monotonic()
        if left <= 0:
            kill(procs)
            raise TimeoutError(f"ranks sent {len(messages)} of {world} messages: {messages}")
        try:
            messages.append(q.get(timeout=min(left, 1.0)))
        except Exception:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                kill(procs)
                raise RuntimeError(f"rank processes died: {[p.exitcode for p in dead]}; messages {messages}")
    return procs, messages


def kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(10)


def join(procs, timeout: float = 60.0) -> None:
    for p in procs:
        p.join(timeout)
        assert p.exitcode == 0, f"rank exited with {p.exitcode}"
