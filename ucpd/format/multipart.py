"""A version uploaded to S3 by many writers at once (a team's flush: every node uploads its share).

``ObjectRoot.publish`` uploads a whole local folder from one machine. Here the version's files
are never whole on one machine: each file is one multipart upload, opened by the lead, whose
parts any writer uploads (``format.shares.plan_parts`` cuts them; ``team.flush_share`` fills
them). The lead then completes each upload only after checking it (every planned part there at
its size, and the store's checksum of its parts equal to the one the writers' CRC32Cs give),
uploads ``objects.bin`` and ``ucp.json`` and writes the commit marker last, as ``publish`` does,
so readers, retention and ``validate`` see one kind of version. A write cut short leaves no
marker (a ``partial`` version); ``clear`` aborts its uploads and deletes its objects before the
step is written again.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ..errors import FormatError, StorageError
from . import spec
from .objstore import ObjectRoot, _b64_crc, _crc32c

log = logging.getLogger("ucpd.format")

__all__ = ["SharedUpload"]


class SharedUpload:
    """Step ``step`` of the S3 root ``root``, uploaded by many writers. Store failures raise
    StorageError naming the object."""

    def __init__(self, root: ObjectRoot, step: int) -> None:
        if not root.s3:
            raise StorageError(f"{root.url}: a version written by many writers needs S3's multipart uploads")
        self.root, self.step = root, step
        self.vdir = spec.step_dirname(step)

    def _key(self, name: str) -> tuple[str, str]:
        bucket, key, _ = self.root.fs.split_path(self.root._p(self.vdir, name))
        return bucket, key

    def _call(self, op: str, **kw: Any) -> Any:
        async def one() -> Any:
            return await self.root.fs._call_s3(op, **kw)

        return self.root._run(one)

    def clear(self) -> None:
        """Before the version is uploaded: the multipart uploads left open under it aborted and
        the objects of an unfinished write of it (no marker) deleted; the upload starts over
        (its plan died with the writer that made it)."""
        self.root._abort_stale_uploads(self.vdir)
        here = self.root._listing(self.vdir)
        if here:
            log.warning("%s: %d objects of another, unfinished write of this step; starting over",
                        self.root._u(self.vdir), len(here))
            self.root._sync("rm", self.root._p(self.vdir), recursive=True)

    def open(self, name: str) -> str:
        """A multipart upload of file ``name``, its parts checksummed with CRC32C; its id."""
        bucket, key = self._key(name)
        return self._call("create_multipart_upload", Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32C")["UploadId"]

    def put_part(self, name: str, upload: str, number: int, data: bytes | bytearray) -> int:
        """Part ``number`` of upload ``upload`` of file ``name`` (any writer may send any part):
        ``data``, with its CRC32C, which S3 checks on receipt. Returns that CRC32C."""
        bucket, key = self._key(name)
        crc = _crc32c(data)
        self._call("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=number,
                   Body=data if isinstance(data, (bytes, bytearray)) else bytes(data), ChecksumCRC32C=_b64_crc(crc))
        return crc

    def finish(self, name: str, upload: str, parts: list[tuple[int, int]]) -> None:
        """Complete upload ``upload`` of file ``name`` whose parts 1..n must be ``parts`` ``[(size,
        crc32c)]``, checked against what the store holds: every part there at its size, then the
        object's size and, where the store reports it, its checksum of the parts' CRC32Cs (the
        bytes S3 received are the bytes ``ucp.json`` records). StorageError otherwise."""
        bucket, key = self._key(name)
        where = self.root._u(self.vdir, name)
        listed: dict[int, dict] = {}
        marker = 0
        while True:
            got = self._call("list_parts", Bucket=bucket, Key=key, UploadId=upload, PartNumberMarker=marker)
            listed.update({int(p["PartNumber"]): p for p in got.get("Parts") or ()})
            if not got.get("IsTruncated"):
                break
            marker = int(got["NextPartNumberMarker"])
        wrong = [f"part {i} missing" if i not in listed else f"part {i} is {listed[i]['Size']} bytes, planned {size}"
                 for i, (size, _) in enumerate(parts, 1) if i not in listed or int(listed[i]["Size"]) != size]
        if wrong or len(listed) != len(parts):
            raise StorageError(f"{where}: the upload's parts are not the planned ones: "
                               f"{', '.join(wrong) or f'{len(listed)} parts, planned {len(parts)}'}")
        done = [{"PartNumber": i, "ETag": listed[i]["ETag"], "ChecksumCRC32C": _b64_crc(crc)}
                for i, (_, crc) in enumerate(parts, 1)]
        self._call("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": done})
        head = self._call("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        size = sum(n for n, _ in parts)
        if int(head["ContentLength"]) != size:
            raise StorageError(f"{where}: {head['ContentLength']} bytes once complete, planned {size}")
        got_sum = head.get("ChecksumCRC32C")
        want = _b64_crc(_crc32c(b"".join(int(c).to_bytes(4, "big") for _, c in parts)))
        if got_sum is not None and got_sum.split("-")[0] != want:
            raise StorageError(f"{where}: the store's checksum of its parts is {got_sum}, the writers' CRC32Cs give "
                               f"{want}-{len(parts)}: a part holds other bytes than its writer checked")

    def abort(self, name: str, upload: str) -> None:
        """Give up upload ``upload`` (its parts are deleted); a failure is left to ``clear``."""
        bucket, key = self._key(name)
        try:
            self._call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
        except (StorageError, FileNotFoundError) as exc:
            log.warning("%s: could not abort an upload (the next flush of the step does): %s",
                        self.root._u(self.vdir, name), exc)

    def commit(self, meta_bytes: bytes, objects: bytes | None, sizes: dict[str, int], update_latest: bool = True) -> int:
        """Commit the version whose files ``sizes`` (name -> size) every writer uploaded (each
        ``finish``-ed): ``objects.bin``, ``ucp.json``, then the commit marker (the commit point),
        then ``LATEST``. Returns the bytes this sent."""
        root, step = self.root, self.step
        meta = spec.parse_meta(meta_bytes, root._u(self.vdir, spec.META_FILE), expect_step=step)
        if set(sizes) != set(meta.files) or any(meta.files[n].size != sizes[n] for n in sizes):
            raise FormatError(f"{root._u(self.vdir)}: the uploaded files {sorted(sizes)} are not ucp.json's "
                              f"{sorted(meta.files)}")
        files = dict(sizes)
        if objects is not None:
            root.write_bytes(objects, self.vdir, spec.OBJECTS_FILE)
            files[spec.OBJECTS_FILE] = len(objects)
        root.write_bytes(meta_bytes, self.vdir, spec.META_FILE)
        marker = json.dumps({"step": step, "meta_crc32c": _crc32c(meta_bytes),
                             "files": {spec.META_FILE: len(meta_bytes), **files}}, sort_keys=True).encode()
        root.write_bytes(marker, spec.marker_name(step))  # the commit point
        if update_latest:
            root.point_latest(step)
        return len(meta_bytes) + len(marker) + (len(objects) if objects is not None else 0)
