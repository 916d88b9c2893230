"""The DeepSpeed CheckpointEngine and the Hugging Face TrainerCallback adapters, through a real
daemon. DeepSpeed's engine is driven through its documented CheckpointEngine interface (the
calls engine.save_checkpoint / load_checkpoint make: create, save per file, commit, load), with
the real DeepSpeed objects' shapes (a LossScaler-like object, flat partitions); the callback
through the TrainerCallback hooks (transformers' own base class and TrainerState where
installed)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from ucpd_client import Checkpointer
from ucpd_client.integrations.deepspeed import UcpdCheckpointEngine, use_ucpd
from ucpd_client.integrations.hf import UcpdCallback


class LossScalerLike:
    def __init__(self, scale):
        self.cur_scale, self.dynamic = scale, False


def ds_files(seed):
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(84, generator=g)
    model = {"module": {"w": torch.randn(3, 4, generator=g).to(torch.bfloat16)}, "global_steps": seed,
             "param_shapes": [{"w": torch.Size([3, 4])}], "ds_version": "0.19.8"}
    optim = {"optimizer_state_dict": {"loss_scaler": LossScalerLike(2.0 ** seed),
                                      "base_optimizer_state": {"state": {0: {"exp_avg": flat * 2, "step": torch.tensor(3.0)}}},
                                      "single_partition_of_fp32_groups": [flat], "partition_count": [1]}}
    return {"mp_rank_00_model_states.pt": model, "zero_pp_rank_0_mp_rank_00_optim_states.pt": optim}


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, LossScalerLike):
        return vars(a) == vars(b)
    return a == b


def test_deepspeed_checkpoint_engine_round_trip(daemon, tmp_path):
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        engine = SimpleNamespace(_config=None)
        ce = use_ucpd(engine, ckpt, wait=True)
        assert engine.checkpoint_engine is ce and isinstance(ce, UcpdCheckpointEngine)
        for step in (10, 20):
            files = ds_files(step)
            info = SimpleNamespace(tag=f"global_step{step}", save_dir=str(tmp_path), save_latest=True)
            ce.create(info)
            for name, sd in files.items():
                ce.save(sd, os.path.join(tmp_path, info.tag, name))
            assert ce.commit(info) is True
            files[name]["optimizer_state_dict"]["single_partition_of_fp32_groups"][0].add_(1)  # after staging
        assert ckpt.latest() == 20
        assert not (tmp_path / "global_step10").exists()  # nothing written to disk
        for step in (10, 20):
            for name, want in ds_files(step).items():
                got = ce.load(os.path.join(tmp_path, f"global_step{step}", name), map_location="cpu")
                assert same(want, got), (step, name)
        with pytest.raises(Exception):
            ce.load(os.path.join(tmp_path, "global_step10", "no_such_file.pt"))
        torch.save({"x": 1}, tmp_path / "plain.pt")  # not in the daemon: read from disk
        assert ce.load(str(tmp_path / "plain.pt")) == {"x": 1}


def _trainer_state(step):
    try:
        from transformers import TrainerControl, TrainerState

        st = TrainerState()
        st.global_step, st.epoch = step, step / 10
        return st, TrainerControl()
    except ImportError:
        return SimpleNamespace(global_step=step, epoch=step / 10), SimpleNamespace()


def test_hf_callback_snapshots_every_n_and_restores(daemon):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        cb = UcpdCallback(ckpt, every=2, wait=True)
        saved = {}
        for step in range(1, 6):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            st, ctl = _trainer_state(step)
            cb.on_step_end(None, st, ctl, model=model, optimizer=opt)
            if step % 2 == 0:
                saved[step] = ({k: v.clone() for k, v in model.state_dict().items()},
                               opt.state_dict()["state"][0]["exp_avg"].clone())
        assert ckpt.latest() == 4
        # a resumed job: fresh model and optimizer (whose state exists after one step)
        model2 = torch.nn.Linear(4, 3)
        opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
        model2(torch.randn(2, 4)).sum().backward()
        opt2.step()
        st, ctl = _trainer_state(0)
        cb2 = UcpdCallback(ckpt, every=2)
        cb2.on_train_begin(None, st, ctl, model=model2, optimizer=opt2)
        assert cb2.restored_step == 4 and st.global_step == 4 and st.epoch == pytest.approx(0.4)
        for k, v in saved[4][0].items():
            assert torch.equal(model2.state_dict()[k], v)
        assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], saved[4][1])


def test_hf_callback_is_a_transformers_callback():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional)")
    assert isinstance(UcpdCallback(object(), every=3), transformers.TrainerCallback)


def _tiny_trainer(tmp_path, seed, max_steps, callbacks):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="accelerate is not installed (transformers' Trainer needs it; "
                        "pip install --no-deps accelerate: its wheel requires torch)")
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(32, (16, 8), generator=g)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / f"out{seed}"), max_steps=max_steps, per_device_train_batch_size=4,
        learning_rate=1e-2, save_strategy="no", report_to=[], use_cpu=True, logging_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=seed)
    return transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def test_hf_callback_inside_a_real_trainer(daemon, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")

    class Probe(transformers.TrainerCallback):
        """Records the model's and optimizer's state when training begins (after UcpdCallback
        restored them) and at each step's end."""

        def __init__(self):
            self.begin, self.steps = None, []

        def snap(self, model, optimizer):
            return ({k: v.clone() for k, v in model.state_dict().items()},
                    {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()})

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
            self.begin = (state.global_step, self.snap(model, optimizer))

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            self.steps.append((state.global_step, self.snap(model, optimizer)))

    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        first = Probe()
        _tiny_trainer(tmp_path, 0, 4, [UcpdCallback(ckpt, every=2, wait=True), first]).train()
        assert ckpt.latest() == 4
        at4 = dict(first.steps)[4]
        # a new job run: another model init, a fresh optimizer (no state), and 6 steps to go
        second, cb = Probe(), UcpdCallback(ckpt, every=2, wait=True)
        trainer = _tiny_trainer(tmp_path, 1, 6, [cb, second])
        trainer.train()
        assert cb.restored_step == 4 and second.begin[0] == 4
        model_sd, opt_sd = second.begin[1]
        assert model_sd.keys() == at4[0].keys() and all(torch.equal(model_sd[k], at4[0][k]) for k in model_sd)
        assert opt_sd.keys() == at4[1].keys() and len(opt_sd) > 0
        for i in opt_sd:
            assert all(torch.equal(opt_sd[i][k], at4[1][i][k]) for k in at4[1][i]), i
        assert [s for s, _ in second.steps] == [5, 6]  # it went on from step 4
        assert trainer.state.global_step == 6 and ckpt.latest() == 6
