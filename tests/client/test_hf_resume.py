"""A Hugging Face ``Trainer`` resumed through ``UcpdCallback`` continues exactly like one that
never stopped, and like HF's own ``resume_from_checkpoint``.

Tiny GPT-2 from a config on the CPU, dropout on, a linear schedule with warmup, shuffled data of
6 batches an epoch, 8 steps logged one by one. A run stopped after step 4 (mid-epoch: the
resumed run must skip the 4 batches already seen, then cross into epoch 1) is resumed by a new
``Trainer`` with another model init: through HF's own checkpoint folder, and through the daemon
(a real one, in its own process). All three log the same losses, gradient norms and learning
rates, bit for bit, and end with the same weights.
"""

from __future__ import annotations

import pytest
import torch

from ucpd_client import Checkpointer
from ucpd_client.integrations.hf import UcpdCallback

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install --no-deps accelerate)")

STEPS, STOP = 8, 4


class StopAt(transformers.TrainerCallback):
    """Ends training after step ``step``, as a job that is killed there (the schedule still
    planned for 8 steps)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def trainer(out, init_seed, callbacks, save=False):
    torch.manual_seed(init_seed)  # the model's init: a resumed run's differs from the first
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(7)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(64, (24, 12), generator=g)]
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=5e-3,
        lr_scheduler_type="linear", warmup_steps=2, logging_steps=1, report_to=[], use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0, seed=11,
        save_strategy="steps" if save else "no", save_steps=STOP)
    return transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def logged(t) -> list[tuple]:
    return [(h["step"], h["loss"], h["grad_norm"], h["learning_rate"]) for h in t.state.log_history if "loss" in h]


def weights(t) -> dict:
    return {k: v.clone() for k, v in t.model.state_dict().items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    t = trainer(tmp_path_factory.mktemp("whole"), 0, [])
    t.train()
    return logged(t), weights(t)


def test_hf_own_resume_matches_the_uninterrupted_run(tmp_path, uninterrupted):
    first = trainer(tmp_path, 0, [StopAt(STOP)], save=True)
    first.train()
    again = trainer(tmp_path, 1, [], save=True)
    again.train(resume_from_checkpoint=str(tmp_path / f"checkpoint-{STOP}"))
    assert logged(again) == uninterrupted[0]


def test_a_resume_through_the_daemon_continues_bit_for_bit(daemon, tmp_path, uninterrupted):
    want_log, want_weights = uninterrupted
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        cb = UcpdCallback(ckpt, every=2)
        first = trainer(tmp_path / "a", 0, [cb, StopAt(STOP)])
        assert cb.resume_from(first) is None  # nothing in the daemon yet: a fresh run
        first.train()
        assert ckpt.latest() == STOP and logged(first) == want_log[:STOP]

        cb2 = UcpdCallback(ckpt, every=2)
        again = trainer(tmp_path / "b", 1, [cb2])
        folder = cb2.resume_from(again)
        assert cb2.restored_step == STOP and folder.endswith(f"checkpoint-{STOP}")
        again.train(resume_from_checkpoint=folder)

        assert logged(again) == want_log  # steps 1-4 from the restored state, 5-8 trained again
        got = weights(again)
        assert got.keys() == want_weights.keys()
        assert [k for k in got if not torch.equal(got[k], want_weights[k])] == []
        assert again.state.global_step == STEPS and ckpt.latest() == STEPS
        assert again.state.total_flos == pytest.approx(trainer_flos(tmp_path))


def trainer_flos(tmp_path) -> float:
    t = trainer(tmp_path / "c", 0, [])
    t.train()
    return t.state.total_flos


def test_without_the_daemons_state_the_resume_is_not_like_hfs(daemon, tmp_path, uninterrupted):
    """The test can fail: a resume that restores the weights and optimizer only (what
    UcpdCallback did before) logs other losses."""
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        cb = UcpdCallback(ckpt, every=STOP, wait=True)
        trainer(tmp_path / "a", 0, [cb, StopAt(STOP)]).train()
        folder = UcpdCallback(ckpt).resume_from(trainer(tmp_path / "x", 1, []))
        import os

        os.remove(os.path.join(folder, "rng_state.pth"))
        os.remove(os.path.join(folder, "scheduler.pt"))
        again = trainer(tmp_path / "b", 1, [])
        again.train(resume_from_checkpoint=folder)
        assert logged(again)[STOP:] != uninterrupted[0][STOP:]


def test_a_resume_folder_never_read_is_gone_when_the_process_exits(daemon, tmp_path):
    """resume_from writes a whole checkpoint (the model, the optimizer) into /dev/shm; a run that
    fails before its first step must not leave it there."""
    import os
    import subprocess
    import sys

    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        trainer(tmp_path / "a", 0, [UcpdCallback(ckpt, every=STOP, wait=True), StopAt(STOP)]).train()
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (
        "import sys\n"
        f"sys.path[:0] = [{tests!r}]\n"
        "from client.test_hf_resume import trainer\n"
        "from ucpd_client import Checkpointer\n"
        "from ucpd_client.integrations.hf import UcpdCallback\n"
        f"with Checkpointer({str(daemon.run_dir)!r}, rank=0, world_size=1, embedded=False) as ckpt:\n"
        f"    print(UcpdCallback(ckpt).resume_from(trainer({str(tmp_path / 'b')!r}, 1, [])), flush=True)\n"
        "raise SystemExit(3)  # the job fails before training\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 3, out.stderr[-2000:]
    folder = out.stdout.strip().splitlines()[-1]
    assert os.path.basename(folder) == f"checkpoint-{STOP}" and not os.path.exists(os.path.dirname(folder))
