"""Locator.disk_latest: what the flush dir says is the newest step, bounded in time — and never a
stale or guessed "none" when RAM holds nothing (a trainer would start afresh)."""

from __future__ import annotations

import threading
import time

import pytest

from ucpd import knobs
from ucpd.daemon.locate import Locator
from ucpd.errors import StorageError


class Disk:
    """A flush dir whose next lookups answer ``steps`` in turn; ``hang()`` makes them block."""

    def __init__(self, *steps):
        self.steps = list(steps)
        self.released = threading.Event()
        self.released.set()

    def hang(self):
        self.released.clear()

    def answer(self, job):
        self.released.wait(30)
        return self.steps.pop(0) if len(self.steps) > 1 else self.steps[0]


@pytest.fixture
def locator(tmp_path):
    made = []

    def make(disk: Disk) -> Locator:
        loc = Locator(None, str(tmp_path))
        loc._disk_latest_now = disk.answer  # the lookup itself; what is tested is the waiting around it
        made.append((loc, disk))
        return loc

    yield make
    for loc, disk in made:
        disk.released.set()
        loc.close()


FAST = dict(UCPD_DISK_LOOKUP_SECONDS=0.2, UCPD_DISK_ANSWER_SECONDS=1.0)


def test_a_hung_flush_dir_is_answered_from_what_was_read_before(locator):
    disk = Disk(4)
    loc = locator(disk)
    with knobs.override(**FAST):
        assert loc.disk_latest("j") == 4
        disk.hang()
        t0 = time.monotonic()
        assert loc.disk_latest("j") == 4
        assert loc.disk_latest("j", needed=True) == 4  # a step read before is an answer
    assert time.monotonic() - t0 < 1.0
    assert loc.disk_unresponsive


def test_with_nothing_in_ram_a_none_read_before_the_first_flush_is_not_an_answer(locator):
    disk = Disk(None, 1)  # nothing flushed at first; then step 1 is
    loc = locator(disk)
    with knobs.override(**FAST):
        assert loc.disk_latest("j") is None
        disk.hang()
        assert loc.disk_latest("j") is None  # RAM answers meanwhile: the old "none" will do
        t0 = time.monotonic()
        with pytest.raises(StorageError, match="unknown"):
            loc.disk_latest("j", needed=True)
        assert 0.9 < time.monotonic() - t0 < 5.0
        threading.Timer(0.3, disk.released.set).start()
        assert loc.disk_latest("j", needed=True) == 1  # the same lookup, answered while waited for


def test_a_flush_dir_never_read_is_waited_for_when_ram_holds_nothing(locator):
    disk = Disk(7)
    disk.hang()
    loc = locator(disk)
    with knobs.override(**FAST):
        assert loc.disk_latest("j") is None  # RAM may answer: nothing read yet
        threading.Timer(0.5, disk.released.set).start()
        assert loc.disk_latest("j", needed=True) == 7


def test_a_lookup_that_finished_after_its_caller_gave_up_is_not_reused_later(locator):
    disk = Disk(None, 3)  # the slow lookup says none; by the next question step 3 is flushed
    disk.hang()
    loc = locator(disk)
    with knobs.override(**FAST):
        assert loc.disk_latest("j") is None  # gave up waiting: the lookup goes on in the background
        disk.released.set()
        time.sleep(0.2)  # it finishes, with nobody waiting for it
        assert loc.disk_latest("j", needed=True) == 3  # a fresh lookup, not the old one's "none"
