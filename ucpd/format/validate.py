"""The validator: every problem of a checkpoint root (or one version), as readable lines."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..errors import ChecksumMismatch, FormatError, UcpdError
from . import spec
from .reader import VersionReader, read_meta
from .root import list_versions, read_latest

_KNOWN_FILES = {spec.META_FILE, spec.OBJECTS_FILE}


def validate(
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
    the checksum pass. Each problem names the path and what is wrong. A URL root is checked
    through ``ObjectRoot.validate`` (each version fetched, then checked as a folder).
    """
    from .objstore import ObjectRoot, is_url

    if is_url(root):
        return ObjectRoot(str(root)).validate(step, full, progress)
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
            total = sum(r.meta.total_bytes for r in readers)
            done = 0
            for r in readers:
                for name, t in r.tensors.items():
                    try:
                        for i, b, e, got, want in r.bad_chunks(name):
                            problems.append(
                                f"{r.path / t.file}: tensor {name!r} chunk {i} (tensor bytes [{b}, {e})) has "
                                f"crc32c {got:#010x}, ucp.json records {want:#010x}"
                            )
                    except FormatError as exc:
                        problems.append(str(exc))
                    done += t.nbytes
                    if progress is not None:
                        progress(done, total)
                try:
                    _ = r.objects  # reading the objects verifies their checksums
                except (ChecksumMismatch, FormatError) as exc:
                    problems.append(str(exc))
    finally:
        for r in readers:
            r.close()
    return problems
