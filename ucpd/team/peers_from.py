"""Where a team's node rank, node count and peer addresses come from when nobody wrote a list:
``ucpd serve --peers-from slurm | torchrun | c10d://HOST:PORT | k8s``.

* ``slurm``: ``SLURM_JOB_NODELIST`` (Slurm's compressed form, ``gpu-[001-004,007],cpu-1``,
  expanded by python-hostlist as Slurm expands it), ``SLURM_NODEID`` (this node's index in it)
  and ``SLURM_NNODES``, as ``srun`` sets them in every task; every node listens on one port.
* ``c10d://HOST:PORT``: the daemons meet in a ``torch.distributed.TCPStore`` (the store torchrun's
  c10d rendezvous uses) at HOST:PORT, hosted by the daemon that can bind it, before the launcher
  starts. A node's rank is assigned there once per address: a node that comes back at its
  address (a restarted daemon, a new host under the same name) gets its rank again. ``--nodes``
  says how many to wait for.
* ``torchrun``: the same, at torchrun's own ``--rdzv-endpoint`` with the port after it, and
  torchrun's ``--nnodes`` (from ``ucpd run``'s launcher command, else ``PET_RDZV_ENDPOINT`` and
  ``PET_NNODES``, torchrun's environment forms).
* ``k8s``: a StatefulSet's (or JobSet's) pod: the ordinal at the end of its hostname is the node
  rank; peers are ``<set>-<i>.<service>.<namespace>.svc.<domain>`` (``UCPD_K8S_SERVICE``, else
  the set's name; ``POD_NAMESPACE`` or the service account's namespace file; ``UCPD_K8S_DOMAIN``,
  default ``cluster.local``); ``UCPD_NODES`` or ``--nodes`` (the set's replicas) the count.
  A pod replaced under the same ordinal keeps the name, so the team reaches it again.

Peer names stay names on the links (ZeroMQ resolves them at each connect, following a replaced
pod's new address); this node's own name is resolved to the address it binds. ``$UCPD_PEER_HOSTS``
names a hosts file (``ADDRESS NAME...`` lines) consulted first: nodes whose names resolve to
the management network can be given the fast NIC's addresses, and tests map names to loopback.
Every missing or malformed variable is an error naming it, at once.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ..errors import UcpdError

log = logging.getLogger("ucpd.team")

DEFAULT_PORT = 7420
MODES = ("slurm", "torchrun", "c10d://HOST:PORT", "k8s")
SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_ORDINAL = re.compile(r"^(?P<set>[a-z0-9]([-a-z0-9]*[a-z0-9])?)-(?P<ordinal>\d+)$")


class PeersFromError(UcpdError):
    """``--peers-from`` cannot form the team: a launcher variable missing or malformed, or a
    rendezvous that did not complete (the message names the variable and what to do)."""

    code = "peers_from"


@dataclass
class Formed:
    """A team as a peer source formed it: node count, this node's rank, every node's address."""

    nodes: int
    node_rank: int
    peers: list[str]
    listen: str | None = None  # the address this node binds (its own name resolved), if the source knows it
    source: str = ""  # where it came from, for the log


HOSTED: list = []  # rendezvous stores this process hosts (kept alive with it)


# --- names -------------------------------------------------------------------------------------


def hosts_file(path: str | None) -> dict[str, str]:
    """``ADDRESS NAME...`` lines (``/etc/hosts`` format) as {name: address}."""
    if not path:
        return {}
    out: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                words = line.split("#", 1)[0].split()
                for name in words[1:]:
                    out.setdefault(name.lower(), words[0])
    except OSError as exc:
        raise PeersFromError(f"$UCPD_PEER_HOSTS: cannot read {path} ({exc})") from None
    return out


def resolve(name: str, hosts: Mapping[str, str]) -> str:
    """``name``'s address: the hosts file's, else the system resolver's (an IPv4 one first)."""
    if name.lower() in hosts:
        return hosts[name.lower()]
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    return infos[0][4][0]


def _url(address: str, port: int) -> str:
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


def _peer(name: str, port: int, hosts: Mapping[str, str]) -> str:
    return _url(hosts.get(name.lower(), name), port)


def _own(name: str, port: int, hosts: Mapping[str, str], what: str, wait: float) -> str:
    """The address this node binds: its own name resolved (waiting ``wait`` s for its DNS record)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return _url(resolve(name, hosts), port)
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise PeersFromError(f"this node's own name {name!r} ({what}) does not resolve: {exc}; check the "
                                     "DNS (a headless service) or list it in $UCPD_PEER_HOSTS") from None
            time.sleep(0.2)


def _int(env: Mapping[str, str], names: Sequence[str], mode: str, hint: str) -> int | None:
    for name in names:
        text = (env.get(name) or "").strip()
        if text:
            if not text.isdigit():
                raise PeersFromError(f"--peers-from {mode}: ${name}={text!r} is not a number. {hint}")
            return int(text)
    return None


# --- the sources -------------------------------------------------------------------------------

SLURM_HINT = ("Start the daemons with srun, one task per node (`srun --ntasks-per-node 1 ucpd serve --peers-from "
              "slurm ...`), inside an sbatch or salloc allocation, or pass --nodes/--node-rank/--peers")


def slurm(env: Mapping[str, str], port: int, hosts: Mapping[str, str]) -> Formed:
    """The team of a Slurm job's nodes, from the variables ``srun`` sets in every task."""
    import hostlist

    text = (env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "").strip()
    missing = [n for n, v in (("SLURM_JOB_NODELIST", text), ("SLURM_NODEID", env.get("SLURM_NODEID")),
                              ("SLURM_NNODES", env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES"))) if not v]
    if missing:
        raise PeersFromError(f"--peers-from slurm: ${', $'.join(missing)} not set. {SLURM_HINT}")
    try:
        names = hostlist.expand_hostlist(text)
    except hostlist.BadHostlist as exc:
        raise PeersFromError(f"--peers-from slurm: $SLURM_JOB_NODELIST={text!r} is not a Slurm host list ({exc})") from None
    nodes = _int(env, ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"), "slurm", SLURM_HINT)
    rank = _int(env, ("SLURM_NODEID",), "slurm", SLURM_HINT)
    if nodes != len(names):
        raise PeersFromError(f"--peers-from slurm: $SLURM_NNODES={nodes} but $SLURM_JOB_NODELIST={text!r} names "
                             f"{len(names)} node(s)")
    if not 0 <= rank < nodes:
        raise PeersFromError(f"--peers-from slurm: $SLURM_NODEID={rank} is outside the job's {nodes} node(s)")
    if nodes < 2:
        raise PeersFromError(f"--peers-from slurm: the job has one node ({text}): a team needs two or more; drop "
                             "--peers-from to run one daemon")
    own = _own(names[rank], port, hosts, f"$SLURM_JOB_NODELIST at $SLURM_NODEID={rank}", 0)
    return Formed(nodes, rank, [_peer(n, port, hosts) for n in names], own,
                  f"Slurm: $SLURM_JOB_NODELIST={text}, $SLURM_NODEID={rank}")


K8S_HINT = ("Run the daemons as a StatefulSet (or JobSet) with a headless service (docs/deploy/k8s-statefulset.yaml): "
            "the pod's hostname ends in its ordinal")


def k8s(env: Mapping[str, str], port: int, hosts: Mapping[str, str], nodes: int | None,
        wait: float = 30.0, namespace_file: str = SA_NAMESPACE) -> Formed:
    """The team of a StatefulSet's pods: the ordinal of this pod's hostname, the service's names."""
    pod = (env.get("HOSTNAME") or socket.gethostname()).split(".", 1)[0]
    m = _ORDINAL.match(pod)
    if m is None:
        raise PeersFromError(f"--peers-from k8s: the pod's hostname {pod!r} ($HOSTNAME) does not end in an ordinal "
                             f"(<set>-<n>). {K8S_HINT}")
    count = nodes or _int(env, ("UCPD_NODES",), "k8s", "Set it to the StatefulSet's replicas")
    if not count:
        raise PeersFromError("--peers-from k8s: $UCPD_NODES not set (nor --nodes): set it to the StatefulSet's "
                             "replicas, e.g. from the manifest's env")
    rank = int(m.group("ordinal"))
    if not 0 <= rank < count:
        raise PeersFromError(f"--peers-from k8s: pod {pod!r} has ordinal {rank}, outside a team of {count} "
                             "($UCPD_NODES or --nodes: the StatefulSet's replicas)")
    namespace = (env.get("POD_NAMESPACE") or "").strip()
    if not namespace:
        try:
            with open(namespace_file) as f:
                namespace = f.read().strip()
        except OSError:
            raise PeersFromError(f"--peers-from k8s: $POD_NAMESPACE not set and {namespace_file} unreadable: set "
                                 "POD_NAMESPACE from the downward API (fieldRef metadata.namespace)") from None
    service = (env.get("UCPD_K8S_SERVICE") or m.group("set")).strip()
    domain = (env.get("UCPD_K8S_DOMAIN") or "cluster.local").strip()
    names = [f"{m.group('set')}-{i}.{service}.{namespace}.svc.{domain}" for i in range(count)]
    own = _own(names[rank], port, hosts, f"pod {pod} behind service {service}", wait)
    return Formed(count, rank, [_peer(n, port, hosts) for n in names], own,
                  f"Kubernetes: pod {pod} of {count}, service {service}.{namespace}")


def torchrun_endpoint(launcher: Sequence[str], env: Mapping[str, str]) -> tuple[str, int, int | None]:
    """torchrun's rendezvous endpoint (host, port) and --nnodes' maximum, from its command line
    (``ucpd run -- torchrun ...``) or its ``PET_*`` environment forms."""
    args: dict[str, str] = {}
    words = list(launcher)
    for i, w in enumerate(words):
        for flag in ("--rdzv-endpoint", "--rdzv_endpoint", "--nnodes"):
            if w == flag and i + 1 < len(words):
                args[flag.replace("_", "-")] = words[i + 1]
            elif w.startswith(flag + "="):
                args[flag.replace("_", "-")] = w.split("=", 1)[1]
    endpoint = args.get("--rdzv-endpoint") or env.get("PET_RDZV_ENDPOINT") or ""
    nnodes = args.get("--nnodes") or env.get("PET_NNODES") or ""
    if not endpoint:
        raise PeersFromError("--peers-from torchrun: no --rdzv-endpoint in the launcher's command (ucpd run -- "
                             "torchrun --rdzv-endpoint HOST:PORT ...) and $PET_RDZV_ENDPOINT not set; or give the "
                             "store itself: --peers-from c10d://HOST:PORT")
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise PeersFromError(f"--peers-from torchrun: rendezvous endpoint {endpoint!r} is not HOST:PORT")
    top = nnodes.split(":")[-1]
    if nnodes and not top.isdigit():
        raise PeersFromError(f"--peers-from torchrun: --nnodes {nnodes!r} is not N or MIN:MAX")
    return host, int(port), int(top) if nnodes else None


def c10d(host: str, port: int, nodes: int | None, listen: str, timeout: float,
         store_factory: Callable | None = None) -> Formed:
    """Meet the other daemons in the TCPStore at ``host:port``; ranks assigned there by address."""
    if not nodes or nodes < 2:
        raise PeersFromError(f"--peers-from c10d://{host}:{port}: say how many daemons meet there with --nodes N "
                             "(N > 1), or use --peers-from torchrun with torchrun's --nnodes")
    where = f"c10d://{host}:{port}"
    own = listen.split("://", 1)[-1].rpartition(":")[0].strip("[]")
    if _loopback(own) and not _loopback(host):
        raise PeersFromError(f"--peers-from {where}: this node's hostname resolves to {own}, a loopback address the "
                             "other nodes cannot reach: pass --listen tcp://ADDRESS:PORT (this node's address)")
    store, hosted = (store_factory or _tcp_store)(host, port, timeout)
    if hosted:
        HOSTED.append(store)  # the store lives as long as this daemon: a node that comes back meets it
    rank = _claim(store, listen, nodes, where)
    store.set(f"ucpd/addr/{rank}", listen)
    keys = [f"ucpd/addr/{i}" for i in range(nodes)]
    try:
        store.wait(keys)
    except Exception:  # noqa: BLE001 - torch raises its own DistStoreError/RuntimeError
        absent = [i for i in range(nodes) if not store.check([f"ucpd/addr/{i}"])]
        raise PeersFromError(f"--peers-from {where}: node rank(s) {absent} of {nodes} did not join within "
                             f"{timeout:g} s ($UCPD_RENDEZVOUS_TIMEOUT): start `ucpd serve --peers-from {where}` "
                             "on every node, with the same --nodes") from None
    return Formed(nodes, rank, [store.get(k).decode() for k in keys], listen,
                  f"rendezvous {where}: node {rank} of {nodes}")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(resolve(host, {})).is_loopback
    except (OSError, ValueError):
        return False


def _claim(store, listen: str, nodes: int, where: str) -> int:
    """This address's rank: the one it had (a node back at its address), else the next free one."""
    mine = f"ucpd/rank-of/{listen}"
    if store.check([mine]):
        return int(store.get(mine))
    rank = store.add("ucpd/joined", 1) - 1
    if rank >= nodes:
        held = [store.get(f"ucpd/addr/{i}").decode() for i in range(nodes) if store.check([f"ucpd/addr/{i}"])]
        raise PeersFromError(f"--peers-from {where}: the team of {nodes} is full (ranks held by {held}); a node "
                             "takes its rank back at the address it had (--listen), or start the team anew with a "
                             "fresh store (another port)")
    got = store.compare_set(mine, "", str(rank)).decode()
    return int(got)


def _tcp_store(host: str, port: int, timeout: float):
    """The TCPStore at host:port: hosted here when this machine can bind it, else joined."""
    from datetime import timedelta

    try:
        from torch.distributed import TCPStore
    except ImportError:
        raise PeersFromError("--peers-from c10d/torchrun needs torch (its TCPStore): install torch on the daemon's "
                             "machine, or use --peers-from slurm|k8s or --peers") from None
    wait = timedelta(seconds=timeout)
    if _is_local(host):
        try:
            return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=wait), True
        except Exception as exc:  # noqa: BLE001 - in use: another daemon here hosts it
            log.debug("not hosting the rendezvous store at %s:%d (%s): joining it", host, port, exc)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=min(timeout, 10.0))), False
        except Exception as exc:  # noqa: BLE001
            if time.monotonic() >= deadline:
                raise PeersFromError(f"--peers-from c10d://{host}:{port}: no rendezvous store answers there within "
                                     f"{timeout:g} s ({exc}); the daemon on {host} hosts it") from None
            time.sleep(0.5)


def _is_local(host: str) -> bool:
    try:
        addr = ipaddress.ip_address(resolve(host, {}))
    except (OSError, ValueError):
        return False
    if addr.is_loopback or host in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        with socket.socket(socket.AF_INET6 if addr.version == 6 else socket.AF_INET) as s:
            s.bind((str(addr), 0))
        return True
    except OSError:
        return False


# --- the option --------------------------------------------------------------------------------


def form(spec: str, *, nodes: int | None = None, listen: str | None = None, port: int | None = None,
         launcher: Sequence[str] = (), env: Mapping[str, str] | None = None) -> Formed:
    """The team ``--peers-from spec`` describes (see the module docstring)."""
    env = os.environ if env is None else env
    hosts = hosts_file(env.get("UCPD_PEER_HOSTS"))
    port = port or DEFAULT_PORT
    timeout = float(env.get("UCPD_RENDEZVOUS_TIMEOUT") or 300)
    if spec == "slurm":
        return slurm(env, port, hosts)
    if spec == "k8s":
        return k8s(env, port, hosts, nodes)
    if spec == "torchrun":
        host, rdzv_port, nnodes = torchrun_endpoint(launcher, env)
        return c10d(host, rdzv_port + 1, nodes or nnodes, listen or _own(socket.gethostname(), port, hosts, "its hostname", 0),
                    timeout)
    if spec.startswith("c10d://"):
        host, _, p = spec[len("c10d://"):].rpartition(":")
        if not host or not p.isdigit():
            raise PeersFromError(f"--peers-from {spec}: give the store as c10d://HOST:PORT")
        return c10d(host.strip("[]"), int(p), nodes, listen or _own(socket.gethostname(), port, hosts, "its hostname", 0),
                    timeout)
    raise PeersFromError(f"--peers-from {spec!r}: use one of {', '.join(MODES)}")
