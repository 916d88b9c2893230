"""A team of real daemons on loopback, each node with its own run and shm dirs."""

from __future__ import annotations

import importlib.util
import os
import shutil
import uuid

import pytest

from helpers.ranks import free_port


def _root_conftest():
    """tests/conftest.py as a module of its own: several test folders have a ``conftest``, so
    ``import conftest`` means whichever was imported first."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")
    spec = importlib.util.spec_from_file_location("ucpd_tests_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DaemonProcess = _root_conftest().DaemonProcess


class Team:
    """N ``ucpd serve`` processes that know each other; node i is ``team.nodes[i]``."""

    def __init__(self, root, n: int, extra: list[str], secret: str | None, shm_prefix: str):
        self.root, self.n, self.extra = root, n, extra
        self.addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(n)]
        self.secret_file = None
        if secret is not None:
            self.secret_file = str(root / "secret")
            with open(self.secret_file, "w") as f:
                f.write(secret)
            os.chmod(self.secret_file, 0o600)
        self.nodes: list[DaemonProcess] = []
        self.started: set[int] = set()  # nodes started at least once (their address is known to peers)
        self.faults: dict[int, str | None] = {}
        for i in range(n):
            os.makedirs(root / f"node{i}", exist_ok=True)
            self.nodes.append(
                DaemonProcess(str(root / f"node{i}" / "run"), f"{shm_prefix}-node{i}-{uuid.uuid4().hex[:6]}", None, [])
            )

    def args(self, i: int) -> list[str]:
        a = ["--nodes", str(self.n), "--node-rank", str(i), "--peers", ",".join(self.addresses),
             "--heartbeat", "0.1", "--dead-after", "1.5", "--mem-limit", "1G", *self.extra]
        if self.secret_file:
            a += ["--secret-file", self.secret_file]
        return a

    def start(self, i: int | None = None, fault: str | None = None) -> "Team":
        """Start every node (or node i); ``fault`` arms a ``ucpd.faults`` crash point in it.

        Ports are chosen before the daemons bind them, so another process may take one meanwhile
        (other test runs on the machine): a node's first start that finds its port taken makes
        the team pick new ports and restart the nodes already up, which knew the old ones."""
        for j in range(self.n) if i is None else [i]:
            self.faults[j] = fault
            for attempt in range(5):
                try:
                    self._start_one(j)
                    break
                except RuntimeError as exc:
                    if "Address already in use" not in str(exc) or j in self.started or attempt == 4:
                        raise
                    self._new_ports()
            self.started.add(j)
        return self

    def _start_one(self, j: int) -> None:
        node = self.nodes[j]
        node.extra = self.args(j)
        if self.faults.get(j):
            os.environ["UCPD_FAULT"] = self.faults[j]
        try:
            node.start()
        finally:
            os.environ.pop("UCPD_FAULT", None)

    def _new_ports(self) -> None:
        self.addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(self.n)]
        for k in sorted(self.started):
            self.nodes[k].stop()
            self._start_one(k)

    def run_dirs(self) -> list[str]:
        return [d.run_dir for d in self.nodes]

    def lose(self, i: int) -> None:
        """Lose node i: SIGKILL its daemon and delete its shm dir (its RAM)."""
        self.nodes[i].kill()
        shutil.rmtree(self.nodes[i].shm_dir, ignore_errors=True)

    def stop(self) -> None:
        for d in self.nodes:
            d.stop()
            shutil.rmtree(d.shm_dir, ignore_errors=True)

    def logs(self) -> str:
        return "\n".join(f"--- node {i}\n{d.read_log()}" for i, d in enumerate(self.nodes))


@pytest.fixture
def make_team(tmp_path, ucpd_isolation):
    """make_team(n, *extra, secret=None) starts n daemons on loopback; all stopped afterwards (their
    shm dirs are under the test's prefix, so the isolation fixture removes them whatever happens)."""
    teams: list[Team] = []

    def make(n: int, *extra: str, secret: str | None = None, start: bool = True) -> Team:
        t = Team(tmp_path, n, list(extra), secret, ucpd_isolation)
        teams.append(t)
        return t.start() if start else t

    yield make
    for t in teams:
        t.stop()
