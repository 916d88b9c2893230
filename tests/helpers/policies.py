"""Commit policies for tests that stand in for a team's decision."""

from __future__ import annotations


class HoldAll:
    """Commits nothing on its own (a team waiting for its peers): the test decides, and reads
    which steps completed."""

    local_parts = False

    def __init__(self):
        self.completed: list[int] = []

    def on_complete(self, version):
        self.completed.append(version.step)
        return False
