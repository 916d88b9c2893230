"""The chaos campaign's job: its state (values that encode the step *and the run*, so a version
stitched from two runs is seen), and its trainer ranks, each writing what it did to a journal.

Every element of every tensor is ``code * 10**8 + i`` (``code = run * 10000 + step``, ``i`` the
element's index in the global tensor, so a shard restored in the wrong place is seen too), a
replicated tensor holds ``code`` itself, and plain values hold the step and the run.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

JOB = "chaos"
CODE = 10_000  # code = run * CODE + step
SCALE = 10 ** 8  # an element = code * SCALE + its global index
TP_GLOBAL_ROWS, TP_COLS = 256, 512  # the TP-split weight (float64), 1 MiB: 512 KiB a rank at TP 2
ZERO_N = 128 * 1024  # each rank's ZeRO partition of a flat optimizer buffer (int64): 1 MiB
REP_N = 128 * 1024  # a replicated tensor (float32): 512 KiB


def job_state(step: int, run: int, rank: int, world: int, tp: int):
    """(state, placements) of ``rank`` at ``step`` of ``run``."""
    import torch
    from ucpd_client import placement as P

    code = run * CODE + step
    tp_rank, rows = rank % tp, TP_GLOBAL_ROWS // tp
    w = torch.arange(rows * TP_COLS, dtype=torch.float64).view(rows, TP_COLS)
    w += tp_rank * rows * TP_COLS + code * SCALE
    z = torch.arange(ZERO_N, dtype=torch.int64) + rank * ZERO_N + code * SCALE
    r = torch.full((REP_N,), float(code), dtype=torch.float32)
    state = {
        "model": {"tp.weight": w, "norm.weight": r},
        "optim": {"zero.exp_avg": z},
        "step": step,
        "meta": {"run": run, "rank": rank},
    }
    return state, {"model.tp.weight": P.Shard(0, tp_rank, tp), "optim.zero.exp_avg": P.Shard(0, rank, world)}


def zero_state(rank: int, world: int, tp: int):
    """The same structure, zeroed (plain values -1): what a restore fills."""
    import torch

    state, pl = job_state(1, 0, rank, world, tp)
    state["model"] = {k: torch.zeros_like(v) for k, v in state["model"].items()}
    state["optim"] = {k: torch.zeros_like(v) for k, v in state["optim"].items()}
    state["step"], state["meta"] = -1, {"run": -1, "rank": -1}
    return state, pl


def decode(state: dict, rank: int, world: int, tp: int) -> dict:
    """{tensor name: {"codes": [[code, count], ...], "garbled": n}, "values": {...}} of a restored state."""
    import torch

    out = {}
    tp_rank, rows = rank % tp, TP_GLOBAL_ROWS // tp
    expect = {
        "model.tp.weight": torch.arange(rows * TP_COLS, dtype=torch.int64).view(rows, TP_COLS) + tp_rank * rows * TP_COLS,
        "optim.zero.exp_avg": torch.arange(ZERO_N, dtype=torch.int64) + rank * ZERO_N,
        "model.norm.weight": None,
    }
    tensors = {"model.tp.weight": state["model"]["tp.weight"], "model.norm.weight": state["model"]["norm.weight"],
               "optim.zero.exp_avg": state["optim"]["zero.exp_avg"]}
    for name, t in tensors.items():
        as_int = t.to(torch.int64)
        integral = as_int.to(t.dtype) == t
        if expect[name] is None:
            codes, ok = as_int, integral
        else:
            rest = as_int - expect[name]
            ok = integral & (rest % SCALE == 0) & (rest >= 0)
            codes = rest // SCALE
        codes = codes[ok]
        u, n = torch.unique(codes, return_counts=True)
        out[name] = {"codes": [[int(a), int(b)] for a, b in zip(u.tolist(), n.tolist())], "garbled": int((~ok).sum())}
    out["values"] = {"step": state["step"], "run": state["meta"]["run"], "rank": state["meta"]["rank"]}
    return out


def flushed_codes(root: str, step: int) -> set:
    """The codes (run * CODE + step) the flushed version's global tensors decode to; one element
    in the wrong place or from another run or step adds another (or -1: garbled)."""
    import numpy as np

    from ucpd.format import open_version

    codes: set = set()
    with open_version(root, step) as v:
        def values(name):  # the reader gives the storage bits: view them as the tensor's dtype
            return np.asarray(v.array(name)).reshape(-1).view(np.dtype(v.tensors[name].dtype)).astype(np.int64)

        for name in ("model.tp.weight", "optim.zero.exp_avg"):
            rest = values(name) - np.arange(values(name).size, dtype=np.int64)
            codes |= set(np.unique(np.where(rest % SCALE == 0, rest // SCALE, -1)).tolist())
        codes |= set(np.unique(values("model.norm.weight")).tolist())
    return codes


# --- trainer processes --------------------------------------------------------------------------------

def _note(journal: str, **rec) -> None:
    rec["t"] = time.time()
    with open(journal, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def rank_main(mode: str, env: dict, journal: str, args: dict) -> None:
    """One trainer rank. ``mode`` "train": latest(), restore it, snapshot ``args['steps']`` steps;
    "verify": read back ``args['check']`` steps (and latest()). Everything goes to the journal."""
    os.environ.update(env)
    from ucpd_client import Checkpointer

    tp = int(args["tp"])
    ckpt = None
    step = None
    try:
        ckpt = Checkpointer(embedded=False)
        rank, world, run = ckpt.rank, ckpt.world_size, int(args["run"])
        latest = ckpt.latest()
        _note(journal, e="latest", step=latest)
        if mode == "verify":
            for s in args["check"]:
                target, pl = zero_state(rank, world, tp)
                try:
                    got = ckpt.restore(target, step=s, placements=pl)
                    _note(journal, e="read", step=s, got=got, where=(ckpt.last_restore or {}).get("where"),
                          dec=decode(target, rank, world, tp))
                except Exception as exc:
                    _note(journal, e="read", step=s, error=f"{type(exc).__name__}: {str(exc)[:400]}")
            _note(journal, e="done")
            return
        if latest is not None:
            target, pl = zero_state(rank, world, tp)
            step = latest
            got = ckpt.restore(target, placements=pl)
            _note(journal, e="restored", step=got, dec=decode(target, rank, world, tp))
        start = (latest or 0) + 1
        for step in range(start, start + int(args["steps"])):
            state, pl = job_state(step, run, rank, world, tp)
            _note(journal, e="begin", step=step)
            ckpt.snapshot(step, state, placements=pl).wait(timeout=float(args["wait"]))
            _note(journal, e="committed", step=step)
        _note(journal, e="done")
    except BaseException as exc:  # the daemon died, the step can no longer commit, a refusal
        _note(journal, e="error", step=step, type=type(exc).__name__, msg=str(exc)[:500])
    finally:
        if ckpt is not None:
            try:
                ckpt.close()
            except Exception:
                pass


_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "ucpd_client", "helpers.team_chaos.job"])
    return _CTX


def read_journal(path: str) -> list[dict]:
    try:
        with open(path) as f:
            out = []
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line cut by SIGKILL
            return out
    except OSError:
        return []
