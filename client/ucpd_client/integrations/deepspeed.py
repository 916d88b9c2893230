"""A DeepSpeed ``CheckpointEngine`` that keeps checkpoints in the ucpd daemon.

A DeepSpeed job switches with one line after ``deepspeed.initialize`` and keeps calling
``engine.save_checkpoint(dir)`` / ``engine.load_checkpoint(dir)``::

    from ucpd_client.integrations.deepspeed import use_ucpd
    use_ucpd(engine)            # engine.checkpoint_engine = UcpdCheckpointEngine(Checkpointer())

DeepSpeed hands the engine one state dict per file (``save(state_dict, path)``) and then
``commit(info)``; the engine snapshots every file this rank saved under the tag as one version
(step: the number in the tag, ``global_step<N>``), waits until the tensors are staged (the
optimizer may then step) and, with ``wait=True``, until the version is committed. Each file is
stored as its tensors (``ds/<file>/<name>``, named by ``ucpd.state_names``: ``module.w``) plus its
structure with the tensors left out (``state_names.skeleton``), pickled into a uint8 tensor
(``ds/<file>/skeleton``): the job's own objects, read back only by the job.
``load(path)`` rebuilds the file from the daemon (RAM, peers or its flush dir), and falls back
to ``torch.load`` of the file on disk when the daemon has no such version or file. Files on disk
are not written (DeepSpeed still writes its ``latest`` tag file, which ``load_checkpoint`` reads).
The daemon flushes versions to the universal format in the background.
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

import torch

from ucpd import state_names

from ..errors import PlacementMismatch, VersionNotFound

try:  # the real base class where DeepSpeed is installed; the same interface otherwise
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine as _Base
except Exception:  # pragma: no cover - depends on the environment
    _Base = object

PREFIX = "ds"


def _Ref(i: int) -> state_names.Ref:
    """A tensor's place in a skeleton pickled before ``state_names.skeleton`` (by its index, the
    name its tensor was saved under)."""
    return state_names.Ref(str(i))


def _is_tensor(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor)


def step_of_tag(tag: str) -> int | None:
    m = re.search(r"(\d+)$", str(tag))
    return int(m.group(1)) if m else None


class UcpdCheckpointEngine(_Base):
    """DeepSpeed ``CheckpointEngine`` over a ``ucpd_client.Checkpointer`` (see the module)."""

    def __init__(self, checkpointer: Any = None, config_params: Any = None, wait: bool = False) -> None:
        if _Base is not object:
            super().__init__(config_params)
        if checkpointer is None:
            from .. import Checkpointer

            checkpointer = Checkpointer()
        self.name = "UcpdCheckpointEngine"
        self.ckpt = checkpointer
        self.wait = wait
        self._pending: dict[str, Any] = {}
        self._counter = 0
        self.last_handle = None

    # -- DeepSpeed's interface ------------------------------------------------------------
    def create(self, info: Any) -> None:
        self._pending = {}

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        self._pending[os.path.basename(path)] = state_dict

    def commit(self, info: Any) -> bool:
        if not self._pending:
            return True
        step = step_of_tag(getattr(info, "tag", ""))
        if step is None:
            self._counter += 1
            step = self._counter
        state: dict[str, Any] = {}
        for fname, sd in self._pending.items():
            skel, tensors = state_names.skeleton(sd, _is_tensor, reserved=("skeleton",))
            skeleton = pickle.dumps(skel, protocol=pickle.HIGHEST_PROTOCOL)
            for name, t in tensors.items():
                state[f"{PREFIX}/{fname}/{name}"] = t.detach()
            state[f"{PREFIX}/{fname}/skeleton"] = torch.frombuffer(bytearray(skeleton), dtype=torch.uint8)
        self._pending = {}
        h = self.ckpt.snapshot(step, state)
        h.staged()  # the optimizer may modify the tensors from here on
        if self.wait:
            h.wait()
        self.last_handle = h
        return True

    def load(self, path: str, map_location: Any = None) -> Any:
        fname = os.path.basename(path)
        step = step_of_tag(os.path.basename(os.path.dirname(path)))
        try:
            return self._load_from_daemon(fname, step)
        except (VersionNotFound, PlacementMismatch, KeyError):
            if os.path.exists(path):
                return torch.load(path, map_location=map_location, weights_only=False)
            raise

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def preserves_storage_sharing(self) -> bool:
        return False

    def cleanup(self) -> None:
        if self.last_handle is not None:
            self.last_handle.wait()

    # -- ucpd --------------------------------------------------------------------------
    def _load_from_daemon(self, fname: str, step: int | None) -> Any:
        desc = self.ckpt.describe(step)
        prefix = f"{PREFIX}/{fname}/"
        infos = {n[len(prefix):]: t for n, t in desc["tensors"].items() if n.startswith(prefix)}
        if "skeleton" not in infos:
            raise KeyError(fname)
        targets = {f"{prefix}{k}": torch.empty(tuple(t["shape"]), dtype=getattr(torch, t["dtype"]))
                   for k, t in infos.items()}
        self.ckpt.restore(targets, step=desc["step"])
        skeleton = pickle.loads(targets[f"{prefix}skeleton"].numpy().tobytes())
        return state_names.fill(skeleton, {k: targets[f"{prefix}{k}"] for k in infos if k != "skeleton"})


def use_ucpd(engine: Any, checkpointer: Any = None, wait: bool = False) -> UcpdCheckpointEngine:
    """Make a DeepSpeed engine save to and load from the ucpd daemon."""
    ce = UcpdCheckpointEngine(checkpointer, getattr(engine, "_config", None), wait=wait)
    engine.checkpoint_engine = ce
    return ce
