"""Waiting in tests: poll a condition until it holds, within a generous bound; never a guessed sleep.

A test that must see a real daemon do something (declare a peer dead, finish a flush, clean up a
file) waits for *that*, not for a time it guessed: the same test passes on a quiet machine in
milliseconds and on a loaded one (another suite beside it, ``pytest -n``) a little later.
``tick`` runs between polls: a test that drives a team's timers itself passes them here.
"""

from __future__ import annotations

import time


def eventually(cond, timeout: float = 30.0, poll: float = 0.02, tick=None) -> bool:
    """True as soon as ``cond()`` holds; False if it still does not after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() > deadline:
            return False
        if tick is not None:
            tick()
        time.sleep(poll)


def wait_until(cond, what: str = "the condition", timeout: float = 30.0, poll: float = 0.02, tick=None) -> None:
    """Return once ``cond()`` holds; AssertionError naming ``what`` after ``timeout`` seconds."""
    if not eventually(cond, timeout, poll, tick):
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
