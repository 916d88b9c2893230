"""A team of real ``ucpd serve`` processes that know each other: on loopback, or each in a network
namespace of its own (``helpers.netns``). The one team-of-processes helper of tests/: the
``make_team`` fixture, the crash trials of ``faultkit`` and the chaos campaign all use it."""

from __future__ import annotations

import os
import shutil
import signal
import uuid

from .daemons import Daemon, free_port


class DaemonTeam:
    """N daemons, node i is ``nodes[i]`` (a ``helpers.daemons.Daemon``) with its own run and shm
    dirs under ``workdir``. Every node gets ``--nodes --node-rank --peers --heartbeat 0.1
    --dead-after D --mem-limit M`` and then ``extra``. ``secret``: a job secret file every node
    proves. ``flush_dir``: the nodes in ``flush_nodes`` (all by default) flush there.

    ``renew()`` makes a fresh team (a new *generation*: new dirs, shm dirs, ports and flush
    folder) for a campaign that starts over after a failure."""

    def __init__(self, workdir: str, shm_prefix: str, n: int, extra: list[str] | tuple = (), *,
                 dead_after: float = 1.5, mem_limit: str = "1G", secret: str | None = None, net=None,
                 flush_dir: str | None = None, flush_nodes: set[int] | None = None):
        self.workdir, self.shm_prefix, self.n, self.extra = str(workdir), shm_prefix, n, list(extra)
        self.dead_after, self.mem_limit, self.net = dead_after, mem_limit, net
        self.base_flush_dir, self.flush_nodes = flush_dir, flush_nodes
        self.secret_file = None
        if secret is not None:
            self.secret_file = os.path.join(self.workdir, "secret")
            os.makedirs(self.workdir, exist_ok=True)
            with open(self.secret_file, "w") as f:
                f.write(secret)
            os.chmod(self.secret_file, 0o600)
        self.generation = 0
        self.paused: set[int] = set()
        self.faults: dict[int, str | None] = {}
        self._make()

    def _make(self) -> None:
        self.started: set[int] = set()  # nodes started at least once (their address is known to peers)
        self.addresses = self._addresses()
        where = self.workdir if self.generation == 0 else os.path.join(self.workdir, f"g{self.generation}")
        self.nodes: list[Daemon] = []
        for i in range(self.n):
            os.makedirs(os.path.join(where, f"node{i}"), exist_ok=True)
            flush = self.flush_dir() if self.flush_nodes is None or i in self.flush_nodes else None
            d = Daemon(os.path.join(where, f"node{i}", "run"),
                       f"{self.shm_prefix}-g{self.generation}-node{i}-{uuid.uuid4().hex[:6]}", [], flush)
            d.prefix = self.net.prefix(i) if self.net else []
            self.nodes.append(d)

    def _addresses(self) -> list[str]:
        return [f"tcp://{self.net.ip(i) if self.net else '127.0.0.1'}:{free_port()}" for i in range(self.n)]

    def flush_dir(self) -> str | None:
        """This generation's flush folder (None without ``flush_dir``)."""
        if self.base_flush_dir is None:
            return None
        return self.base_flush_dir if self.generation == 0 else os.path.join(self.base_flush_dir, f"g{self.generation}")

    def args(self, i: int) -> list[str]:
        a = ["--nodes", str(self.n), "--node-rank", str(i), "--peers", ",".join(self.addresses),
             "--heartbeat", "0.1", "--dead-after", f"{self.dead_after:g}", "--mem-limit", self.mem_limit]
        if self.net is not None:  # off loopback, a node listens on its namespace's address
            a += ["--listen", self.addresses[i]]
        a += self.extra
        if self.secret_file:
            a += ["--secret-file", self.secret_file]
        return a

    def start(self, i: int | None = None, fault: str | None = None) -> "DaemonTeam":
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
        node.args = self.args(j)
        node.start(fault=self.faults.get(j))

    def _new_ports(self) -> None:
        self.addresses = self._addresses()
        for k in sorted(self.started):
            self.nodes[k].stop()
            self._start_one(k)

    def renew(self) -> "DaemonTeam":
        """Stop this team and make a fresh one (not started): new dirs, ports, flush folder."""
        self.stop()
        self.generation += 1
        self._make()
        return self

    def restart(self, i: int) -> None:
        self.nodes[i].start()

    def run_dirs(self) -> list[str]:
        return [d.run_dir for d in self.nodes]

    def kill(self, i: int) -> None:
        """Crash node i's daemon (SIGKILL; its shm dir stays)."""
        self.resume(i)
        self.nodes[i].kill()

    def lose(self, i: int) -> None:
        """Lose node i: SIGKILL its daemon and delete its shm dir (its RAM)."""
        self.kill(i)
        shutil.rmtree(self.nodes[i].shm_dir, ignore_errors=True)

    def pause(self, i: int) -> None:
        os.kill(self.nodes[i].proc.pid, signal.SIGSTOP)
        self.paused.add(i)

    def resume(self, i: int) -> None:
        if i in self.paused:
            self.paused.discard(i)
            if self.nodes[i].alive():
                os.kill(self.nodes[i].proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Stop every node: all are asked (SIGTERM) before any is waited for, so a team's nodes
        shut down side by side, each killed if it has not exited within 10 s."""
        for i, d in enumerate(self.nodes):
            self.resume(i)
            if self.net is not None:
                self.net.heal(i)
            d.terminate()
        for d in self.nodes:
            d.stop()
            shutil.rmtree(d.shm_dir, ignore_errors=True)

    def close(self) -> None:
        self.stop()
        if self.net is not None:
            self.net.close()

    def status(self, i: int, timeout: float = 5.0) -> dict | None:
        """Node i's status, or None: paused, down, or no answer within ``timeout``."""
        if i in self.paused or not self.nodes[i].alive():
            return None
        try:
            return self.nodes[i].status(timeout)
        except Exception:
            return None

    def healthy(self, nodes) -> bool:
        """Each of ``nodes`` answers, and its team and every version it lists say healthy."""
        for i in nodes:
            st = self.status(i)
            t = (st or {}).get("team")
            if t is None or t["health"] != "healthy" or any(v["health"] != "healthy" for v in t["versions"]):
                return False
        return True

    def up(self) -> list[int]:
        return [i for i, d in enumerate(self.nodes) if d.alive() and i not in self.paused]

    def sees_dead(self, i: int, dead: int) -> bool:
        st = self.status(i)
        return st is not None and not st["team"]["nodes"][dead]["live"]

    def formed(self) -> bool:
        """Every node is up and sees every node live, with one coordinator."""
        coords = set()
        for i in range(self.n):
            st = self.status(i)
            if st is None or not all(x["live"] for x in st["team"]["nodes"]):
                return False
            coords.add(st["team"]["coordinator"])
        return len(coords) == 1

    def logs(self, nbytes: int = 4000) -> str:
        return "\n".join(f"--- node {i}\n{d.read_log(nbytes)}" for i, d in enumerate(self.nodes))
