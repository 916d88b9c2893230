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


class LocalSizeWrong(CommitTimeout):
    """A step can never commit: the job's ranks seal on several nodes, but a node was told that
    the whole world runs on it (no launcher variable gave the local size). Raised by
    ``SnapshotHandle.wait()`` as soon as the team sees it, with the text that says what to set."""

    code = "local_size_wrong"


class InvalidJobName(UcpdError, ValueError):
    """``Checkpointer(job=...)`` or ``$UCPD_JOB`` is not a usable job name (it names a folder
    of the flush directory: 1-128 letters, digits, ``.``, ``_`` or ``-``)."""

    code = "invalid_job_name"
