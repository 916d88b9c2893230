"""Checkpoint roots in an object store (``s3://``), against a real S3 API server on loopback
(moto's server mode) behind a proxy that cuts connections, answers errors or holds requests:
a version is visible only once its commit marker is written, every upload carries a correct
CRC32C, interrupted uploads resume, reads of an old version go on while a new one is written,
retention removes markers first, and ``ucpd ls/inspect/convert`` take the URLs."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from helpers.s3server import Rule, moto_server, s3  # noqa: F401  (fixtures)
from ucpd.cli import main
from ucpd.errors import FormatError, StorageError, VersionNotFound
from ucpd.format import list_versions, open_version, read_latest, retain, validate, write_version
from ucpd.format.objstore import ObjectRoot

from .helpers import rand_bytes, sample_state, sources_of

MiB = 1 << 20


def state(seed: int) -> dict:
    """sample_state plus a 6.25 MiB tensor: its shard goes up as a multipart upload of two 5 MiB parts."""
    rng = np.random.default_rng(seed)
    out = sample_state(rng)
    out["big"] = ("float32", rand_bytes("float32", (1024, 1600), rng))
    return out


def write(url: str, step: int, st: dict, **kw):
    return write_version(url, step, sources_of(st), objects={"global": b"g%d" % step, "ranks": {0: b"r0", 1: b"r1"}},
                         shard_bytes=4 * MiB, **kw)


def assert_reads_back(url: str, step: int, st: dict) -> None:
    with open_version(url, step) as r:
        assert r.step == step
        for name, (_, arr) in st.items():
            assert r.array(name).tobytes() == arr.tobytes(), name
            r.verify(name)
        assert r.objects["global"] == b"g%d" % step


def keys(s3, prefix: str = "ckpt/") -> list[str]:
    got = s3.client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix).get("Contents") or []
    return sorted(o["Key"] for o in got)


def test_a_version_goes_up_in_parallel_parts_with_crc32c_and_reads_back_as_from_a_directory(s3):
    st = state(0)
    assert write(s3.url, 3, st) == f"{s3.url}/step-3"
    assert [(v.step, v.state, v.latest) for v in list_versions(s3.url)] == [(3, "complete", True)]
    assert read_latest(s3.url) == 3
    assert "ckpt/step-3.committed" in keys(s3)
    uploads = [p for p in s3.proxy.seen if "uploadId=" in p and "partNumber=" in p]
    assert len(uploads) == 2  # the 6.25 MiB shard: two parts of a multipart upload
    # every PUT of data carried the CRC32C of its body (moto keeps them without checking: the proxy does)
    assert s3.proxy.checked >= 5 and s3.proxy.unchecked == [] and s3.proxy.bad_checksums == []
    assert_reads_back(s3.url, 3, st)
    assert validate(s3.url) == []


def test_a_version_is_invisible_until_its_marker_and_a_second_publish_resumes_the_upload(s3):
    first, second = state(1), state(2)
    write(s3.url, 1, first)
    marker = s3.proxy.add(Rule("error", "PUT", r"step-2\.committed", times=-1))  # every try at the commit point fails
    with pytest.raises(StorageError, match="failed a request after retries"):
        write(s3.url, 2, second, created=1.7e9)
    assert [(v.step, v.state) for v in list_versions(s3.url)] == [(1, "complete"), (2, "partial")]
    assert read_latest(s3.url) == 1
    with pytest.raises(VersionNotFound, match="not committed"):
        open_version(s3.url, 2)
    assert_reads_back(s3.url, 1, first)  # the default version is still the old one
    assert marker.hits >= 2  # retried before giving up
    # the same version published again: what went up whole stays, then the marker
    s3.proxy.clear()
    data_puts = len([p for p in s3.proxy.seen if "step-2/model" in p])
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        # the same version written again (a restarted daemon finds it in its local folder)
        local = write_version(tmp, 2, sources_of(second), objects={"global": b"g2", "ranks": {0: b"r0", 1: b"r1"}},
                              shard_bytes=4 * MiB, created=1.7e9)
        ObjectRoot(s3.url).publish(local, 2)
    # the second publish uploaded no shard again (same name and size), only ucp.json and the marker
    assert len([p for p in s3.proxy.seen if "step-2/model" in p]) == data_puts
    assert [(v.step, v.state, v.latest) for v in list_versions(s3.url)] == [(1, "complete", False), (2, "complete", True)]
    assert_reads_back(s3.url, 2, second)


@pytest.mark.parametrize("fault", ["drop", "error"])
def test_uploads_and_reads_recover_from_dropped_connections_and_server_errors(s3, fault):
    st = state(3)
    s3.proxy.add(Rule(fault, "PUT", r"partNumber=", times=2))  # two part uploads cut mid-body / answered 500
    s3.proxy.add(Rule(fault, "PUT", r"ucp\.json", times=1))
    write(s3.url, 5, st)
    assert s3.proxy.faults == 3
    assert [(v.step, v.state) for v in list_versions(s3.url)] == [(5, "complete")]
    s3.proxy.add(Rule(fault, "GET", r"step-5/model", times=2))  # ranged reads cut too
    assert_reads_back(s3.url, 5, st)
    assert s3.proxy.faults == 5
    assert s3.proxy.bad_checksums == []


def test_a_server_that_keeps_failing_leaves_nothing_visible_and_no_open_multipart_upload(s3):
    s3.proxy.add(Rule("error", "PUT", r"partNumber=2", times=-1))
    with pytest.raises(StorageError):
        write(s3.url, 1, state(4))
    assert [v.state for v in list_versions(s3.url)] in ([], ["partial"])
    assert read_latest(s3.url) is None
    with pytest.raises(VersionNotFound):
        open_version(s3.url)
    assert s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads") in (None, [])  # aborted, parts freed


def test_an_old_version_is_read_while_a_new_one_is_written(s3):
    old, new = state(5), state(6)
    write(s3.url, 1, old)
    hold = s3.proxy.add(Rule("hold", "PUT", r"step-2/model.*partNumber=1", times=1))
    errors = []
    writer = threading.Thread(target=lambda: errors.append(None) if write(s3.url, 2, new) else None)
    writer.start()
    try:
        assert hold.seen.wait(60), "the upload of step 2 never started"
        # step 2 is on its way up: readers see step 1 only, and read it whole and verified
        assert [(v.step, v.state) for v in list_versions(s3.url)] == [(1, "complete"), (2, "partial")]
        assert_reads_back(s3.url, 1, old)
        with open_version(s3.url) as r:
            assert r.step == 1
        assert validate(s3.url, 1) == []
    finally:
        hold.released.set()  # the held part's connection is cut: the client retries it
        writer.join(120)
    assert errors == [None]
    assert [(v.step, v.state, v.latest) for v in list_versions(s3.url)] == [(1, "complete", False), (2, "complete", True)]
    assert_reads_back(s3.url, 2, new)
    assert_reads_back(s3.url, 1, old)


def test_retention_deletes_each_old_version_marker_first(s3):
    states = {s: state(10 + s) for s in range(1, 5)}
    for s, st in states.items():
        write(s3.url, s, st)
    # the deletion of step 1's objects fails after its marker went: it is left unmarked, never complete
    s3.proxy.add(Rule("error", "POST", r"delete", times=-1, after=1))
    with pytest.raises(StorageError):
        retain(s3.url, 2)
    assert [(v.step, v.state) for v in list_versions(s3.url)][0] == (1, "partial")
    s3.proxy.clear()
    removed = retain(s3.url, 2, protect=[2])  # step 2 is being read: it stays
    assert removed == [f"{s3.url}/step-1"]
    assert [(v.step, v.state) for v in list_versions(s3.url)] == [(2, "complete"), (3, "complete"), (4, "complete")]
    assert retain(s3.url, 2) == [f"{s3.url}/step-2"]
    assert not [k for k in keys(s3) if k.startswith(("ckpt/step-1", "ckpt/step-2"))]
    assert_reads_back(s3.url, 4, states[4])


def test_ucpd_ls_and_inspect_verify_take_an_s3_url_and_name_a_damaged_chunk(s3, capsys):
    write(s3.url, 7, state(7))
    assert main(["ls", s3.url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(v["step"], v["state"], v["latest"], v["path"]) for v in listed] == [(7, "complete", True, f"{s3.url}/step-7")]
    assert main(["ls", s3.url.rsplit("/", 1)[0]]) == 0
    assert "ckpt" in capsys.readouterr().out  # the bucket root: it names the roots under it
    assert main(["inspect", "--verify", s3.url]) == 0
    out = capsys.readouterr().out
    assert f"{s3.url}/step-7" in out and "verified: no problems" in out
    # one byte of the big tensor flipped in the bucket (same size: the marker cannot tell)
    key = next(k for k in keys(s3) if k.startswith("ckpt/step-7/model") and s3.client.head_object(Bucket=s3.bucket, Key=k)["ContentLength"] > 6 * MiB)
    body = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    body[3 * MiB] ^= 0x10
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(body))
    assert main(["inspect", "--verify", "--json", f"{s3.url}/step-7"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert len(problems) == 1 and f"{s3.url}/step-7/" in problems[0] and "tensor 'big' chunk 0" in problems[0]
    assert any("tensor 'big'" in p for p in validate(s3.url))
    with pytest.raises(Exception, match="fails its checks"):
        open_version(s3.url)  # a restore never reads it


def test_ucpd_convert_reads_from_and_writes_to_s3(s3, tmp_path, capsys):
    st = state(8)
    write(s3.url, 2, st)
    out = tmp_path / "exported.safetensors"
    assert main(["convert", s3.url, str(out), "--from", "universal", "--to", "safetensors"]) == 0
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as f:
        assert f.get_tensor("layers.0.w").numpy().tobytes() == st["layers.0.w"][1].tobytes()
    copy = s3.url.replace("/ckpt", "/copy")
    assert main(["convert", s3.url, copy, "--from", "universal", "--to", "universal"]) == 0
    assert [(v.step, v.state) for v in list_versions(copy)] == [(2, "complete")]
    assert_reads_back(copy, 2, st)


def test_without_s3fs_a_url_fails_with_what_to_install_and_folders_still_work(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['s3fs'] = None\n"  # as if s3fs were not installed
        "from ucpd.cli import main\n"
        "sys.exit(main(['ls', sys.argv[1]]) * 10 + main(['ls', 's3://bucket/prefix']))"
    )
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr  # the folder listed (0), the URL refused (2)
    assert "pip install 'ucpd[s3]'" in run.stderr and "Traceback" not in run.stderr


def test_a_missing_bucket_is_a_storage_error_that_says_so(s3):
    with pytest.raises(StorageError, match="does the bucket exist"):
        write(f"s3://no-such-bucket-{s3.bucket}/ckpt", 1, state(9))


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_any_fsspec_url_holds_versions_the_same_way(tmp_path, scheme):
    url = f"file://{tmp_path}/store" if scheme == "file" else f"memory://ucpd-test-{tmp_path.name}/ckpt"
    states = {s: state(20 + s) for s in (1, 2, 3)}
    for s, st in states.items():
        write(url, s, st)
    assert [(v.step, v.state, v.latest) for v in list_versions(url)] == [(1, "complete", False), (2, "complete", False),
                                                                         (3, "complete", True)]
    assert_reads_back(url, 2, states[2])
    assert validate(url) == []
    assert retain(url, 1) == [f"{url}/step-1", f"{url}/step-2"]
    assert [v.step for v in list_versions(url)] == [3]
    if scheme == "file":  # the markers beside the folders, the folders as write_version makes them
        assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["LATEST", "step-3", "step-3.committed"]


def test_objects_of_another_write_of_the_step_are_never_taken_for_this_one(s3):
    """A job that went back (restored an older step) writes step 2 anew, with other values of the
    same shapes: the dead write's objects have the right names and sizes, and must not be kept."""
    s3.proxy.add(Rule("error", "PUT", r"step-2\.committed", times=-1))
    with pytest.raises(StorageError):
        write(s3.url, 2, state(30))  # the first write of step 2 dies before its commit point
    s3.proxy.clear()
    again = state(31)  # the new run's step 2: same tensors and shapes, other bytes
    write(s3.url, 2, again)
    assert [(v.step, v.state) for v in list_versions(s3.url)] == [(2, "complete")]
    assert_reads_back(s3.url, 2, again)
    assert validate(s3.url) == []


@pytest.mark.parametrize("change,says", [
    (lambda files: files.update({"stray.safetensors": 16}), "stray.safetensors: in the commit marker, not in ucp.json"),
    (lambda files: files.update({n: files[n] + 1 for n in files if n.endswith(".safetensors")}), "the commit marker records"),
])
def test_a_commit_marker_that_disagrees_with_ucp_json_is_refused_naming_the_file(tmp_path, change, says):
    url = f"file://{tmp_path}/root"
    write(url, 4, state(4))
    marker_path = tmp_path / "root" / "step-4.committed"
    marker = json.loads(marker_path.read_text())
    change(marker["files"])
    marker_path.write_text(json.dumps(marker))
    with pytest.raises(FormatError, match=says):
        ObjectRoot(url).fetch(4, tmp_path / "copy")
    assert not (tmp_path / "copy" / "step-4").exists()  # nothing half-fetched is left to be taken for a copy
