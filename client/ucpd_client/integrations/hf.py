"""A Hugging Face ``TrainerCallback`` that snapshots into the ucpd daemon, and a resume that is
``Trainer``'s own ``resume_from_checkpoint``::

    from ucpd_client.integrations.hf import UcpdCallback
    cb = UcpdCallback(every=50)
    trainer = Trainer(..., callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.resume_from(trainer))   # None: nothing to resume

What a snapshot holds is what ``Trainer._save_checkpoint`` writes: the model's and the
optimizer's tensors (through shared memory), the LR scheduler's state, the RNG states (Python,
numpy, torch CPU, CUDA where present) and the ``TrainerState`` (global step, epoch, log history,
FLOs, best metric, stateful callbacks) as plain values.

``resume_from(trainer)`` restores the newest committed version from the daemon's RAM into a
checkpoint folder in HF's layout, in a private temporary folder on ``/dev/shm`` (removed once
the trainer has read it), and returns its path: ``Trainer`` itself then loads the weights,
optimizer, scheduler and trainer state, skips the batches of the epoch already seen
(``accelerate.skip_first_batches``, unless ``ignore_data_skip``) and puts the RNG states back
where its own resume does — so a resumed run logs the same losses, bit for bit, as one that
never stopped (``tests/client/test_hf_resume.py``).

When is a step snapshotted: every ``every`` optimizer steps, at the point where HF would save
it — after the step's log (``on_log``) and evaluation (``on_evaluate``) when the step logs or
evaluates, else at ``on_step_end`` — so the log history and the RNG states are those of HF's
checkpoint of that step. The snapshot waits only until the tensors are staged.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import random
import shutil
import tempfile
import weakref
from typing import Any

try:
    from transformers import TrainerCallback as _Base
except Exception:  # pragma: no cover - depends on the environment
    _Base = object

log = logging.getLogger("ucpd.hf")


def _rng_state() -> dict:
    """The RNG states as ``Trainer._save_rng_state`` takes them (torch states as bytes: plain values)."""
    import numpy as np
    import torch

    out = {"python": random.getstate(), "numpy": np.random.get_state(),
           "cpu": torch.random.get_rng_state().numpy().tobytes()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [s.numpy().tobytes() for s in torch.cuda.random.get_rng_state_all()]
    return out


def _rng_file_state(rng: dict, distributed: bool) -> dict:
    """The RNG states in the form of HF's ``rng_state.pth`` (torch states as ByteTensors)."""
    import torch

    def t(b: bytes):
        return torch.frombuffer(bytearray(b), dtype=torch.uint8)

    out = {"python": rng["python"], "numpy": rng["numpy"], "cpu": t(rng["cpu"])}
    if "cuda" in rng:
        out["cuda"] = [t(b) for b in rng["cuda"]] if distributed else t(rng["cuda"][0])
    return out


class UcpdCallback(_Base):
    """Snapshots the training state into the daemon every ``every`` optimizer steps.

    Args:
        checkpointer: a ``Checkpointer`` (default: one made on first use).
        every: snapshot every that many optimizer steps.
        restore: ``resume_from`` restores (False: it always returns None).
        optimizer_state: snapshot the optimizer's state too.
        wait: wait until each snapshot is committed by every rank (default: until staged).
    """

    def __init__(self, checkpointer: Any = None, every: int = 1, restore: bool = True,
                 optimizer_state: bool = True, wait: bool = False) -> None:
        if every < 1:
            raise ValueError("every must be >= 1")
        self._ckpt = checkpointer
        self.every, self.restore, self.optimizer_state, self.wait = every, restore, optimizer_state, wait
        self.restored_step: int | None = None
        self.last_handle = None
        self._trainer = None
        self._pending: dict | None = None  # a due step waiting for its log / evaluation
        self._folder: str | None = None  # the checkpoint folder resume_from made, until HF read it

    @property
    def ckpt(self) -> Any:
        if self._ckpt is None:
            from .. import Checkpointer

            self._ckpt = Checkpointer()
        return self._ckpt

    # --- snapshots ---------------------------------------------------------------------------

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                    lr_scheduler: Any = None, **kw: Any) -> Any:
        if model is None or state.global_step <= 0 or state.global_step % self.every:
            return control
        self._pending = {"args": args, "state": state, "model": model, "optimizer": optimizer, "scheduler": lr_scheduler,
                         "after": "evaluate" if control.should_evaluate else "log" if control.should_log else None}
        if self._pending["after"] is None:
            self._take()
        return control

    def on_log(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        if self._pending is not None and self._pending["after"] == "log":
            self._take()
        return control

    def on_evaluate(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        if self._pending is not None and self._pending["after"] == "evaluate":
            self._take()
        return control

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        if self.restore and self._trainer is None and state.global_step == 0:
            step = self.ckpt.latest()
            if step is not None:  # the old way (restore here) skewed the resumed run: say how to resume
                log.warning(
                    "the daemon holds step %d of job %r, and this Trainer starts from step 0: to resume from it, "
                    "call trainer.train(resume_from_checkpoint=callback.resume_from(trainer))", step, self.ckpt.job)
        return control

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        self._forget_folder()  # the trainer has read what resume_from wrote (RNG states last)
        if self._pending is not None:  # the step's log or evaluation did not happen after all
            self._take()
        return control

    def _take(self) -> None:
        p, self._pending = self._pending, None
        state, trainer = p["state"], self._trainer
        if trainer is not None:  # as Trainer._save_checkpoint: FLOs and the stateful callbacks, then the state
            trainer.store_flos()
            _export_callbacks(trainer)
        resume = {  # one plain value (nested dicts would be flattened into leaves of unknown names)
            "trainer_state": json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n",
            "rng": _rng_state(),
            "scheduler": p["scheduler"].state_dict() if p["scheduler"] is not None else None,
        }
        values = {"global_step": int(state.global_step), "epoch": float(state.epoch or 0.0),
                  "hf": pickle.dumps(resume, protocol=pickle.HIGHEST_PROTOCOL)}
        out = {"model": p["model"].state_dict(), "trainer": values}
        opt = p["optimizer"]
        if self.optimizer_state and opt is not None and opt.state_dict().get("state"):
            out["optimizer"] = opt.state_dict()
        h = self.ckpt.snapshot(int(state.global_step), out)
        h.staged()
        if self.wait:
            h.wait()
        self.last_handle = h

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        if self._pending is not None:
            self._take()
        if self.last_handle is not None:
            self.last_handle.wait()
        self._forget_folder()
        return control

    # --- resume ------------------------------------------------------------------------------

    def resume_from(self, trainer: Any) -> str | None:
        """Restore the newest committed version of this job into a checkpoint folder that
        ``trainer.train(resume_from_checkpoint=...)`` reads; None when there is none (a fresh
        run). Binds the callback to ``trainer`` (its FLO counter and stateful callbacks are
        then saved as HF saves them). Raises VersionNotFound, ChecksumMismatch."""
        import torch
        from safetensors.torch import save_file

        self._trainer = trainer
        if not self.restore:
            return None
        step = self.ckpt.latest()
        if step is None:
            return None
        desc = self.ckpt.describe(step)
        model: dict = {}
        opt_state: dict = {}
        for name, info in desc["tensors"].items():
            empty = torch.empty(tuple(info["shape"]), dtype=getattr(torch, info["dtype"]))
            if name.startswith("model."):
                model[name[len("model."):]] = empty
            elif name.startswith("optimizer.state."):
                pid, _, key = name[len("optimizer.state."):].partition(".")
                opt_state.setdefault(int(pid), {})[key] = empty
        values = {"global_step": None, "epoch": None, "hf": None}
        target = {"model": model, "trainer": values}
        if opt_state:
            target["optimizer"] = {"state": opt_state, "param_groups": None}
        self.ckpt.restore(target, step=step)
        if values["hf"] is None:
            from ..errors import VersionNotFound

            raise VersionNotFound(
                f"step {step} of job {self.ckpt.job!r} holds no trainer state (saved by an older UcpdCallback): "
                "resume from a newer step, or load its model with ucpd_client's restore()")
        values = pickle.loads(values["hf"])  # written by this job's own ranks, checked against its CRC
        self._forget_folder()
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self._folder = tempfile.mkdtemp(prefix=f"ucpd-hf-{self.ckpt.job}-", dir=shm)
        # removed once the trainer read it, and in any case when the process exits: a run that
        # fails before its first step leaves no model copy in /dev/shm
        self._remove_folder = weakref.finalize(_PROCESS, shutil.rmtree, self._folder, True)
        path = os.path.join(self._folder, f"checkpoint-{step}")
        os.makedirs(path)
        save_file(model, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        if opt_state:
            torch.save(target["optimizer"], os.path.join(path, "optimizer.pt"))
        if values["scheduler"] is not None:
            torch.save(values["scheduler"], os.path.join(path, "scheduler.pt"))
        args = trainer.args
        rng_name = "rng_state.pth" if args.world_size <= 1 else f"rng_state_{args.process_index}.pth"
        torch.save(_rng_file_state(values["rng"], args.world_size > 1), os.path.join(path, rng_name))
        with open(os.path.join(path, "trainer_state.json"), "w", encoding="utf-8") as f:
            f.write(values["trainer_state"])
        self.restored_step = step
        log.info("resuming from step %d of job %r (the daemon's RAM, through %s)", step, self.ckpt.job, path)
        return path

    def _forget_folder(self) -> None:
        if self._folder is not None:
            self._remove_folder()
            self._folder = None


class _Process:
    """Lives as long as the process: what is finalized on it goes at exit (or when called)."""


_PROCESS = _Process()


def _export_callbacks(trainer: Any) -> None:
    """``TrainerState.stateful_callbacks`` as ``Trainer._save_checkpoint`` updates it."""
    try:
        from transformers.trainer_callback import ExportableState
    except ImportError:  # pragma: no cover
        return
    for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control] if isinstance(c, ExportableState)]:
        name, cb_state = cb.__class__.__name__, cb.state()
        if isinstance(trainer.state.stateful_callbacks.get(name), list):
            trainer.state.stateful_callbacks[name].append(cb_state)
        else:
            trainer.state.stateful_callbacks[name] = cb_state
