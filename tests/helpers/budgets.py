"""Each test area's time budget, and the table the suite prints at its end (tests/conftest.py).

An area is a folder under tests/ (the files at the top are ``top``). Its budget is the time its
tests may take together, summed over the xdist workers (setup, call and teardown of each test),
on a quiet 2-core machine: with 3 workers, ``make test`` stays under 8 minutes with setup while
the areas stay within their budgets. docs/TESTING.md says how an area that grows past its budget
gets back under it (the in-process seams; one real-process case per feature).
"""

from __future__ import annotations

# seconds of worker time, on a quiet 2-core machine (docs/TESTING.md, "Budgets")
BUDGETS = {
    "team": 280.0,
    "client": 230.0,
    "faults": 210.0,
    "daemon": 140.0,
    "top": 60.0,
    "examples": 60.0,
    "format": 40.0,
    "fuzz": 15.0,
    "native": 15.0,
    "sim": 12.0,
    "corruption": 10.0,
    "ucl": 10.0,
    "gpu": 5.0,
}


def area(nodeid: str) -> str:
    """``tests/team/test_x.py::test_y`` (or ``team/test_x.py::...``) -> ``team``; top-level files -> ``top``."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    if parts and parts[0] == "tests":
        parts = parts[1:]
    return parts[0] if len(parts) > 1 else "top"


class Spent:
    """Seconds per area, from the test reports (on the xdist controller: every worker's)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.tests: dict[str, set[str]] = {}

    def add(self, nodeid: str, seconds: float) -> None:
        a = area(nodeid)
        self.seconds[a] = self.seconds.get(a, 0.0) + seconds
        self.tests.setdefault(a, set()).add(nodeid)

    def table(self) -> list[str]:
        """One line per area that ran, the slowest first; areas over their budget are marked."""
        if not self.seconds:
            return []
        lines = [f"{'area':12s} {'tests':>6s} {'seconds':>8s} {'budget':>7s}"]
        for a, s in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            budget = BUDGETS.get(a)
            mark = "" if budget is None or s <= budget else "  over budget"
            lines.append(f"{a:12s} {len(self.tests[a]):6d} {s:8.1f} {budget if budget is not None else '-':>7}{mark}")
        lines.append(f"{'all':12s} {sum(len(t) for t in self.tests.values()):6d} {sum(self.seconds.values()):8.1f} "
                     f"{sum(BUDGETS.values()):7.0f}")
        return lines
