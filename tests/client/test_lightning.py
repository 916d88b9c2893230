"""``UcpdCheckpointIO`` inside a real ``lightning.Trainer`` on the CPU, with a real daemon.

A small regression model trained with Adam and a warmup schedule, on data shuffled anew each
epoch by a sampler seeded by the epoch (as a ``DistributedSampler`` does). ``ModelCheckpoint``
saves every epoch (top 2 by loss, and ``last.ckpt``) through the plugin: the files it leaves
are pointers, the state is in the daemon. A second ``Trainer`` (another model init) resumed
with ``ckpt_path="last"`` continues bit for bit: the same losses as a run that never stopped,
and as Lightning's own resume from its own files.
"""

from __future__ import annotations

import json

import pytest
import torch

from ucpd_client import Checkpointer

L = pytest.importorskip("lightning", reason="lightning is not installed (make setup installs it with --no-deps)")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from ucpd_client.integrations.lightning import UcpdCheckpointIO  # noqa: E402

EPOCHS, BATCHES = 4, 4


class EpochShuffle(torch.utils.data.Sampler):
    """A new order each epoch, from the seed and the epoch only (Lightning calls set_epoch)."""

    def __init__(self, n, seed=3):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist())

    def __len__(self):
        return self.n


class Regression(L.LightningModule):
    def __init__(self, init_seed):
        super().__init__()
        torch.manual_seed(init_seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.losses = []

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        self.losses.append((self.global_step, loss.item()))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.05)
        total = EPOCHS * BATCHES
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * (1 - s / total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(5)
        x = torch.randn(BATCHES * 8, 8, generator=g)
        y = x.sum(1, keepdim=True).sin()
        data = torch.utils.data.TensorDataset(x, y)
        return torch.utils.data.DataLoader(data, batch_size=8, sampler=EpochShuffle(len(data)))


def trainer(root, epochs, plugins=()):
    ckpt_cb = ModelCheckpoint(dirpath=str(root / "ckpts"), monitor="train_loss", save_top_k=2, save_last=True)
    return L.Trainer(default_root_dir=str(root), max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=[ckpt_cb],
                     plugins=list(plugins), deterministic=True), ckpt_cb


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    model = Regression(0)
    t, _ = trainer(tmp_path_factory.mktemp("whole"), EPOCHS)
    t.fit(model)
    return model.losses, params(model)


def test_lightnings_own_resume_matches_the_uninterrupted_run(tmp_path, uninterrupted):
    first = Regression(0)
    trainer(tmp_path, 2)[0].fit(first)
    again = Regression(1)
    trainer(tmp_path, EPOCHS)[0].fit(again, ckpt_path=str(tmp_path / "ckpts" / "last.ckpt"))
    assert first.losses + again.losses == uninterrupted[0]


def test_checkpoints_go_to_the_daemon_and_a_new_trainer_resumes_from_them_bit_for_bit(daemon, tmp_path, uninterrupted):
    want_losses, want_params = uninterrupted
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, job="lightning-test") as ckpt:
        first = Regression(0)
        t, cb = trainer(tmp_path, 2, [UcpdCheckpointIO(ckpt)])
        t.fit(first)
        assert ckpt.latest() is not None and ckpt.latest() >= 2 * BATCHES
        last = tmp_path / "ckpts" / "last.ckpt"
        pointer = json.loads(last.read_text())  # a pointer, not the state
        assert pointer["format"] == "ucpd-lightning-pointer" and pointer["job"] == "lightning-test"
        assert pointer["global_step"] == 2 * BATCHES and last.stat().st_size < 1024
        assert len(list((tmp_path / "ckpts").glob("epoch=*.ckpt"))) == 2  # top 2: the third was removed
        assert cb.best_model_path and UcpdCheckpointIO.read_pointer(cb.best_model_path) is not None

        again = Regression(1)
        t2, _ = trainer(tmp_path, EPOCHS, [UcpdCheckpointIO(ckpt)])
        t2.fit(again, ckpt_path="last")
        assert first.losses + again.losses == want_losses
        assert all(torch.equal(a, b) for a, b in zip(params(again), want_params))
        assert t2.global_step == EPOCHS * BATCHES


def test_a_state_loaded_back_is_the_checkpoint_lightning_gave(daemon, tmp_path):
    """The whole checkpoint dict comes back: tensors bit for bit, everything else equal."""
    model = Regression(0)
    t, _ = trainer(tmp_path, 1, [UcpdCheckpointIO(Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False))])
    t.fit(model)
    want = t._checkpoint_connector.dump_checkpoint()
    io = UcpdCheckpointIO(Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False))
    io.save_checkpoint(want, tmp_path / "x.ckpt")
    got = io.load_checkpoint(tmp_path / "x.ckpt")
    assert got.keys() == want.keys()
    for k in want["state_dict"]:
        assert torch.equal(got["state_dict"][k], want["state_dict"][k])
    assert got["loops"] == want["loops"] and got["callbacks"].keys() == want["callbacks"].keys()
    assert got["lr_schedulers"] == want["lr_schedulers"]
    a, b = got["optimizer_states"][0], want["optimizer_states"][0]
    assert a["param_groups"] == b["param_groups"]
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in b["state"] for k in b["state"][i])
    torch.save(want, tmp_path / "real.ckpt")  # a real checkpoint file still loads through the plugin
    assert io.load_checkpoint(tmp_path / "real.ckpt", weights_only=False)["global_step"] == want["global_step"]
