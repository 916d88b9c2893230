"""A checkpoint root in a folder: the folder holding ``step-<N>/`` versions and the ``LATEST`` pointer
(``roots.LocalRoot``; a root of either kind, folder or object store, is a ``roots.Root``).

What concerns the root as a whole, rather than writing or reading one version: the ``LATEST``
pointer, listing the versions (complete, torn, a writer's temporary folder and whether that
writer still lives), choosing and opening one, and retention (deleting old versions).
``writer`` (one version out) and ``reader`` (one version in) both sit below this module:
it imports ``reader``, and ``writer`` imports it, so neither of them imports the other.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from ..errors import FormatError, VersionNotFound
from . import spec
from .durable import fsync_dir, write_file_atomic
from .reader import VersionReader, check_files_present, read_meta
from .spec import VersionSummary

log = logging.getLogger("ucpd.format")

__all__ = [
    "clean_temp", "default_step", "list_versions", "maybe_update_latest", "open_version", "pid_alive",
    "point_latest", "read_latest", "retain", "write_latest",
]

# -- LATEST ---------------------------------------------------------------------------------


def read_latest(root: str | os.PathLike) -> int | None:
    """The step ``LATEST`` names, or None if it is missing or unreadable."""
    try:
        text = (Path(root) / spec.LATEST_FILE).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return spec.parse_step_dirname(text)


def write_latest(root: str | os.PathLike, step: int, *, fsync: bool = True) -> None:
    """Point ``LATEST`` at ``step-<step>`` (atomically)."""
    write_file_atomic(Path(root) / spec.LATEST_FILE, (spec.step_dirname(step) + "\n").encode(), fsync=fsync)


def maybe_update_latest(root: Path, step: int, fsync: bool) -> None:
    """Point ``LATEST`` at ``step`` unless it already names a newer complete version."""
    cur = read_latest(root)
    if cur is not None and cur > step and (root / spec.step_dirname(cur) / spec.META_FILE).is_file():
        return  # LATEST already names a newer complete version
    write_latest(root, step, fsync=fsync)


# -- listing and opening --------------------------------------------------------------------


def _summarize(path: Path, step: int, latest: int | None) -> VersionSummary:
    try:
        meta = read_meta(path, step)
        check_files_present(path, meta)
    except FormatError as exc:
        return VersionSummary(step, path, "torn", latest=step == latest, problem=str(exc))
    return VersionSummary(
        step, path, "complete", len(meta.tensors), meta.total_bytes, meta.created_unix, step == latest
    )


def list_versions(root: str | os.PathLike) -> list[VersionSummary]:
    """Every ``step-<N>`` folder under ``root`` (and writers' temporary folders), by step.

    Cheap: reads each ``ucp.json`` and stats the files; use ``validate`` for checksums.
    A missing ``root`` has no versions.
    """
    root = Path(root)
    latest = read_latest(root)
    out: list[VersionSummary] = []
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for e in entries:
        if not e.is_dir(follow_symlinks=True):
            continue
        step = spec.parse_step_dirname(e.name)
        if step is not None:
            out.append(_summarize(Path(e.path), step, latest))
            continue
        m = spec.TMP_RE.match(e.name)
        if m:
            pid = int(m.group(2))
            how = "in progress" if pid_alive(pid) else "stale: its writer is gone"
            out.append(VersionSummary(int(m.group(1)), Path(e.path), "partial", problem=f"writer pid {pid} ({how})"))
    out.sort(key=lambda v: (v.step, v.state != "complete"))
    return out


def default_step(root: Path) -> int:
    """The step ``LATEST`` names if it is complete, else the newest complete one."""
    root = Path(root)
    versions = [v for v in list_versions(root) if v.state == "complete"]
    latest = read_latest(root)
    if latest is not None:
        if any(v.step == latest for v in versions):
            return latest
        log.warning(
            "%s names step-%d, which is missing or torn; using the newest complete version",
            root / spec.LATEST_FILE, latest,
        )
    if not versions:
        if not root.is_dir():
            raise VersionNotFound(f"{root}: no such directory; pass the checkpoint root (the folder holding step-<N>/)")
        raise VersionNotFound(f"{root}: no complete version (step-<N>/ with ucp.json); nothing to restore")
    return versions[-1].step


def open_version(root: str | os.PathLike, step: int | None = None) -> VersionReader:
    """Open version ``step`` under ``root``; ``None`` = the one ``LATEST`` names, or the newest
    complete one when ``LATEST`` is missing or names a missing/torn folder.

    Raises VersionNotFound (no such step / nothing complete) or FormatError (torn or malformed:
    missing or bad ucp.json, missing/truncated file, bad header, header disagreeing with
    ucp.json), each naming the path and the problem.
    """
    root = Path(root)
    if step is None:
        step = default_step(root)
    path = root / spec.step_dirname(step)
    if not path.is_dir():
        have = [v.step for v in list_versions(root) if v.state == "complete"]
        raise VersionNotFound(f"{path}: no such version; complete versions under {root}: {have or 'none'}")
    return VersionReader(path, read_meta(path, step))


# -- retention ------------------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dir(root: Path, path: Path, step: int) -> None:
    """Rename out of sight first (so a crash mid-delete leaves no torn ``step-<N>``), then delete."""
    doomed = root / spec.del_dirname(step, os.getpid())
    if doomed.exists():
        shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    fsync_dir(root)
    shutil.rmtree(doomed, ignore_errors=True)


def retain(root: str | os.PathLike, keep: int, protect: Iterable[int] = ()) -> list[Path]:
    """Delete all but the newest ``keep`` complete versions (never the one ``LATEST`` names,
    nor the steps in ``protect``: versions being read),
    torn ``step-<N>`` folders older than the newest complete version, and temporary or
    half-deleted folders whose writer process is gone. Returns the paths removed."""
    if keep < 1:
        raise FormatError(f"keep must be >= 1, got {keep}")
    root = Path(root)
    if not root.is_dir():
        return []
    removed: list[Path] = []
    versions = list_versions(root)
    complete = sorted(v.step for v in versions if v.state == "complete")
    latest = read_latest(root)
    keep_steps = set(complete[-keep:]) | set(protect)
    if latest is not None:
        keep_steps.add(latest)
    newest = complete[-1] if complete else None
    for v in versions:
        if v.state == "complete" and v.step not in keep_steps or v.state == "torn" and newest is not None and v.step < newest and v.step not in keep_steps:
            _remove_dir(root, v.path, v.step)
            removed.append(v.path)
    return removed + clean_temp(root)


def clean_temp(root: str | os.PathLike) -> list[Path]:
    """Remove the temporary (``.tmp``) and half-deleted (``.del``) folders under ``root`` whose
    writer process is gone (a writer killed mid-version). Returns the paths removed."""
    removed: list[Path] = []
    if not os.path.isdir(root):
        return removed
    for entry in os.scandir(root):
        m = spec.TMP_RE.match(entry.name) or spec.DEL_RE.match(entry.name)
        if m and entry.is_dir(follow_symlinks=False) and not pid_alive(int(m.group(2))):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed


def point_latest(root: str | os.PathLike, step: int, fsync: bool = True) -> None:
    """Make ``LATEST`` name ``step`` unless it already names a newer complete version."""
    maybe_update_latest(Path(root), step, fsync)
