"""A Lightning ``CheckpointIO`` plugin: checkpoints go to the ucpd daemon's RAM, and resumes
come back from it::

    from ucpd_client.integrations.lightning import UcpdCheckpointIO
    trainer = lightning.Trainer(plugins=[UcpdCheckpointIO()], callbacks=[ModelCheckpoint(...)])
    trainer.fit(model, ckpt_path="last")      # or a path ModelCheckpoint wrote

``save_checkpoint(checkpoint, path)`` snapshots the checkpoint dict — its tensors (weights,
optimizer states) through shared memory, everything else (loop counters, callback states such
as ``ModelCheckpoint``'s, hyper-parameters, schedulers) as one plain value — waits until the
version is committed, then writes at ``path`` a *pointer*: a few hundred bytes of JSON naming
the job and the version (written to a temporary name, then renamed). So ``ModelCheckpoint``'s
bookkeeping (top-k, ``last.ckpt``, ``ckpt_path="last"``/``"best"``) works as with files, and
``remove_checkpoint`` removes the pointer (the daemon keeps its ``--keep`` newest versions, and
flushes them where ``--flush-dir`` says). ``load_checkpoint(path)`` reads the pointer and
restores that version from the daemon (a real ``.ckpt`` file is loaded by Lightning's own
``TorchCheckpointIO``).

Lightning saves on global rank 0 only (single device, DDP), so the plugin's ``Checkpointer``
is a job of one rank (``rank=0, world_size=1``); every rank can load. Versions are numbered by
``global_step`` (a second save at the same step, e.g. ``last.ckpt``, takes the next number:
the pointer says which). Lightning's checkpoints hold no RNG state, here as in its own files.
"""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

import torch

from ucpd import state_names
from ucpd.format.durable import write_file_atomic

try:
    from lightning.pytorch.plugins.io import CheckpointIO as _Base, TorchCheckpointIO
except ImportError:  # pragma: no cover - the older package name
    from pytorch_lightning.plugins.io import CheckpointIO as _Base, TorchCheckpointIO

POINTER_FORMAT = "ucpd-lightning-pointer"
_POINTER_MAX = 64 << 10  # a pointer file is a few hundred bytes; anything larger is a real checkpoint


def _Ref(name: str) -> state_names.Ref:
    """A tensor's place in a checkpoint dict pickled before ``state_names.skeleton`` (its name)."""
    return state_names.Ref(name)


def _is_tensor(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor)


class UcpdCheckpointIO(_Base):
    """Lightning checkpoints in the ucpd daemon (``Trainer(plugins=[UcpdCheckpointIO()])``).

    Args:
        checkpointer: a ``Checkpointer`` (default: one made on first use, ``rank=0,
            world_size=1``, the job from ``$UCPD_JOB`` / the launcher as ``Checkpointer`` finds it).
    """

    def __init__(self, checkpointer: Any = None) -> None:
        self._ckpt = checkpointer
        self._last: int | None = None  # the newest version number this plugin used

    @property
    def ckpt(self) -> Any:
        if self._ckpt is None:
            from .. import Checkpointer

            self._ckpt = Checkpointer(rank=0, world_size=1)
        return self._ckpt

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Snapshot ``checkpoint`` into the daemon (committed when this returns) and write the
        pointer at ``path``."""
        if storage_options is not None:
            raise TypeError(f"UcpdCheckpointIO takes no storage_options (got {storage_options!r})")
        skeleton, tensors = state_names.skeleton(checkpoint, _is_tensor)
        if self._last is None:
            self._last = self.ckpt.latest() or 0
        step = max(int(checkpoint.get("global_step", 0)), self._last + 1)
        state = {"tensors": {k: (t.detach().cpu() if t.is_cuda else t) for k, t in tensors.items()},
                 "lightning": pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)}
        self.ckpt.snapshot(step, state).wait()
        self._last = step
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        pointer = {"format": POINTER_FORMAT, "version": 1, "job": self.ckpt.job, "step": step,
                   "global_step": int(checkpoint.get("global_step", 0)), "epoch": int(checkpoint.get("epoch", 0)),
                   "tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
        write_file_atomic(path, json.dumps(pointer).encode(), tmp=f"{path}.tmp-{os.getpid()}")

    @staticmethod
    def read_pointer(path: Any) -> dict | None:
        """The pointer at ``path``, or None when it is not one (a real checkpoint file)."""
        try:
            if os.path.getsize(path) > _POINTER_MAX:
                return None
            with open(path, "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) and doc.get("format") == POINTER_FORMAT else None

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict the pointer at ``path`` names, restored from the daemon (a real
        checkpoint file: loaded by ``TorchCheckpointIO``). Raises VersionNotFound (the version
        left the daemon's RAM and flush dir), ChecksumMismatch."""
        pointer = self.read_pointer(path)
        if pointer is None:
            return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if pointer["job"] != self.ckpt.job:
            from ..errors import VersionNotFound

            raise VersionNotFound(
                f"{path} points to job {pointer['job']!r}'s step {pointer['step']}, and this Checkpointer serves job "
                f"{self.ckpt.job!r}: pass UcpdCheckpointIO(Checkpointer(job={pointer['job']!r}, rank=0, world_size=1))")
        step = int(pointer["step"])
        desc = self.ckpt.describe(step)
        tensors = {name[len("tensors."):]: torch.empty(tuple(info["shape"]), dtype=getattr(torch, info["dtype"]))
                   for name, info in desc["tensors"].items() if name.startswith("tensors.")}
        target = {"tensors": tensors, "lightning": None}
        self.ckpt.restore(target, step=step)
        return state_names.fill(pickle.loads(target["lightning"]), tensors)  # this job's own pickle, CRC-checked

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer (or file) at ``path``; the daemon's versions follow its ``--keep``."""
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

    def teardown(self) -> None:
        pass
