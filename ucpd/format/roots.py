"""The storage seam: a checkpoint root is a :class:`Root`, a folder (:class:`LocalRoot`) or an
object store (:class:`StoreRoot`, over ``objstore.ObjectRoot``), and :func:`as_root` is the one
place that tells a URL from a path (PyTorch DCP's shape: ``FileSystemBase`` with a local
``FileSystem`` and an fsspec one). Everything above the format (the public functions of
``ucpd.format``, the CLI, the daemon's flush and restores) asks a root, never which kind it is.

Both hold the same versions under the same names (``step-<N>/``, ``LATEST``); they differ in how
a version is committed (a folder renamed; a commit marker written last) and read (in place; a
verified download into a local folder). A store root may have a ``staging`` folder (the
daemon's flush cache): versions are written there before they are published, a copy written
before a restart is published as it is, and restores fetch into it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..errors import FormatError
from . import root as folder
from . import spec
from .objstore import ObjectRoot, is_url
from .reader import VersionReader, read_meta
from .spec import VersionSummary
from .validate import validate_folder, validate_store
from .writer import write_version as write_folder_version

log = logging.getLogger("ucpd.format")

__all__ = ["LocalRoot", "Root", "StoreRoot", "as_root"]


@runtime_checkable
class Root(Protocol):
    """A checkpoint root: where a job's versions live. ``name``: its path or URL;
    ``storage_options``: fsspec's (a store's; empty for a folder); ``downloads``: whether a
    version is read from a local copy fetched first (``fetch``, ``staged``)."""

    name: str
    storage_options: dict
    downloads: bool

    def prepare(self) -> None:
        """Make the root ready to be written (a folder made; a store's staging folder)."""

    def join(self, *names: str) -> Root:
        """The root ``names`` below this one (a job's, under a flush dir)."""

    def where(self, step: int) -> str:
        """The path or URL of version ``step``."""

    def exists(self) -> bool: ...

    def children(self) -> list[str]:
        """The names of the checkpoint roots directly below this one (a flush dir's jobs)."""

    def contains(self, where: str) -> bool:
        """Whether the path or URL ``where`` lies below this root."""

    def read_latest(self) -> int | None: ...

    def point_latest(self, step: int) -> None:
        """Make ``LATEST`` name ``step`` unless it names a newer complete version already."""

    def list_versions(self) -> list[VersionSummary]: ...

    def default_step(self) -> int:
        """The step ``LATEST`` names if it is complete, else the newest complete one."""

    def committed(self, step: int) -> bool:
        """Whether version ``step`` is committed here (a folder: its ``ucp.json`` is in place, the
        rename being the commit point; a store: its commit marker, FormatError when malformed)."""

    def open_version(self, step: int | None = None, *, verify: bool = True) -> VersionReader: ...

    def write_version(self, step: int, tensors: Iterable, **kw: Any) -> Path | str:
        """``writer.write_version``'s arguments, into this root; returns the version's ``Path``
        (a folder) or URL."""

    def retain(self, keep: int, protect: Iterable[int] = ()) -> list:
        """``root.retain``'s rule: all but the newest ``keep`` complete versions go."""

    def clean(self) -> list:
        """Remove what writers that died left (temporary folders); returns what went."""

    def staged(self, step: int) -> Path | None:
        """A complete local copy of ``step`` not read from this root itself: written before it
        was published, or fetched (a store's staging folder); None for a folder."""

    def fetch(self, step: int | None) -> int:
        """Make committed ``step`` (None: the newest) readable here without a download (a
        store: a verified copy into the staging folder); returns the step."""

    def prune(self, keep: set[int]) -> None:
        """Drop local copies but the newest and ``keep`` (a store's staging)."""

    def validate(self, step: int | None = None, full: bool = True,
                 progress: Callable[[int, int], None] | None = None) -> list[str]: ...

    @property
    def target(self) -> Path | ObjectRoot:
        """What a team's flush writes into: the folder, or the store's ``ObjectRoot``."""


class LocalRoot:
    """A checkpoint root in a local folder (versions committed by renaming a folder)."""

    storage_options: dict = {}
    downloads = False

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.name = str(self.path)

    def prepare(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalRoot({self.name!r})"

    @property
    def target(self) -> Path:
        return self.path

    def join(self, *names: str) -> LocalRoot:
        return LocalRoot(os.path.join(self.path, *names))

    def where(self, step: int) -> str:
        return str(self.path / spec.step_dirname(step))

    def exists(self) -> bool:
        return self.path.is_dir()

    def children(self) -> list[str]:
        return sorted(d.name for d in self.path.iterdir()
                      if d.is_dir() and (any(d.glob("step-*")) or (d / spec.LATEST_FILE).exists()))

    def contains(self, where: str) -> bool:
        return str(where).startswith(os.path.join(os.path.realpath(self.path), ""))

    def read_latest(self) -> int | None:
        return folder.read_latest(self.path)

    def point_latest(self, step: int) -> None:
        folder.point_latest(self.path, step)

    def list_versions(self) -> list[VersionSummary]:
        return folder.list_versions(self.path)

    def default_step(self) -> int:
        return folder.default_step(self.path)

    def committed(self, step: int) -> bool:
        return (self.path / spec.step_dirname(step) / spec.META_FILE).is_file()  # (the rename is the commit point)

    def open_version(self, step: int | None = None, *, verify: bool = True) -> VersionReader:
        return folder.open_version(self.path, step)

    def write_version(self, step: int, tensors: Iterable, **kw: Any) -> Path:
        return write_folder_version(self.path, step, tensors, **kw)

    def retain(self, keep: int, protect: Iterable[int] = ()) -> list:
        return folder.retain(self.path, keep, protect)

    def clean(self) -> list:
        return folder.clean_temp(self.path)

    def staged(self, step: int) -> Path | None:
        return None

    def fetch(self, step: int | None) -> int:
        return self.default_step() if step is None else step

    def prune(self, keep: set[int]) -> None:
        pass

    def validate(self, step: int | None = None, full: bool = True,
                 progress: Callable[[int, int], None] | None = None) -> list[str]:
        return validate_folder(self.path, step, full, progress)


class StoreRoot:
    """A checkpoint root in an object store (``objstore.ObjectRoot``: a commit marker per
    version). ``staging``: a local folder where versions are written before they are published
    and fetched into for restores (the daemon's flush cache); without one, a temporary folder
    per write or read. ``lock``: serialises changes to the staging folder (shared by the roots
    ``join`` makes)."""

    downloads = True

    def __init__(self, url: str, storage_options: dict | None = None, staging: str | os.PathLike | None = None,
                 lock: threading.Lock | None = None) -> None:
        self.store = ObjectRoot(url, storage_options)  # a missing library or a bad URL fails here
        self.name = self.store.url
        self.storage_options = dict(storage_options or {})
        self.staging = None if staging is None else str(staging)
        self.lock = lock or threading.Lock()
        self.prepare()

    def prepare(self) -> None:
        if self.staging is not None:  # checkpoint bytes: ours alone
            os.makedirs(self.staging, mode=0o700, exist_ok=True)

    def __repr__(self) -> str:
        return f"StoreRoot({self.name!r})"

    @property
    def target(self) -> ObjectRoot:
        return self.store

    def join(self, *names: str) -> StoreRoot:
        staging = None if self.staging is None else os.path.join(self.staging, *names)
        return StoreRoot("/".join([self.name, *names]), self.storage_options, staging, self.lock)

    def where(self, step: int) -> str:
        return f"{self.name}/{spec.step_dirname(step)}"

    def exists(self) -> bool:
        return bool(self.store.fs.exists(self.store.path))

    def children(self) -> list[str]:
        try:
            return sorted({p.rstrip("/").rsplit("/", 1)[-1] for p in self.store.fs.ls(self.store.path, detail=False)})
        except FileNotFoundError:
            return []

    def contains(self, where: str) -> bool:
        return str(where).rstrip("/").startswith(self.name + "/")

    def read_latest(self) -> int | None:
        return self.store.read_latest()

    def point_latest(self, step: int) -> None:
        self.store.point_latest(step)

    def list_versions(self) -> list[VersionSummary]:
        try:
            return self.store.list_versions()
        except FileNotFoundError:
            return []

    def default_step(self) -> int:
        return self.store.default_step()

    def committed(self, step: int) -> bool:
        return self.store.committed(step)

    def open_version(self, step: int | None = None, *, verify: bool = True) -> VersionReader:
        """The committed version fetched (ranged reads; ``verify``: every chunk checked): into the
        staging folder, where it stays (``fetch``), or else into a temporary folder that closing
        the reader removes."""
        if self.staging is not None:
            step = self.fetch(step)
            return folder.open_version(self.staging, step)
        tmp = tempfile.mkdtemp(prefix="ucpd-fetch-")
        try:
            path = self.store.fetch(step, tmp, verify=verify)
            return VersionReader(path, read_meta(path), on_close=lambda: shutil.rmtree(tmp, ignore_errors=True))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def fetch(self, step: int | None) -> int:
        """A verified copy of committed ``step`` (None: the newest) into the staging folder,
        kept there. A copy whose objects fail their checks twice is kept for its readers to meet
        the damage chunk by chunk, as in a damaged file (the daemon's restores)."""
        if self.staging is None:
            raise FormatError(f"{self.name}: no staging folder to fetch into")
        with self.lock:
            step = self.store.default_step() if step is None else step
            if self.staged(step) is None:
                for stale in folder.clean_temp(self.staging):
                    log.warning("removed %s, left by a fetch that did not finish", stale)
                log.info("fetching step %d from %s", step, self.name)
                self.store.fetch(step, self.staging, keep_damaged=True)
        return step

    def write_version(self, step: int, tensors: Iterable, *, progress: Callable[[int, int], None] | None = None,
                      rate_limit: float | None = None, update_latest: bool = True, **kw: Any) -> Path | str:
        """Written as into a folder (the staging folder; a copy written there before a restart
        is published as it is), then published: parallel multipart uploads, the marker last."""
        kw.pop("fsync", None)  # the local copy is only read back to be uploaded
        if self.store.committed(step):
            raise FormatError(f"{self.where(step)} already exists; versions are immutable")
        if self.staging is None:
            with tempfile.TemporaryDirectory(prefix="ucpd-stage-") as tmp:
                local = write_folder_version(tmp, step, tensors, progress=progress, rate_limit=rate_limit, fsync=False,
                                             update_latest=False, **kw)
                self.store.publish(local, step, update_latest=update_latest)
            return self.where(step)
        staged = self.staged(step)
        if staged is None:
            staged = write_folder_version(self.staging, step, tensors, progress=progress, rate_limit=rate_limit,
                                          update_latest=False, **kw)
        else:
            log.info("step %d was written to %s before a restart; publishing it", step, staged)
        if progress is not None:
            progress(0, 0)  # now the upload's bytes
        self.store.publish(staged, step, progress=progress, rate=rate_limit, update_latest=update_latest)
        return self.where(step)

    def retain(self, keep: int, protect: Iterable[int] = ()) -> list:
        return self.store.retain(keep, protect)

    def clean(self) -> list:
        if self.staging is None:
            return []
        with self.lock:
            return folder.clean_temp(self.staging)

    def staged(self, step: int) -> Path | None:
        if self.staging is None:
            return None
        path = Path(self.staging) / spec.step_dirname(step)
        return path if (path / spec.META_FILE).is_file() else None

    def prune(self, keep: set[int]) -> None:
        """Remove the staging folder's copies other than the newest and ``keep`` (being read)."""
        if self.staging is None:
            return
        with self.lock:
            try:
                steps = sorted(s for s in (spec.parse_step_dirname(e) for e in os.listdir(self.staging)) if s is not None)
            except FileNotFoundError:
                return
            for s in steps[:-1]:
                if s not in keep:  # out of sight first: a crash mid-delete leaves no half copy named step-<N>
                    doomed = os.path.join(self.staging, spec.del_dirname(s, os.getpid()))
                    shutil.rmtree(doomed, ignore_errors=True)
                    os.rename(os.path.join(self.staging, spec.step_dirname(s)), doomed)
                    shutil.rmtree(doomed, ignore_errors=True)

    def validate(self, step: int | None = None, full: bool = True,
                 progress: Callable[[int, int], None] | None = None) -> list[str]:
        return validate_store(self.store, step, full, progress)


def as_root(root: str | os.PathLike | Root, storage_options: dict | None = None,
            staging: str | os.PathLike | None = None) -> Root:
    """The :class:`Root` that ``root`` names: a URL (``scheme://...``) is an object store, any
    other path a folder; a Root is returned as it is. ``storage_options`` and ``staging``: a
    store's (see :class:`StoreRoot`)."""
    if not isinstance(root, (str, os.PathLike)) and isinstance(root, Root):
        return root
    if is_url(root):
        return StoreRoot(str(root), storage_options, staging)
    if not isinstance(root, (str, os.PathLike)):
        raise FormatError(f"a checkpoint root is a folder path or a URL (scheme://...), got {type(root).__name__}")
    return LocalRoot(root)


# -- the public functions of ucpd.format: any root ------------------------------------------------


def read_latest(root: str | os.PathLike | Root) -> int | None:
    """The step ``LATEST`` names, or None if it is missing or unreadable."""
    return as_root(root).read_latest()


def list_versions(root: str | os.PathLike | Root) -> list[VersionSummary]:
    """Every version under ``root``, by step (``root.list_versions``; a URL: ``ObjectRoot.list_versions``).
    Cheap: reads each ``ucp.json`` and stats the files; use ``validate`` for checksums. A missing
    root has no versions."""
    return as_root(root).list_versions()


def open_version(root: str | os.PathLike | Root, step: int | None = None) -> VersionReader:
    """Open version ``step`` under ``root`` (``root.open_version``); ``None``: the one ``LATEST``
    names, or the newest complete one. A URL root: the committed version is fetched (ranged
    reads, every chunk checked) into a temporary folder that closing the reader removes."""
    return as_root(root).open_version(step)


def retain(root: str | os.PathLike | Root, keep: int, protect: Iterable[int] = ()) -> list:
    """Delete all but the newest ``keep`` complete versions (``root.retain``; a URL:
    ``ObjectRoot.retain``, commit markers first). Returns what was removed."""
    return as_root(root).retain(keep, protect)


def write_version(root: str | os.PathLike | Root, step: int, tensors: Iterable, **kw: Any):
    """``writer.write_version`` into ``root``: a folder (returns the version's ``Path``), or a
    URL: written as here into a local temporary folder, then published to the object store
    (parallel multipart uploads, then the commit marker; returns the version's URL)."""
    return as_root(root).write_version(step, tensors, **kw)


def validate(root: str | os.PathLike | Root, step: int | None = None, full: bool = True,
             progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Check ``root`` (every version, or only ``step``) and return the problems found
    (``validate.validate_folder``; a URL: each version fetched, then checked as a folder)."""
    return as_root(root).validate(step, full, progress)
