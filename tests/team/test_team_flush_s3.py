"""A team of daemons whose ``--flush-dir`` is an S3 bucket (moto's server on loopback, behind the
fault proxy): every node uploads its share of a flush as parts of the files' multipart uploads
and node 0 commits the version (marker last); the bytes each node sends are within 2x of the
mean; a node killed mid-upload leaves its parts to the others, the lead killed mid-upload leaves
the last committed version whole; when RAM has lost a step the team, or a lone daemon in another
layout, restores it from the bucket, meeting a damaged object as a damaged file."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from helpers import TEST_JOB, ranks
from helpers.s3server import moto_server, s3  # noqa: F401  (fixtures)
from ucpd import knobs
from ucpd.errors import ChecksumMismatch
from ucpd.format import list_versions, open_version, read_latest, validate
from ucpd_client import Checkpointer, layouts as L, placement as P

from .test_team_daemons import restore_on, snapshot_ranks, status, wait_for

pytestmark = pytest.mark.slow

ROWS, COLS, TENSORS = 6 * 256, 1024, 4  # float32: 6 MiB a tensor, 24 MiB a version (and a small replicated one)


def big_tensor(step: int, i: int, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of tensor i at ``step``: exact float32 values, made from the rows alone."""
    idx = torch.arange(r0 * COLS, r1 * COLS, dtype=torch.int64)
    return ((idx % 65521) + 3 * step + 7 * i).to(torch.float32).reshape(r1 - r0, COLS)


def big_state(step: int, rank: int, world: int) -> tuple[dict, dict]:
    """Rank ``rank``'s rows of every tensor (split along dim 0 across ``world`` ranks), and a
    replicated bias every rank holds whole."""
    per = ROWS // world
    state = {f"w{i}": big_tensor(step, i, rank * per, (rank + 1) * per) for i in range(TENSORS)}
    placements = {f"w{i}": L.column_parallel(rank, world) for i in range(TENSORS)}
    state["bias"] = torch.arange(COLS, dtype=torch.float32) + step
    placements["bias"] = P.Replicated()
    return state, placements


def snapshot_big(rank, world, rendezvous, q, run_dirs, per_node, steps, hold):
    ranks.init_gloo(rank, world, rendezvous)
    import time

    from ucpd_client import Checkpointer

    ckpt = Checkpointer(run_dirs[rank // per_node], embedded=False, local_world_size=per_node)
    for step in steps:
        state, placements = big_state(step, rank, world)
        ckpt.snapshot(step, state, placements=placements).wait(timeout=60)
    q.put(("committed", rank, ckpt.latest()))
    if hold:
        time.sleep(600)  # the test SIGKILLs us
    ckpt.close()


def complete(url: str, step: int) -> bool:
    return any(v.step == step and v.state == "complete" for v in list_versions(url))


def uploaded(team, nodes) -> dict[int, int]:
    return {i: status(team.nodes[i].run_dir)["team"]["counters"].get("flush_uploaded_bytes", 0) for i in nodes}


def stored_bytes(s3, step: int) -> int:
    """Bytes of step ``step``'s objects in the bucket: its files, ``ucp.json`` and the marker."""
    prefix = f"ckpt/{TEST_JOB}/"
    got = s3.client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix)["Contents"]
    return sum(o["Size"] for o in got if o["Key"][len(prefix):].startswith((f"step-{step}/", f"step-{step}.")))


def flip_object(s3, url: str, step: int, name: str, at: int) -> None:
    """Flip a byte of tensor ``name`` in ``step``'s shard object in the bucket."""
    with open_version(url, step) as reader:
        info = reader.tensors[name]
    key = f"ckpt/{TEST_JOB}/step-{step}/{info.file}"
    body = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    body[info.data_offset + at] ^= 0x20
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(body))


def test_every_node_uploads_its_share_and_a_lone_daemon_restores_it_in_another_layout(make_team, make_daemon, s3):
    url = f"{s3.url}/{TEST_JOB}"
    team = make_team(3, "--replicas", "1", "--flush-dir", s3.url)
    procs, done = ranks.spawn(snapshot_big, 6, team.run_dirs(), 2, (1, 2), True)  # 2 ranks a node
    assert sorted(m[2] for m in done) == [2] * 6, team.logs()
    wait_for(lambda: complete(url, 1) and complete(url, 2), "the team's uploads of steps 1 and 2", 90)
    assert validate(url, 1, full=True) == [] and validate(url, 2, full=True) == []  # every chunk against ucp.json
    sent = uploaded(team, range(3))
    mean = sum(sent.values()) / 3
    print(f"bytes uploaded by node: {sent}, mean {mean:.0f}, max/mean {max(sent.values()) / mean:.2f}")
    assert all(mean / 2 <= b <= 2 * mean for b in sent.values()), sent  # no node's uplink carries the versions
    assert sum(sent.values()) == stored_bytes(s3, 1) + stored_bytes(s3, 2), sent  # each byte sent once
    assert s3.proxy.bad_checksums == [] and not [u for u in s3.proxy.unchecked if "partNumber" in u]
    assert status(team.nodes[0].run_dir)["flush"]["last_error"] is None
    assert not os.path.exists(os.path.join(team.nodes[0].run_dir, "flush-cache", TEST_JOB, "step-2"))  # no local copy
    ranks.kill(procs)
    team.stop()  # every node's RAM is gone
    flip_object(s3, url, 2, "w1", 10)

    d = make_daemon("--mem-limit", "512M", "--flush-dir", s3.url, flush=False)
    want, placements = big_state(1, 0, 1)  # one rank: every tensor whole
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        t = {k: torch.full_like(v, -1.0) for k, v in want.items()}
        with pytest.raises(ChecksumMismatch, match="step 2"), knobs.override(UCPD_RESTORE_VERIFY="all"):
            ckpt.restore(t, placements=placements, step=2)  # a damaged object, met as a damaged file
        assert all((v == -1.0).all() for v in t.values())
        assert ckpt.restore(t, placements=placements) == 1
        assert ckpt.last_restore == {"step": 1, "where": "disk", "damaged": [(2, "disk")]}
        assert [k for k in want if not torch.equal(t[k], want[k])] == []


def test_a_writer_killed_mid_upload_leaves_its_parts_to_the_others(make_team, s3):
    url = f"{s3.url}/{TEST_JOB}"
    team = make_team(3, "--replicas", "1", "--flush-dir", s3.url, start=False)
    for i in range(3):
        team.start(i, fault="flush.share@1" if i == 2 else None)  # node 2 dies once it uploaded a part
    procs, _ = ranks.spawn(snapshot_big, 6, team.run_dirs(), 2, (1,), True)
    wait_for(lambda: team.nodes[2].proc.poll() is not None, "node 2 to die uploading its share", 60)
    shutil.rmtree(team.nodes[2].shm_dir, ignore_errors=True)
    wait_for(lambda: complete(url, 1), "the survivors to upload node 2's share", 90)
    assert validate(url, 1, full=True) == []
    sent = uploaded(team, (0, 1))
    assert all(sent.values()), sent
    ranks.kill(procs)


def test_the_lead_killed_mid_upload_leaves_the_last_version_whole_and_uploads_it_once_restarted(make_team, s3):
    url = f"{s3.url}/{TEST_JOB}"
    team = make_team(3, "--replicas", "1", "--flush-dir", s3.url, start=False)
    for i in range(3):
        team.start(i, fault="flush.share@2" if i == 0 else None)  # node 0 dies after its first part of step 2
    procs, _ = ranks.spawn(snapshot_big, 6, team.run_dirs(), 2, (1, 2), True)
    wait_for(lambda: team.nodes[0].proc.poll() is not None, "node 0 to die uploading step 2", 90)
    assert complete(url, 1) and not complete(url, 2), list_versions(url)
    assert validate(url, 1, full=True) == [] and read_latest(url) == 1  # the last committed version is whole
    team.start(0)  # its RAM is there: it flushes step 2 again, over the debris of the first try
    wait_for(lambda: complete(url, 2), "step 2 uploaded after the lead's restart", 90)
    assert validate(url, 2, full=True) == [] and read_latest(url) == 2
    sent = uploaded(team, (1, 2))
    assert all(sent.values()), sent
    ranks.kill(procs)


def test_when_ram_has_lost_a_step_the_team_restores_it_from_the_bucket(make_team, s3):
    url = f"{s3.url}/{TEST_JOB}"
    team = make_team(3, "--replicas", "0", "--flush-dir", s3.url)
    procs, _ = ranks.spawn(snapshot_ranks, 3, team.run_dirs(), 1, 1, (1,), True)
    wait_for(lambda: complete(url, 1), "the flush of step 1", 90)
    assert validate(url) == []
    ranks.kill(procs)
    team.lose(2)  # no replicas: node 2's part of step 1 is gone from RAM, but not from the bucket
    wait_for(lambda: not status(team.nodes[0].run_dir)["team"]["nodes"][2]["live"], "node 2 to be declared dead")
    restore_on(team.run_dirs()[:2], 2, 1, 1, 1)
    # node 1 fetched step 1 from the bucket into its own folder
    assert os.path.isfile(os.path.join(team.run_dirs()[1], "flush-cache", TEST_JOB, "step-1", "ucp.json"))
