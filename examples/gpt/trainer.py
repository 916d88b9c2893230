"""The training loop: pipeline schedule, ZeRO-1 AdamW, learning-rate schedule, data, checkpoints.

One rank of a ``tp x pp x dp`` job (Megatron rank order: tp fastest, then dp, then pp):

- the model part of its stage and tensor-parallel rank (``model.GPTStage``);
- a GPipe schedule over micro-batches of a fixed size: all forwards, then all backwards, with
  activations and their gradients sent between stages (``isend``/``recv`` over gloo);
- gradients reduced in a fixed order: each micro-batch's gradients are kept apart, gathered
  across the data-parallel group and summed in global micro-batch order, so the result does
  not depend on how micro-batches were spread over ranks and stages (a production trainer
  would reduce-scatter; the order-fixed sum is what lets the tests compare layouts bit for bit);
- AdamW on ZeRO-1 partitions: the model part's parameters are views into one flat fp32
  buffer; each data-parallel rank owns a slice of the buffer (``layouts.MegatronLayout.zero``)
  and the Adam moments of that slice, updates it, and all-gathers the buffer;
- a warmup + cosine learning-rate schedule, a ``ShardedSampler`` over a deterministic corpus.

Its checkpoint state: the parameters under their TP placements, both Adam moments as ZeRO
``Flat`` placements, and plain values — step, Adam's step count, the schedule, the data-loader
position and this rank's generator states.
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from ucpd_client import layouts as L
from ucpd_client.dataloader import ShardedSampler, restore_rng, rng_state

from .data import MarkovCorpus
from .model import Comm, GPTConfig, GPTStage, initialize, placement_of


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 60
    global_batch: int = 16
    micro_batch: int = 4
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 5
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    dataset_size: int = 512
    data_seed: int = 7
    shuffle_seed: int = 11


class WarmupCosine:
    """Linear warmup to ``max_lr``, then cosine decay to ``min_lr`` at step ``total``."""

    def __init__(self, max_lr: float, min_lr: float, warmup: int, total: int):
        self.max_lr, self.min_lr, self.warmup, self.total = max_lr, min_lr, warmup, total
        self.last_step = 0

    def lr_at(self, step: int) -> float:
        if step <= self.warmup:
            return self.max_lr * step / max(1, self.warmup)
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_lr + 0.5 * (self.max_lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))

    def step(self) -> float:
        self.last_step += 1
        return self.lr_at(self.last_step)

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "warmup": self.warmup, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step = int(state["last_step"])


class ZeroAdamW:
    """AdamW whose moments are ZeRO-1 partitioned over the data-parallel group."""

    MOMENTS = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, placements, layout: L.MegatronLayout, comm: Comm, cfg: TrainConfig, n_micro: int):
        self.params, self.layout, self.comm, self.cfg = params, layout, comm, cfg
        specs = [(name, tuple(p.shape), placements[name]) for name, p in params]
        self.partition = layout.zero(specs)  # this dp rank's slice of the flat buffer
        buf = self.partition.of
        self.starts = buf.starts
        self.flat = torch.zeros(buf.size)
        decay = torch.zeros(buf.size)
        with torch.no_grad():
            for (_, p), s in zip(params, self.starts):
                n = p.numel()
                self.flat[s : s + n].copy_(p.detach().reshape(-1))
                p.data = self.flat[s : s + n].view(p.shape)  # parameters live in the flat buffer
                if p.dim() >= 2:
                    decay[s : s + n] = 1.0  # weight decay on matrices, not on biases and norms
        self.lo, self.hi = self.partition.offset, self.partition.offset + self.partition.numel
        self.decay = decay[self.lo : self.hi].clone()
        self.exp_avg = torch.zeros(self.hi - self.lo)
        self.exp_avg_sq = torch.zeros(self.hi - self.lo)
        self.t = 0
        self.grads = torch.zeros(n_micro, buf.size)
        self.moment_placements = {
            m: layout.zero([(f"optim.{name}.{m}", shape, pl) for name, shape, pl in specs]) for m in self.MOMENTS
        }

    def collect(self, i: int) -> None:
        """Move the parameters' gradients of micro-batch ``i`` into row ``i``."""
        for (_, p), s in zip(self.params, self.starts):
            row = self.grads[i, s : s + p.numel()]
            if p.grad is None:
                row.zero_()
            else:
                row.copy_(p.grad.reshape(-1))
                p.grad = None

    def step(self, lr: float, before_update: Callable[[], None] | None = None) -> None:
        import torch.distributed as dist

        dp, group = self.layout.dp, self.comm.dp_group
        if group is not None:
            every = torch.empty(self.grads.shape[0] * dp, self.grads.shape[1])
            dist.all_gather(list(every.chunk(dp)), self.grads, group=group)
        else:
            every = self.grads
        g = every[0, self.lo : self.hi].clone()
        for i in range(1, every.shape[0]):  # global micro-batch order, whatever the layout
            g.add_(every[i, self.lo : self.hi])
        g.div_(every.shape[0])
        if before_update is not None:
            before_update()  # the last snapshot must have copied the state we now change
        c = self.cfg
        self.t += 1
        self.exp_avg.mul_(c.beta1).add_(g * (1.0 - c.beta1))
        self.exp_avg_sq.mul_(c.beta2).add_(g * g * (1.0 - c.beta2))
        denom = (self.exp_avg_sq / (1.0 - c.beta2**self.t)).sqrt_().add_(c.eps)
        update = (self.exp_avg / (1.0 - c.beta1**self.t)).div_(denom)
        mine = self.flat[self.lo : self.hi]
        mine.mul_(torch.where(self.decay > 0, 1.0 - lr * c.weight_decay, 1.0))
        mine.sub_(update.mul_(lr))
        if group is not None:
            dist.all_gather(list(self.flat.chunk(dp)), mine.clone(), group=group)


@dataclass(frozen=True)
class RunSpec:
    """What one job (every rank of it) does."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    model: GPTConfig = field(default_factory=GPTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run_dirs: tuple[str, ...] = ()  # node daemons' run dirs; empty: no checkpoints
    ranks_per_node: int = 0  # rank r talks to run_dirs[r // ranks_per_node] (0: all on one node)
    job: str = "gpt"  # the job its versions belong to: the same across restarts
    job_id: str = "gpt"  # this run of the job (a restart is another)
    resume: bool = False  # restore (the newest committed step unless restore_step) before training
    restore_step: int | None = None
    snapshot: bool = True  # snapshot every step (when run_dirs)
    hold_at: int | None = None  # after step N is committed, wait for the go-ahead
    log_dir: str | None = None

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def layout_name(self) -> str:
        return f"TP{self.tp}xPP{self.pp}xDP{self.dp}"

    def with_(self, **kw) -> "RunSpec":
        return replace(self, **kw)


class Trainer:
    """One rank's model part, optimizer, schedule and data."""

    def __init__(self, spec: RunSpec, rank: int, connect: bool = True):
        cfg, tc = spec.model, spec.train
        self.spec, self.cfg, self.tc = spec, cfg, tc
        self.layout = L.MegatronLayout.of_rank(rank, tp=spec.tp, pp=spec.pp, dp=spec.dp, num_layers=cfg.layers)
        if tc.global_batch % (tc.micro_batch * spec.dp):
            raise ValueError(f"global batch {tc.global_batch} must be a multiple of micro batch x dp")
        self.comm = Comm(self.layout, connect)  # connect=False: no process groups (offline inspection)
        self.stage = GPTStage(cfg, self.comm)
        initialize(self.stage)
        self.params = self.stage.global_parameters()
        self.placements = {name: placement_of(name, self.layout, cfg) for name, _ in self.params}
        self.n_micro = tc.global_batch // (tc.micro_batch * spec.dp)
        self.opt = ZeroAdamW(self.params, self.placements, self.layout, self.comm, tc, self.n_micro)
        self.sched = WarmupCosine(tc.lr, tc.min_lr, tc.warmup, tc.steps)
        self.corpus = MarkovCorpus(cfg.vocab_size, cfg.seq_len, tc.dataset_size, tc.data_seed)
        self.sampler = ShardedSampler(
            len(self.corpus), self.layout.dp_rank, spec.dp, global_batch=tc.global_batch, seed=tc.shuffle_seed
        )
        self.step = 0
        self.owner = f"{self.layout.describe()}/rank{rank}"
        self.rng_restore: str | None = None
        self.stage.train()

    @property
    def reports(self) -> bool:
        """The rank that reports the loss: last stage, tp rank 0, dp rank 0."""
        return self.layout.is_last_stage and self.layout.tp_rank == 0 and self.layout.dp_rank == 0

    # --- checkpoint state ------------------------------------------------------------------

    def state(self) -> tuple[dict, dict]:
        """(state, placements) for ``Checkpointer.snapshot`` / ``restore``."""
        state = {
            # plain tensors sharing the parameters' storage (an nn.Parameter would make the
            # client check for DTensor, whose first import costs a second or two)
            "model": {name: p.detach() for name, p in self.params},
            "optim": {"exp_avg": self.opt.exp_avg, "exp_avg_sq": self.opt.exp_avg_sq, "step": self.opt.t},
            "sched": self.sched.state_dict(),
            "loader": self.sampler.state_dict(),
            "rng": rng_state(self.owner),
            "step": self.step,
        }
        placements = {f"model.{name}": pl for name, pl in self.placements.items()}
        placements |= {f"optim.{m}": pl for m, pl in self.opt.moment_placements.items()}
        return state, placements

    def restore(self, ckpt, step: int | None = None) -> int:
        """Fill this rank's state from the checkpoint (any source layout); returns the step."""
        state, placements = self.state()
        got = ckpt.restore(state, step=step, placements=placements)
        self.load_values(state)
        return got

    def load_values(self, state: dict) -> None:
        """Take the plain values of a restored state (the tensors were filled in place)."""
        self.opt.t = int(state["optim"]["step"])
        self.sched.load_state_dict(state["sched"])
        self.sampler.load_state_dict(state["loader"])
        self.step = int(state["step"])
        self.rng_restore = restore_rng(state["rng"], self.owner, seed=self.cfg.seed, step=self.step)

    # --- training --------------------------------------------------------------------------

    def train_step(self, before_update: Callable[[], None] | None = None) -> float | None:
        """One optimizer step; returns the global mean loss on the reporting rank, else None."""
        step = self.step + 1
        lr = self.sched.step()
        inputs, targets = self.corpus.batch(self.sampler.next_batch())
        mb = self.tc.micro_batch
        first_micro = self.layout.dp_rank * self.n_micro
        losses = self._forward_backward(inputs.split(mb), targets.split(mb), step, first_micro)
        self.opt.step(lr, before_update)
        self.step = step
        self.last_lr = lr
        return self._global_loss(losses)

    def _forward_backward(self, xs, ys, step: int, first_micro: int):
        lay, stage, n = self.layout, self.stage, len(xs)
        if lay.pp > 1:
            import torch.distributed as dist
        shape = (self.tc.micro_batch, self.cfg.seq_len, self.cfg.hidden)
        outs, ins, pending, losses = [], [], [], []
        for i in range(n):  # all forwards ...
            stage.at(step, first_micro + i)
            if lay.is_first_stage:
                inp = xs[i]
            else:
                inp = torch.empty(shape)
                dist.recv(inp, src=lay.prev_stage, tag=i)
                inp.requires_grad_(True)
            out = stage(inp)
            if lay.is_last_stage:
                out = stage.loss(out, ys[i])
            else:
                act = out.detach().contiguous()
                pending.append((dist.isend(act, dst=lay.next_stage, tag=i), act))
            outs.append(out)
            ins.append(inp)
        for i in range(n):  # ... then all backwards, in the same order
            if lay.is_last_stage:
                outs[i].backward()
                losses.append(outs[i].detach())
            else:
                grad = torch.empty(shape)
                dist.recv(grad, src=lay.next_stage, tag=n + i)
                outs[i].backward(grad)
            if not lay.is_first_stage:
                g = ins[i].grad.contiguous()
                pending.append((dist.isend(g, dst=lay.prev_stage, tag=n + i), g))
            self.opt.collect(i)
        for work, _ in pending:
            work.wait()
        return torch.stack(losses) if losses else None

    def _global_loss(self, losses) -> float | None:
        if losses is None:
            return None
        if self.comm.dp_group is not None:
            import torch.distributed as dist

            every = torch.empty(losses.numel() * self.layout.dp)
            dist.all_gather(list(every.chunk(self.layout.dp)), losses, group=self.comm.dp_group)
            losses = every
        return math.fsum(float(x) for x in losses) / losses.numel() if self.reports else None


# ---------------------------------------------------------------------------------------------
# one rank of a job, in its own process


def _redirect_output(log_dir: str | None, rank: int) -> None:
    if not log_dir:
        return
    os.makedirs(log_dir, exist_ok=True)
    fd = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def rank_main(rank: int, world: int, rendezvous: str, q, spec: RunSpec, go) -> None:
    """Entry point of a spawned trainer rank. Reports to ``q`` as (kind, rank, details):
    ``ready``, ``restored``, ``step`` (the reporting rank), ``parked``, ``done``, ``error``."""
    _redirect_output(spec.log_dir, rank)
    torch.set_num_threads(1)
    ckpt = None
    try:
        if world > 1:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
        trainer = Trainer(spec, rank)

        def report(kind: str, **details) -> None:
            q.put((kind, rank, details))

        if spec.run_dirs:
            from ucpd_client import Checkpointer

            per_node = spec.ranks_per_node or world
            ckpt = Checkpointer(
                spec.run_dirs[rank // per_node], rank=rank, world_size=world, embedded=False,
                job=spec.job, job_id=spec.job_id, local_world_size=per_node,
            )
        if spec.resume:
            if ckpt is None:
                raise RuntimeError("resume needs a daemon (run_dirs)")
            latest = ckpt.latest()
            if latest is None:
                raise RuntimeError("no committed step to resume from")
            t0 = time.perf_counter()
            got = trainer.restore(ckpt, spec.restore_step)
            report("restored", step=got, latest=latest, seconds=time.perf_counter() - t0, rng=trainer.rng_restore)
        report("ready", step=trainer.step)
        last = None
        while trainer.step < spec.train.steps:
            t0 = time.perf_counter()
            loss = trainer.train_step(before_update=(lambda h=last: h.staged(60)) if last is not None else None)
            call = None
            if ckpt is not None and spec.snapshot:
                state, placements = trainer.state()
                t1 = time.perf_counter()
                last = ckpt.snapshot(trainer.step, state, placements=placements)
                call = time.perf_counter() - t1
            if trainer.reports:
                report("step", step=trainer.step, loss=loss, lr=trainer.last_lr,
                       seconds=time.perf_counter() - t0, snapshot_call=call)
            if spec.hold_at == trainer.step:
                if last is not None:
                    last.wait(120)  # committed: every node has it protected
                report("parked", step=trainer.step)
                go.wait()
        if last is not None:
            last.wait(120)
        report("done", step=trainer.step)
        if ckpt is not None:
            ckpt.close()
        if world > 1:
            dist.destroy_process_group()
    except BaseException as exc:  # reported to the launcher, which says what failed
        traceback.print_exc()
        sys.stderr.flush()
        q.put(("error", rank, {"message": f"{type(exc).__name__}: {exc}"}))
        sys.exit(1)
