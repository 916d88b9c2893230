"""A torchft ``CheckpointTransport`` that heals a recovering replica from the ucpd daemons' RAM.

torchft (https://github.com/pytorch/torchft) keeps training while replica groups fail and come
back; a replica that (re)joins is *healed* with the state of a live replica at the quorum's
step. Its default transports make the live replica serve the bytes itself (HTTP, or sends over
the process group) while it trains. With this transport the live replica only snapshots its
state into its node daemon (``send_checkpoint`` returns once the tensors are staged: the
optimizer may step again at once) and the recovering replica restores that version from the
daemon's RAM::

    from ucpd_client import Checkpointer
    from ucpd_client.integrations.torchft import UcpdTransport

    ckpt = Checkpointer(job=f"{run}-replica{replica_id}", rank=group_rank, world_size=group_size)
    transport = UcpdTransport(ckpt, state_dict=lambda: manager._manager_state_dict())  # optional template
    manager = Manager(pg=ProcessGroupGloo(), ..., checkpoint_transport=transport)

What each call does (the interface is torchft's ``torchft.checkpointing.CheckpointTransport``,
checked against torchft 0.2.0, whose ``Manager`` calls it from its quorum thread):

* ``metadata()`` -> JSON naming the daemon (its run dir and host), the job, this group rank and
  the replica group's size. The Manager hands the live replica's metadata, per group rank, to
  the recovering one.
* ``send_checkpoint(dst_ranks, step, state_dict, timeout)`` snapshots ``state_dict`` (the
  Manager's ``{"user": ..., "torchft": {"step", "batches_committed"}}``) as version ``step`` of
  this Checkpointer's job and waits until it is staged. Each tensor is named by its path in the
  state dict (``user.default.model.weight``); DTensors bring their own placement, other tensors
  take ``placements`` given here (default: replicated); a DTensor on a device mesh without this
  process travels as it is (its local tensor, named ``<path>@rank<r>``, and its spec). The structure (a torch pytree spec) and
  every non-tensor leaf travel as one plain value of the version. A step already snapshotted
  (the same version asked for by two recovering replicas, or one the job snapshotted itself)
  is not snapshotted again.
* ``disallow_checkpoint()`` -- the Manager may then change the state: nothing is left to wait
  for (the bytes were copied out before ``send_checkpoint`` returned); raises a snapshot's error.
* ``recv_checkpoint(src_rank, metadata, step, timeout)`` waits (up to ``timeout``) until version
  ``step`` of the sender's job is committed in the daemon that ``metadata`` names, and returns
  the state dict: the tensors of the template ``state_dict()`` (given at construction, as
  torchft's ``PGTransport`` takes it) are filled in place wherever path, dtype and shape agree
  (so they land on the template's device, and a DTensor template is read under its own
  placement); every other tensor is a new CPU tensor of the shape the sender recorded (a DTensor
  leaf is rebuilt on the sender's pickled spec, as ``PGTransport`` does). torchft's Manager does
  not pass the recovering replica's state to ``recv_checkpoint``, hence the optional template.
* ``shutdown(wait)`` waits for the last snapshot's commit (``wait=True``) and closes the
  Checkpointers this transport opened.

Where the bytes come from: the receiver reads the daemon at the run dir named in the metadata,
so it must reach that daemon's socket: the same node (a replica group restarted on the nodes it
ran on, a spare on the same host) or a run dir shared with it. A daemon on another node is not
reachable from a trainer (trainers speak to daemons over ``ipc://`` only); for that case pass
``fallback=`` another transport (e.g. torchft's ``HTTPTransport``): the sender then also offers
its state through it, and a receiver that cannot reach the sender's daemon uses it instead.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import threading
import time
import warnings
from datetime import timedelta
from typing import Any, Callable, Generic, Mapping, TypeVar

import torch
from torch.utils import _pytree as pytree

from ..errors import DaemonUnreachable, UcpdError, VersionNotFound
from ..placement import dtensor_class  # cached: torch.distributed imported once
from ..restore import merged_values

try:  # torchft's own abstract base class where torchft is installed; the same interface otherwise
    from torchft.checkpointing.transport import CheckpointTransport as _Base
except Exception:  # pragma: no cover - depends on the environment
    T_ = TypeVar("T_")

    class _Base(Generic[T_]):  # type: ignore[no-redef]
        pass

T = TypeVar("T")

META_KEY = "__torchft__"  # the plain value holding the structure and the non-tensor leaves
METADATA_KIND = "ucpd/1"


class _TensorLeaf:
    """Where a tensor leaf went: its name in the version, dtype, local shape, and the DTensor
    spec of the sender (None for a plain tensor). ``local``: a DTensor on a device mesh that
    does not include the sender: its local tensor travels as it is, under a name of the
    sender's rank, and the receiver rebuilds the DTensor on the spec (as torchft's transports do)."""

    __slots__ = ("name", "dtype", "shape", "spec", "local")

    def __init__(self, name: str, dtype: torch.dtype, shape: tuple, spec: Any = None, local: bool = False) -> None:
        self.name, self.dtype, self.shape, self.spec, self.local = name, dtype, tuple(shape), spec, local

    def __reduce__(self):
        return (_TensorLeaf, (self.name, self.dtype, self.shape, self.spec, self.local))


def _key_name(entry: Any) -> str:
    for attr in ("key", "idx", "name"):  # MappingKey, SequenceKey, GetAttrKey
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def path_name(path: tuple) -> str:
    """A pytree key path as a dotted tensor name: ``("user", "default", "w")`` -> ``user.default.w``."""
    return ".".join(_key_name(e) for e in path)


def split_state(state_dict: Any, rank: int = 0) -> tuple[dict[str, torch.Tensor], Any]:
    """(named tensors to snapshot, the pickleable description of everything else). ``rank``:
    the sender's group rank, naming the local tensors of DTensors whose mesh it is not on.

    Walked with torch's pytree rather than ``ucpd.state_names``: torchft's own transports
    flatten and rebuild the state through a treespec (named tuples, registered pytree nodes,
    received in place), and ``placements`` are named by its key paths."""
    leaves, spec = pytree.tree_flatten_with_path(state_dict)
    DTensor = dtensor_class()
    tensors: dict[str, torch.Tensor] = {}
    described: list = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            name = path_name(path)
            off_mesh = isinstance(leaf, DTensor) and leaf.device_mesh.get_coordinate() is None
            if off_mesh:  # no placement to give: this rank's local tensor as it is, under its own name
                name = f"{name}@rank{rank}"
            while name in tensors:  # two paths that print alike (a key "a.b" and a["b"])
                name += "#"
            if off_mesh:
                tensors[name] = leaf._local_tensor.detach()
                described.append(_TensorLeaf(name, leaf.dtype, leaf._local_tensor.shape, leaf._spec, local=True))
                continue
            tensors[name] = leaf.detach()
            if isinstance(leaf, DTensor):
                described.append(_TensorLeaf(name, leaf.dtype, leaf._local_tensor.shape, leaf._spec))
            else:
                described.append(_TensorLeaf(name, leaf.dtype, leaf.shape))
        else:
            described.append(leaf)
    return tensors, {"treespec": spec, "leaves": described, "paths": [path_name(p) for p, _ in leaves]}


class UcpdTransport(_Base, Generic[T]):
    """torchft ``CheckpointTransport`` over a ``ucpd_client.Checkpointer`` (see the module).

    Args:
        checkpointer: this replica-group rank's Checkpointer. Its job names the replica group's
            versions (one job per replica group: two groups' rank 0 must not seal each other's
            versions), its rank is the group rank, its world size the group's size. Default:
            ``Checkpointer()`` (``$UCPD_JOB``, ``$RANK``/``$WORLD_SIZE``).
        state_dict: optional callable returning the recovering replica's own state dict (the
            Manager's shape, ``{"user": {...}, "torchft": {...}}``), received into in place.
        placements: placements of plain tensors that are sharded across the group ranks, by
            their dotted path (``user.default.model.w``); DTensors bring their own.
        fallback: a transport for receivers that cannot reach the sender's daemon.
        poll: seconds between checks while a receiver waits for the version to commit.
    """

    def __init__(self, checkpointer: Any = None, *, state_dict: Callable[[], Any] | None = None,
                 placements: Mapping[str, Any] | None = None, fallback: Any = None, poll: float = 0.05) -> None:
        if checkpointer is None:
            from .. import Checkpointer

            checkpointer = Checkpointer()
        self.ckpt = checkpointer
        self._state_dict = state_dict
        self.placements = dict(placements or {})
        self.fallback = fallback
        self.poll = poll
        self._lock = threading.Lock()
        self._sent: dict[int, Any] = {}  # step -> SnapshotHandle (None: already in the daemon)
        self._readers: dict[tuple[str, str, int], Any] = {}
        self.last_handle = None
        self.received: list[tuple[int, str]] = []  # (step, "ucpd" | "fallback"), for inspection

    # -- torchft's interface ---------------------------------------------------------------
    def metadata(self) -> str:
        meta = {"kind": METADATA_KIND, "host": socket.gethostname(), "run_dir": os.path.abspath(self.ckpt.run_dir),
                "job": self.ckpt.job, "rank": int(self.ckpt.rank), "world_size": int(self.ckpt.world_size)}
        if self.fallback is not None:
            meta["fallback"] = self.fallback.metadata()
        return json.dumps(meta, sort_keys=True)

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta) -> None:
        step = int(step)
        with self._lock:
            if step not in self._sent:
                self._sent[step] = self._snapshot(step, state_dict)
            handle = self._sent[step]
        if handle is not None:
            handle.staged(timeout.total_seconds())
        if self.fallback is not None:
            self.fallback.send_checkpoint(dst_ranks, step, state_dict, timeout)

    def disallow_checkpoint(self) -> None:
        if self.last_handle is not None:
            self.last_handle.staged()  # already staged: raises the snapshot's error, if any
        if self.fallback is not None:
            self.fallback.disallow_checkpoint()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        meta = json.loads(metadata)
        if meta.get("kind") != METADATA_KIND:
            raise UcpdError(f"checkpoint metadata {metadata[:200]!r} is not from a ucpd transport: "
                            "every replica group must use UcpdTransport")
        deadline = time.monotonic() + timeout.total_seconds()
        try:
            reader = self._reader(meta)
        except DaemonUnreachable as exc:
            if self.fallback is None or "fallback" not in meta:
                raise DaemonUnreachable(
                    f"the daemon of replica rank {src_rank} ({meta['host']}:{meta['run_dir']}) is not reachable "
                    f"from {socket.gethostname()}: run the recovering replica where it can reach that run dir, "
                    f"or give UcpdTransport a fallback= transport ({exc})") from exc
            out = self.fallback.recv_checkpoint(src_rank, meta["fallback"], step, timeout)
            self.received.append((int(step), "fallback"))
            return out
        desc = self._wait_committed(reader, int(step), deadline, meta)
        values = merged_values(desc["objects"], reader.rank, desc.get("objects_crcs"))
        if META_KEY not in values:
            raise VersionNotFound(f"step {step} of job {meta['job']} was not written by a UcpdTransport "
                                  "(it has no torchft structure)")
        with warnings.catch_warnings():  # torch's own FutureWarning about unpickling a LeafSpec
            warnings.simplefilter("ignore", FutureWarning)
            described = pickle.loads(values[META_KEY])
        out = self._restore(reader, int(step), described)
        self.received.append((int(step), "ucpd"))
        return out

    def shutdown(self, wait: bool = True) -> None:
        if wait and self.last_handle is not None:
            try:
                self.last_handle.wait()
            except UcpdError:
                pass
        for r in self._readers.values():
            r.close()
        self._readers.clear()
        if self.fallback is not None:
            self.fallback.shutdown(wait)

    # -- ucpd --------------------------------------------------------------------------
    def _snapshot(self, step: int, state_dict: Any):
        latest = self.ckpt.latest()
        if latest is not None and latest >= step:
            try:  # the job has this step already (a snapshot of its own): serve that one
                self.ckpt.describe(step)
                return None
            except VersionNotFound:
                raise UcpdError(f"job {self.ckpt.job} is at step {latest}; torchft asks to send step {step}: "
                                "a replica group's steps must increase (one job per replica group)") from None
        tensors, described = split_state(state_dict, int(self.ckpt.rank))
        state: dict[str, Any] = dict(tensors)
        state[META_KEY] = pickle.dumps(described, protocol=pickle.HIGHEST_PROTOCOL)  # one plain value
        h = self.ckpt.snapshot(step, state, placements=self.placements)
        self.last_handle = h
        return h

    def _reader(self, meta: dict):
        """A Checkpointer on the sender's daemon and job, as this group rank."""
        key = (meta["run_dir"], meta["job"], int(meta["world_size"]))
        if key not in self._readers:
            if os.path.abspath(self.ckpt.run_dir) == meta["run_dir"] and self.ckpt.job == meta["job"]:
                return self.ckpt
            if not os.path.exists(os.path.join(meta["run_dir"], "ucpd.sock")):
                raise DaemonUnreachable(f"no daemon socket in {meta['run_dir']}")
            from .. import Checkpointer

            self._readers[key] = Checkpointer(meta["run_dir"], rank=self.ckpt.rank, world_size=int(meta["world_size"]),
                                              embedded=False, job=meta["job"], job_id="torchft-reader")
        return self._readers[key]

    def _wait_committed(self, reader: Any, step: int, deadline: float, meta: dict) -> dict:
        while True:
            try:
                return reader.describe(step)
            except VersionNotFound as exc:
                if time.monotonic() >= deadline:
                    raise VersionNotFound(f"step {step} of job {meta['job']} was not committed in "
                                          f"{meta['run_dir']} within the timeout ({exc})") from None
                time.sleep(self.poll)

    def _restore(self, reader: Any, step: int, described: dict) -> Any:
        template = {}
        if self._state_dict is not None:
            leaves, _ = pytree.tree_flatten_with_path(self._state_dict())
            template = {path_name(p): leaf for p, leaf in leaves if isinstance(leaf, torch.Tensor)}
        DTensor = dtensor_class()
        targets: dict[str, torch.Tensor] = {}
        values: list = []
        for path, leaf in zip(described["paths"], described["leaves"]):
            if not isinstance(leaf, _TensorLeaf):
                values.append(leaf)
                continue
            if leaf.local:  # a DTensor off the sender's mesh: its local tensor, then the DTensor on its spec
                local = targets[leaf.name] = torch.empty(leaf.shape, dtype=leaf.dtype)
                values.append(_LocalDTensor(local, leaf.spec))
                continue
            t = template.get(path)
            if t is not None and t.dtype == leaf.dtype and _fits(t, leaf):
                targets[leaf.name] = t.detach()  # the same storage: filled in place
                values.append(t)
                continue
            if leaf.spec is not None:
                target = DTensor(torch.empty(leaf.shape, dtype=leaf.dtype), leaf.spec, requires_grad=False)
            else:
                target = torch.empty(leaf.shape, dtype=leaf.dtype)
            targets[leaf.name] = target
            values.append(target)
        reader.restore(targets, step=step, placements={k: v for k, v in self.placements.items() if k in targets})
        values = [DTensor(v.local, v.spec, requires_grad=False) if isinstance(v, _LocalDTensor) else v for v in values]
        return pytree.tree_unflatten(values, described["treespec"])


class _LocalDTensor:
    """A DTensor to rebuild once its local tensor is restored."""

    __slots__ = ("local", "spec")

    def __init__(self, local: torch.Tensor, spec: Any) -> None:
        self.local, self.spec = local, spec


def _fits(t: torch.Tensor, leaf: _TensorLeaf) -> bool:
    if leaf.spec is not None:  # a DTensor: its global shape must agree; the template's layout is read
        return tuple(t.shape) == tuple(leaf.spec.shape)
    return tuple(t.shape) == leaf.shape and not isinstance(t, dtensor_class())
