"""The typed errors a trainer can catch (the same classes the daemon raises, by wire code)."""

from ucpd.errors import (  # noqa: F401
    AlreadyRunning,
    AuthError,
    ChecksumMismatch,
    DaemonUnreachable,
    FormatError,
    InvalidPlacement,
    PlacementMismatch,
    ProtocolError,
    SnapshotRejected,
    UcpdError,
    VersionNotFound,
)
