"""A flush every node writes (``--flush-writers all``), in one process: real ``Team`` and
``NodeStore`` objects on real slots, joined by the in-process link (``helpers.inproc_team``); the
lead (``team.flush_lead.TeamFlush``) writes into a real folder.

The version on disk is the one a single writer would make (same files, every byte checked);
each node writes the rows it holds; a writer lost mid-flush, failing, or not seeing the flush
dir has its pieces written by the others, and nothing is visible until every piece is in. On
real daemons: ``test_team_daemons`` (a node killed mid-flush) and the ``flush.share`` kill point.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from helpers.inproc_team import InProcTeam
from ucpd.daemon.versions import VersionState
from ucpd.errors import DaemonUnreachable, StorageError
from ucpd.format import list_versions, open_version, validate
from ucpd.team import flush_lead

NODES, PER_NODE = 3, 2
WORLD = NODES * PER_NODE
ROWS = 32  # rows of "w" each rank holds


def rank_tensors(rank: int, step: int) -> list:
    """Rank ``rank``'s part: a row shard of "w", a tensor of its own and a replicated "ln"; the
    values encode the rank and the step (a version stitched from two steps cannot pass)."""
    rng = np.random.default_rng(rank * 100 + step)
    return [
        ("w", rng.standard_normal((ROWS, 64)).astype(np.float32), {"kind": "shard", "dim": 0, "index": rank, "parts": WORLD}),
        (f"r{rank}", rng.integers(0, 256, 3000, dtype=np.uint8), {"kind": "shard", "dim": 0, "index": 0, "parts": 1}),
        ("ln", np.full(64, float(step), np.float32), {"kind": "replicated"}),
        ("count", np.array(step * 1000, np.int64), {"kind": "replicated"}),  # a 0-d tensor: one piece, one row
    ]


def expected(step: int) -> dict[str, np.ndarray]:
    parts = [rank_tensors(r, step) for r in range(WORLD)]
    out = {"w": np.concatenate([p[0][1] for p in parts]), "ln": parts[0][2][1], "count": parts[0][3][1]}
    out.update({p[1][0]: p[1][1] for p in parts})
    return out


@pytest.fixture
def team(ucpd_isolation, monkeypatch):
    monkeypatch.setattr(flush_lead, "BLOCK_MIN", ROWS * 64 * 4)  # pieces of one rank's rows of "w"
    t = InProcTeam(NODES, ucpd_isolation, replicas=1, per_node=PER_NODE)
    yield t
    t.close()


def snapshot(team: InProcTeam, step: int, run: int = 1) -> None:
    for r in range(WORLD):
        team[r // PER_NODE].seal_tensors(r, WORLD, step, rank_tensors(r, step), run)
    team.wait_state(step, VersionState.COMMITTED)


def flush(team: InProcTeam, step: int, root) -> bool:
    return team[0].team.flush_lead.write(team[0].store.version(step), root, lambda done, total: None)


def flush_while_ticking(team: InProcTeam, step: int, root, until=None):
    """Flush on a thread while the test's clock runs (a lost node is declared dead meanwhile)."""
    out: dict = {}

    def go():
        try:
            out["ok"] = flush(team, step, root)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out["error"] = exc

    th = threading.Thread(target=go)
    th.start()
    team.wait(lambda: not th.is_alive(), "the flush to end", timeout=60)
    th.join()
    return out


def check_on_disk(root, step: int) -> None:
    assert validate(root, step, full=True) == []  # every chunk against ucp.json
    with open_version(root, step) as v:
        for name, arr in expected(step).items():
            assert v.array(name).tobytes() == arr.tobytes(), name


def written(team: InProcTeam) -> list[int]:
    return [n.team.counters.get("flush_written_bytes", 0) for n in team]


def test_every_node_writes_the_rows_it_holds_and_the_version_is_whole(team, tmp_path):
    snapshot(team, 1)
    assert flush(team, 1, tmp_path) is True
    check_on_disk(tmp_path, 1)
    total = sum(a.nbytes for a in expected(1).values())
    assert sum(written(team)) == total
    assert min(written(team)) > 0.7 * total / NODES  # balanced
    # each node wrote what it holds (its ranks' parts, or the replicas it keeps): nothing fetched
    assert [n.team.counters.get("flush_fetched_bytes", 0) for n in team] == [0, 0, 0]
    assert not [f for n in team for f in os.listdir(n.store.shm_dir) if f.startswith("fetch-")]  # windows dropped


def test_a_job_that_names_no_run_is_flushed_by_every_node_too(team, tmp_path):
    snapshot(team, 1, run=0)  # no job id (Checkpointer without job_id): the run has no name
    assert flush(team, 1, tmp_path)
    check_on_disk(tmp_path, 1)
    assert all(written(team))  # no writer refused the lead's request


def test_rows_split_across_nodes_are_fetched_once_from_a_holder(team, tmp_path, monkeypatch):
    monkeypatch.setattr(flush_lead, "BLOCK_MIN", 3 * ROWS * 64 * 4)  # a piece spans three ranks on two nodes
    snapshot(team, 1)
    assert flush(team, 1, tmp_path)
    check_on_disk(tmp_path, 1)
    fetched = sum(n.team.counters.get("flush_fetched_bytes", 0) for n in team)
    w = expected(1)["w"].nbytes
    assert 0 < fetched <= w  # each byte crosses the network at most once (whole chunks at its edges)


def test_a_writer_lost_mid_flush_has_its_unfinished_pieces_written_by_the_others(team, tmp_path):
    snapshot(team, 1)
    wrote_one, gone = threading.Event(), threading.Event()
    node2 = team[2].team.flush_share
    real = node2.write

    def write_one_then_die(body):
        real(dict(body, pieces=body["pieces"][:1]))  # one piece durable, then the node is lost
        wrote_one.set()
        gone.wait(60)  # its reply never comes
        raise DaemonUnreachable("node 2 is gone")

    node2.write = write_one_then_die
    out: dict = {}
    runner = threading.Thread(target=lambda: out.setdefault("ok", flush(team, 1, tmp_path)))
    runner.start()
    try:
        team.wait(wrote_one.is_set, "node 2 to write a piece", 60)
        assert [v.state for v in list_versions(tmp_path)] == ["partial"]  # nothing visible while pieces are missing
        team.lose(2)
        team.wait(lambda: not runner.is_alive(), "the others to finish the flush", 60)
    finally:
        gone.set()
    assert out == {"ok": True}
    check_on_disk(tmp_path, 1)


def test_a_failing_writer_has_its_batch_written_by_another_node(team, tmp_path):
    snapshot(team, 1)
    team.net.fail(dest=1, msg_type="flush_share", nth=1)  # node 1's first batch fails; it stays live
    out = flush_while_ticking(team, 1, tmp_path)
    assert out == {"ok": True}
    check_on_disk(tmp_path, 1)


def test_a_node_that_does_not_see_the_flush_dir_leaves_its_share_to_the_others(team, tmp_path):
    snapshot(team, 1)
    node1 = team[1].team.flush_share
    real = node1.write
    node1.write = lambda body: real(dict(body, dir=str(tmp_path / "not-mounted-here" / os.path.basename(body["dir"]))))
    assert flush(team, 1, tmp_path)
    check_on_disk(tmp_path, 1)
    assert written(team)[1] == 0 and written(team)[0] and written(team)[2]


def test_when_no_node_can_write_the_flush_fails_and_leaves_nothing(team, tmp_path):
    snapshot(team, 1)
    for n in team:
        real = n.team.flush_share.write
        n.team.flush_share.write = lambda body, real=real: real(dict(body, dir="/nonexistent/ucpd/.step-1.tmp-1"))
    with pytest.raises(StorageError, match="cannot write the flush dir"):
        flush(team, 1, tmp_path)
    assert os.listdir(tmp_path) == []  # no version, no temporary folder


@pytest.mark.parametrize("change, error", [
    ({"dir": "/etc"}, "is not the temporary folder of step 1"),
    ({"dir": "/tmp/x/.step-2.tmp-5"}, "is not the temporary folder of step 1"),
    ({"file": "../../../etc/passwd"}, "names file '../../../etc/passwd'"),
])
def test_a_peer_cannot_make_a_node_write_outside_the_versions_files(team, tmp_path, change, error):
    from ucpd.errors import ProtocolError

    body = {"step": 1, "dir": str(tmp_path / ".step-1.tmp-7"), "chunk": 1 << 22, "sources": [],
            "pieces": [{"name": "w", "dtype": "float32", "shape": [4], "file": "model-00001-of-00001.safetensors",
                        "begin": 80, "end": 96, "r0": 0, "r1": 4}]}
    if "file" in change:
        body["pieces"][0]["file"] = change["file"]
    else:
        body.update(change)
    with pytest.raises(ProtocolError, match=error):
        team[1].team.flush_share.write(body)
