"""The safetensors subset we write and the strict parser we read it with.

A safetensors file is ``u64le N`` + ``N`` bytes of UTF-8 JSON + one byte buffer with no holes.
We write the JSON compact, in data order, with ``__metadata__`` first and padded with spaces so
that the buffer starts 8-byte aligned; inside a file tensors are ordered by descending item size,
so every tensor starts aligned to its own item size (zero-copy typed views stay aligned).

The parser accepts any conforming file (any key order, any padding) but checks everything a
reader relies on and raises :class:`FormatError` for anything else, never another exception.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from ..dtypes import BY_NAME, BY_SAFETENSORS, DType
from ..errors import FormatError
from .spec import MAX_HEADER_BYTES, loads_strict

ALIGN = 8


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    begin: int  # relative to the start of the byte buffer, as in the file
    end: int


@dataclass(frozen=True)
class Header:
    data_offset: int  # 8 + N: absolute offset of the byte buffer
    data_len: int
    metadata: dict[str, str]
    entries: dict[str, HeaderEntry]


def build_header(
    entries: list[tuple[str, str, tuple[int, ...], int, int]], metadata: dict[str, str] | None
) -> bytes:
    """The first ``8 + N`` bytes of a safetensors file.

    ``entries``: ``(name, torch dtype name, shape, begin, end)`` with offsets relative to the
    byte buffer, in data order. Returns prefix + JSON + space padding; ``len(result) % 8 == 0``.
    """
    obj: dict = {}
    if metadata:
        obj["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, dname, shape, b, e in entries:
        obj[name] = {"dtype": BY_NAME[dname].safetensors, "shape": list(shape), "data_offsets": [b, e]}
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-(8 + len(text)) % ALIGN)
    return struct.pack("<Q", len(text)) + text


def header_length(prefix: bytes, file_size: int, path: str) -> int:
    """Decode and bounds-check the 8-byte header length."""
    if file_size < 8 or len(prefix) < 8:
        raise FormatError(f"{path}: {file_size} bytes is too short for a safetensors file (truncated?)")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n < 2:
        raise FormatError(f"{path}: header length {n} is too small to hold a JSON object")
    if n > MAX_HEADER_BYTES:
        raise FormatError(f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (corrupt prefix?)")
    if 8 + n > file_size:
        raise FormatError(f"{path}: header length {n} runs past the end of the {file_size}-byte file (truncated?)")
    return n


def parse_header(head: bytes, file_size: int, path: str) -> Header:
    """Parse ``head`` (the first ``8 + N`` bytes of the file) of a file of ``file_size`` bytes.

    Checks: the length prefix against the file size; UTF-8 JSON object with no duplicate keys;
    ``__metadata__`` a str->str map; each tensor's dtype known, shape non-negative ints,
    ``data_offsets`` inside the buffer and matching dtype x shape; tensors neither overlap nor
    leave holes, and they cover the buffer exactly. Raises FormatError naming ``path``.
    """
    n = header_length(head, file_size, path)
    if len(head) < 8 + n:
        raise FormatError(f"{path}: header truncated ({len(head) - 8} of {n} bytes)")
    raw = head[8 : 8 + n]
    if raw[:1] != b"{":
        raise FormatError(f"{path}: header does not start with '{{' (not a safetensors file?)")
    try:
        obj = loads_strict(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise FormatError(f"{path}: header is not a JSON object")
    data_offset = 8 + n
    data_len = file_size - data_offset
    metadata = obj.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise FormatError(f"{path}: __metadata__ must map strings to strings")
    entries: dict[str, HeaderEntry] = {}
    for name, e in obj.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise FormatError(f"{path}: tensor {name!r}: entry must have exactly dtype, shape, data_offsets")
        code, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(code, str) or code not in BY_SAFETENSORS:
            raise FormatError(f"{path}: tensor {name!r}: unknown dtype {code!r}")
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise FormatError(f"{path}: tensor {name!r}: shape must be a list of non-negative ints")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(x) is int for x in offs)):
            raise FormatError(f"{path}: tensor {name!r}: data_offsets must be two ints")
        b, en = offs
        if not (0 <= b <= en <= data_len):
            raise FormatError(
                f"{path}: tensor {name!r}: data_offsets [{b}, {en}) outside the {data_len}-byte buffer"
                + (" (truncated file?)" if en > data_len else "")
            )
        dt = BY_SAFETENSORS[code]
        numel = 1
        for s in shape:
            numel *= s
        if numel * dt.itemsize != en - b:
            raise FormatError(
                f"{path}: tensor {name!r}: {code}{shape} needs {numel * dt.itemsize} bytes, data_offsets hold {en - b}"
            )
        entries[name] = HeaderEntry(name, dt, tuple(shape), b, en)
    pos = 0
    prev = None
    for ent in sorted(entries.values(), key=lambda x: (x.begin, x.end)):
        if ent.begin < pos:
            raise FormatError(f"{path}: tensors {prev!r} and {ent.name!r} overlap at buffer offset {ent.begin}")
        if ent.begin > pos:
            raise FormatError(f"{path}: hole in the byte buffer at [{pos}, {ent.begin}) before {ent.name!r}")
        pos, prev = ent.end, ent.name
    if pos != data_len:
        raise FormatError(f"{path}: {data_len - pos} trailing bytes after the last tensor (buffer has holes)")
    return Header(data_offset, data_len, metadata, entries)


def read_header(fd: int, file_size: int, path: str) -> Header:
    """Read and parse the header of an open file (pread; the file offset is not used)."""
    import os

    prefix = os.pread(fd, 8, 0)
    n = header_length(prefix, file_size, path)
    head = prefix + os.pread(fd, n, 8)
    return parse_header(head, file_size, path)
