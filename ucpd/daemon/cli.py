"""``ucpd serve``, ``ucpd status``, ``ucpd drop`` and ``ucpd stop``: run a node daemon and look at it."""

from __future__ import annotations

import json
import logging
import os
import sys
import tomllib

from .. import knobs
from ..errors import UcpdError
from ..team.liveness import MEMBERSHIPS
from . import heap

GOSSIP_FROM = 64  # --membership auto: nodes from which gossip replaces all-to-all heartbeats
AUTO_FANOUT = 32  # --commit-fanout's default from GOSSIP_FROM nodes (a rack's worth)


def add_commands(sub) -> None:
    p = sub.add_parser("serve", help="run the node daemon", description="Run the ucpd node daemon in the foreground.")
    p.add_argument("--config", help="TOML file whose keys are these options (dashes or underscores)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's index in the job (default 0)")
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (daemons) in the job (default 1)")
    p.add_argument("--listen", help="tcp://HOST:PORT for peer daemons (multi-node)")
    p.add_argument("--peers", help="comma-separated --listen addresses of every node, in node order")
    p.add_argument("--hostfile", help="file with every node's --listen address, one per line, in node order")
    p.add_argument("--peers-from", metavar="SOURCE",
                   help="form the team where the job is launched instead of a list: slurm (SLURM_JOB_NODELIST, "
                   "SLURM_NODEID), torchrun (meet at torchrun's --rdzv-endpoint, its port + 1), c10d://HOST:PORT (a "
                   "TCPStore rendezvous; with --nodes), or k8s (a StatefulSet pod's ordinal and headless-service names)")
    p.add_argument("--peer-port", type=int, default=None,
                   help="the port every node listens on for --peers-from (default 7420)")
    p.add_argument("--secret-file", help="job secret that peers prove (default $UCPD_SECRET_FILE)")
    p.add_argument("--domain", help="this node's failure domain (rack, switch): copies go to other domains")
    p.add_argument("--net-limit", help="bandwidth for copies to peers in bytes/s, e.g. 1G (0: unlimited)")
    p.add_argument("--data-transport", choices=("tcp", "nixl", "zmq"), default=None,
                   help="how bulk bytes (replicas, restore and flush fetches) move between daemons: tcp (plain TCP "
                   "streams beside the control lane, received straight into place), nixl (one-sided reads and "
                   "writes through NIXL/UCX; `pip install 'ucpd[nixl]'`), or zmq (on the control lane itself) "
                   "(default tcp)")
    p.add_argument("--data-listen", metavar="HOST[:PORT]",
                   help="address (the NIC) for bulk bytes from peers (default: --listen's host, any free port)")
    p.add_argument("--link-floor", metavar="GB/S", type=float, default=None,
                   help="warn loudly when the measured link to a peer is slower than this (the bulk bytes may take "
                   "the wrong network, e.g. a 1 GbE management port; 0: never; default 0.5)")
    p.add_argument("--heartbeat", type=float, default=None, help="seconds between heartbeats to peers (default 0.25)")
    p.add_argument("--dead-after", type=float, default=None, help="a peer silent this long is dead (default 3)")
    p.add_argument("--membership", choices=("auto", *MEMBERSHIPS), default=None,
                   help="how the team learns who is alive: heartbeat (every daemon to every other), gossip (SWIM: "
                   "a probe per period whatever the team's size), or auto: gossip from %d nodes (default auto)"
                   % GOSSIP_FROM)
    p.add_argument("--commit-fanout", type=int, default=None,
                   help="a large team's ways: commit reports and acks go through one aggregator per group of N "
                   "nodes, so the coordinator handles O(nodes/N) messages per step, and a restart learns what the "
                   "team holds by recursive doubling, log2(nodes) requests a node instead of nodes for each rank "
                   "(0: every node talks to the coordinator, every rank asks every node; default: %d from %d nodes, "
                   "else 0)" % (AUTO_FANOUT, GOSSIP_FROM))
    p.add_argument("--mem-limit", help="RAM for snapshot slots, e.g. 64G (default 80%% of free /dev/shm)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--replicas", type=int, help="copies of each node's part of a version on other nodes")
    g.add_argument("--parity", help="erasure-coded groups: K (XOR over K+1 nodes) or K+M (Reed-Solomon)")
    p.add_argument("--flush-dir", help="directory for the universal-format flush (none: no flush), or an object-store "
                   "URL: s3://bucket/prefix or any fsspec URL (needs `pip install 'ucpd[s3]'`)")
    p.add_argument("--flush-writers", choices=("all", "one"), default=None,
                   help="who writes a team's flush: all (every node writes its share of the version into the flush "
                   "dir, which every node must mount; a node that does not see it leaves its share to the others) "
                   "or one (node 0 gathers the version and writes it); an object-store --flush-dir is written by "
                   "node 0 (default all)")
    p.add_argument("--flush-cache", help="an object-store --flush-dir's local folder: versions are written there before "
                   "their upload, and restores that RAM cannot serve fetch them there (default <run-dir>/flush-cache)")
    p.add_argument("--flush-storage-options", metavar="JSON",
                   help="fsspec storage options of an object-store --flush-dir, e.g. '{\"endpoint_url\": "
                   "\"http://minio:9000\"}' (default: the AWS_* variables, AWS_ENDPOINT_URL_S3, fsspec config)")
    p.add_argument(
        "--flush-every", default=None,
        help="flush every Nth committed version (default 1), or auto: the interval that minimises flush cost plus "
        "expected lost work (Young/Daly), from the measured flush time and --mtbf",
    )
    p.add_argument(
        "--mtbf", default=None,
        help="mean time between failures for --flush-every auto, e.g. 6h (default: learned from the job's restarts)",
    )
    p.add_argument("--flush-rate", help="flush bandwidth limit in bytes/s, e.g. 2G (0: unlimited)")
    p.add_argument("--flush-keep", type=int, default=None, help="complete versions kept in the flush dir (0: all)")
    p.add_argument("--keep", type=int, default=None, help="committed versions kept in RAM, per job (default 2)")
    p.add_argument("--job-mem-limit", help="RAM one job's slots may hold, e.g. 32G (default: only --mem-limit)")
    p.add_argument("--job", help="the job a team of daemons serves (default: the first that snapshots)")
    p.add_argument("--run-dir", help="socket directory (default $UCPD_RUN_DIR or /tmp/ucpd-$USER)")
    p.add_argument("--shm-dir", help="segment directory (default /dev/shm/ucpd-$USER-<node-rank>)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT")
    p.add_argument("--idle-exit", type=float, default=None, help="exit after this many idle seconds (0: never)")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=cmd_serve)

    s = sub.add_parser("status", help="show a daemon's versions, memory and flush progress")
    s.add_argument("--run-dir", help="the daemon's run dir (default $UCPD_RUN_DIR or /tmp/ucpd-$USER)")
    s.add_argument("--json", action="store_true", help="print JSON instead of tables")
    s.set_defaults(func=cmd_status)

    d = sub.add_parser(
        "drop", help="free a job's versions on this node",
        description="Free every version of JOB in this node's RAM (its flushed files stay). `ucpd status` lists the jobs.",
    )
    d.add_argument("job", metavar="JOB")
    d.add_argument("--run-dir", help="the daemon's run dir (default $UCPD_RUN_DIR or /tmp/ucpd-$USER)")
    d.add_argument("--json", action="store_true", help="print JSON")
    d.set_defaults(func=cmd_drop)

    t = sub.add_parser(
        "stop", help="stop a daemon (its shm segments stay for re-adoption; --purge frees them)",
        description="Stop the daemon of a run dir. Its shared memory (the versions in RAM) stays in its shm dir on "
                    "purpose: a daemon started again on the same run dir re-adopts it, and the jobs resume from RAM. "
                    "--purge frees it instead (containers often have a small /dev/shm).",
    )
    t.add_argument("--run-dir", help="the daemon's run dir (default $UCPD_RUN_DIR or /tmp/ucpd-$USER)")
    t.add_argument("--purge", action="store_true", help="free the daemon's shared memory once it has stopped")
    t.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the daemon to exit (default 30)")
    t.set_defaults(func=cmd_stop)


def _merged(args) -> dict:
    """Command-line options over the --config file's."""
    opts = {}
    if args.config:
        with open(args.config, "rb") as f:
            opts = {k.replace("-", "_"): v for k, v in tomllib.load(f).items()}
    for k, v in vars(args).items():
        if v is not None and k not in ("func", "command", "config"):
            opts[k] = v
    return opts


def config_from_args(args):
    from .server import DaemonConfig
    from .slots import shm_free_bytes

    o = _merged(args)
    if o.get("peers_from"):
        form_team(o, getattr(args, "launcher", None) or ())
    nodes = int(o.get("nodes", 1))
    node_rank = int(o.get("node_rank", 0))
    run_dir = o.get("run_dir") or knobs.run_dir()
    shm_dir = o.get("shm_dir") or knobs.shm_dir(node_rank, run_dir)
    team = team_config(o, nodes, node_rank)
    mem_limit = knobs.parse_size(o["mem_limit"]) if o.get("mem_limit") else knobs.mem_limit()
    if not mem_limit:  # 80% of what the shm file system can give us, counting our own segments
        where = shm_dir if os.path.isdir(shm_dir) else os.path.dirname(shm_dir)
        ours = sum(e.stat().st_size for e in os.scandir(shm_dir) if e.name.startswith("slot-")) if os.path.isdir(shm_dir) else 0
        mem_limit = int((shm_free_bytes(where) + ours) * 0.8)
    return DaemonConfig(
        team=team,
        run_dir=run_dir,
        shm_dir=shm_dir,
        mem_limit=mem_limit,
        keep=int(o.get("keep", knobs.keep_versions())),
        node_rank=node_rank,
        nodes=nodes,
        flush_dir=o.get("flush_dir"),
        flush_every=_flush_every(o.get("flush_every")),
        mtbf=_duration("--mtbf", o.get("mtbf")),
        flush_rate=float(knobs.parse_size(o["flush_rate"])) if o.get("flush_rate") is not None else knobs.flush_rate(),
        flush_keep=int(o.get("flush_keep", 0)),
        flush_cache=o.get("flush_cache"),
        flush_storage_options=_storage_options(o.get("flush_storage_options")),
        idle_exit=float(o.get("idle_exit", 0)),
        metrics_port=o.get("metrics_port"),
        job_mem_limit=knobs.parse_size(o["job_mem_limit"]) if o.get("job_mem_limit") else 0,
        job=_checked_job(o.get("job")),
    )


def _storage_options(text):
    if text is None or isinstance(text, dict):  # a --config file may give a table
        return text
    try:
        opts = json.loads(text)
    except ValueError as exc:
        raise UcpdError(f"--flush-storage-options: not JSON ({exc}); give an object, e.g. '{{\"anon\": false}}'") from None
    if not isinstance(opts, dict):
        raise UcpdError("--flush-storage-options: give a JSON object of fsspec storage options")
    return opts


def _flush_every(text):
    from .flush_interval import parse_every

    try:
        return parse_every(text)
    except ValueError:
        raise UcpdError(f"--flush-every {text!r}: give a positive number of versions, or auto") from None


def _duration(flag: str, text):
    if text is None:
        return None
    from .flush_interval import parse_duration

    try:
        return parse_duration(text)
    except ValueError:
        raise UcpdError(f"{flag} {text!r}: give seconds, or a number with s, m, h or d (e.g. 6h)") from None


def _checked_job(job):
    if job is None:
        return None
    from ..errors import ProtocolError
    from ..protocol import job_name

    try:
        return job_name("--job", str(job))
    except ProtocolError as exc:
        raise UcpdError(str(exc)) from None


def form_team(o: dict, launcher=()) -> None:
    """``--peers-from``: the node count, node rank, peers and (unless given) --listen, into ``o``."""
    from ..team import peers_from

    clash = [f"--{k.replace('_', '-')}" for k in ("peers", "hostfile", "node_rank") if o.get(k) is not None]
    if clash:
        raise UcpdError(f"--peers-from {o['peers_from']} finds the node rank and the peers itself: drop {', '.join(clash)}")
    formed = peers_from.form(str(o["peers_from"]), nodes=o.get("nodes"), listen=o.get("listen"),
                             port=o.get("peer_port"), launcher=launcher)
    logging.getLogger("ucpd.team").info("team from %s: node %d of %d, peers %s", formed.source, formed.node_rank,
                                        formed.nodes, ",".join(formed.peers))
    o.update(nodes=formed.nodes, node_rank=formed.node_rank, peers=",".join(formed.peers))
    if formed.listen and not o.get("listen"):
        o["listen"] = formed.listen


def team_config(o: dict, nodes: int, node_rank: int):
    """The team section of the options (None for one node), checked: every error says what to pass."""
    from ..team.config import TeamConfig
    from ..team.holders import parse_parity

    multi = ("peers", "hostfile", "listen", "replicas", "parity", "domain")
    if nodes <= 1:
        given = [f"--{k.replace('_', '-')}" for k in multi if o.get(k)]
        if given:
            raise UcpdError(f"{', '.join(given)} need a team: pass --nodes N (N > 1) and --node-rank I")
        return None
    if not 0 <= node_rank < nodes:
        raise UcpdError(f"--node-rank {node_rank} is outside a team of --nodes {nodes} (0..{nodes - 1})")
    if o.get("hostfile"):
        with open(o["hostfile"]) as f:
            peers = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    elif o.get("peers"):
        peers = [p.strip() for p in str(o["peers"]).split(",") if p.strip()]
    else:
        raise UcpdError("a team needs every node's address: pass --peers ADDR0,ADDR1,... or --hostfile FILE")
    if len(peers) != nodes:
        raise UcpdError(f"--nodes {nodes} but {len(peers)} peer addresses were given: list one per node, in node order")
    listen = o.get("listen") or peers[node_rank]
    secret_file = o.get("secret_file") or knobs.secret_file()
    secret = None
    if secret_file:
        with open(secret_file, "rb") as f:
            secret = f.read().strip()
        if len(secret) < 16:
            raise UcpdError(f"the job secret in {secret_file} is shorter than 16 bytes: use e.g. `openssl rand -hex 32`")
    parity = None
    if o.get("parity"):
        try:
            parity = parse_parity(str(o["parity"]))
        except ValueError as exc:
            raise UcpdError(str(exc)) from None
        from ..team.holders import parity_groups

        try:
            parity_groups(nodes, *parity)
        except ValueError as exc:
            raise UcpdError(f"--parity {o['parity']} over --nodes {nodes}: {exc}") from None
    replicas = int(o.get("replicas", 0) or 0)
    heartbeat, dead_after = float(o.get("heartbeat") or 0.25), float(o.get("dead_after") or 3.0)
    membership = str(o.get("membership") or "auto")
    if membership not in ("auto", *MEMBERSHIPS):
        raise UcpdError(f"--membership {membership!r}: use auto, {' or '.join(MEMBERSHIPS)}")
    if membership == "auto":
        membership = "gossip" if nodes >= GOSSIP_FROM else "heartbeat"
    fanout = o.get("commit_fanout")
    fanout = (AUTO_FANOUT if nodes >= GOSSIP_FROM else 0) if fanout is None else int(fanout)
    if fanout == 1 or fanout < 0:
        raise UcpdError(f"--commit-fanout {fanout}: use 0 (no aggregation) or a group size of 2 or more, e.g. 32")
    flush_writers = str(o.get("flush_writers") or "all")
    if flush_writers not in ("all", "one"):
        raise UcpdError(f"--flush-writers {flush_writers!r}: use all or one")
    if not 0 < heartbeat < dead_after:
        raise UcpdError(f"--heartbeat {heartbeat:g} and --dead-after {dead_after:g}: a peer must get several "
                        "periods before it is dead; use e.g. --heartbeat 0.25 --dead-after 3")
    if not 0 <= replicas < nodes:
        raise UcpdError(f"--replicas {replicas} needs at least {replicas + 1} nodes; the team has {nodes}")
    data_transport = str(o.get("data_transport") or "tcp")
    if data_transport not in ("tcp", "nixl", "zmq"):
        raise UcpdError(f"--data-transport {data_transport!r}: use tcp, nixl or zmq")
    link_floor = float(o["link_floor"]) if o.get("link_floor") is not None else 0.5
    if link_floor < 0:
        raise UcpdError(f"--link-floor {link_floor:g}: give GB/s, 0 or more")
    return TeamConfig(
        data_transport=data_transport,
        data_listen=o.get("data_listen"),
        link_floor=link_floor,
        nodes=nodes,
        node_rank=node_rank,
        listen=listen,
        peers=peers,
        secret=secret,
        replicas=replicas,
        parity=parity,
        domain=o.get("domain"),
        net_limit=float(knobs.parse_size(o["net_limit"])) if o.get("net_limit") else 0.0,
        heartbeat=heartbeat,
        dead_after=dead_after,
        membership=membership,
        fanout=fanout or None,
        keep=int(o.get("keep", knobs.keep_versions())),
        flush_dir=o.get("flush_dir"),
        flush_writers=flush_writers,
    )


# --- one node's process: the daemon composed with its store, team and flusher -----------------


def compose(config, *, policy=None, store=None):
    """One node's ``Daemon``, built from ``config``: the run-dir and shm-dir locks first (nothing
    reads the shm dir before this process owns it), then the team (``--nodes > 1``), the store
    (re-adopting what its index lists; ``store``: one a test made), the flush and the daemon.
    ``policy`` decides commits (default: the team's, or one node's: complete is committed)."""
    from .runtime import DirLocks
    from .server import Daemon

    locks = DirLocks(config.run_dir, config.shm_dir)
    try:
        team = make_team(config)
        store = store if store is not None else make_store(config, policy or team, single_job=team is not None)
        root = make_flush_root(config)
        if team is not None and root is not None:  # every node uploads its share of an S3 flush with these
            team.flush_storage_options = root.storage_options
        flusher = make_flusher(config, store, team, root)
        return Daemon(config, locks=locks, store=store, team=team, flusher=flusher, flush_root=root)
    except BaseException:
        locks.release()
        raise


def make_team(config):
    """The team of daemons this node belongs to (``--nodes > 1``), or None."""
    if config.team is None:
        return None
    from ..team.team import Team

    return Team(config.team, config.shm_dir)


def make_store(config, policy=None, single_job: bool = False):
    """The node's store (re-adopting what the index lists); ``single_job``: a team's node, which
    serves one job."""
    from .store import NodeStore

    return NodeStore(
        config.shm_dir, config.mem_limit, config.keep, rounding=knobs.segment_rounding(), policy=policy,
        job_limit=config.job_mem_limit, single_job=single_job, job=config.job,
    )


def make_flusher(config, store, team=None, root=None):
    """The background flush to ``--flush-dir`` (``root``: its ``Root``), or None (no flush dir,
    or a team node that does not flush)."""
    if not config.flush_dir or (team is not None and not team.flushes):
        return None
    from .flush import Flusher
    from .flush_interval import FlushInterval

    gather = team.gather_for_flush if team is not None else None
    shared = team.flush_shared if team is not None and team.config.flush_writers == "all" else None
    interval = FlushInterval(config.flush_every, config.mtbf)
    return Flusher(store, root if root is not None else make_flush_root(config), interval, config.flush_rate,
                   config.flush_keep, gather=gather, shared=shared)


def make_flush_root(config):
    """The ``Root`` of ``--flush-dir`` (None: none). An object store's has a staging folder
    (``--flush-cache``, default ``<run-dir>/flush-cache``): the flush writes a version there
    before publishing it, and a restore that RAM cannot serve fetches one there, so that
    trainers map its files as they map a flushed folder's. The newest copy of a job stays (a
    restore after a crash reads it without a download; a daemon killed mid-upload resumes from
    it); older ones go unless a restore reads them."""
    if not config.flush_dir:
        return None
    from ..format.roots import as_root

    staging = config.flush_cache or os.path.join(config.run_dir, "flush-cache")
    root = as_root(config.flush_dir, config.flush_storage_options, staging=staging)
    root.prepare()
    return root


def cmd_serve(args) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO), format="%(asctime)s ucpd %(levelname)s %(message)s")
    import gc

    # A daemon holds every kept version's manifest: 10^5-10^6 long-lived objects with MoE-sized
    # jobs. At the default thresholds the collector walks them all several times per commit
    # (half its cost at 100k tensors, benchmarks/snapshot/bench_scale_tensors.py); these keep that rare.
    gc.set_threshold(50_000, 20, 10)
    heap.limit_arenas()  # before the threads start: one malloc arena, trimmed (RSS that grew at every fault)
    daemon = compose(config_from_args(args))
    heap.HeapTrim().start()
    for note in daemon.store.adopted.dropped:
        print(f"ucpd: re-adoption: {note}", file=sys.stderr)
    if daemon.store.adopted.versions:
        print(f"ucpd: re-adopted {daemon.store.adopted.versions} version(s) of job(s) {daemon.store.jobs()} "
              f"from {daemon.config.shm_dir}", file=sys.stderr)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: daemon.stop())
    daemon.serve()
    return 0


def _client(run_dir):
    from ..rpc import Connection

    return Connection(run_dir or knobs.run_dir(), timeout=10.0)


def cmd_status(args) -> int:
    with _client(args.run_dir) as conn:
        status = conn.call("status")
    if args.json:
        print(json.dumps(status, indent=2, default=str))
    else:
        from rich.console import Console

        from .status import render

        render(status, Console())
    return 0


def cmd_drop(args) -> int:
    with _client(args.run_dir) as conn:
        out = conn.call("drop", job=args.job)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"dropped job {out['job']}: {len(out['steps'])} version(s) {out['steps']}, {out['bytes'] >> 20} MiB freed")
    return 0


def cmd_stop(args) -> int:
    """Stop the daemon, wait until it has exited, then say what shared memory it left and where
    (``--purge``: free it)."""
    from ..errors import DaemonUnreachable
    from .shm_left import default_shm_dirs, describe, purge, shm_usage, wait_exit

    run_dir = args.run_dir or knobs.run_dir()
    try:
        with _client(run_dir) as conn:
            status = conn.call("status")
            conn.call("shutdown")
    except DaemonUnreachable:
        if not args.purge:
            raise
        freed = [(d, *purge(d)) for d in default_shm_dirs(run_dir)]  # no daemon: free what the last one left
        for d, files, nbytes in freed:
            print(f"no daemon serves {run_dir}; freed its shared memory: {files} file(s), {nbytes / 2**20:.1f} MiB in {d}")
        if not freed:
            print(f"no daemon serves {run_dir}, and no shared memory of one is left")
        return 0
    shm_dir = status["shm_dir"]
    if not wait_exit(run_dir, shm_dir, args.timeout):
        print(f"ucpd stop: the daemon (pid {status['pid']}) has not exited within {args.timeout:.0f} s; "
              f"its shared memory in {shm_dir} is left as it is", file=sys.stderr)
        return 1
    if args.purge:
        files, nbytes = purge(shm_dir)
        print(f"stopped the daemon (pid {status['pid']}) and freed its shared memory: {files} file(s), "
              f"{nbytes / 2**20:.1f} MiB in {shm_dir}")
        return 0
    print(describe(status, run_dir, *shm_usage(shm_dir)))
    return 0
