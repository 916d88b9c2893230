"""Landing files of a team's pulls (``ucpd.daemon.landing``): reused from pull to pull, the
smallest that fits; deleted once idle for ``IDLE_SECONDS`` or beyond ``MAX_IDLE``."""

from __future__ import annotations

import os

from ucpd.daemon import landing
from ucpd.daemon.landing import Landings


def test_a_landing_is_reused_then_deleted_once_idle_too_long(tmp_path):
    now = [0.0]
    pool = Landings(str(tmp_path), clock=lambda: now[0])
    a = pool.take(100 << 10)
    b = pool.take(100 << 10)  # two in flight: two files
    assert a.path != b.path and a.capacity >= 100 << 10
    a.at(4096, 1 << 20, 10)[1 << 20 : (1 << 20) + 10] = b"0123456789"  # a part's offsets land at the landing's
    with open(a.path, "rb") as f:
        f.seek(4096)
        assert f.read(10) == b"0123456789"
    pool.give_back(a)
    pool.give_back(b)
    again = pool.take(50 << 10)
    assert again.path in (a.path, b.path)  # no new file, no new mapping
    pool.give_back(again)
    assert pool.status()["landings_idle"] == 2
    now[0] += landing.IDLE_SECONDS + 1
    pool.expire()
    assert pool.status()["landings_idle"] == 0
    assert not os.path.exists(a.path) and not os.path.exists(b.path)


def test_idle_landings_beyond_the_bound_go_the_largest_first(tmp_path):
    pool = Landings(str(tmp_path))
    taken = [pool.take((i + 1) << 12) for i in range(landing.MAX_IDLE + 2)]
    for x in taken:
        pool.give_back(x)
    assert pool.status()["landings_idle"] == landing.MAX_IDLE
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(x.path) for x in taken[: landing.MAX_IDLE])
    pool.close()
    assert os.listdir(tmp_path) == []
