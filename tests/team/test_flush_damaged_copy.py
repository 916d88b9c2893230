"""A flush writer that meets a damaged copy reads the tensor again from each other copy in turn
(the restore's rule, ``VersionSources.check_fetched``), instead of failing its batch and leaving
the piece to be tried elsewhere until the flush fails. In one process, as
``test_team_flush_shared.py`` (whose team and helpers these use): every node's replica has a
flipped byte, and each writer that reads one meets it."""

from __future__ import annotations

import logging

from .test_team_flush_shared import check_on_disk, flush, snapshot, team  # noqa: F401 - team is a fixture


def flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


def test_a_writer_reading_a_damaged_replica_reads_it_again_from_another_copy(team, tmp_path, caplog):  # noqa: F811
    snapshot(team, 1)
    damaged = 0
    for node in team:
        for (origin, step), rep in node.team.replicas.held.items():
            for rank, part in rep.parts.items():
                t = part.tensors[0]  # rows of "w": what a writer holding this replica is given
                flip(rep.path, rep.bases[rank] + t.offset + 5)
                damaged += 1
    assert damaged == 6  # every rank's part: one replica of each on another node
    with caplog.at_level(logging.WARNING, logger="ucpd.team"):
        assert flush(team, 1, tmp_path) is True
    check_on_disk(tmp_path, 1)  # bit for bit, every chunk against ucp.json
    errors = [n.team.counters.get("flush_checksum_errors", 0) for n in team]
    assert sum(errors) >= 1, errors  # the damage was met by a writer, and read around
    assert "copy passes" in caplog.text
    assert "failed pieces" not in caplog.text, caplog.text  # no batch failed: nothing was given to another node
