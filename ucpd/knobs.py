"""Every tunable of ucpd in one place, each overridable by an environment variable.

Read a knob by calling its getter (``knobs.copy_threads()``); tests override with
``knobs.override(NAME=value)`` as a context manager. Command-line flags of ``ucpd serve``
take precedence over these defaults.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import tempfile
from typing import Iterator

_overrides: dict[str, str] = {}


def get(name: str, default: str | None = None) -> str | None:
    """The raw text of knob ``name``: an ``override`` in force, else the environment, else
    ``default``. Every reader of a ``UCPD_*`` variable goes through here (``ucpd.native``'s
    thread count included), so an override reaches all of them."""
    if name in _overrides:
        return _overrides[name]
    return os.environ.get(name, default)


def _get(name: str, default: str) -> str:
    return get(name, default)  # type: ignore[return-value]


@contextlib.contextmanager
def override(**values: object) -> Iterator[None]:
    """Temporarily set knobs by their environment names, e.g. ``override(UCPD_COPY_THREADS=1)``."""
    saved = dict(_overrides)
    _overrides.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


def user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return str(os.getuid())


def job() -> str | None:
    """``$UCPD_JOB``: the job a Checkpointer belongs to (None: worked out from the launcher)."""
    return get("UCPD_JOB") or None


def job_id() -> str | None:
    """``$UCPD_JOB_ID``: this run of the job (None: from the launcher, or made by rank 0)."""
    return get("UCPD_JOB_ID") or None


def run_dir() -> str:
    """Where the daemon's socket lives: $UCPD_RUN_DIR, else a per-user folder in the temp dir."""
    return _get("UCPD_RUN_DIR", os.path.join(tempfile.gettempdir(), f"ucpd-{user()}"))


def shm_dir(node_rank: int = 0, run_dir_path: str | None = None) -> str:
    """Where the daemon keeps its shared-memory segments (a tmpfs folder): one per user, run
    dir and node rank, so that two run dirs never share (and fight over) one."""
    import hashlib

    rd = os.path.realpath(run_dir_path or run_dir())
    tag = hashlib.sha256(rd.encode()).hexdigest()[:8]
    return _get("UCPD_SHM_DIR", f"/dev/shm/ucpd-{user()}-{tag}-{node_rank}")


def named_shm_dir() -> str | None:
    """``$UCPD_SHM_DIR`` when one is named (an embedded daemon is started with it), else None."""
    return get("UCPD_SHM_DIR") or None


def parity_unit() -> int:
    """Bytes of a parity unit (``--parity``): each row of a group's parity encodes one unit per member."""
    return max(64, parse_size(_get("UCPD_PARITY_UNIT", "4M")) // 64 * 64)


def copy_threads() -> int:
    """Threads for copies into and out of slots."""
    return max(1, int(_get("UCPD_COPY_THREADS", str(min(os.cpu_count() or 1, 8)))))


def slot_alignment() -> int:
    """Byte alignment of every tensor inside a slot (a cache line keeps copies vector-aligned)."""
    return int(_get("UCPD_SLOT_ALIGN", "64"))


def segment_rounding() -> int:
    """Slot segments are rounded up to this many bytes (huge-page friendly)."""
    return int(_get("UCPD_SEGMENT_ROUND", str(2 << 20)))


def keep_versions() -> int:
    """Committed versions the daemon keeps in RAM (--keep)."""
    return max(1, int(_get("UCPD_KEEP", "2")))


def flush_rate() -> float:
    """Bytes per second the background flush may write (0 = unthrottled)."""
    return float(_get("UCPD_FLUSH_RATE", str(2 << 30)))


def flush_io() -> str:
    """How the flush writes its files: ``direct`` (O_DIRECT from its staging buffer: no copy into
    the page cache, the disk busy while the next block is consolidated; where the file system
    refuses O_DIRECT, through the page cache) or ``pwrite`` (through the page cache, written out
    by the fsync at the end of each file)."""
    return _get("UCPD_FLUSH_IO", "direct")


def object_part_bytes() -> int:
    """Bytes of each part of a multipart upload, and of each ranged read, to an object store
    (a ``--flush-dir`` URL); S3 wants parts of at least 5 MiB."""
    return max(5 << 20, parse_size(_get("UCPD_OBJECT_PART_BYTES", "16M")))


def object_concurrency() -> int:
    """Parts (uploads or ranged reads) in flight at once to an object store; each holds a part in memory."""
    return max(1, int(_get("UCPD_OBJECT_CONCURRENCY", "8")))


def rpc_timeout() -> float:
    """Seconds a client waits for a daemon reply before raising DaemonUnreachable."""
    return float(_get("UCPD_RPC_TIMEOUT", "60"))


def commit_timeout() -> float | None:
    """Seconds ``SnapshotHandle.wait()`` waits for every rank to commit a step when given no
    timeout, before it raises ``CommitTimeout`` naming the ranks that never came ($UCPD_COMMIT_TIMEOUT;
    0 = for ever)."""
    value = float(_get("UCPD_COMMIT_TIMEOUT", "900"))
    return value if value > 0 else None


def stall_warn() -> float:
    """Seconds a version may wait for ranks before the daemon logs which ranks of which job it
    waits for (and again every 6 times as long), and a client waiting on it logs the same."""
    return float(_get("UCPD_STALL_WARN", "10"))


def dedup_wait() -> float:
    """Seconds the ranks of a job with balanced dedup wait for each other at a snapshot (to agree
    on who writes which share) before each writes its tensors whole from then on
    ($UCPD_DEDUP_WAIT; default $UCPD_STALL_WARN)."""
    return float(_get("UCPD_DEDUP_WAIT", str(stall_warn())))


def disk_lookup_seconds() -> float:
    """Seconds a lookup in the flush dir may take before ``latest``/restores answer from RAM
    (a hung file system never stalls them; the lookup goes on in the background)."""
    return float(_get("UCPD_DISK_LOOKUP_SECONDS", "") or 2.0)


def disk_answer_seconds() -> float:
    """Seconds ``latest``/a restore waits in all for the flush dir when RAM holds nothing of the
    job (the flush dir's answer is then the only one); after that, a ``StorageError``."""
    return float(_get("UCPD_DISK_ANSWER_SECONDS", "") or 60.0)


def flush_stall_seconds() -> float:
    """Seconds a flush may write nothing before ``ucpd status`` calls it stalled."""
    return float(_get("UCPD_FLUSH_STALL_SECONDS", "") or 30.0)


def secret_file() -> str | None:
    """The file holding the job secret a team's peers prove (``--secret-file`` wins)."""
    return get("UCPD_SECRET_FILE") or None


def embedded_start_timeout() -> float:
    """Seconds to wait for an embedded daemon to come up."""
    return float(_get("UCPD_EMBEDDED_TIMEOUT", "30"))


def embedded_idle_exit() -> float:
    """An embedded daemon exits after this many seconds with no client (0 = never)."""
    return float(_get("UCPD_EMBEDDED_IDLE_EXIT", "900"))


def mem_limit() -> int:
    """Bytes of RAM the daemon may hold in slots (0 = 80% of what /dev/shm can hold)."""
    return parse_size(_get("UCPD_MEM_LIMIT", "0"))


def restore_verify() -> str:
    """How a restore checks its sources as it writes its targets; each mode reads every byte it
    copies and checks every chunk against its CRC32C. ``fused`` (default): CPU targets in one
    pass that checksums each chunk as it copies it, each byte read from RAM once (the fastest:
    a restore near a plain copy); a damaged chunk is found as it lands, the next source, if
    any, rewrites every target, and when none is left the error says the targets are partly
    written. CUDA targets go as ``window``. ``window``: the plan runs in windows of
    ``restore_window()`` bytes, each chunk checked and then copied while it is still in cache
    (on a GPU the DMA of a window overlaps the check of the next): no byte of a damaged chunk is
    written, the windows before it are. ``all``: every chunk the plan reads is verified before
    the first target byte is written, so a damaged source leaves every target as it was, at the
    cost of reading the bytes from RAM twice (the check, then the copy)."""
    mode = _get("UCPD_RESTORE_VERIFY", "fused")
    if mode not in ("all", "window", "fused"):
        raise ValueError(f"UCPD_RESTORE_VERIFY must be 'window', 'fused' or 'all', got {mode!r}")
    return mode


def restore_lane() -> bool:
    """Whether a restoring rank gets the sources held on other nodes itself, on the team's data
    lane, landing them in its targets (``ucpd_client.lane_restore``; ``UCPD_RESTORE_LANE``, on by
    default). Off, or for CUDA targets and the ``window``/``all`` checks: the daemon fetches
    them into files of its node first, and the rank copies them from there."""
    return _get("UCPD_RESTORE_LANE", "1").strip().lower() not in ("0", "false", "no", "off")


def restore_window() -> int:
    """Bytes of a restore window (``restore_verify() == "window"``, and the pieces a GPU restore
    queues at once in any mode): rounded down to whole CRC chunks, at least one."""
    return max(1, parse_size(_get("UCPD_RESTORE_WINDOW", "16M")))


def stage_window() -> int:
    """Bytes of a snapshot's device-to-host window: CUDA tensors are copied in windows, each
    followed by an event, and the chunk CRCs of a window are computed while the next one is
    in flight (rounded to whole CRC chunks, at least one)."""
    return max(1, parse_size(_get("UCPD_STAGE_WINDOW", "64M")))


def parse_size(text: str) -> int:
    """Parse '16G', '512MiB', '1.5g', '1048576' into bytes."""
    s = str(text).strip().lower().replace("ib", "").rstrip("b")
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    if s and s[-1] in units:
        return int(float(s[:-1]) * units[s[-1]])
    return int(float(s)) if s else 0
