"""PyTorch Distributed Checkpoint (DCP) storage backed by the node daemon.

Code that already calls ``torch.distributed.checkpoint.save``/``load`` switches to ucpd by
passing a storage object; DCP's planners (deduplication, resharding of DTensors and
ShardedTensors) keep working, and the bytes go to the daemon's RAM instead of files::

    import torch.distributed.checkpoint as dcp
    from ucpd_client import Checkpointer
    from ucpd_client.dcp import UcpdStorageWriter, UcpdStorageReader

    ckpt = Checkpointer()
    dcp.save(state_dict, storage_writer=UcpdStorageWriter(ckpt, step=100))
    dcp.load(state_dict, storage_reader=UcpdStorageReader(ckpt))        # newest committed

Each chunk DCP writes becomes a tensor with a UCL ``Box`` placement (its offsets in the global
tensor; several chunks of one tensor on a rank, as a ShardedTensor may have, one ``Flat`` buffer
of boxes); bytes items (non-tensor state) travel as plain values. On load the reader describes
the version as one whole chunk per tensor, so DCP asks for exactly the regions each rank
needs, whatever layout saved them, and the daemon serves them from RAM (or its flush dir).
A ``checkpoint_id`` of ``step-N`` or ``N`` selects the step.

``dcp.async_save(sd, storage_writer=UcpdStorageWriter(ckpt, step))`` works with DCP's default
thread executor: DCP stages the state dict to CPU, then saves it from a thread. The process
executor (``async_checkpointer_type=AsyncCheckpointerType.PROCESS``) would pickle the writer
into a checkpoint process, away from this rank's ``Checkpointer``; it raises
``AsyncSaveUnsupported`` instead (the daemon already takes the slow part off the trainer).
"""

from __future__ import annotations

import io
import os
import re
from typing import Any

import torch
from torch.futures import Future
from torch.distributed.checkpoint import Metadata, StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ucpd.errors import UcpdError

from . import restore as restore_mod
from .errors import AsyncSaveUnsupported
from .placement import Box, Flat, FlatBuffer, FlatEntry
from .staging import Entry

_STEP = re.compile(r"^(?:.*step-)?(\d+)$")


def _step_of(checkpoint_id: str | os.PathLike | None) -> int | None:
    if checkpoint_id is None:
        return None
    m = _STEP.match(os.fspath(checkpoint_id).rstrip("/"))
    if m is None:
        raise UcpdError(f"checkpoint_id {checkpoint_id!r} is not a step: use 'step-<N>' or '<N>'")
    return int(m.group(1))


def _done(value: Any) -> Future:
    f: Future = Future()  # DCP waits on torch futures
    f.set_result(value)
    return f


class UcpdStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` that snapshots into the daemon as ``step``.

    ``write_data`` returns once the version is committed by every rank (``wait=True``) or
    once this rank's tensors are staged (``wait=False``; call ``last_handle.wait()`` later).
    Pickling it (DCP's process-based async save) raises ``AsyncSaveUnsupported``.
    """

    def __init__(self, checkpointer, step: int | None = None, wait: bool = True):
        super().__init__()
        self.ckpt = checkpointer
        self.step = step
        self.wait = wait
        self.last_handle = None

    def __reduce__(self):
        raise AsyncSaveUnsupported(
            "UcpdStorageWriter writes through this process's Checkpointer and cannot be pickled "
            "or sent to another process; call dcp.async_save with the default "
            "async_checkpointer_type=AsyncCheckpointerType.THREAD (or dcp.save, or "
            "Checkpointer.snapshot, which returns at once)"
        )

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        step = _step_of(checkpoint_id)
        if step is not None:
            self.step = step

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _STEP.match(os.fspath(checkpoint_id).rstrip("/")) is not None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.step is None:
            raise UcpdError("UcpdStorageWriter needs a step: pass step=N or checkpoint_id='step-N'")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        chunks: dict[str, list[tuple[torch.Tensor, Any]]] = {}
        values: dict[str, bytes] = {}
        results = []
        for item in plan.items:
            fqn = item.index.fqn
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data.read())
                values[fqn] = raw
                results.append(WriteResult(index=item.index, size_in_bytes=len(raw), storage_data=self.step))
                continue
            td = item.tensor_data
            chunks.setdefault(fqn, []).append((data.detach(), td))
            results.append(WriteResult(index=item.index, size_in_bytes=data.numel() * data.element_size(), storage_data=self.step))
        tensors: dict[str, torch.Tensor] = {}
        placements: dict[str, Any] = {}
        for fqn, parts in chunks.items():
            if len(parts) == 1:  # one chunk (DTensor, a plain tensor): a box of the global tensor
                data, td = parts[0]
                tensors[fqn] = data
                placements[fqn] = Box(tuple(td.chunk.offsets), tuple(td.chunk.sizes), tuple(td.size))
                continue
            # several chunks on this rank (a ShardedTensor with several shards here): one flat
            # buffer of them, each chunk an entry placed as its box of the global tensor
            tensors[fqn] = torch.cat([d.reshape(-1) for d, _ in parts])
            entries = [FlatEntry(fqn, tuple(td.chunk.sizes), Box(tuple(td.chunk.offsets), tuple(td.chunk.sizes), tuple(td.size)))
                       for _, td in parts]
            placements[fqn] = Flat(0, tensors[fqn].numel(), FlatBuffer(tuple(entries)))
        state = {**tensors, "__dcp_bytes__": values}
        handle = self.ckpt.snapshot(self.step, state, placements=placements)
        self.last_handle = handle
        handle.wait() if self.wait else handle.staged()
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing to write: the daemon committed the version (and flushes it if configured)."""

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"step-{self.step}")


class UcpdStorageReader(StorageReader):
    """A DCP ``StorageReader`` that restores ``step`` (None: the newest committed) from the
    daemon, resharded to whatever layout the loading ranks have."""

    def __init__(self, checkpointer, step: int | None = None):
        super().__init__()
        self.session = checkpointer.session
        self.step = step
        self._bytes: dict[str, bytes] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, torch.dtype] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        step = _step_of(checkpoint_id)
        if step is not None:
            self.step = step

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return UcpdStorageWriter.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        desc = self.session.describe(self.step)
        self.step = desc["step"]
        values = restore_mod.merged_values(desc["objects"], self.session.rank, desc.get("objects_crcs"))
        self._bytes = {}
        for name, value in values.items():
            if name.startswith("__dcp_bytes__."):
                self._bytes[name.removeprefix("__dcp_bytes__.")] = value
        md: dict[str, Any] = {}
        for name, t in desc["tensors"].items():
            shape = tuple(t["shape"])
            self._shapes[name] = shape
            dtype = self._dtypes[name] = getattr(torch, t["dtype"])
            chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=torch.Size(shape))
            md[name] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), [chunk])
        for name in self._bytes:
            md[name] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=md, storage_data=self.step, storage_meta=StorageMeta(checkpoint_id=f"step-{self.step}"))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.step is None:
            self.step = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        entries, items = [], []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(self._bytes[fqn]))
                continue
            target = planner.resolve_tensor(item).detach()
            box = Box(tuple(item.storage_offsets), tuple(item.lengths), self._shapes[fqn])
            saved = self._dtypes.get(fqn, target.dtype)
            # another dtype than saved (the planner allowed the cast): read as saved, then cast, as DCP's own readers do
            into = target if target.dtype == saved else torch.empty(tuple(item.lengths), dtype=saved)
            entries.append(Entry(fqn, into, box.to_dict()))
            items.append((item, target, into))
        if entries:
            restore_mod.restore_entries(self.session, entries, self.step)
        for item, target, into in items:
            if into is not target:
                target.copy_(into.view(target.shape))
            planner.commit_tensor(item, target)
        return _done(None)
