"""Checkpoint roots in an object store: ``s3://bucket/prefix`` or any other fsspec URL.

The storage seam. A checkpoint root is either a local directory (``root``: versions committed by
renaming a folder) or a URL, handled here through fsspec (s3fs for ``s3://``), holding the same
files under the same names: ``<root>/step-<N>/ucp.json``, its safetensors shards,
``objects.bin``, and ``<root>/LATEST``. Nothing above this module writes a second copy of the
format: a version is written once, by ``writer.write_version``, into a local folder (the flush's
staging folder, or a temporary one), then published here file by file; a version is read by
fetching it into a local folder and opening that with ``reader.VersionReader``. So the bytes,
the checks and the resharded reads are exactly a directory's.

Object stores have no rename, so a version becomes visible through a commit marker
(``spec.marker_name``: ``<root>/step-<N>.committed``), written only after every object of the
version is in place; it records the version's files, their sizes and the CRC32C of its
``ucp.json``. A version without a marker is an upload in progress or left by a writer that died
(``partial``); readers never take it for a complete one. Publishing a version again (a
restarted daemon) uploads only what is missing, then writes the marker: an interrupted upload
resumes. ``ucp.json`` goes up first and tells whose the objects are: those of another write of
the same step are deleted and that upload starts over. Retention deletes a version's marker first, then its objects, so a reader never sees a
half-deleted version as complete.
A version whose files are never whole on one machine (a team's flush, every node uploading its
share as parts of the files' multipart uploads) goes up through ``format.multipart`` instead,
to the same objects and the same marker.

Transfers run many parts at once: files above ``knobs.object_part_bytes()`` go as multipart
uploads, reads are ranged gets of that size, ``knobs.object_concurrency()`` parts in flight.
On S3 every upload carries its CRC32C (``x-amz-checksum-crc32c``, computed by ``ucpd.native``
while the part is read), which S3 verifies on receipt and keeps with the object; other fsspec
stores get the files through their own ``put_file``. Either way ``ucp.json``'s chunk CRC32Cs are
the checksums every read is verified against.

Why s3fs rather than boto3's transfer manager: one fsspec URL reaches S3 and every other store
fsspec knows (GCS, Azure, a local ``file://`` path, ``memory://`` in tests) with one code path,
and its async client keeps many parts in flight from one thread. boto3's manager, also measured
(``benchmarks/format/bench_objstore.py``), uploads the same bytes at a similar rate through a
thread per part but reaches S3 only. The multipart calls are made here (through s3fs's client,
with its retries) rather than by ``S3FileSystem.put_file``, which neither sends part checksums
nor keeps a window of parts in flight (it waits for each batch).

Credentials and endpoints: the usual fsspec and AWS ways. s3fs reads ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE``, and botocore ``AWS_ENDPOINT_URL_S3`` (or
``AWS_ENDPOINT_URL``) for an S3-compatible server (MinIO, Ceph, a test server); fsspec's
``FSSPEC_S3_*`` variables and config files work too; ``storage_options`` (``ucpd serve
--flush-storage-options JSON``) passes keyword arguments to the filesystem, as in fsspec.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .. import knobs
from ..errors import FormatError, StorageError, UcpdError, VersionNotFound
from . import spec
from .reader import VersionReader

log = logging.getLogger("ucpd.format")

_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

__all__ = ["ObjectRoot", "is_url", "join"]


def is_url(root: Any) -> bool:
    """Whether ``root`` names an object store (``scheme://...``) rather than a local directory."""
    return isinstance(root, str) and bool(_URL_RE.match(root))


def join(root: str | os.PathLike, *names: str) -> str:
    """``root/names...``: a URL joined with ``/``, a local path with ``os.path.join``."""
    if is_url(root):
        return "/".join([str(root).rstrip("/"), *names])
    return os.path.join(root, *names)


def _b64_crc(crc: int) -> str:
    return base64.b64encode(int(crc).to_bytes(4, "big")).decode()


def _crc32c(data: Any) -> int:
    from .. import native

    return int(native.crc32c(data))


async def _all(coros: Iterable) -> list:
    """Run coroutines concurrently; on the first failure cancel the rest (no part goes on
    uploading after its upload was aborted) and raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class _Pace:
    """Progress reports and a bytes-per-second ceiling for a transfer."""

    def __init__(self, total: int, rate: float | None, progress: Callable[[int, int], None] | None) -> None:
        self.total, self.done, self.rate, self.progress = total, 0, float(rate or 0), progress
        self.t0 = time.monotonic()

    def delay(self, n: int) -> float:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)
        return max(0.0, self.done / self.rate - (time.monotonic() - self.t0)) if self.rate > 0 else 0.0


def _marked_sizes(vdir_url: str, marker: dict, meta: spec.Meta) -> dict[str, int]:
    """The files of a version a commit marker lists besides ``ucp.json``, with their sizes;
    FormatError for one ``ucp.json`` does not list or records at another size."""
    sizes = {n: int(size) for n, size in marker["files"].items() if n != spec.META_FILE}
    for n, size in sizes.items():
        if n not in meta.files and n != spec.OBJECTS_FILE:
            raise FormatError(f"{vdir_url}/{n}: in the commit marker, not in ucp.json")
        if n in meta.files and size != meta.files[n].size:
            raise FormatError(f"{vdir_url}/{n}: the commit marker records {size} bytes, ucp.json {meta.files[n].size}")
    return sizes


def _copy_problems(path: Path, meta) -> tuple[list[str], bool]:
    """A downloaded copy's checksum problems, and whether each is bytes failing their CRC32C
    (``VersionReader.checksum_report``) rather than a copy that does not read."""
    try:
        with VersionReader(path, meta) as r:
            return r.checksum_report()
    except FormatError as exc:
        return [str(exc)], False


class ObjectRoot:
    """One checkpoint root at an fsspec URL. Methods raise StorageError when the store fails a
    request after its retries (naming the URL), FormatError for a malformed version, and
    VersionNotFound for a version that is not there."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        if not is_url(url):
            raise FormatError(f"{url!r} is not a URL (scheme://...); a local directory is read without ObjectRoot")
        try:
            import fsspec
        except ImportError:
            raise StorageError(f"{url}: object-store roots need fsspec: pip install 'ucpd[s3]' (fsspec and s3fs)") from None
        self.url = url.rstrip("/")
        opts = dict(storage_options or {})
        if self.url.startswith(("file://", "local://")):
            opts.setdefault("auto_mkdir", True)  # a local path as a URL: folders are made as objects need them
        try:
            self.fs, self.path = fsspec.core.url_to_fs(self.url, **opts)
        except ImportError as exc:
            raise StorageError(f"{url}: the library for this URL is not installed ({exc}); for s3:// URLs: "
                               "pip install 'ucpd[s3]' (s3fs)") from None
        except ValueError as exc:
            raise StorageError(f"{url}: {exc}") from None
        self.path = self.path.rstrip("/")
        self.s3 = callable(getattr(self.fs, "_call_s3", None))
        self.part_bytes = knobs.object_part_bytes()
        self.concurrency = knobs.object_concurrency()

    def __repr__(self) -> str:
        return f"ObjectRoot({self.url!r})"

    # -- plumbing ------------------------------------------------------------------------------

    def _p(self, *names: str) -> str:
        return "/".join([self.path, *names])

    def _u(self, *names: str) -> str:
        return "/".join([self.url, *names])

    def _run(self, fn: Callable, *args: Any) -> Any:
        """Run coroutine function ``fn(*args)``: on the filesystem's own loop (async ones, like
        s3fs), else on a private one whose calls go to threads. Store failures become StorageError."""
        try:
            if self.fs.async_impl:
                from fsspec.asyn import sync

                return sync(self.fs.loop, fn, *args)
            return asyncio.run(fn(*args))
        except UcpdError:
            raise
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise StorageError(f"{self.url}: the object store failed a request after retries: {type(exc).__name__}: {exc}") from exc

    async def _call(self, name: str, *args: Any, **kw: Any) -> Any:
        if self.fs.async_impl:
            return await getattr(self.fs, "_" + name)(*args, **kw)
        return await asyncio.to_thread(getattr(self.fs, name), *args, **kw)

    def _sync(self, name: str, *args: Any, **kw: Any) -> Any:
        async def one() -> Any:
            return await self._call(name, *args, **kw)

        return self._run(one)

    def _listing(self, under: str = "") -> dict[str, int]:
        """Every object under the root (or its folder ``under``): path relative to the root ->
        size (one listing)."""
        self.fs.invalidate_cache()
        try:
            found = self._sync("find", self._p(under) if under else self.path, detail=True)
        except FileNotFoundError:
            return {}
        n = len(self.path) + 1
        return {p[n:]: int(info.get("size") or 0) for p, info in found.items() if p.startswith(self.path + "/")}

    def read_bytes(self, *names: str) -> bytes:
        return self._sync("cat_file", self._p(*names))

    def write_bytes(self, data: bytes, *names: str) -> None:
        """One small object, whole (a put is atomic: readers see the old object or the new one)."""
        if self.s3:
            bucket, key, _ = self.fs.split_path(self._p(*names))

            async def put() -> None:
                await self.fs._call_s3("put_object", Bucket=bucket, Key=key, Body=data, ChecksumCRC32C=_b64_crc(_crc32c(data)))

            self._run(put)
        else:
            self._sync("pipe_file", self._p(*names), data)

    def _remove(self, paths: list[str]) -> None:
        if paths:
            try:
                self._sync("rm", paths)
            except FileNotFoundError:
                pass

    # -- LATEST and markers ---------------------------------------------------------------------

    def read_latest(self) -> int | None:
        """The step ``LATEST`` names, or None if it is missing or unreadable."""
        try:
            text = self.read_bytes(spec.LATEST_FILE).decode("ascii").strip()
        except (FileNotFoundError, UnicodeDecodeError):
            return None
        return spec.parse_step_dirname(text)

    def write_latest(self, step: int) -> None:
        self.write_bytes((spec.step_dirname(step) + "\n").encode(), spec.LATEST_FILE)

    def marker(self, step: int) -> dict | None:
        """The commit marker of ``step`` (None: the version is not committed here)."""
        try:
            raw = self.read_bytes(spec.marker_name(step))
        except FileNotFoundError:
            return None
        try:
            m = json.loads(raw)
            if m["step"] != step or not isinstance(m["files"], dict) or not isinstance(m["meta_crc32c"], int):
                raise ValueError("fields")
        except (ValueError, KeyError, TypeError) as exc:
            raise FormatError(f"{self._u(spec.marker_name(step))}: malformed commit marker ({exc})") from None
        return m

    def committed(self, step: int) -> bool:
        return self.marker(step) is not None

    def read_meta(self, step: int, marker: dict | None = None) -> tuple[bytes, spec.Meta]:
        """``ucp.json`` of a committed version, checked against the CRC32C its marker records."""
        marker = marker if marker is not None else self.marker(step)
        where = self._u(spec.step_dirname(step), spec.META_FILE)
        if marker is None:
            raise VersionNotFound(f"{self._u(spec.step_dirname(step))}: no commit marker; the version is not committed")
        try:
            data = self.read_bytes(spec.step_dirname(step), spec.META_FILE)
        except FileNotFoundError:
            raise FormatError(f"{where}: missing, but the version's commit marker exists (deleted behind ucpd?)") from None
        if _crc32c(data) != marker["meta_crc32c"]:
            raise FormatError(f"{where}: crc32c {_crc32c(data):#010x}, the commit marker records "
                              f"{marker['meta_crc32c']:#010x}; the object is corrupt or was replaced")
        return data, spec.parse_meta(data, where, expect_step=step)

    # -- listing --------------------------------------------------------------------------------

    def list_versions(self) -> list:
        """Every version under the root, by step, as ``spec.VersionSummary`` (``path`` is the
        version's URL): ``complete`` (marker, ``ucp.json`` matching it, every file there with its
        size), ``torn`` (a marker whose version is not so) or ``partial`` (objects of a version
        without a marker: an upload in progress, or left by a writer that died)."""
        objects = self._listing()
        latest = self.read_latest()
        steps: dict[int, bool] = {}
        for rel in objects:
            head = rel.split("/", 1)[0]
            m = spec.MARKER_RE.match(head)
            if m and "/" not in rel:
                steps[int(m.group(1))] = True
                continue
            s = spec.parse_step_dirname(head)
            if s is not None and "/" in rel:
                steps.setdefault(s, False)
        out = []
        for step, marked in steps.items():
            url = self._u(spec.step_dirname(step))
            if not marked:
                out.append(spec.VersionSummary(step, url, "partial", problem="objects without a commit marker (an upload in "
                                          "progress, or left by a writer that died)"))
                continue
            try:
                marker = self.marker(step)
                _, meta = self.read_meta(step, marker)
                for name, size in marker["files"].items():
                    got = objects.get(f"{spec.step_dirname(step)}/{name}")
                    if got is None:
                        raise FormatError(f"{url}/{name}: missing (listed in the commit marker)")
                    if got != size:
                        raise FormatError(f"{url}/{name}: {got} bytes, the commit marker records {size}")
            except (FormatError, VersionNotFound) as exc:
                out.append(spec.VersionSummary(step, url, "torn", latest=step == latest, problem=str(exc)))
                continue
            out.append(spec.VersionSummary(step, url, "complete", len(meta.tensors), meta.total_bytes, meta.created_unix,
                                      step == latest))
        out.sort(key=lambda v: (v.step, v.state != "complete"))
        return out

    def default_step(self) -> int:
        """The step ``LATEST`` names if it is complete, else the newest complete one."""
        complete = [v.step for v in self.list_versions() if v.state == "complete"]
        latest = self.read_latest()
        if latest is not None and latest in complete:
            return latest
        if latest is not None:
            log.warning("%s names step-%d, which is not committed; using the newest complete version",
                        self._u(spec.LATEST_FILE), latest)
        if not complete:
            raise VersionNotFound(f"{self.url}: no committed version (step-<N>/ with its {spec.MARKER_SUFFIX} marker); "
                                  "nothing to read")
        return complete[-1]

    # -- publishing -----------------------------------------------------------------------------

    def publish(self, local: str | os.PathLike, step: int, *, progress: Callable[[int, int], None] | None = None,
                rate: float | None = None, update_latest: bool = True) -> None:
        """Upload the complete local version folder ``local`` (``write_version``'s output) as
        ``step``, then its commit marker, then ``LATEST`` (unless it names a newer committed
        version). Objects already uploaded whole by an earlier, interrupted publish of this
        version (same name and size) are kept: the upload resumes. A version already committed
        here is left as it is."""
        local = Path(local)
        meta_bytes = (local / spec.META_FILE).read_bytes()
        meta = spec.parse_meta(meta_bytes, str(local / spec.META_FILE), expect_step=step)
        try:
            self._publish(local, step, meta_bytes, meta, progress, rate)
        except FileNotFoundError as exc:
            raise StorageError(f"{self.url}: {exc} (does the bucket exist, and may these credentials write to it?)") from None
        if update_latest:
            self.point_latest(step)

    def _publish(self, local: Path, step: int, meta_bytes: bytes, meta, progress, rate) -> None:
        """``ucp.json`` goes first: it names the version's exact bytes (every chunk's CRC32C and its
        creation time), so a later publish of the step keeps the objects already there only when
        they belong to this very version (the same ``ucp.json``); objects of any other write of
        the step (a writer that died, a job that went back and wrote the step anew) are deleted and
        the upload starts over. The marker, last, is the commit point."""
        if self.committed(step):
            log.info("%s is committed already", self._u(spec.step_dirname(step)))
            return
        names = sorted(meta.files) + ([spec.OBJECTS_FILE] if (local / spec.OBJECTS_FILE).exists() else [])
        sizes = {n: (local / n).stat().st_size for n in names}
        vdir = spec.step_dirname(step)
        self._abort_stale_uploads(vdir)
        here = self._listing(vdir)
        ours = False
        if here.get(f"{vdir}/{spec.META_FILE}") == len(meta_bytes):
            try:
                ours = self.read_bytes(vdir, spec.META_FILE) == meta_bytes
            except FileNotFoundError:
                pass
        if here and not ours:
            log.warning("%s: %d objects of another, unfinished write of this step; starting over", self._u(vdir), len(here))
            self._sync("rm", self._p(vdir), recursive=True)
            here = {}
        if not ours:
            self.write_bytes(meta_bytes, vdir, spec.META_FILE)
        todo = [n for n in names if here.get(f"{vdir}/{n}") != sizes[n]]
        if len(todo) < len(names):
            log.info("%s: resuming an upload, %d of %d files are there already", self._u(vdir), len(names) - len(todo), len(names))
        pace = _Pace(sum(sizes[n] for n in todo), rate, progress)
        self._run(self._upload, [(local / n, self._p(vdir, n), sizes[n]) for n in todo], pace)
        marker = {"step": step, "meta_crc32c": _crc32c(meta_bytes), "files": {spec.META_FILE: len(meta_bytes), **sizes}}
        self.write_bytes(json.dumps(marker, sort_keys=True).encode(), spec.marker_name(step))  # the commit point

    def point_latest(self, step: int) -> None:
        """Make ``LATEST`` name ``step`` unless it names a newer committed version."""
        cur = self.read_latest()
        if cur is None or cur <= step or not self.committed(cur):
            self.write_latest(step)

    def _abort_stale_uploads(self, vdir: str) -> None:
        """Multipart uploads a dead writer left open under the version (S3 keeps and bills their parts)."""
        if not self.s3:
            return
        bucket, prefix, _ = self.fs.split_path(self._p(vdir) + "/")

        async def abort() -> None:
            got = await self.fs._call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
            for up in got.get("Uploads") or ():
                await self.fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
                log.info("aborted an unfinished multipart upload of s3://%s/%s", bucket, up["Key"])

        self._run(abort)

    async def _upload(self, files: list[tuple[Path, str, int]], pace: _Pace) -> None:
        sem = asyncio.Semaphore(self.concurrency)

        async def paced(n: int) -> None:
            wait = pace.delay(n)
            if wait:
                await asyncio.sleep(wait)

        async def one(local: Path, remote: str, size: int) -> None:
            if not self.s3:  # the store's own upload; ucp.json's CRCs check the bytes when read
                async with sem:
                    await self._call("put_file", str(local), remote)
                await paced(size)
                return
            fd = os.open(local, os.O_RDONLY)
            try:
                await self._s3_put(fd, remote, size, sem, paced)
            finally:
                os.close(fd)

        await _all(one(*f) for f in files)

    async def _s3_put(self, fd: int, remote: str, size: int, sem: asyncio.Semaphore, paced: Callable) -> None:
        """One file to S3: a PutObject, or a multipart upload of ``part_bytes`` parts (many in
        flight); each request carries the CRC32C of its body, which S3 checks on receipt."""
        call = self.fs._call_s3
        bucket, key, _ = self.fs.split_path(remote)

        def read(off: int, n: int) -> tuple[bytes, str]:
            data = os.pread(fd, n, off)
            if len(data) != n:
                raise FormatError(f"{remote}: the local file shrank while it was uploaded ({off + len(data)} of {size} bytes)")
            return data, _b64_crc(_crc32c(data))

        if size <= self.part_bytes:
            async with sem:
                data, crc = await asyncio.to_thread(read, 0, size)
                await call("put_object", Bucket=bucket, Key=key, Body=data, ChecksumCRC32C=crc)
            await paced(size)
            return
        up = await call("create_multipart_upload", Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32C")
        uid = up["UploadId"]

        async def part(number: int, off: int) -> dict:
            n = min(self.part_bytes, size - off)
            async with sem:
                data, crc = await asyncio.to_thread(read, off, n)
                got = await call("upload_part", Bucket=bucket, Key=key, UploadId=uid, PartNumber=number, Body=data,
                                 ChecksumCRC32C=crc)
            await paced(n)
            return {"PartNumber": number, "ETag": got["ETag"], "ChecksumCRC32C": crc}

        try:
            parts = await _all(part(i + 1, off) for i, off in enumerate(range(0, size, self.part_bytes)))
            await call("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=uid, MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                await call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=uid)
            except Exception:  # the next publish of this version aborts it (_abort_stale_uploads)
                pass
            raise

    # -- fetching -------------------------------------------------------------------------------

    def fetch(self, step: int | None, dest: str | os.PathLike, *, verify: bool = True,
              progress: Callable[[int, int], None] | None = None, keep_damaged: bool = False) -> Path:
        """Download committed version ``step`` (None: ``default_step``) into the local root
        ``dest`` as ``dest/step-<N>/`` (ranged reads, many in flight, into a temporary folder
        renamed into place) and return that folder. A complete copy already there is reused.
        ``verify``: check every chunk CRC32C of the copy against ``ucp.json`` (FormatError
        naming each problem, and the copy is removed). ``keep_damaged``: a copy whose bytes fail
        their CRC32Cs is downloaded once more (a byte changed in transit), and if it still fails
        (the objects themselves are damaged) it is kept and returned: its reader then meets the
        damage chunk by chunk, as in a damaged file (the daemon's restores)."""
        step = self.default_step() if step is None else step
        dest = Path(dest)
        final = dest / spec.step_dirname(step)
        if (final / spec.META_FILE).is_file():
            return final
        marker = self.marker(step)
        if marker is None:
            have = [v.step for v in self.list_versions() if v.state == "complete"]
            raise VersionNotFound(f"{self._u(spec.step_dirname(step))}: not committed; committed versions under "
                                  f"{self.url}: {have or 'none'}")
        meta_bytes, meta = self.read_meta(step, marker)
        for attempt in range(2 if keep_damaged else 1):
            self._download_copy(step, dest, marker, meta_bytes, meta, progress)
            problems, flipped = _copy_problems(final, meta) if verify else ([], True)
            if not problems:
                return final
            if flipped and keep_damaged and attempt == 1:
                log.error("%s: its objects fail their checksums in two downloads (damaged in the store); the copy is "
                          "kept, for restores to meet the damage as in a damaged file: %s",
                          self._u(spec.step_dirname(step)), "; ".join(problems[:3]))
                return final
            shutil.rmtree(final, ignore_errors=True)
            if not (flipped and keep_damaged):
                break
        raise FormatError(f"{self._u(spec.step_dirname(step))}: the downloaded copy fails its checks: "
                          + "; ".join(p.replace(str(dest), self.url) for p in problems[:5]))

    def _download_copy(self, step: int, dest: Path, marker: dict, meta_bytes: bytes, meta, progress) -> None:
        """Every file of ``step`` into ``dest/step-<N>/``, through a temporary folder."""
        dest.mkdir(parents=True, exist_ok=True)
        tmp = dest / spec.tmp_dirname(step, os.getpid())
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            sizes = _marked_sizes(self._u(spec.step_dirname(step)), marker, meta)
            self._run(self._download, [(self._p(spec.step_dirname(step), n), tmp / n, sizes[n]) for n in sizes],
                      _Pace(sum(sizes.values()), None, progress))
            (tmp / spec.META_FILE).write_bytes(meta_bytes)
            os.rename(tmp, dest / spec.step_dirname(step))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    async def _download(self, files: list[tuple[str, Path, int]], pace: _Pace) -> None:
        sem = asyncio.Semaphore(self.concurrency)
        fds = {}
        try:
            for remote, local, size in files:
                fd = fds[local] = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                os.ftruncate(fd, size)

            async def piece(remote: str, fd: int, off: int, n: int) -> None:
                async with sem:
                    data = await self._call("cat_file", remote, start=off, end=off + n)
                    if len(data) != n:
                        raise FormatError(f"{remote}: a ranged read of bytes [{off}, {off + n}) returned {len(data)} "
                                          "bytes (the object is shorter than its commit marker records)")
                    await asyncio.to_thread(os.pwrite, fd, data, off)
                pace.delay(n)

            await _all(
                piece(remote, fds[local], off, min(self.part_bytes, size - off))
                for remote, local, size in files for off in range(0, size, self.part_bytes)
            )
        finally:  # no fsync: a fetched copy is a cache, checked chunk by chunk whenever it is read
            for fd in fds.values():
                os.close(fd)

    # -- retention ------------------------------------------------------------------------------

    def retain(self, keep: int, protect: Iterable[int] = ()) -> list[str]:
        """Delete all but the newest ``keep`` committed versions (never the one ``LATEST``
        names, nor ``protect``: versions being read), and, older than the newest committed one,
        torn versions and unmarked (abandoned) uploads. Each version's marker goes first, then
        its objects: a crash between leaves an unmarked version, never a half-deleted one that
        looks complete. Returns the URLs of the versions removed."""
        if keep < 1:
            raise FormatError(f"keep must be >= 1, got {keep}")
        versions = self.list_versions()
        complete = sorted(v.step for v in versions if v.state == "complete")
        keep_steps = set(complete[-keep:]) | set(protect)
        latest = self.read_latest()
        if latest is not None:
            keep_steps.add(latest)
        newest = complete[-1] if complete else None
        removed = []
        for v in versions:
            doomed = v.state == "complete" and v.step not in keep_steps or (
                v.state in ("torn", "partial") and newest is not None and v.step < newest and v.step not in keep_steps
            )
            if not doomed:
                continue
            self._remove([self._p(spec.marker_name(v.step))] if v.state != "partial" else [])
            self.fs.invalidate_cache()
            try:
                self._sync("rm", self._p(spec.step_dirname(v.step)), recursive=True)
            except FileNotFoundError:
                pass
            if self.s3:
                self._abort_stale_uploads(spec.step_dirname(v.step))
            removed.append(str(v.path))
        return removed
