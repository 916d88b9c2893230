"""The local side of an object-store flush dir (``--flush-dir s3://...``): one folder per job
where the flush writes a version before publishing it, and where a restore that RAM cannot
serve fetches one, so that trainers map its files as they map a flushed directory's.

``<cache>/<job>/step-<N>/`` is a complete version in the universal format (``ucpd.format``'s
writer wrote it, or ``ObjectRoot.fetch`` downloaded and verified it). The newest one of a job
stays (a restore after a crash reads it without a download; a daemon killed mid-upload resumes
the upload from it); older ones go unless a restore is reading them. One lock serialises the
flush thread's and the restores' changes to the folder.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

from ..format import spec
from ..format.objstore import ObjectRoot, join
from ..format.root import clean_temp

log = logging.getLogger("ucpd.flush")


class FlushCache:
    """``flush_dir``: the URL; ``cache_dir``: the local folder; ``storage_options``: fsspec's."""

    def __init__(self, flush_dir: str, cache_dir: str, storage_options: dict | None = None) -> None:
        self.flush_dir, self.dir, self.storage_options = flush_dir, cache_dir, storage_options or {}
        self.lock = threading.Lock()
        os.makedirs(cache_dir, mode=0o700, exist_ok=True)
        ObjectRoot(flush_dir, self.storage_options)  # a missing library or a bad URL fails at start

    def store(self, job: str) -> ObjectRoot:
        """The job's checkpoint root in the object store."""
        return ObjectRoot(join(self.flush_dir, job), self.storage_options)

    def local(self, job: str) -> str:
        """The job's local folder (a checkpoint root of its own)."""
        return os.path.join(self.dir, job)

    def staged(self, job: str, step: int) -> Path | None:
        """The complete local copy of ``step``, if there is one."""
        path = Path(self.local(job)) / spec.step_dirname(step)
        return path if (path / spec.META_FILE).is_file() else None

    def fetch(self, job: str, step: int | None) -> tuple[str, int]:
        """A verified local copy of ``job``'s committed ``step`` (None: the newest): (local root, step)."""
        store = self.store(job)
        with self.lock:
            step = store.default_step() if step is None else step
            if self.staged(job, step) is None:
                for stale in clean_temp(self.local(job)):
                    log.warning("removed %s, left by a fetch that did not finish", stale)
                log.info("fetching step %d of job %r from %s", step, job, store.url)
                store.fetch(step, self.local(job), keep_damaged=True)  # restores meet damage as in a file
        return self.local(job), step

    def prune(self, job: str, keep: set[int]) -> None:
        """Remove the job's local copies other than the newest and ``keep`` (being read)."""
        with self.lock:
            root = self.local(job)
            try:
                steps = sorted(s for s in (spec.parse_step_dirname(e) for e in os.listdir(root)) if s is not None)
            except FileNotFoundError:
                return
            for s in steps[:-1]:
                if s not in keep:  # out of sight first: a crash mid-delete leaves no half copy named step-<N>
                    doomed = os.path.join(root, spec.del_dirname(s, os.getpid()))
                    shutil.rmtree(doomed, ignore_errors=True)
                    os.rename(os.path.join(root, spec.step_dirname(s)), doomed)
                    shutil.rmtree(doomed, ignore_errors=True)
