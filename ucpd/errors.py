"""Typed errors shared by the daemon, the format, UCL and the client.

Every error has a stable wire ``code`` so that a failure raised inside the daemon reaches
the trainer as the same exception type. Messages say what went wrong and how to fix it.
"""

from __future__ import annotations


class UcpdError(Exception):
    """Base class of every ucpd error."""

    code = "internal"


class DaemonUnreachable(UcpdError):
    """No daemon answers at the run directory (not started, crashed, or wrong --run-dir)."""

    code = "unreachable"


class SnapshotRejected(UcpdError):
    """The daemon refused a snapshot (memory limit full, or a slot cannot be had)."""

    code = "rejected"


class VersionNotFound(UcpdError):
    """The requested step is not committed anywhere the daemon can reach (RAM or flush dir)."""

    code = "not_found"


class ChecksumMismatch(UcpdError):
    """Bytes read back (RAM, peer, disk) do not match the checksum recorded when written."""

    code = "checksum"


class PlacementMismatch(UcpdError):
    """A requested slice cannot be served: unknown tensor, wrong shape or dtype, or a region no
    source covers."""

    code = "placement"


class InvalidPlacement(UcpdError, ValueError):
    """A placement description is malformed (bad field, out-of-range index, inconsistent sizes)."""

    code = "invalid_placement"


class FormatError(UcpdError):
    """A universal checkpoint on disk is malformed, torn or incomplete."""

    code = "format"


class UnsafePickle(FormatError):
    """A pickled file names a type that ucpd does not read without running code (only tensors,
    plain containers and an allowlist of DeepSpeed and torch types are read as inert records)."""

    code = "unsafe_pickle"


class ProtocolError(UcpdError):
    """A message broke the wire protocol (bad envelope, schema, sizes or offsets)."""

    code = "protocol"


class AuthError(UcpdError):
    """A peer failed authentication (missing or wrong job secret)."""

    code = "auth"


class AlreadyRunning(UcpdError):
    """Another daemon already serves this run directory."""

    code = "already_running"


class LaunchError(UcpdError):
    """``ucpd run`` cannot run the job's launcher (none given after ``--``, not found, not executable)."""

    code = "launch"


class StorageError(UcpdError):
    """An object store (a ``--flush-dir`` URL such as ``s3://bucket/prefix``) failed a request after
    its retries, or the library its URL needs is not installed (the message says what to install)."""

    code = "storage"


class CommitTimeout(UcpdError, TimeoutError):
    """A step was not committed within the wait's timeout: some ranks never sealed it, or a node
    waits for more ranks than run on it (a wrong local size). The message names them."""

    code = "commit_timeout"


ALL_ERRORS: tuple[type[UcpdError], ...] = (
    UcpdError,
    DaemonUnreachable,
    SnapshotRejected,
    VersionNotFound,
    ChecksumMismatch,
    PlacementMismatch,
    InvalidPlacement,
    FormatError,
    UnsafePickle,
    ProtocolError,
    AuthError,
    AlreadyRunning,
    LaunchError,
    StorageError,
    CommitTimeout,
)

_BY_CODE = {cls.code: cls for cls in ALL_ERRORS}


def error_from_code(code: str, message: str) -> UcpdError:
    """Rebuild the typed exception for a wire error ``code`` (unknown codes become UcpdError)."""
    return _BY_CODE.get(code, UcpdError)(message)
