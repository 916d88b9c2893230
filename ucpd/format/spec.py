"""Names, constants and the strict parser of ``ucp.json`` (format version 1).

Byte-level spec: ``docs/FORMAT.md``. This module knows no torch and touches no files except
through the paths it is given; every check raises :class:`~ucpd.errors.FormatError` naming
the path and the field that is wrong.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..dtypes import BY_NAME, DType
from ..errors import FormatError

FORMAT_NAME = "ucpd-universal"
FORMAT_VERSION = 1  # bumped on any change a version-1 reader would misread
META_FILE = "ucp.json"
OBJECTS_FILE = "objects.bin"
LATEST_FILE = "LATEST"
CHECKSUM = "crc32c"

CHUNK_BYTES = 4 << 20  # default CRC chunk on disk; recorded per version in ucp.json
DEFAULT_SHARD_BYTES = 1 << 30
MAX_HEADER_BYTES = 100 << 20  # a safetensors header larger than this is refused (as upstream)

STEP_RE = re.compile(r"^step-(\d+)$")
TMP_RE = re.compile(r"^\.step-(\d+)\.tmp-(\d+)$")
DEL_RE = re.compile(r"^\.step-(\d+)\.del-(\d+)$")
MARKER_SUFFIX = ".committed"
MARKER_RE = re.compile(r"^step-(\d+)\.committed$")
SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")


def step_dirname(step: int) -> str:
    return f"step-{step}"


def tmp_dirname(step: int, pid: int) -> str:
    return f".step-{step}.tmp-{pid}"


def del_dirname(step: int, pid: int) -> str:
    return f".step-{step}.del-{pid}"


def shard_filename(index: int, count: int) -> str:
    """``index`` counts from 1, as in Hugging Face shard names."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def marker_name(step: int) -> str:
    """The commit marker of a version in an object store: the object beside ``step-<N>/`` whose
    presence makes the version visible (object stores have no rename; ``docs/FORMAT.md``)."""
    return f"step-{step}{MARKER_SUFFIX}"


def parse_step_dirname(name: str) -> int | None:
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------------------------
# ucp.json
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """One consolidated tensor of a version, as recorded in ``ucp.json``.

    ``data_offset`` is the absolute offset of the tensor's first byte in ``file``; the tensor
    occupies ``[data_offset, data_offset + nbytes)``. ``crcs[i]`` is the CRC32C of bytes
    ``[i*chunk_bytes, min((i+1)*chunk_bytes, nbytes))`` of the tensor.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    pattern: Any
    file: str
    data_offset: int
    nbytes: int
    crcs: tuple[int, ...]

    @property
    def dt(self) -> DType:
        return BY_NAME[self.dtype]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class BlobInfo:
    """A non-tensor object: opaque bytes at ``[offset, offset + nbytes)`` of ``file``."""

    key: str  # "global" or "rank/<r>"
    file: str
    offset: int
    nbytes: int
    crcs: tuple[int, ...]


@dataclass(frozen=True)
class FileInfo:
    name: str
    size: int  # exact file size in bytes
    data_offset: int  # 8 + header length: where the safetensors byte buffer starts


@dataclass
class Meta:
    """The parsed, checked content of one ``ucp.json``."""

    step: int
    format_version: int
    created: str
    created_unix: float
    chunk_bytes: int
    layout: dict
    files: dict[str, FileInfo]
    tensors: dict[str, TensorInfo]
    objects_global: BlobInfo | None
    objects_ranks: dict[int, BlobInfo]
    raw: dict = field(repr=False, default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def n_chunks(nbytes: int, chunk: int) -> int:
    return (nbytes + chunk - 1) // chunk


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not allowed")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def loads_strict(text: bytes | str) -> Any:
    """JSON decode with duplicate keys and NaN/Infinity refused (raises ValueError)."""
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Checker:
    def __init__(self, path: str):
        self.path = path

    def fail(self, what: str) -> FormatError:
        return FormatError(f"{self.path}: {what}")

    def get(self, d: dict, key: str, kind: type | tuple, where: str) -> Any:
        if key not in d:
            raise self.fail(f"{where}: missing field {key!r}")
        v = d[key]
        if kind is int:
            ok = _is_int(v)
        elif kind is float:
            ok = _is_int(v) or isinstance(v, float)
        else:
            ok = isinstance(v, kind)
        if not ok:
            raise self.fail(f"{where}: field {key!r} has the wrong type ({type(v).__name__})")
        return v

    def nonneg(self, v: int, what: str) -> int:
        if v < 0:
            raise self.fail(f"{what} is negative ({v})")
        return v

    def crcs(self, v: Any, nbytes: int, chunk: int, where: str) -> tuple[int, ...]:
        if not isinstance(v, list) or not all(_is_int(c) and 0 <= c < 2**32 for c in v):
            raise self.fail(f"{where}: 'crc32c' must be a list of 32-bit unsigned ints")
        want = n_chunks(nbytes, chunk)
        if len(v) != want:
            raise self.fail(f"{where}: {len(v)} chunk checksums for {nbytes} bytes, expected {want}")
        return tuple(v)

    def byte_range(self, v: Any, where: str) -> tuple[int, int]:
        if not (isinstance(v, list) and len(v) == 2 and all(_is_int(x) for x in v) and 0 <= v[0] <= v[1]):
            raise self.fail(f"{where}: 'byte_range' must be [begin, end] with 0 <= begin <= end")
        return v[0], v[1]


def parse_meta(data: bytes, path: str, *, expect_step: int | None = None) -> Meta:
    """Parse and check one ``ucp.json``; raises FormatError naming ``path`` and the problem.

    Checks structure and types, chunk counts against byte ranges, that every tensor lies inside
    its file's data buffer and that tensors of one file do not overlap. It does not open the
    shard files (see ``reader.open_version``).
    """
    c = _Checker(path)
    try:
        raw = loads_strict(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, ...
        raise c.fail(f"not valid JSON ({exc}); the version is torn or corrupt") from None
    if not isinstance(raw, dict):
        raise c.fail("top level is not a JSON object")
    if raw.get("format") != FORMAT_NAME:
        raise c.fail(f"'format' is {raw.get('format')!r}, expected {FORMAT_NAME!r}")
    version = c.get(raw, "format_version", int, "top level")
    if version > FORMAT_VERSION:
        raise c.fail(
            f"format_version {version} is newer than this ucpd understands ({FORMAT_VERSION}); upgrade ucpd"
        )
    if version < 1:
        raise c.fail(f"bad format_version {version}")
    step = c.nonneg(c.get(raw, "step", int, "top level"), "step")
    if expect_step is not None and step != expect_step:
        raise c.fail(f"records step {step} but lives in the directory of step {expect_step}")
    if c.get(raw, "checksum", str, "top level") != CHECKSUM:
        raise c.fail(f"unknown checksum {raw['checksum']!r}, expected {CHECKSUM!r}")
    chunk = c.get(raw, "chunk_bytes", int, "top level")
    if chunk <= 0:
        raise c.fail(f"chunk_bytes must be positive, got {chunk}")
    created = c.get(raw, "created", str, "top level")
    created_unix = float(c.get(raw, "created_unix", float, "top level"))
    layout = c.get(raw, "layout", dict, "top level")

    files: dict[str, FileInfo] = {}
    for fname, f in c.get(raw, "files", dict, "top level").items():
        where = f"files[{fname!r}]"
        if not SHARD_RE.match(fname):
            raise c.fail(f"{where}: not a shard file name (model-NNNNN-of-NNNNN.safetensors)")
        if not isinstance(f, dict):
            raise c.fail(f"{where}: not an object")
        size = c.get(f, "size", int, where)
        doff = c.get(f, "data_offset", int, where)
        if not (8 < doff <= size):
            raise c.fail(f"{where}: data_offset {doff} outside the file of {size} bytes")
        files[fname] = FileInfo(fname, size, doff)

    tensors: dict[str, TensorInfo] = {}
    per_file: dict[str, list[tuple[int, int, str]]] = {}
    for name, t in c.get(raw, "tensors", dict, "top level").items():
        where = f"tensor {name!r}"
        if not name or name == "__metadata__":
            raise c.fail(f"{where}: reserved or empty name")
        if not isinstance(t, dict):
            raise c.fail(f"{where}: not an object")
        dname = c.get(t, "dtype", str, where)
        if dname not in BY_NAME:
            raise c.fail(f"{where}: unknown dtype {dname!r}")
        shape = c.get(t, "shape", list, where)
        if not all(_is_int(s) and s >= 0 for s in shape):
            raise c.fail(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
        if "pattern" not in t:
            raise c.fail(f"{where}: missing field 'pattern'")
        fname = c.get(t, "file", str, where)
        if fname not in files:
            raise c.fail(f"{where}: file {fname!r} is not listed in 'files'")
        b, e = c.byte_range(t.get("byte_range"), where)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * BY_NAME[dname].itemsize
        if e - b != nbytes:
            raise c.fail(f"{where}: byte_range holds {e - b} bytes but {dname}{list(shape)} needs {nbytes}")
        fi = files[fname]
        if b < fi.data_offset or e > fi.size:
            raise c.fail(f"{where}: byte_range [{b}, {e}) outside the data of {fname} [{fi.data_offset}, {fi.size})")
        crcs = c.crcs(t.get("crc32c"), nbytes, chunk, where)
        tensors[name] = TensorInfo(name, dname, tuple(shape), t["pattern"], fname, b, nbytes, crcs)
        per_file.setdefault(fname, []).append((b, e, name))
    for fname, spans in per_file.items():
        spans.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise c.fail(f"tensors {n0!r} [{b0}, {e0}) and {n1!r} [{b1}, {e1}) overlap in {fname}")

    objs = c.get(raw, "objects", dict, "top level")
    g = objs.get("global")
    ranks_raw = c.get(objs, "ranks", dict, "objects")

    def blob(key: str, d: Any) -> BlobInfo:
        where = f"objects[{key!r}]"
        if not isinstance(d, dict):
            raise c.fail(f"{where}: not an object")
        f = c.get(d, "file", str, where)
        if f != OBJECTS_FILE:
            raise c.fail(f"{where}: file must be {OBJECTS_FILE!r}, got {f!r}")
        b, e = c.byte_range(d.get("byte_range"), where)
        return BlobInfo(key, f, b, e - b, c.crcs(d.get("crc32c"), e - b, chunk, where))

    objects_global = None if g is None else blob("global", g)
    objects_ranks: dict[int, BlobInfo] = {}
    for rk, d in ranks_raw.items():
        if not (isinstance(rk, str) and rk.isdigit()):
            raise c.fail(f"objects.ranks: key {rk!r} is not a rank number")
        objects_ranks[int(rk)] = blob(f"rank/{rk}", d)

    return Meta(
        step=step,
        format_version=version,
        created=created,
        created_unix=created_unix,
        chunk_bytes=chunk,
        layout=layout,
        files=files,
        tensors=tensors,
        objects_global=objects_global,
        objects_ranks=objects_ranks,
        raw=raw,
    )


def pattern_text(pattern: Any) -> str:
    """A short human form of an opaque UCL pattern dict, e.g. ``shard(dim=0, parts=4)``."""
    if not isinstance(pattern, dict):
        return json.dumps(pattern)
    kind = pattern.get("kind", "?")
    args = []
    for k, v in pattern.items():
        if k == "kind":
            continue
        if isinstance(v, dict):
            v = pattern_text(v)
        elif isinstance(v, (list, tuple)) and len(v) > 6:
            v = f"[{len(v)} items]"
        args.append(f"{k}={v}")
    return f"{kind}({', '.join(args)})" if args else str(kind)


# -- listing --------------------------------------------------------------------------------


@dataclass(frozen=True)
class VersionSummary:
    """One ``step-<N>`` folder (or a writer's temporary folder) under a root, cheaply checked.

    ``state``: ``"complete"`` (ucp.json parses, every file is there with its recorded size),
    ``"torn"`` (a ``step-<N>`` folder that is not; ``problem`` says why) or ``"partial"``
    (``.step-<N>.tmp-<pid>``: a write in progress, or left by a writer that died).
    """

    step: int
    path: Path
    state: str
    tensors: int = 0
    nbytes: int = 0
    created: float | None = None
    latest: bool = False
    problem: str | None = None

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "path": str(self.path),
            "state": self.state,
            "tensors": self.tensors,
            "bytes": self.nbytes,
            "created": self.created,
            "latest": self.latest,
            "problem": self.problem,
        }
