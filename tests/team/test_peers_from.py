"""Teams of real daemons formed by ``ucpd serve --peers-from`` instead of a hand-written list.

Each node is a ``ucpd serve`` process with the environment its launcher gives it: Slurm's
variables as ``srun`` sets them, a StatefulSet pod's hostname and namespace, or a ``TCPStore``
rendezvous (hosted by the test, as torchrun's agent hosts its own). Every node listens on the
same port at a loopback address of its own (127.0.0.2, 127.0.0.3, ...), its name mapped there
by ``$UCPD_PEER_HOSTS`` (a hosts file, no ``/etc/hosts`` edit). The team is formed when every
node sees every other live over the real links; a node lost with its RAM and started again from
the same environment (same ``SLURM_NODEID``, same ordinal, same address) rejoins under its rank.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from datetime import timedelta

import pytest

from helpers.daemons import ROOT, Daemon, free_port
from helpers.waiting import wait_until
NODES = 3


class Node(Daemon):
    """One ``ucpd serve --peers-from`` process with its own environment."""

    def __init__(self, root, shm_prefix: str, i: int, args: list[str], env: dict[str, str]):
        os.makedirs(root / f"node{i}", exist_ok=True)
        super().__init__(str(root / f"node{i}" / "run"), f"{shm_prefix}-pf{i}-{uuid.uuid4().hex[:6]}",
                         ["--mem-limit", "256M", "--heartbeat", "0.1", "--dead-after", "1.5", *args])
        self.env = env

    def start(self) -> "Node":
        return super().start(env=self.env, timeout=90)

    def launch(self) -> "Node":
        return super().launch(env=self.env)

    def lose(self) -> None:
        """The node is gone, and its RAM with it."""
        self.kill()
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        self.shm_dir = f"{self.shm_dir}-new"  # the replacement's memory is its own

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    def team(self) -> tuple[int, list[bool], list[str]]:
        """(this node's rank, which nodes it sees live, their addresses)."""
        s = self.status(10)
        nodes = s["team"]["nodes"]
        return s["node_rank"], [n["live"] for n in nodes], [n["address"] for n in nodes]


@pytest.fixture
def cluster(tmp_path, ucpd_isolation):
    """cluster(args_of(i), env_of(i)) -> NODES nodes, started together (a rendezvous waits for all)."""
    made: list[Node] = []

    def make(args_of, env_of) -> list[Node]:
        nodes = [Node(tmp_path, ucpd_isolation, i, args_of(i), env_of(i)) for i in range(NODES)]
        made.extend(nodes)
        for n in nodes:  # together, from this thread (a daemon ends with the thread that started it)
            n.launch()
        for n in nodes:
            wait_until(n.serving, "every daemon to serve", 90)
        return nodes

    yield make
    for n in made:
        n.stop()


def hosts_file(tmp_path, names: list[str]) -> str:
    path = tmp_path / "peer-hosts"
    path.write_text("".join(f"127.0.0.{i + 2} {name}\n" for i, name in enumerate(names)))
    return str(path)


def formed(nodes: list[Node], ranks=None) -> None:
    """Every node sees every node live, all with one list of addresses (and ``ranks`` in node order)."""
    def all_live():
        return all(all(n.team()[1]) for n in nodes)

    wait_until(all_live, "every node to see the whole team live", 60)
    views = [n.team() for n in nodes]
    assert len({tuple(addrs) for _, _, addrs in views}) == 1, views
    if ranks is not None:
        assert [r for r, _, _ in views] == ranks


def rejoined(nodes: list[Node], lost: int) -> None:
    """Node ``lost`` was lost and its replacement started: the others see it gone, then back."""
    wait_until(lambda: not nodes[0 if lost else 1].team()[1][lost], f"node {lost} to be seen dead", 30)
    nodes[lost].start()
    formed(nodes, list(range(NODES)))
    assert nodes[lost].status()["node_rank"] == lost


def test_slurm_variables_as_srun_sets_them_form_the_team_and_a_replaced_node_rejoins(cluster, tmp_path):
    names = [f"gpu-{n:03d}" for n in (1, 2, 4)]
    hosts, port = hosts_file(tmp_path, names), free_port()

    def env(i):  # srun --nodes 3 --ntasks-per-node 1 in a job on gpu-[001-002,004]
        return {"SLURM_JOB_NODELIST": "gpu-[001-002,004]", "SLURM_NODEID": str(i), "SLURM_NNODES": "3",
                "SLURM_JOB_ID": "77", "SLURM_PROCID": str(i), "UCPD_PEER_HOSTS": hosts}

    nodes = cluster(lambda i: ["--peers-from", "slurm", "--peer-port", str(port), "--replicas", "1"], env)
    formed(nodes, [0, 1, 2])
    assert nodes[0].team()[2] == [f"tcp://127.0.0.{i + 2}:{port}" for i in range(3)]
    assert "team from Slurm: $SLURM_JOB_NODELIST=gpu-[001-002,004], $SLURM_NODEID=1" in nodes[1].read_log()
    nodes[1].lose()
    rejoined(nodes, 1)


def test_a_statefulsets_pods_form_the_team_from_their_ordinals_and_a_replaced_pod_rejoins(cluster, tmp_path):
    names = [f"ucpd-{i}.ucpd-peers.training.svc.cluster.local" for i in range(NODES)]
    hosts, port = hosts_file(tmp_path, names), free_port()

    def env(i):
        return {"HOSTNAME": f"ucpd-{i}", "POD_NAMESPACE": "training", "UCPD_K8S_SERVICE": "ucpd-peers",
                "UCPD_NODES": str(NODES), "UCPD_PEER_HOSTS": hosts}

    nodes = cluster(lambda i: ["--peers-from", "k8s", "--peer-port", str(port), "--replicas", "1"], env)
    formed(nodes, [0, 1, 2])
    assert "team from Kubernetes: pod ucpd-2 of 3, service ucpd-peers.training" in nodes[2].read_log()
    nodes[2].lose()
    rejoined(nodes, 2)


def test_daemons_meet_in_a_tcpstore_rendezvous_and_a_node_back_at_its_address_takes_its_rank(cluster):
    from torch.distributed import TCPStore

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    listens = [f"tcp://127.0.0.{i + 2}:{free_port()}" for i in range(NODES)]
    nodes = cluster(lambda i: ["--peers-from", f"c10d://127.0.0.1:{port}", "--nodes", str(NODES),
                               "--listen", listens[i]], lambda i: {})
    wait_until(lambda: all(all(n.team()[1]) for n in nodes), "every node to see the whole team live", 60)
    ranks = [n.team()[0] for n in nodes]
    assert sorted(ranks) == [0, 1, 2]  # assigned in the store, in the order the daemons arrived
    by_rank = {r: listens[i] for i, r in enumerate(ranks)}
    assert nodes[0].team()[2] == [by_rank[r] for r in range(NODES)]
    lost = ranks.index(1)
    nodes[lost].lose()
    wait_until(lambda: not nodes[lost - 1].team()[1][1], "rank 1 to be seen dead", 30)
    nodes[lost].start()  # a node back at its address (a new daemon, empty RAM): its rank again
    wait_until(lambda: all(all(n.team()[1]) for n in nodes), "the team live again", 60)
    assert nodes[lost].team()[0] == 1
    assert int(store.get("ucpd/joined")) == NODES  # no rank was handed out twice


def serve_fails(args: list[str], env: dict[str, str], tmp_path) -> tuple[str, float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "POD_", "UCPD_NODES"))}
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "ucpd", "serve", "--run-dir", str(tmp_path / "r"), *args],
                         env={**clean, **env}, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode != 0
    return out.stderr, time.monotonic() - start


@pytest.mark.parametrize("env, says", [
    ({}, "$SLURM_JOB_NODELIST, $SLURM_NODEID, $SLURM_NNODES not set"),
    ({"SLURM_JOB_NODELIST": "gpu-[001-002]", "SLURM_NNODES": "2"}, "$SLURM_NODEID not set"),
    ({"SLURM_JOB_NODELIST": "gpu-[001-002", "SLURM_NODEID": "0", "SLURM_NNODES": "2"}, "is not a Slurm host list"),
    ({"SLURM_JOB_NODELIST": "gpu-[001-002]", "SLURM_NODEID": "0", "SLURM_NNODES": "3"}, "names 2 node(s)"),
])
def test_a_partial_slurm_environment_is_an_error_naming_the_variable_at_once(tmp_path, env, says):
    err, seconds = serve_fails(["--peers-from", "slurm"], env, tmp_path)
    assert says in err and seconds < 10, err


@pytest.mark.parametrize("env, says", [
    ({"HOSTNAME": "trainer"}, "does not end in an ordinal"),
    ({"HOSTNAME": "ucpd-1"}, "$UCPD_NODES not set"),
    ({"HOSTNAME": "ucpd-4", "UCPD_NODES": "3"}, "ordinal 4, outside a team of 3"),
])
def test_a_partial_k8s_environment_is_an_error_naming_the_variable_at_once(tmp_path, env, says):
    err, seconds = serve_fails(["--peers-from", "k8s"], env, tmp_path)
    assert says in err and seconds < 10, err


def test_torchrun_mode_meets_beside_torchruns_own_rendezvous():
    from ucpd.launch import torchrun_peers
    from ucpd.team.peers_from import PeersFromError, torchrun_endpoint

    launcher = ["torchrun", "--nnodes", "2:4", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                "--rdzv-endpoint=node0:29400", "train.py"]
    assert torchrun_endpoint(launcher, {}) == ("node0", 29400, 4)
    assert torchrun_endpoint(["torchrun", "t.py"], {"PET_RDZV_ENDPOINT": "h:1", "PET_NNODES": "2"}) == ("h", 1, 2)
    assert torchrun_peers(["--peers-from", "torchrun", "--replicas", "1"], launcher) == [
        "--peers-from", "c10d://node0:29401", "--replicas", "1", "--nodes", "4"]
    with pytest.raises(PeersFromError, match="no --rdzv-endpoint"):
        torchrun_endpoint(["torchrun", "train.py"], {})


def test_the_statefulset_manifest_forms_its_team_with_peers_from_k8s():
    import yaml

    from ucpd.team.peers_from import k8s

    docs = list(yaml.safe_load_all(open(os.path.join(ROOT, "docs", "deploy", "k8s-statefulset.yaml"))))
    service = next(d for d in docs if d["kind"] == "Service")
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    assert service["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == service["metadata"]["name"]
    (box,) = sts["spec"]["template"]["spec"]["containers"]
    assert "--peers-from=k8s" in box["args"]
    env = {e["name"]: e.get("value") for e in box["env"]}
    assert int(env["UCPD_NODES"]) == sts["spec"]["replicas"]
    ns = sts["metadata"]["namespace"]
    names = {f"{sts['metadata']['name']}-{i}.{service['metadata']['name']}.{ns}.svc.cluster.local": "10.0.0.%d" % i
             for i in range(sts["spec"]["replicas"])}
    got = k8s({**env, "HOSTNAME": "ucpd-3", "POD_NAMESPACE": ns}, 7420, names, None, wait=0)
    assert (got.nodes, got.node_rank, got.listen) == (4, 3, "tcp://10.0.0.3:7420")
    assert got.peers == [f"tcp://10.0.0.{i}:7420" for i in range(4)]
