"""Network namespaces for a team of daemons (``ip netns``, root only): each node on a veth of its
own, all on one bridge, so a test can cut a node's link and heal it (a real partition)."""

from __future__ import annotations

import os
import shutil
import subprocess


class Net:
    """Each node in a network namespace of its own, its veth on one bridge (``ip netns``, root
    only): a partition takes a node's link down, and up again. Trainers still reach their daemon
    through its ``ipc://`` socket (a file: every namespace sees it)."""

    def __init__(self, nodes: int) -> None:
        tag = f"{os.getpid() % 100000:05d}"
        self.bridge, self.subnet = f"ucbr{tag}", f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
        self.ns = [f"ucpd-{tag}-n{i}" for i in range(nodes)]
        self.veth = [f"uc{tag}n{i}" for i in range(nodes)]
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i in range(nodes):
                _ip("netns", "add", self.ns[i])
                _ip("link", "add", self.veth[i], "type", "veth", "peer", "name", "eth0", "netns", self.ns[i])
                _ip("link", "set", self.veth[i], "master", self.bridge, "up")
                _ip("-n", self.ns[i], "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
                _ip("-n", self.ns[i], "link", "set", "eth0", "up")
                _ip("-n", self.ns[i], "link", "set", "lo", "up")
        except Exception:
            self.close()
            raise

    def ip(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[i]]

    def cut(self, i: int) -> None:
        _ip("link", "set", self.veth[i], "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self.veth[i], "up")

    def close(self) -> None:
        for name in self.veth + [self.bridge]:
            subprocess.run(["ip", "link", "del", name], capture_output=True)
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def partitions_available() -> str | None:
    """None when this machine can build the namespaces (root, ``ip netns``), else why not."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "partitions need root and iproute2's ip"
    probe = f"ucpd-probe-{os.getpid()}"
    out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if out.returncode == 0 else f"ip netns add failed: {out.stderr.strip()}"
