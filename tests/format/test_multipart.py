"""A version uploaded to S3 by many writers (``format.multipart.SharedUpload``, moto behind the
fault proxy): parts sent by different clients complete into the files one writer makes, the
marker goes last, and the lead's checks refuse a part missing, of the wrong size, or holding
other bytes than its writer's CRC32C says; ``clear`` removes what a write cut short left."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.s3server import moto_server, s3  # noqa: F401  (fixtures)
from ucpd import native
from ucpd.errors import StorageError
from ucpd.format import REPLICATED, list_versions, open_version, read_latest, spec, validate, write_version
from ucpd.format.multipart import SharedUpload
from ucpd.format.objstore import ObjectRoot

from .helpers import rand_bytes, source

pytestmark = pytest.mark.slow

PART = 5 << 20  # moto, as S3, refuses parts under 5 MiB but for the last one


def local_version(tmp_path, rng):
    """A version on disk with one 12 MiB file (three parts) and objects."""
    big = rand_bytes("float32", (3 << 20,), rng)
    small = rand_bytes("int64", (7,), rng)
    return write_version(tmp_path / "local", 3, [source("big", big, "float32", REPLICATED),
                                                 source("small", small, "int64", REPLICATED)],
                         objects={"global": None, "ranks": {0: b"zero"}}, fsync=False)


def upload_by_two_writers(url, vdir, step, tamper=None, skip=None):
    """Every file of ``vdir`` as parts, the odd ones sent by one client and the even ones by
    another (two ``ObjectRoot``s); ``tamper``: a part number whose bytes change after its CRC32C
    is reckoned; ``skip``: one not sent. Returns (lead, {file: (upload, [(size, crc)])})."""
    lead = SharedUpload(ObjectRoot(url), step)
    other = SharedUpload(ObjectRoot(url), step)
    lead.clear()
    out = {}
    meta = spec.parse_meta((vdir / spec.META_FILE).read_bytes(), "ucp.json")
    for name in sorted(meta.files):
        data = (vdir / name).read_bytes()
        upload = lead.open(name)
        parts = []
        for number, off in enumerate(range(0, len(data), PART), 1):
            body = bytearray(data[off : off + PART])
            parts.append((len(body), native.crc32c(bytes(body))))
            if number == skip:
                continue
            if number == tamper:
                body[100] ^= 1
            (lead if number % 2 else other).put_part(name, upload, number, body)
        out[name] = (upload, parts)
    return lead, out


def test_parts_from_two_writers_make_the_version_and_the_marker_goes_last(tmp_path, s3):
    url = f"{s3.url}/job"
    vdir = local_version(tmp_path, np.random.default_rng(1))
    lead, uploads = upload_by_two_writers(url, vdir, 3)
    assert len(uploads["model-00001-of-00001.safetensors"][1]) == 3
    for name, (upload, parts) in uploads.items():
        lead.finish(name, upload, parts)
    assert [v.state for v in list_versions(url)] == ["partial"]  # every file there, no marker yet
    meta = (vdir / spec.META_FILE).read_bytes()
    sizes = {n: (vdir / n).stat().st_size for n in uploads}
    s3.proxy.seen.clear()
    sent = lead.commit(meta, (vdir / spec.OBJECTS_FILE).read_bytes(), sizes)
    puts = [r.split("?")[0].rsplit("/", 1)[-1] for r in s3.proxy.seen if r.startswith("PUT")]
    assert puts == [spec.OBJECTS_FILE, spec.META_FILE, spec.marker_name(3), spec.LATEST_FILE]
    assert sent > len(meta)
    assert validate(url, 3, full=True) == [] and read_latest(url) == 3
    with open_version(url, 3) as r, open_version(tmp_path / "local", 3) as want:
        assert np.array_equal(r.array("big"), want.array("big")) and r.objects == want.objects


@pytest.mark.parametrize("fault, says", [("skip", "part 2 missing"), ("tamper", "other bytes than its writer checked")])
def test_the_lead_refuses_an_upload_with_a_part_missing_or_holding_other_bytes(tmp_path, s3, fault, says):
    url = f"{s3.url}/job"
    vdir = local_version(tmp_path, np.random.default_rng(2))
    lead, uploads = upload_by_two_writers(url, vdir, 3, **{fault: 2})
    name = "model-00001-of-00001.safetensors"
    upload, parts = uploads[name]
    with pytest.raises(StorageError, match=says):
        lead.finish(name, upload, parts)
    assert not any(v.state == "complete" for v in list_versions(url))


def test_clear_aborts_the_uploads_and_deletes_the_objects_a_write_cut_short_left(tmp_path, s3):
    url = f"{s3.url}/job"
    vdir = local_version(tmp_path, np.random.default_rng(3))
    lead, uploads = upload_by_two_writers(url, vdir, 3)
    name = "model-00001-of-00001.safetensors"
    lead.finish(name, *uploads[name])  # one file complete, the other's upload open: then the lead died
    SharedUpload(ObjectRoot(url), 3).clear()
    assert list_versions(url) == []
    prefix = "ckpt/job/step-3/"
    assert s3.client.list_multipart_uploads(Bucket=s3.bucket, Prefix=prefix).get("Uploads") is None
    assert s3.client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix).get("KeyCount") == 0


def test_a_store_without_multipart_uploads_is_refused_with_a_storage_error(tmp_path):
    with pytest.raises(StorageError, match="multipart"):
        SharedUpload(ObjectRoot(f"file://{tmp_path}/root"), 1)
