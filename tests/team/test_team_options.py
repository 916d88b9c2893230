"""The options of ``ucpd serve`` that span nodes, as ``daemon.cli.team_config`` reads them."""

from __future__ import annotations

import pytest

from ucpd.daemon.cli import GOSSIP_FROM, team_config
from ucpd.errors import UcpdError


def _peers(n: int) -> dict:
    return {"peers": ",".join(f"tcp://127.0.0.1:{7000 + i}" for i in range(n))}


def test_membership_auto_gossips_from_a_team_size_and_heartbeats_below():
    assert team_config(_peers(4), 4, 0).membership == "heartbeat"
    assert team_config(_peers(GOSSIP_FROM), GOSSIP_FROM, 0).membership == "gossip"
    assert team_config(dict(_peers(4), membership="gossip"), 4, 0).membership == "gossip"
    assert team_config(dict(_peers(GOSSIP_FROM), membership="heartbeat"), GOSSIP_FROM, 0).membership == "heartbeat"


def test_commit_fanout_auto_groups_large_teams_and_zero_turns_it_off():
    assert team_config(_peers(4), 4, 0).fanout is None
    assert team_config(_peers(GOSSIP_FROM), GOSSIP_FROM, 0).fanout == 32
    assert team_config(dict(_peers(GOSSIP_FROM), commit_fanout=0), GOSSIP_FROM, 0).fanout is None
    assert team_config(dict(_peers(4), commit_fanout=2), 4, 0).fanout == 2


@pytest.mark.parametrize("options, why", [
    ({"membership": "telepathy"}, "use auto, heartbeat or gossip"),
    ({"heartbeat": 2.0, "dead_after": 1.0}, "several periods before it is dead"),
    ({"commit_fanout": 1}, "a group size of 2 or more"),
])
def test_bad_liveness_options_say_what_to_use(options, why):
    with pytest.raises(UcpdError, match=why):
        team_config(dict(_peers(4), **options), 4, 0)
