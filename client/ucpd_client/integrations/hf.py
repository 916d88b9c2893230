"""A Hugging Face ``TrainerCallback`` that snapshots into the ucpd daemon every N steps and
restores on resume (the model, and the optimizer's state even before its first step)::

    from ucpd_client.integrations.hf import UcpdCallback
    trainer = Trainer(..., callbacks=[UcpdCallback(every=50)])

``on_step_end``: every ``every`` optimizer steps, ``snapshot(global_step, {"model": ...,
"optimizer": ..., "trainer": {"global_step", "epoch"}})``, waiting only until the tensors are
staged (the next step may then change them). ``on_train_begin``: with ``restore=True`` and a
committed version in the daemon, fills the model's tensors (and the optimizer's, once its state
exists) in place and puts the trainer counters back on ``state``; ``restored_step`` says which.
Works without transformers installed (the interface is duck-typed: ``state.global_step``,
``state.epoch``, the ``model`` / ``optimizer`` keyword arguments the Trainer passes).
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback as _Base
except Exception:  # pragma: no cover - depends on the environment
    _Base = object


class UcpdCallback(_Base):
    def __init__(self, checkpointer: Any = None, every: int = 1, restore: bool = True,
                 optimizer_state: bool = True, wait: bool = False) -> None:
        if every < 1:
            raise ValueError("every must be >= 1")
        self._ckpt = checkpointer
        self.every, self.restore, self.optimizer_state, self.wait = every, restore, optimizer_state, wait
        self.restored_step: int | None = None
        self.last_handle = None

    @property
    def ckpt(self) -> Any:
        if self._ckpt is None:
            from .. import Checkpointer

            self._ckpt = Checkpointer()
        return self._ckpt

    def _state(self, model: Any, optimizer: Any, state: Any) -> dict:
        out = {"model": model.state_dict(),
               "trainer": {"global_step": int(state.global_step), "epoch": float(state.epoch or 0.0)}}
        if self.optimizer_state and optimizer is not None and optimizer.state_dict().get("state"):
            out["optimizer"] = optimizer.state_dict()
        return out

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                    **kw: Any) -> Any:
        if model is not None and state.global_step > 0 and state.global_step % self.every == 0:
            h = self.ckpt.snapshot(int(state.global_step), self._state(model, optimizer, state))
            h.staged()
            if self.wait:
                h.wait()
            self.last_handle = h
        return control

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kw: Any) -> Any:
        if not self.restore or model is None:
            return control
        step = self.ckpt.latest()
        if step is None:
            return control
        target = self._state(model, optimizer, state)
        if self.optimizer_state and optimizer is not None and "optimizer" not in target:
            opt = self._optimizer_target(optimizer, step)  # no state before the first step: shapes from the daemon
            if opt is not None:
                target["optimizer"] = opt
        self.ckpt.restore(target, step=step)
        state.global_step = int(target["trainer"]["global_step"])
        state.epoch = float(target["trainer"]["epoch"])
        if "optimizer" in target:
            optimizer.load_state_dict(target["optimizer"])
        self.restored_step = step
        return control

    def _optimizer_target(self, optimizer: Any, step: int) -> dict | None:
        """An optimizer state dict to restore into, shaped as the saved one (the daemon's
        ``describe``): a fresh optimizer has no state until its first step."""
        import torch

        desc = self.ckpt._conn().call("describe", step=step)
        prefix = "optimizer.state."
        state: dict = {}
        for name, info in desc["tensors"].items():
            if name.startswith(prefix):
                pid, _, key = name[len(prefix):].partition(".")
                state.setdefault(int(pid), {})[key] = torch.empty(tuple(info["shape"]), dtype=getattr(torch, info["dtype"]))
        if not state:
            return None
        return {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        if self.last_handle is not None:
            self.last_handle.wait()
        return control
