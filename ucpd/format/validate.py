"""The validator: every problem of a checkpoint root (or one version), as readable lines: a
folder's (``validate_folder``) or an object store's (``validate_store``); ``roots.validate`` takes either."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..errors import FormatError, UcpdError, VersionNotFound
from . import spec
from .objstore import ObjectRoot
from .reader import VersionReader, read_meta
from .root import list_versions, read_latest

_KNOWN_FILES = {spec.META_FILE, spec.OBJECTS_FILE}


def validate_folder(
    root: str | os.PathLike,
    step: int | None = None,
    full: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Check ``root`` (every version, or only ``step``) and return the problems found.

    An empty list means valid. Structure is always checked (ucp.json schema, files present
    with their recorded sizes, safetensors headers bounds-checked and agreeing with ucp.json,
    no unexpected files, LATEST naming a complete version); ``full`` also verifies every
    checksum chunk of every tensor and object. ``progress(bytes_done, bytes_total)`` follows
    the checksum pass. Each problem names the path and what is wrong.
    """
    root = Path(root)
    if not root.is_dir():
        return [f"{root}: not a directory"]
    problems: list[str] = []
    versions = list_versions(root)
    if step is not None:
        versions = [v for v in versions if v.step == step]
        if not versions:
            return [f"{root / spec.step_dirname(step)}: no such version"]

    latest = read_latest(root)
    latest_file = root / spec.LATEST_FILE
    if step is None or step == latest:
        if latest is None and latest_file.exists():
            problems.append(f"{latest_file}: unreadable; it must hold 'step-<N>'")
        elif latest is not None:
            if not any(v.step == latest and v.state == "complete" for v in list_versions(root)):
                problems.append(f"{latest_file}: names step-{latest}, which is missing or torn")

    readers: list[VersionReader] = []
    for v in versions:
        if v.state == "partial":
            if "stale" in (v.problem or ""):
                problems.append(f"{v.path}: stale temporary folder of step {v.step}, {v.problem} (run retain to remove)")
            continue
        if v.state == "torn":
            problems.append(f"{v.path}: torn version: {v.problem}")
            continue
        try:
            r = VersionReader(v.path, read_meta(v.path, v.step))
        except UcpdError as exc:
            problems.append(f"{v.path}: {exc}")
            continue
        for entry in sorted(os.listdir(v.path)):
            if entry not in _KNOWN_FILES and entry not in r.meta.files:
                problems.append(f"{v.path / entry}: unexpected file in a version folder")
        readers.append(r)

    try:
        if full:
            total, done = sum(r.meta.total_bytes for r in readers), 0

            def advance(n: int) -> None:
                nonlocal done
                done += n
                progress(done, total)

            for r in readers:
                problems += r.checksum_problems(advance if progress is not None else None)
    finally:
        for r in readers:
            r.close()
    return problems


def validate_store(store: ObjectRoot, step: int | None, full: bool, progress: Callable[[int, int], None] | None) -> list[str]:
    """``validate_folder`` of an object-store root: every committed version (or ``step``) fetched into
    a temporary folder and checked there, plus the store's own problems (torn versions,
    abandoned uploads, ``LATEST`` naming an uncommitted one)."""
    problems: list[str] = []
    try:
        versions = store.list_versions()
    except FileNotFoundError:
        return [f"{store.url}: no such bucket or prefix"]
    if step is not None:
        versions = [v for v in versions if v.step == step]
        if not versions:
            return [f"{store.url}/{spec.step_dirname(step)}: no such version"]
    latest = store.read_latest()
    if (step is None or step == latest) and latest is not None:
        if not any(v.step == latest and v.state == "complete" for v in store.list_versions()):
            problems.append(f"{store.url}/{spec.LATEST_FILE}: names step-{latest}, which is not committed")
    for v in versions:
        if v.state == "partial":
            problems.append(f"{v.path}: {v.problem}")
        elif v.state == "torn":
            problems.append(f"{v.path}: torn version: {v.problem}")
        else:
            with tempfile.TemporaryDirectory(prefix="ucpd-fetch-") as tmp:
                try:
                    store.fetch(v.step, tmp, verify=False)
                except (FormatError, VersionNotFound) as exc:
                    problems.append(str(exc))
                    continue
                problems += [p.replace(tmp, store.url) for p in validate_folder(tmp, v.step, full=full, progress=progress)
                             if not p.startswith(str(Path(tmp) / spec.LATEST_FILE))]
    return problems
