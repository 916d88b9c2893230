"""The universal on-disk format: one ``step-<N>/`` folder per version, consolidated tensors in
safetensors shards, ``ucp.json`` with dtypes, global shapes, UCL patterns and chunk CRC32Cs.

Byte-level spec: ``docs/FORMAT.md``. Where versions live, a folder or an object store: ``roots``. The core imports no torch (only ``convert`` does, lazily).
"""

from __future__ import annotations

from .reader import VersionReader
from .root import write_latest
from .roots import LocalRoot, Root, StoreRoot, as_root, list_versions, open_version, read_latest, retain, validate, write_version
from .spec import CHUNK_BYTES, DEFAULT_SHARD_BYTES, FORMAT_VERSION, BlobInfo, FileInfo, Meta, TensorInfo, VersionSummary
from .writer import REPLICATED, TensorSource, write_safetensors

__all__ = [
    "CHUNK_BYTES",
    "DEFAULT_SHARD_BYTES",
    "FORMAT_VERSION",
    "REPLICATED",
    "Root",
    "StoreRoot",
    "BlobInfo",
    "FileInfo",
    "LocalRoot",
    "Meta",
    "TensorInfo",
    "TensorSource",
    "VersionReader",
    "VersionSummary",
    "as_root",
    "list_versions",
    "open_version",
    "read_latest",
    "retain",
    "validate",
    "write_latest",
    "write_safetensors",
    "write_version",
]
