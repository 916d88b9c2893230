"""Import and export: torch.save files, DCP directories, plain safetensors; the table of every
conversion (``CONVERTERS``). DeepSpeed lives in ``ucpd.format.deepspeed``, Hugging Face in
``ucpd.format.hf``. torch is imported inside the functions only (``torch_bytes.torch_module``).

Non-tensor state imported from torch-based sources is stored as the global object, encoded with
``torch.save`` of a flat ``{key: value}`` dict (``layout["objects_encoding"] == "torch.save"``).
Keys are nested dict keys joined with ``.``.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..dtypes import BY_NAME
from .. import state_names
from ..errors import FormatError
from .deepspeed import deepspeed_to_universal, deepspeed_ucp_to_universal, universal_to_deepspeed_ucp
from .hf import universal_to_hf
from .roots import open_version, write_version
from .torch_bytes import dtype_name, tensor_bytes, tensor_from_array, torch_module
from .writer import REPLICATED, TensorSource, write_safetensors

Progress = Callable[[int, int], None] | None
UCPD_KEY = "__ucpd__"  # prefix of the entries that carry ucp.json facts through DCP


def flatten_state(obj: Any, prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a nested state into ``({flat_name: tensor}, {flat_name: other_value})``, named as
    a snapshot of the same state would be (``ucpd.state_names``). A state that is not a dict,
    list or tuple is one value named ``_``."""
    torch = torch_module()
    is_tensor = lambda x: isinstance(x, torch.Tensor)  # noqa: E731
    tensors: dict[str, Any] = {}
    others: dict[str, Any] = {}
    if isinstance(obj, dict) and not obj:
        return tensors, others
    if is_tensor(obj) or not isinstance(obj, (dict, list, tuple)):
        (tensors if is_tensor(obj) else others)[prefix or "_"] = obj
        return tensors, others
    for name, leaf, _, _ in state_names.walk(obj, is_tensor, f"{prefix}." if prefix else ""):
        (tensors if is_tensor(leaf) else others)[name] = leaf
    return tensors, others


def _torch_save_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch_module().save(obj, buf)
    return buf.getvalue()


def _guess_step(values: dict[str, Any], default: int = 0) -> int:
    for key in ("step", "iteration", "global_step", "trainer.step"):
        v = values.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v
    return default


def _load(path: Path, unsafe_pickle: bool) -> Any:
    torch = torch_module()
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=not unsafe_pickle)
    except Exception as exc:
        if not unsafe_pickle and "weights_only" in str(exc):
            raise FormatError(
                f"{path}: holds objects that torch.load(weights_only=True) refuses; if you trust "
                f"the file, pass --unsafe-pickle"
            ) from None
        raise FormatError(f"{path}: cannot load ({type(exc).__name__}: {exc})") from None


def _sources(tensors: dict[str, Any], pattern: Any = REPLICATED) -> list[TensorSource]:
    return [
        TensorSource(name, dtype_name(t), tuple(t.shape), pattern, tensor_bytes(t)) for name, t in tensors.items()
    ]


# --------------------------------------------------------------------------------------------
# into the universal format
# --------------------------------------------------------------------------------------------


def torch_to_universal(
    src: str | os.PathLike, root: str | os.PathLike, *, step: int | None = None,
    shard_bytes: int | None = None, progress: Progress = None, unsafe_pickle: bool = False,
) -> Path:
    """A ``torch.save``d (nested) state dict -> version ``step`` under ``root``; every tensor
    Replicated (a single-process save holds whole tensors)."""
    src = Path(src)
    state = _load(src, unsafe_pickle)
    tensors, others = flatten_state(state)
    step = _guess_step(others) if step is None else step
    layout = {"source": "torch", "path": str(src), "objects_encoding": "torch.save"}
    objects = {"global": _torch_save_bytes(others)} if others else None
    kw = {"shard_bytes": shard_bytes} if shard_bytes else {}
    return write_version(root, step, _sources(tensors), layout=layout, objects=objects, progress=progress, **kw)


def _dcp_metadata(src: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    if not (src / ".metadata").is_file():
        raise FormatError(f"{src}: not a DCP checkpoint (no .metadata file)")
    try:
        return FileSystemReader(str(src)).read_metadata()
    except Exception as exc:
        raise FormatError(f"{src}/.metadata: cannot read ({type(exc).__name__}: {exc})") from None


def _dcp_load(src: Path, state: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=FileSystemReader(str(src)), no_dist=True)


def dcp_to_universal(
    src: str | os.PathLike, root: str | os.PathLike, *, step: int | None = None,
    shard_bytes: int | None = None, progress: Progress = None,
) -> Path:
    """A DCP directory (``.metadata`` + ``*.distcp``) -> version ``step`` under ``root``.

    Each tensor is loaded by DCP straight into the writer's staging buffer. Entries written by
    ``universal_to_dcp`` under ``__ucpd__.*`` restore the layout, patterns and objects exactly.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    torch = torch_module()
    src = Path(src)
    md = _dcp_metadata(src)
    tensor_md = {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    other_keys = [k for k in md.state_dict_metadata if k not in tensor_md]
    others: dict[str, Any] = {k: None for k in other_keys}
    if others:
        _dcp_load(src, others)
    meta_json = others.pop(f"{UCPD_KEY}.meta", None)
    carried = json.loads(meta_json) if isinstance(meta_json, str) else None

    def make_fill(fqn: str, shape: tuple[int, ...], dname: str):
        def fill(out: np.ndarray) -> None:
            t = torch.from_numpy(out).view(getattr(torch, dname)).reshape(shape)
            _dcp_load(src, {fqn: t})

        return fill

    sources = []
    for fqn, m in tensor_md.items():
        dname = str(m.properties.dtype).removeprefix("torch.")
        if dname not in BY_NAME:
            raise FormatError(f"{src}: tensor {fqn!r} has unsupported dtype {dname}")
        shape = tuple(int(s) for s in m.size)
        pattern = carried["patterns"].get(fqn, REPLICATED) if carried else REPLICATED
        sources.append(TensorSource(fqn, dname, shape, pattern, make_fill(fqn, shape, dname)))
    if carried:
        objects = {
            "global": others.pop(f"{UCPD_KEY}.objects.global", None),
            "ranks": {
                int(k.rsplit(".", 1)[1]): others.pop(k)
                for k in list(others)
                if k.startswith(f"{UCPD_KEY}.objects.rank.")
            },
        }
        layout = carried["layout"]
        step = carried["step"] if step is None else step
    else:
        layout = {"source": "dcp", "path": str(src), "objects_encoding": "torch.save"}
        objects = {"global": _torch_save_bytes(others)} if others else None
        step = _guess_step(others) if step is None else step
    kw = {"shard_bytes": shard_bytes} if shard_bytes else {}
    return write_version(root, step, sources, layout=layout, objects=objects, progress=progress, **kw)


def universal_to_universal(
    src: str | os.PathLike, root: str | os.PathLike, *, step: int | None = None,
    shard_bytes: int | None = None, progress: Progress = None,
) -> Path:
    """Copy one version to another root (verifying every chunk), e.g. to re-shard its files."""
    with open_version(src, step) as r:
        sources = []
        for name, t in r.tensors.items():
            r.verify(name)
            sources.append(TensorSource(name, t.dtype, t.shape, t.pattern, r.bytes_view(name)))
        kw = {"shard_bytes": shard_bytes} if shard_bytes else {}
        return write_version(
            root, r.step, sources, layout=r.meta.layout, objects=r.objects, progress=progress,
            chunk_bytes=r.meta.chunk_bytes, **kw,
        )


# --------------------------------------------------------------------------------------------
# out of the universal format
# --------------------------------------------------------------------------------------------


def universal_to_safetensors(
    src: str | os.PathLike, dst: str | os.PathLike, *, step: int | None = None, progress: Progress = None
) -> Path:
    """One version -> one consolidated safetensors file (tensors only; every chunk verified).
    Its ``__metadata__`` records the step and the patterns (``ucpd.patterns``, JSON)."""
    dst = Path(dst)
    if dst.is_dir():
        raise FormatError(f"{dst}: is a directory; give the path of the .safetensors file to write")
    with open_version(src, step) as r:
        sources = []
        for name, t in r.tensors.items():
            r.verify(name)
            sources.append(TensorSource(name, t.dtype, t.shape, t.pattern, r.bytes_view(name)))
        md = {
            "format": "pt",
            "ucpd.step": str(r.step),
            "ucpd.patterns": json.dumps({n: t.pattern for n, t in r.tensors.items()}, separators=(",", ":")),
        }
        dst.parent.mkdir(parents=True, exist_ok=True)
        write_safetensors(dst, sources, metadata=md, progress=progress)
    return dst


def universal_to_dcp(
    src: str | os.PathLike, dst: str | os.PathLike, *, step: int | None = None, progress: Progress = None
) -> Path:
    """One version -> a DCP directory (``torch.distributed.checkpoint.save``, no process group).

    Tensors keep their universal names. ``__ucpd__.meta`` (JSON: step, layout, patterns) and
    ``__ucpd__.objects.*`` (raw bytes) make the way back lossless; objects stored as
    ``torch.save`` dicts are also expanded into plain entries for DCP users.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    torch = torch_module()
    dst = Path(dst)
    with open_version(src, step) as r:
        state: dict[str, Any] = {}
        done, total = 0, r.meta.total_bytes
        for name, t in r.tensors.items():
            r.verify(name)
            state[name] = tensor_from_array(r.array(name), t.dtype)
            done += t.nbytes
            if progress:
                progress(done, total)
        objs = r.objects
        meta = {"step": r.step, "layout": r.meta.layout, "patterns": {n: t.pattern for n, t in r.tensors.items()}}
        state[f"{UCPD_KEY}.meta"] = json.dumps(meta)
        if objs["global"] is not None:
            state[f"{UCPD_KEY}.objects.global"] = objs["global"]
            if r.meta.layout.get("objects_encoding") == "torch.save":
                try:  # plain values only: never unpickle arbitrary objects from a checkpoint
                    decoded = torch.load(io.BytesIO(objs["global"]), weights_only=True)
                except Exception:
                    decoded = None
                if isinstance(decoded, dict):
                    for k, v in decoded.items():
                        state.setdefault(str(k), v)
        for rank, b in objs["ranks"].items():
            state[f"{UCPD_KEY}.objects.rank.{rank}"] = b
        dst.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=FileSystemWriter(str(dst)), no_dist=True)
    return dst


CONVERTERS = {
    ("torch", "universal"): torch_to_universal,
    ("dcp", "universal"): dcp_to_universal,
    ("deepspeed", "universal"): deepspeed_to_universal,
    ("deepspeed-ucp", "universal"): deepspeed_ucp_to_universal,
    ("universal", "universal"): universal_to_universal,
    ("universal", "safetensors"): universal_to_safetensors,
    ("universal", "dcp"): universal_to_dcp,
    ("universal", "deepspeed-ucp"): universal_to_deepspeed_ucp,
    ("universal", "hf"): universal_to_hf,
}
