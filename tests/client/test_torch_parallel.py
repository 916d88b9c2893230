"""PyTorch's own parallelism, snapshotted with ``Checkpointer.snapshot`` and restored on another
mesh, bit for bit.

A small block (an attention-like mixer with q, k, v split by columns and o by rows, and an MLP
with fc1 by columns and fc2 by rows) is trained two steps under tensor parallelism
(``parallelize_module``), FSDP2 (``fully_shard``) or both on a 2x2 mesh (FSDP x TP: FSDP2
shards TP's shards again, a ``_StridedShard``). Its state comes from
``torch.distributed.checkpoint.state_dict.get_state_dict(model, [two optimizers])`` — SGD with
momentum (two parameter groups) beside RMSprop or Adagrad — with a StepLR scheduler and a
GradScaler as plain objects. Placements are the DTensors' own. The restoring job builds the
model on another layout, fills ``get_state_dict``'s tensors with ``Checkpointer.restore`` and
hands them to ``set_state_dict``; what the model and optimizers then hold, consolidated, must
equal what the saving job held.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from helpers import ranks

pytestmark = pytest.mark.slow

STEP = 2  # training steps before the snapshot, and its step number
D, H, F = 9, 8, 12  # D = 9 rows: FSDP2 splits o, fc2 and scale unevenly (5 + 4)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, H), nn.Linear(D, H), nn.Linear(D, H)
        self.o = nn.Linear(H, D)
        self.fc1, self.fc2 = nn.Linear(D, F), nn.Linear(F, D)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, D))

    def forward(self, x):
        x = x + self.o(torch.sigmoid(self.q(x)) * self.k(x) * self.v(x))  # per column: local under TP
        x = x + self.fc2(torch.relu(self.fc1(x)))
        scale = self.scale
        return x * (scale.to_local() if hasattr(scale, "to_local") else scale)  # replicated under TP


def build(layout: str, optim: str):
    """The block on ``layout`` ("plain", "tp", "fsdp" or "fsdp x tp"), its two optimizers
    (SGD with momentum on the mixer; ``optim`` on the MLP) and a StepLR on the SGD."""
    torch.manual_seed(0)
    model = Block()
    world = torch.distributed.get_world_size() if layout != "plain" else 1
    if layout != "plain":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        shape, names = {"tp": ((world,), ("tp",)), "fsdp": ((world,), ("dp",)), "fsdp x tp": ((2, world // 2), ("dp", "tp"))}[layout]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        if "tp" in names:
            col, row = ColwiseParallel(), RowwiseParallel()
            parallelize_module(model, mesh["tp"], {"q": col, "k": col, "v": col, "o": row, "fc1": col, "fc2": row})
        if names == ("tp",):
            # GradScaler cannot unscale an optimizer's mix of DTensor and plain grads
            # (torch 2.13: "got mixed torch.Tensor and DTensor"); FSDP2 makes every param a DTensor
            from torch.distributed.tensor import Replicate, distribute_tensor

            model.scale = nn.Parameter(distribute_tensor(model.scale.data, mesh["tp"], [Replicate()]))
        if "dp" in names:
            fully_shard(model, mesh=mesh["dp"])
    sgd = torch.optim.SGD(
        [{"params": [*model.q.parameters(), *model.k.parameters(), *model.v.parameters()]},
         {"params": model.o.parameters(), "lr": 0.05}],
        lr=0.1, momentum=0.9,
    )
    mlp = [*model.fc1.parameters(), *model.fc2.parameters(), model.scale]
    other = torch.optim.RMSprop(mlp, lr=0.01) if optim == "rmsprop" else torch.optim.Adagrad(mlp, lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    return model, [sgd, other], sched


def train_and_snapshot(rank, world, rendezvous, q, run_dir, layout, optim):
    """Train STEP steps on ``layout``, snapshotting the state dicts after each; rank 0 sends the
    consolidated state of the last."""
    ranks.init_gloo(rank, world, rendezvous)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ucpd_client import Checkpointer

    model, opts, sched = build(layout, optim)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=7)
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(1))
    with Checkpointer(run_dir, embedded=False) as ckpt:
        for step in range(1, STEP + 1):  # a snapshot every step: the second skips what lower ranks hold
            scaler.scale(model(x).square().mean()).backward()
            for opt in opts:
                scaler.step(opt)
                opt.zero_grad()
            scaler.update()
            sched.step()
            msd, osd = get_state_dict(model, opts)
            state = {"model": msd, "optim": osd, "sched": sched.state_dict(), "scaler": scaler.state_dict(), "step": step}
            ckpt.snapshot(step, state).wait()
    full = consolidated(state)  # a collective: every rank takes part
    q.put((rank, full if rank == 0 else None))


def restore_into(layout: str, optim: str, run_dir: str) -> dict:
    """Build the block on ``layout``, restore the newest snapshot into it through
    get_state_dict/set_state_dict, and return what it then holds, consolidated."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ucpd_client import Checkpointer

    model, opts, sched = build(layout, optim)
    scaler = torch.amp.GradScaler("cpu")
    msd, osd = get_state_dict(model, opts)  # fresh optimizers get their state tensors made here
    state = {"model": msd, "optim": osd, "sched": sched.state_dict(), "scaler": scaler.state_dict(), "step": 0}
    world = torch.distributed.get_world_size() if layout != "plain" else 1
    with Checkpointer(run_dir, rank=0 if layout == "plain" else None, world_size=world, embedded=False) as ckpt:
        assert ckpt.restore(state) == STEP
    set_state_dict(model, opts, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(state["sched"])
    scaler.load_state_dict(state["scaler"])
    msd, osd = get_state_dict(model, opts)  # read back what the model and optimizers now hold
    return consolidated({"model": msd, "optim": osd, "sched": sched.state_dict(), "scaler": scaler.state_dict(), "step": state["step"]})


def restore_ranks(rank, world, rendezvous, q, run_dir, layout, optim):
    ranks.init_gloo(rank, world, rendezvous)
    got = restore_into(layout, optim, run_dir)
    q.put((rank, got))


def consolidated(state: dict) -> dict:
    """{flat name: whole tensor as numpy (DTensors gathered) or plain value}."""
    from torch.distributed.tensor import DTensor

    from ucpd_client.state import split

    tensors, values = split(state)
    out = dict(values)
    for name, t in tensors.items():
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone().numpy()
    return out


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        if hasattr(w, "dtype"):  # numpy: compare as torch tensors, bit for bit
            assert torch.equal(torch.from_numpy(g), torch.from_numpy(w)), name
        else:
            assert g == w, name


def saved(run_dir: str, layout: str, world: int, optim: str) -> dict:
    procs, messages = ranks.spawn(train_and_snapshot, world, run_dir, layout, optim)
    ranks.join(procs)
    want = dict(messages)[0]
    # the state is a real one: trained, the scheduler has halved the SGD rates, the scaler counted
    assert [g["lr"] for g in want["optim.param_groups"][:2]] == [0.1 / 2**STEP, 0.05 / 2**STEP]
    assert want["scaler._growth_tracker"] == STEP
    assert any(k.endswith("momentum_buffer") and abs(v).sum() > 0 for k, v in want.items() if hasattr(v, "dtype"))
    return want


def test_fsdp_x_tp_on_a_2x2_mesh_restores_bit_for_bit_into_one_plain_rank(daemon):
    want = saved(daemon.run_dir, "fsdp x tp", 4, "rmsprop")
    assert_same(restore_into("plain", "rmsprop", daemon.run_dir), want)


def test_fsdp_x_tp_on_a_2x2_mesh_restores_bit_for_bit_into_two_rank_tensor_parallel(daemon):
    want = saved(daemon.run_dir, "fsdp x tp", 4, "adagrad")
    procs, messages = ranks.spawn(restore_ranks, 2, daemon.run_dir, "tp", "adagrad")
    ranks.join(procs)
    for _, got in messages:
        assert_same(got, want)


def test_tensor_parallel_state_restores_bit_for_bit_into_fsdp2_and_into_one_plain_rank(daemon):
    want = saved(daemon.run_dir, "tp", 2, "adagrad")
    procs, messages = ranks.spawn(restore_ranks, 2, daemon.run_dir, "fsdp", "adagrad")
    ranks.join(procs)
    for _, got in messages:
        assert_same(got, want)
    assert_same(restore_into("plain", "adagrad", daemon.run_dir), want)
