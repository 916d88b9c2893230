"""The universal on-disk format: one ``step-<N>/`` folder per version, consolidated tensors in
safetensors shards, ``ucp.json`` with dtypes, global shapes, UCL patterns and chunk CRC32Cs.

Byte-level spec: ``docs/FORMAT.md``. The core imports no torch (only ``convert`` does, lazily).
"""

from __future__ import annotations

from .reader import VersionReader
from .root import list_versions, open_version, read_latest, retain, write_latest
from .spec import CHUNK_BYTES, DEFAULT_SHARD_BYTES, FORMAT_VERSION, BlobInfo, FileInfo, Meta, TensorInfo, VersionSummary
from .validate import validate
from .writer import REPLICATED, TensorSource, write_safetensors, write_version

__all__ = [
    "CHUNK_BYTES",
    "DEFAULT_SHARD_BYTES",
    "FORMAT_VERSION",
    "REPLICATED",
    "BlobInfo",
    "FileInfo",
    "Meta",
    "TensorInfo",
    "TensorSource",
    "VersionReader",
    "VersionSummary",
    "list_versions",
    "open_version",
    "read_latest",
    "retain",
    "validate",
    "write_latest",
    "write_safetensors",
    "write_version",
]
