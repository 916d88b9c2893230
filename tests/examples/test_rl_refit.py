"""The RL refit scene (examples/rl): a 2-rank trainer on a 2-daemon team snapshots every step;
two TP-2 rollout processes (fused QKV and gate/up, a padded vocabulary, bf16), one per node,
pull every version they are told of and check it against the trainer's rule; rollout 1 is
SIGKILLed after its second version and, restarted, catches up from ``latest()``."""

from __future__ import annotations

import pytest

from rl.refit import scene  # examples/ is on sys.path (conftest.py)

pytestmark = pytest.mark.slow  # six processes start

STEPS = 5


def test_two_rollouts_in_another_layout_follow_the_trainer_and_a_killed_one_catches_up(tmp_path, ucpd_isolation):
    events = scene(str(tmp_path / "scene"), STEPS, shm_prefix=ucpd_isolation, timeout=120)
    pulls = [e for e in events if "ok" in e]
    assert pulls and all(e["ok"] for e in pulls), [e for e in pulls if not e["ok"]]
    by = {r: [e for e in pulls if e["who"] == f"rollout{r}"] for r in (0, 1)}
    assert by[0][-1]["step"] == STEPS and by[1][-1]["step"] == STEPS
    assert [e["step"] for e in by[0]] == sorted({e["step"] for e in by[0]})  # each version once, in order
    assert any(e["warm"] for e in by[0])  # after its first pull, the plan was the daemon's cached one
    killed = next(i for i, e in enumerate(events) if e.get("killed") == "rollout1")
    before = {e["pid"] for e in events[:killed] if e.get("who") == "rollout1"}
    after = [e for e in events[killed:] if e.get("who") == "rollout1"]
    assert len([e for e in events[:killed] if e.get("who") == "rollout1"]) >= 2
    assert after and {e["pid"] for e in after}.isdisjoint(before)  # a new process ...
    assert after[0]["warm"] == 0 and after[-1]["step"] == STEPS  # ... planned afresh, caught up to the last step
