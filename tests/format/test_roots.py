"""The storage seam (``ucpd.format.roots``): the same calls on a folder (``LocalRoot``) and on an
object store (``StoreRoot``, against a real S3 API server on loopback: moto's server mode) give
the same versions, and ``as_root`` is the one place that tells them apart."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.s3server import moto_server, s3  # noqa: F401  (fixtures)
from ucpd.errors import FormatError, VersionNotFound
from ucpd.format import LocalRoot, Root, StoreRoot, as_root, list_versions, read_latest

from .helpers import sample_state, sources_of

OBJECTS = {"global": b"g", "ranks": {0: b"r0"}}


@pytest.fixture(params=["folder", "store"])
def where(request, tmp_path):
    """A checkpoint root's name, with the staging folder a daemon gives a store's."""
    if request.param == "folder":
        return str(tmp_path / "ckpt"), None
    return request.getfixturevalue("s3").url, tmp_path / "staging"


def write(root: Root, step: int, st: dict) -> None:
    root.write_version(step, sources_of(st), objects=OBJECTS)


def test_a_folder_and_a_store_answer_the_same_calls_alike(where):
    name, staging = where
    root = as_root(name, staging=staging)
    assert isinstance(root, Root) and isinstance(root, LocalRoot if staging is None else StoreRoot)
    root.prepare()
    st = {i: sample_state(np.random.default_rng(i)) for i in (1, 2, 3)}
    for step in (1, 2, 3):
        write(root, step, st[step])
    assert [(v.step, v.state, v.latest) for v in root.list_versions()] == [(1, "complete", False), (2, "complete", False),
                                                                           (3, "complete", True)]
    assert root.read_latest() == root.default_step() == 3 and root.committed(3) and not root.committed(4)
    assert root.where(3) == f"{root.name}/step-3" and root.contains(root.where(3))
    with root.open_version(2) as r:
        for tname, (_, arr) in st[2].items():
            assert r.array(tname).tobytes() == arr.tobytes(), tname
        assert r.objects["global"] == b"g"
    assert root.validate() == []
    with pytest.raises(FormatError, match="already exists"):
        write(root, 3, st[3])
    root.retain(2)
    root.prune(set())  # (the flush's order: a store's staged copies go with the versions)
    assert [v.step for v in root.list_versions()] == [2, 3]
    with pytest.raises(VersionNotFound):
        root.open_version(1).close()
    # the module-level functions take either name and go through the same root
    assert read_latest(name) == 3 and [v.step for v in list_versions(name)] == [2, 3]


def test_a_store_root_reads_through_its_staging_folder_and_keeps_the_newest_copy(s3, tmp_path):
    staging = tmp_path / "staging"
    flush = as_root(s3.url, staging=staging)
    job = flush.join("job")
    assert job.name == f"{s3.url}/job" and job.downloads and not as_root(str(tmp_path)).downloads
    for step in (1, 2):
        write(job, step, sample_state(np.random.default_rng(step)))
    assert job.staged(1) == staging / "job" / "step-1" and job.staged(2) is not None  # written there, then published
    job.prune({1})  # a restore reads step 1: it stays, as does the newest
    assert job.staged(1) is not None and job.staged(2) is not None
    job.prune(set())
    assert job.staged(1) is None and job.staged(2) is not None
    assert flush.children() == ["job"]
    with job.open_version(1) as r:  # fetched (verified) into the staging folder, where it stays
        assert r.path == staging / "job" / "step-1"
    assert job.staged(1) is not None and job.fetch(None) == 2


def test_as_root_tells_a_url_from_a_path_once(tmp_path):
    assert isinstance(as_root(tmp_path), LocalRoot) and isinstance(as_root(str(tmp_path)), LocalRoot)
    root = as_root(str(tmp_path / "a"))
    assert as_root(root) is root and root.join("job").name == str(tmp_path / "a" / "job")
    assert root.contains(str(tmp_path / "a" / "job" / ".step-1.tmp-1")) and not root.contains(str(tmp_path / "b"))
    assert as_root("memory://bucket/ckpt").contains("memory://bucket/ckpt/job/step-1")
    assert not as_root("memory://bucket/ckpt").contains("memory://bucket/other/step-1")
    with pytest.raises(FormatError, match="a folder path or a URL"):
        as_root(42)
