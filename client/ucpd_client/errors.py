"""The typed errors a trainer can catch (the same classes the daemon raises, by wire code),
and the client-only ones that never cross the wire."""

from ucpd.errors import (  # noqa: F401
    AlreadyRunning,
    AuthError,
    ChecksumMismatch,
    CommitTimeout,
    DaemonUnreachable,
    FormatError,
    InvalidPlacement,
    PlacementMismatch,
    ProtocolError,
    SnapshotRejected,
    StorageError,
    UcpdError,
    UnsafePickle,
    VersionNotFound,
)


class AsyncSaveUnsupported(UcpdError, TypeError):
    """A DCP storage object was asked to move to another process (``dcp.async_save`` with
    ``AsyncCheckpointerType.PROCESS``); it writes through this process's ``Checkpointer``."""

    code = "async_save_unsupported"


class InvalidJobName(UcpdError, ValueError):
    """``Checkpointer(job=...)`` or ``$UCPD_JOB`` is not a usable job name (it names a folder
    of the flush directory: 1-128 letters, digits, ``.``, ``_`` or ``-``)."""

    code = "invalid_job_name"
