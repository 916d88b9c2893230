"""A short randomized fault campaign (seeded, bounded in time): many kill points in one run.

The long one is ``benchmarks/reliability/campaign.py --seed S --minutes M``; this one draws
one-node points and steps from its seed until 3 crashes were injected (every point has its own
trial in ``test_kill_points.py``; this one adds the steps a seed draws): the same trials on a quiet
machine and on a loaded one (a count, not a time). A failure prints the seed and the trial to replay it with
``tests/faults/test_kill_points.py`` or the campaign script.
"""

from __future__ import annotations

from helpers.scripts import load_benchmark

SEED = 20261123


def _campaign_module():
    return load_benchmark("reliability/campaign.py", "ucpd_campaign")


def test_a_short_seeded_campaign_survives_every_crash_it_injects():
    mod = _campaign_module()
    trials = mod.campaign(SEED, 0.0, team=False, log=lambda s: None, min_fired=3)
    text, per = mod.table(trials)
    print(text)
    assert sum(t.fired for t in trials) >= 3, text
    failed = [(t.point, t.step, t.error) for t in trials if t.fired and not t.survived]
    assert not failed, f"seed {SEED}: {failed}\n{text}"
